"""python -m parity_tests.port TORCH FLAX --inputs SPEC [--weights FILE]

TORCH and FLAX are `module:factory` (a callable returning the torch module, and one
returning its Flax NNX port). The torch module's weights (its own, or --weights, a state
dict file) are copied into the port (copy_weights), both are compared (compare) and the
per-module table is printed; exit 1 naming the first divergent module, 2 on bad arguments.

--kw name=VALUE (repeated) hands an input to both by name (VALUE: a .npy file, or one SPEC
item); positional inputs go to torch by the names the port's call gives them where torch's
forward has such parameters (GPT-J's second parameter is its cache).

SPEC: comma-separated inputs, each `float:2x16x32` (standard normal), `int:2x16:100`
(integers in [0, 100)) or `bool:2x16` (True with probability --true-rate), e.g.
    python -m parity_tests.port mypkg.model:TorchLM mypkg.port:FlaxLM --inputs int:2x16:50000
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np


def _factory(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"expected module:factory, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"cannot load {spec!r}: {e}") from e


def parse_inputs(spec: str, seed: int = 0, true_rate: float = 0.8) -> list[np.ndarray]:
    """'float:2x8x16,int:2x8:100,bool:2x8' -> numpy arrays (seeded)."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for item in filter(None, spec.split(",")):
        kind, _, rest = item.strip().partition(":")
        shape_s, _, high = rest.partition(":")
        try:
            shape = tuple(int(n) for n in shape_s.split("x"))
        except ValueError:
            raise ValueError(f"input {item!r}: expected a shape like 2x16, got {shape_s!r}") from None
        if kind == "float":
            out.append(rng.standard_normal(shape))
        elif kind == "int":
            if not high:
                raise ValueError(f"input {item!r}: an int input needs its bound, e.g. int:2x16:100")
            out.append(rng.integers(0, int(high), shape))
        elif kind == "bool":
            out.append(rng.random(shape) < true_rate)
        else:
            raise ValueError(f"input {item!r}: expected float:, int: or bool:, got {kind!r}")
    return out


def named_inputs(items: list[str], seed: int = 0, true_rate: float = 0.8) -> dict[str, np.ndarray]:
    """['attention_mask=mask.npy', 'pixel_values=float:2x3x8x8'] -> {name: array}."""
    import os

    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier() or not value:
            raise ValueError(f"--kw {item!r}: expected NAME=FILE.npy or NAME=SPEC, e.g. attention_mask=mask.npy")
        out[name] = np.load(value) if os.path.exists(value) else parse_inputs(value, seed, true_rate)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from . import compare, copy_weights

    ap = argparse.ArgumentParser(prog="python -m parity_tests.port", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("torch", type=_factory, help="module:factory returning the torch module")
    ap.add_argument("flax", type=_factory, help="module:factory returning its Flax NNX port")
    ap.add_argument("--inputs", default="", help="e.g. int:2x16:100,bool:2x16")
    ap.add_argument("--kw", action="append", default=[], metavar="NAME=VALUE",
                    help="a named input: a .npy file or one SPEC item, e.g. attention_mask=mask.npy")
    ap.add_argument("--weights", help="a torch state dict file (.pt) for the torch module")
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--no-grads", action="store_true", help="skip the gradients")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--true-rate", type=float, default=0.8, help="for bool inputs")
    ap.add_argument("--plot", help="write the error-per-module plot here (.png)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    tm, fm = args.torch(), args.flax()
    try:
        inputs = parse_inputs(args.inputs, args.seed, args.true_rate)
        named = named_inputs(args.kw, args.seed, args.true_rate)
    except ValueError as e:
        ap.error(str(e))
    if args.weights:
        tm.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
    copy_weights(tm, fm)
    start = time.perf_counter()
    try:
        report = compare(tm, fm, *inputs, dtype=args.dtype, grads=not args.no_grads, seed=args.seed, **named)
    except Exception as e:  # the inputs do not fit the models: say which
        ap.error(f"running the models on --inputs {args.inputs} failed: {type(e).__name__}: {e}")
    print(report)
    print(f"(compared in {time.perf_counter() - start:.1f} s)")
    if args.plot:
        report.plot(args.plot)
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())
    if not report.ok:
        print(f"FAILED: {report.first_divergence}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
