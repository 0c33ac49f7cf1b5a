"""First-construction time of a small language model: the library's Encoder against the
same model written plainly in Flax, each built in a fresh process (so every compile of
the initialisers is paid, as a user's first run pays it).

    python -m experiments.bench.construction              # 5 alternating rounds, medians
    python -m experiments.bench.construction --rounds 3 --d-model 128 --layers 4

The models: nnx.Embed + blocks + nnx.Linear head. "library": fb.Encoder(num_layers=L)
(pre-LN, causal, dropout 0); "plain": L blocks of nnx.MultiHeadAttention + nnx.LayerNorm
x2 + nnx.Linear x2, in a Python list. Timed: the constructor until the parameters exist
(jax.block_until_ready), after the imports. XLA's default optimisation level (the test
suite's conftest lowers it; XLA_FLAGS is cleared here unless --keep-xla-flags).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import jax
from flax import nnx
import flax_blocks as fb

which, V, D, H, FF, L = sys.argv[1], *map(int, sys.argv[2:7])


class PlainBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.up, self.down = nnx.Linear(D, FF, rngs=rngs), nnx.Linear(FF, D, rngs=rngs)


class Plain(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([PlainBlock(rngs) for _ in range(L)])
        self.head = nnx.Linear(D, V, rngs=rngs)


class Library(nnx.Module):
    def __init__(self, rngs):
        cfg = fb.BlockConfig(d_model=D, num_heads=H, d_ff=FF, dropout=0.0, norm="pre", causal=True)
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.encoder = fb.Encoder(cfg, num_layers=L, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)


jax.block_until_ready(jax.numpy.zeros(()))  # the backend exists before the clock starts
t = time.perf_counter()
model = (Plain if which == "plain" else Library)(nnx.Rngs(0))
jax.block_until_ready(nnx.state(model))
print(json.dumps({"which": which, "seconds": time.perf_counter() - t}))
"""


def measure(which: str, args: argparse.Namespace) -> float:
    env = dict(os.environ)
    if not args.keep_xla_flags:
        env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", CHILD, which, *map(str, (args.vocab, args.d_model, args.heads,
                                                                         args.d_ff, args.layers))],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.construction", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (each: one process per model)")
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--keep-xla-flags", action="store_true", help="keep XLA_FLAGS from the environment")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {"library": [], "plain": []}
    for r in range(args.rounds):
        for which in (("library", "plain") if r % 2 == 0 else ("plain", "library")):
            times[which].append(measure(which, args))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"seconds": times, "median": med, "ratio": med["library"] / med["plain"]}
    print(f"first construction, d{args.d_model} L{args.layers} LM: library {med['library']:.2f} s, "
          f"plain Flax {med['plain']:.2f} s (median of {args.rounds}), ratio {result['ratio']:.2f}")
    return result


if __name__ == "__main__":
    main()
