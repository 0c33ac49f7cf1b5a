"""Long-sequence timing of the d256 block: the JAX twin (jitted, attention="blocked") against
the torch twin (eager, SDPA) in the same process, interleaved; forward and train step
(value_and_grad of sum(y * r)), median of `--reps`, plus XLA temp memory of each compiled
JAX program. `--impl before` swaps in the blocked attention of a git revision (default
the merge this branch started from) for a before/after comparison; `--impl both` times both
in one process, interleaved. Not a test; prints one
table row per (T, causal) and writes nothing.

    python -m experiments.bench.long_attention --seqs 2048,8192 --reps 5 [--impl before]

`--vs-library cudnn` (for a GPU: experiments/gpu_check.sh) times the attention alone instead:
the blocked (flash) path against `jax.nn.dot_product_attention(implementation=...)` on
(1, T, 8 heads, 128) in `--dtype`, forward and forward + backward, with the achieved TFLOP/s
and MFU against `--peak-tflops` (useful FLOPs: 4 T^2 H hd forward, halved when causal; 2.5x
that for the backward, the FlashAttention-2 convention).

    python -m experiments.bench.long_attention --vs-library cudnn --dtype bfloat16 --seqs 2048,4096,8192
"""

from __future__ import annotations

import argparse
import ast
import statistics
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_blocks as fb
import flax_blocks.attention as fa
import flax_blocks.flash as flash
import torch_blocks as tb
from flax_blocks.core.config import BlockConfig

from .blocks import compile_jax
from .timing import interleaved


def old_blocked_attention(rev: str):
    """`blocked_attention` as it was at `rev`, run in this module's namespace."""
    src = subprocess.run(["git", "show", f"{rev}:flax_blocks/attention.py"], check=True, capture_output=True,
                         text=True).stdout
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "blocked_attention")
    ns = {**vars(fa), **vars(flash)}  # its helpers (flax_blocks/flash.py since 0.2.0)
    exec(compile(ast.Module([node], []), "<old blocked_attention>", "exec"), ns)  # noqa: S102
    return ns["blocked_attention"]


def run(seq: int, causal: bool, reps: int, attention: str, before=None) -> dict:
    cfg = BlockConfig(d_model=256, num_heads=4, d_ff=1024, norm="pre", causal=causal, dropout=0.0,
                      attention=attention)
    graphdef, params, rest = nnx.split(fb.TransformerBlock(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((2, 1, seq, 256)).astype(np.float32)
    xj, rj = jnp.asarray(x), jnp.asarray(r)

    def forward(p, x):
        return nnx.merge(graphdef, p, rest)(x)

    def train(p, x, r):
        return jax.value_and_grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x) * r))(p)

    fwd_c, _, _, fwd_temp = compile_jax(forward, params, xj)
    train_c, _, _, train_temp = compile_jax(train, params, xj, rj)
    if before is not None:  # the same programs traced with the old blocked attention
        now, fa.blocked_attention = fa.blocked_attention, before
        try:
            # new function objects: jit's trace cache would hand back the programs above
            bfwd_c, _, _, _ = compile_jax(lambda p, x: forward(p, x), params, xj)
            btrain_c, _, _, btrain_temp = compile_jax(lambda p, x, r: train(p, x, r), params, xj, rj)
        finally:
            fa.blocked_attention = now
    tm = tb.TransformerBlock(cfg)
    xt, rt = torch.from_numpy(x), torch.from_numpy(r)

    def t_fwd():
        with torch.no_grad():
            tm(xt)

    def t_train():
        tm.zero_grad(set_to_none=True)
        (tm(xt) * rt).sum().backward()

    fns = {"jax fwd": lambda: jax.block_until_ready(fwd_c(params, xj)),
           "torch fwd": t_fwd,
           "jax train": lambda: jax.block_until_ready(train_c(params, xj, rj)),
           "torch train": t_train}
    if before is not None:
        fns["before fwd"] = lambda: jax.block_until_ready(bfwd_c(params, xj))
        fns["before train"] = lambda: jax.block_until_ready(btrain_c(params, xj, rj))
    times = interleaved(fns, reps)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    row = {"seq": seq, "causal": causal, **{k + " ms": v for k, v in med.items()},
           "fwd ratio": med["jax fwd"] / med["torch fwd"], "train ratio": med["jax train"] / med["torch train"],
           "fwd temp MiB": (fwd_temp or 0) / 2**20, "train temp MiB": (train_temp or 0) / 2**20}
    if before is not None:
        row.update({"before fwd ratio": med["before fwd"] / med["torch fwd"],
                    "before train ratio": med["before train"] / med["torch train"],
                    "before train temp MiB": (btrain_temp or 0) / 2**20})
    return row


