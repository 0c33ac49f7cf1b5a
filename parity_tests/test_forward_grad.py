"""Forward and gradient parity, Flax vs torch, over the whole option matrix."""

from __future__ import annotations

import pytest

from .cases import CASES, FLOAT32_CASES
from .harness import TOL, parity

# every case in both dtypes; the fused path (float32 softmax) in float32 only
RUNS = [(case, dtype) for case in CASES for dtype in ("float32", "float64")] + [(c, "float32") for c in FLOAT32_CASES]


@pytest.mark.parametrize(("case", "dtype"), RUNS, ids=[f"{c.name}-{d}" for c, d in RUNS])
def test_forward_and_gradients_match(case, dtype):
    err = parity(case, dtype)
    assert err.forward <= TOL["forward", dtype], f"forward {err.forward:.2e}"
    assert err.dx <= TOL["grad", dtype], f"input gradient {err.dx:.2e}"
    worst = max(err.grad_by_param, key=err.grad_by_param.get)
    assert err.grad <= TOL["grad", dtype], f"gradient of {worst}: {err.grad:.2e}"
    assert err.grad_by_param, "no parameter gradients were compared"
