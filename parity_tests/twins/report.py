"""`python -m parity_tests.twins.report [--out FILE] [--doc docs/parity.md]`: the parity figures as a
markdown table; --doc replaces the table between that page's parity-report markers.

Every row is measured now, by the same code as the test suite: forward and gradient
errors (Flax vs torch, relative to the torch value's scale) for each case of the option
matrix in float32 and float64, then the 100-step AdamW trajectories.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import torch

from .. import markers
from .cases import CASES
from .harness import TOL, parity
from .trajectory import compare_trajectories


def build(cases=CASES, trajectories: bool = True) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} CPU, jax {jax.__version__}, "
        f"torch {torch.__version__}.",
        "Errors are max|flax - torch| / max|torch|; gradients: the worst parameter. "
        f"Tolerances: float32 forward {TOL['forward', 'float32']:.0e}, gradient {TOL['grad', 'float32']:.0e}; "
        f"float64 forward {TOL['forward', 'float64']:.0e}, gradient {TOL['grad', 'float64']:.0e}.",
        "",
        "| case | f32 forward | f32 grad | f64 forward | f64 grad |",
        "|---|---|---|---|---|",
    ]
    for case in cases:
        e32, e64 = parity(case, "float32"), parity(case, "float64")
        lines.append(f"| {case.name} | {e32.forward:.1e} | {max(e32.grad, e32.dx):.1e} "
                     f"| {e64.forward:.1e} | {max(e64.grad, e64.dx):.1e} |")
    if not trajectories:
        return "\n".join(lines) + "\n"
    lines += ["", "| 100-step AdamW trajectory | loss (max over steps) | weights (worst tensor) | key bias |",
              "|---|---|---|---|"]
    for dtype in ("float32", "float64"):
        t = compare_trajectories(dtype)
        lines.append(f"| {dtype} | {t.loss_err:.1e} | {t.weight_err:.1e} | {t.key_bias_err:.1e} |")
    return "\n".join(lines) + "\n"


DOC = "docs/parity.md"  # where the committed table lives
START = f"<!-- parity-report:start (python -m parity_tests.twins.report --doc {DOC}) -->"
END = "<!-- parity-report:end -->"


def splice(document: str, table: str) -> str:
    """`document` with the text between the START and END markers replaced by `table`."""
    return markers.splice(document, table, START, END, "parity-report")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.twins.report", description=__doc__)
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--doc", metavar="FILE",
                    help="replace the table between this markdown file's parity-report markers "
                         f"(the committed one: {DOC})")
    args = ap.parse_args(argv)
    if args.doc:  # fail before the minutes of measuring, not after
        with open(args.doc) as f:
            splice(f.read(), "")
    text = build()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.doc:
        markers.rewrite(args.doc, text, START, END, "parity-report")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