def attention_vs_library(seq: int, causal: bool, reps: int, implementation: str | None, dtype: str,
                         block: int, peak_tflops: float | None, heads: int = 8, head_dim: int = 128) -> dict:
    """One row: our blocked attention against jax.nn.dot_product_attention, same inputs."""
    rng = np.random.default_rng(0)
    q, k, v, r = (jnp.asarray(rng.standard_normal((1, seq, heads, head_dim)), dtype) for _ in range(4))

    def ours(q, k, v):  # (B, T, H, hd) with one query per kv head group
        return fa.blocked_attention(q[:, :, :, None], k, v, causal=causal, key_valid=None, block=block)[0][:, :, :, 0]

    def library(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

    def train(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * r), argnums=(0, 1, 2)))

    progs = {"ours fwd": jax.jit(ours), "library fwd": jax.jit(library), "ours train": train(ours),
             "library train": train(library)}
    for f in progs.values():
        jax.block_until_ready(f(q, k, v))
    times = interleaved({name: (lambda f=f: jax.block_until_ready(f(q, k, v))) for name, f in progs.items()}, reps)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    fwd_flops = 4 * seq * seq * heads * head_dim * (0.5 if causal else 1.0)
    row = {"seq": seq, "causal": causal}
    for name, t in med.items():
        flops = fwd_flops * (1.0 if "fwd" in name else 3.5)
        row[name + " ms"] = 1e3 * t
        row[name + " TFLOP/s"] = flops / t / 1e12
        row[name + " MFU"] = flops / t / (peak_tflops * 1e12) if peak_tflops else float("nan")
    row["fwd ratio"] = med["ours fwd"] / med["library fwd"]
    row["train ratio"] = med["ours train"] / med["library train"]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.long_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="2048,8192", help="comma list of sequence lengths")
    p.add_argument("--causal", default="1,0", help="comma list of 1 / 0")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--attention", default="blocked", choices=["blocked", "auto"])
    p.add_argument("--impl", default="after", choices=["after", "before", "both"],
                   help="both: the JAX programs of before and after interleaved with torch in one process")
    p.add_argument("--rev", default="dc5acd9", help="the git revision of --impl before")
    p.add_argument("--vs-library", metavar="IMPL", default=None,
                   help="time the attention alone against jax.nn.dot_product_attention(implementation=IMPL): "
                        "cudnn (GPU), xla, or default (JAX's choice)")
    p.add_argument("--dtype", default="bfloat16", help="with --vs-library: float32 or bfloat16")
    p.add_argument("--block", type=int, default=512, help="with --vs-library: the blocked path's block size")
    p.add_argument("--peak-tflops", type=float, default=None, help="with --vs-library: the chip's peak, for MFU")
    args = p.parse_args(argv)
    if args.vs_library is not None:
        impl = None if args.vs_library == "default" else args.vs_library
        cols = ["seq", "causal", "ours fwd ms", "library fwd ms", "fwd ratio", "ours train ms", "library train ms",
                "train ratio", "ours fwd MFU", "library fwd MFU", "ours train MFU", "library train MFU",
                "ours train TFLOP/s", "library train TFLOP/s"]
        print(f"attention alone vs jax.nn.dot_product_attention(implementation={impl!r}), {args.dtype}, "
              f"block {args.block}, on {jax.devices()[0].device_kind}")
        print(" | ".join(cols), flush=True)
        for seq in map(int, args.seqs.split(",")):
            for causal in (c == "1" for c in args.causal.split(",")):
                row = attention_vs_library(seq, causal, args.reps, impl, args.dtype, args.block, args.peak_tflops)
                print(" | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols),
                      flush=True)
        return
    before = old_blocked_attention(args.rev) if args.impl != "after" else None
    if args.impl == "before":
        fa.blocked_attention, before = before, None
    cols = ["seq", "causal", "jax fwd ms", "torch fwd ms", "fwd ratio", "jax train ms", "torch train ms",
            "train ratio", "fwd temp MiB", "train temp MiB"]
    if before is not None:
        cols += ["before fwd ratio", "before train ratio", "before train temp MiB"]
    print(f"impl {args.impl}, torch {torch.__version__} threads {torch.get_num_threads()}, jax {jax.__version__}")
    print(" | ".join(cols), flush=True)
    for seq in map(int, args.seqs.split(",")):
        for causal in (c == "1" for c in args.causal.split(",")):
            row = run(seq, causal, args.reps, args.attention, before)
            print(" | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols), flush=True)


if __name__ == "__main__":
    main()
