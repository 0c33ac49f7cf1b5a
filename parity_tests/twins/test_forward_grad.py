"""Forward and gradient parity, Flax vs torch, over the whole option matrix.

Every case runs in float64, where parity is proven (1e-12 relative). float32, whose
tolerances only bound rounding, runs on a sample that keeps the suite's time: the first case
of each kind, then every third case (the options a float32 run could get wrong, dtype casts
and float32-only paths, are the same code for every case; FLOAT32_CASES, the fused path
whose float32 softmax makes a float64 run meaningless, always). The parity table in
docs/parity.md (`python -m parity_tests.twins.report`) holds every case in both dtypes.
"""

from __future__ import annotations

import pytest

from .cases import CASES, FLOAT32_CASES
from .harness import TOL, parity

_FIRST_OF_KIND = {next(i for i, c in enumerate(CASES) if c.kind == kind) for kind in {c.kind for c in CASES}}
FLOAT32_SAMPLE = [c for i, c in enumerate(CASES) if i % 3 == 0 or i in _FIRST_OF_KIND] + FLOAT32_CASES
RUNS = [(case, "float64") for case in CASES] + [(case, "float32") for case in FLOAT32_SAMPLE]


@pytest.mark.parametrize(("case", "dtype"), RUNS, ids=[f"{c.name}-{d}" for c, d in RUNS])
def test_forward_and_gradients_match(case, dtype):
    err = parity(case, dtype)
    assert err.forward <= TOL["forward", dtype], f"forward {err.forward:.2e}"
    assert err.dx <= TOL["grad", dtype], f"input gradient {err.dx:.2e}"
    worst = max(err.grad_by_param, key=err.grad_by_param.get)
    assert err.grad <= TOL["grad", dtype], f"gradient of {worst}: {err.grad:.2e}"
    assert err.grad_by_param, "no parameter gradients were compared"
