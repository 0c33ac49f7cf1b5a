"""Test-session settings, applied before JAX creates its backend (and inherited by the
subprocesses some tests start).

XLA on CPU spends most of this suite's time compiling many tiny programs (a fresh
jax.random.uniform of a new shape takes 0.7-1.6 s at the default LLVM optimisation level,
0.24 s at level 0). `--xla_backend_optimization_level=0` lowers only LLVM's code-generation
effort; the HLO passes (fusion, layout, algebraic simplification) are unchanged. Results
move by rounding only: measured on a 3-layer Encoder's loss and gradients, 2.6e-7 relative
in float32 and 1.5e-14 in float64 between the two levels, far inside every parity
tolerance (each tolerance's negative twin still fails). The experiments and the benchmark
run at XLA's default level. Set XLA_FLAGS yourself to override.
"""

from __future__ import annotations

import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
