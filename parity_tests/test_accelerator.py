"""The same parity on an accelerator, at highest matmul precision with TF32 off.
Skips cleanly where neither framework sees a GPU."""

from __future__ import annotations

import jax
import pytest
import torch

from .cases import CASES
from .harness import TOL, parity


def _jax_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


needs_gpu = pytest.mark.skipif(not (_jax_gpu() and torch.cuda.is_available()), reason="no GPU visible to both JAX and torch")


@needs_gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.kind in ("TransformerBlock", "Encoder")][:6], ids=lambda c: c.name)
def test_float32_parity_on_gpu(case):
    """JAX runs on its default device (the GPU); torch's twin stays on CPU as reference,
    so this measures the GPU kernels against the CPU ones."""
    err = parity(case, "float32")
    assert err.forward <= TOL["forward", "float32"] and max(err.grad, err.dx) <= TOL["grad", "float32"]
