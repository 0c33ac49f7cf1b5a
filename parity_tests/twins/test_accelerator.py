"""The same parity on an accelerator, at highest matmul precision with TF32 off.

Needs CUDA builds of JAX and torch: `make test-gpu` installs them in .venv-gpu and runs
this file. Skips, saying which framework sees no GPU, everywhere else (the CPU venv of
`make test` has a CPU torch and a CPU jaxlib)."""

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


def _no_gpu_reason() -> str:
    """Why the accelerator tests cannot run here ("" when they can)."""
    missing = []
    if not _jax_gpu():
        missing.append(f"JAX {jax.__version__} sees no GPU (backend {jax.default_backend()}; "
                       "a CUDA jaxlib plugin is needed)")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build"
        missing.append(f"torch {torch.__version__} ({build}) sees no CUDA device")
    return "; ".join(missing) + ("; run `make test-gpu` on a machine with an NVIDIA GPU" if missing else "")


NO_GPU = _no_gpu_reason()
needs_gpu = pytest.mark.skipif(bool(NO_GPU), reason=NO_GPU)


@needs_gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.kind in ("TransformerBlock", "Encoder")][:6],
                         ids=lambda c: c.name)
def test_float32_parity_on_gpu(case):
    """JAX runs on its default device (the GPU); torch's twin stays on CPU as reference,
    so this measures the GPU kernels against the CPU ones."""
    err = parity(case, "float32")
    assert err.forward <= TOL["forward", "float32"] and max(err.grad, err.dx) <= TOL["grad", "float32"]
