"""Settle an XLA:CPU flag with interleaved paired runs: is JAX faster with it, and
does it leave torch alone?

    python -m experiments.bench.xla_flags --pairs 5 --doc experiments/bench/results/xla_flags.md

A flag in XLA_FLAGS is read once, when JAX creates its CPU backend, so each setting needs its
own process. One pair = one process with XLA's defaults and one with the flag, in a shuffled
order; `--pairs` such pairs run one after another, so slow drifts of the machine hit both
settings alike. Each process times, interleaved in-process, the JAX twin (jitted) and the
torch twin (eager) on the bench's target rows: the block's train step (value_and_grad of
sum(y * r), 8 heads) at d256 and d512 T 128 B 8 and d256 T 2048 and T 8192 B 1 causal (the
blocked path). Reported per row and
setting: the median over pairs of each process's median, and the paired ratio flag / default
for JAX and for torch (median and IQR over pairs). The rule, fixed here before any data:
the flag is worth setting by default if JAX's paired ratio is below 1 - GAIN on every row
and torch's is within 1 +- TORCH_TOL on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

FLAG = "--xla_cpu_experimental_ynn_fusion_type="  # = experiments.bench.CPU_DOT_FLAG (Eigen dots, no YNNPACK)
GAIN = 0.05  # JAX must be at least 5 % faster with the flag
TORCH_TOL = 0.05  # and torch within 5 % of its time without it
# (d_model, d_ff, T, B, causal) of the block's train step (8 heads): the bench's target rows
ROWS = ((256, 1024, 128, 8, False), (512, 2048, 128, 8, False), (256, 1024, 2048, 1, True), (256, 1024, 8192, 1, True))


def child(reps: int) -> dict:
    """Time the rows in this process (XLA_FLAGS as given); {row: {"jax": ms, "torch": ms}}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    import flax_blocks as fb
    import torch_blocks as tb

    from .timing import interleaved

    out = {}
    for d, ff, seq, batch, causal in ROWS:
        cfg = fb.BlockConfig(d_model=d, num_heads=8, d_ff=ff, norm="pre", causal=causal, dropout=0.0)
        graphdef, params, rest = nnx.split(fb.TransformerBlock(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
        x, r = np.random.default_rng(0).standard_normal((2, batch, seq, d)).astype(np.float32)
        xj, rj = jnp.asarray(x), jnp.asarray(r)

        def loss(p, x, r, graphdef=graphdef, rest=rest):
            return jnp.sum(nnx.merge(graphdef, p, rest)(x) * r)

        step = jax.jit(jax.value_and_grad(loss))
        tm = tb.TransformerBlock(cfg)
        xt, rt = torch.from_numpy(x), torch.from_numpy(r)

        def t_step(tm=tm, xt=xt, rt=rt):
            tm.zero_grad(set_to_none=True)
            (tm(xt) * rt).sum().backward()

        times = interleaved({"jax": lambda step=step, params=params, xj=xj, rj=rj: jax.block_until_ready(
                                 step(params, xj, rj)),
                             "torch": t_step},
                            reps if seq <= 512 else max(3, reps // (4 if seq <= 2048 else 8)))
        out[f"d{d} T{seq} B{batch}{' causal' if causal else ''}"] = {k: 1e3 * statistics.median(v)
                                                                    for k, v in times.items()}
    return out


def _q(v: list[float], q: float) -> float:
    return float(__import__("numpy").quantile(v, q))


def run_pairs(pairs: int, reps: int, seed: int = 0) -> dict:
    """`pairs` x (defaults, flag) processes, each pair in a shuffled order."""
    rng = random.Random(seed)
    results: dict[str, list[dict]] = {"default": [], "flag": []}
    for i in range(pairs):
        order = ["default", "flag"]
        rng.shuffle(order)
        for setting in order:
            env = dict(os.environ)
            flags = env.get("XLA_FLAGS", "").replace(FLAG, "").strip()
            env["XLA_FLAGS"] = (flags + " " + FLAG).strip() if setting == "flag" else flags
            proc = subprocess.run([sys.executable, "-m", "experiments.bench.xla_flags", "--child", "--reps", str(reps)],
                                  env=env, capture_output=True, text=True, check=True)
            results[setting].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"pair {i + 1}/{pairs} {setting}: {results[setting][-1]}", flush=True)
    return results


def table(results: dict) -> tuple[str, bool]:
    """Markdown table of a finished study and the decision of the rule."""
    rows = list(results["default"][0])
    lines = ["| row | JAX default ms | JAX flag ms | JAX flag/default (IQR) | torch default ms | torch flag ms | "
             "torch flag/default (IQR) |", "|---|---|---|---|---|---|---|"]
    good = []
    for row in rows:
        med = {(s, fw): statistics.median(p[row][fw] for p in results[s]) for s in results for fw in ("jax", "torch")}
        ratio = {fw: [f[row][fw] / d[row][fw] for d, f in zip(results["default"], results["flag"], strict=True)]
                 for fw in ("jax", "torch")}
        r = {fw: (statistics.median(v), _q(v, 0.25), _q(v, 0.75)) for fw, v in ratio.items()}
        good.append(r["jax"][0] < 1 - GAIN and abs(r["torch"][0] - 1) <= TORCH_TOL)
        lines.append(f"| {row} | {med['default', 'jax']:.1f} | {med['flag', 'jax']:.1f} | "
                     f"{r['jax'][0]:.3f} ({r['jax'][1]:.3f}-{r['jax'][2]:.3f}) | {med['default', 'torch']:.1f} | "
                     f"{med['flag', 'torch']:.1f} | {r['torch'][0]:.3f} ({r['torch'][1]:.3f}-{r['torch'][2]:.3f}) |")
    return "\n".join(lines), all(good)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.xla_flags", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="timed repeats per row in each process (T 2048: a quarter)")
    p.add_argument("--doc", type=Path, help="write the table and the decision to this markdown file")
    p.add_argument("--child", action="store_true", help="(internal) time the rows in this process, print JSON")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.reps)))
        return 0
    results = run_pairs(args.pairs, args.reps)
    text, keep = table(results)
    decision = (f"Decision (rule: JAX faster by more than {GAIN:.0%} on every row, torch within {TORCH_TOL:.0%}): "
                + ("set the flag by default in the experiments' entry points." if keep else "drop the flag."))
    doc = "\n".join([f"# XLA:CPU flag `{FLAG}`: {args.pairs} interleaved pairs of processes", "",
                     "Generated by `python -m experiments.bench.xla_flags`; medians over pairs of each process's "
                     "median time of the block's train step (8 heads), the paired ratios' median and IQR.", "",
                     text, "",
                     decision, "", "Raw: " + json.dumps(results), ""])
    print(doc)
    if args.doc:
        args.doc.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
