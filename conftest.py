"""Test-session settings, applied before JAX creates its backend (and inherited by the
subprocesses some tests start).

XLA on CPU spends most of this suite's time compiling many tiny programs (a fresh
jax.random.uniform of a new shape takes 0.7-1.6 s at the default LLVM optimisation level,
0.24 s at level 0). `--xla_backend_optimization_level=0` lowers only LLVM's code-generation
effort; the HLO passes (fusion, layout, algebraic simplification) are unchanged. Results
move by rounding only: measured on a 3-layer Encoder's loss and gradients, 2.6e-7 relative
in float32 and 1.5e-14 in float64 between the two levels, far inside every parity
tolerance (each tolerance's negative twin still fails). The experiments and the benchmark
run at XLA's default level. `--xla_cpu_use_fusion_emitters=false` compiles fusions with
XLA's older elemental emitters instead of the MLIR fusion emitters (the same fusions, the
same arithmetic up to rounding): measured, the float64 half of the parity matrix ran in 20 s
instead of 36 s on the 2-core machine, every tolerance still met and every negative twin
still failing. `--xla_cpu_parallel_codegen_split_count=1` compiles each program's LLVM module
as one piece instead of splitting it for parallel code generation: for these tiny programs the
split costs more CPU than it saves, and the suite's two workers keep both cores busy anyway.
Measured side by side (one process, 316 parity and block tests, alternating twice): 164 / 173 s
of CPU -> 135 / 143 s; the worst float64 gradient error of 30 parity cases moves from 1.13e-15
to 1.46e-15 (rounding). Set XLA_FLAGS yourself to override.

OMP_NUM_THREADS=1 (unless set): the suite runs two workers on two cores, and torch's (and
numpy's BLAS) second OpenMP thread per worker only spins against the other worker: measured,
the HF family and numpy reference tests 82 -> 76 s on two workers.
"""

from __future__ import annotations

import os

for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
             "--xla_cpu_parallel_codegen_split_count=1"):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
os.environ.setdefault("OMP_NUM_THREADS", "1")
