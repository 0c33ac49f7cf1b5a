"""Long-sequence timing of the d256 block: the JAX twin (jitted, attention="blocked") against
the torch twin (eager, SDPA) in the same process, interleaved; forward and train step
(value_and_grad of sum(y * r)), median of `--reps`, plus XLA temp memory of each compiled
JAX program. `--impl before` swaps in the blocked attention of a git revision (default
the merge this branch started from) for a before/after comparison; `--impl both` times both
in one process, interleaved. Not a test; prints one
table row per (T, causal) and writes nothing.

    python -m experiments.long_attention --seqs 2048,8192 --reps 5 [--impl before]
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
import torch_blocks as tb
from experiments.bench import compile_jax, interleaved
from flax_blocks.config import BlockConfig


def old_blocked_attention(rev: str):
    """`blocked_attention` as it was at `rev`, run in this module's namespace."""
    src = subprocess.run(["git", "show", f"{rev}:flax_blocks/attention.py"], check=True, capture_output=True,
                         text=True).stdout
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "blocked_attention")
    ns = dict(vars(fa))
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.long_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="2048,8192", help="comma list of sequence lengths")
    p.add_argument("--causal", default="1,0", help="comma list of 1 / 0")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--attention", default="blocked", choices=["blocked", "auto"])
    p.add_argument("--impl", default="after", choices=["after", "before", "both"],
                   help="both: the JAX programs of before and after interleaved with torch in one process")
    p.add_argument("--rev", default="dc5acd9", help="the git revision of --impl before")
    args = p.parse_args(argv)
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
