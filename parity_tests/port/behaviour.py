"""HF's building blocks known by what they compute, not by how they are written.

transformers' activations keep a reference to `F.gelu` taken when they were built
(`GELUActivation`), write the tanh formula out (`NewGELUActivation`) or wrap it in a partial
(`GELUTanh`); LLaMA's, Gemma's and T5's norms are hand-written. Patching torch's functions
reaches none of them, so a module is recognised by running it on probe values:

    activation   a module with no parameters and no children whose output, elementwise,
                 equals one of ACTIVATIONS on a probe
    norm         a module with no children and one weight vector (and maybe a bias) whose
                 output equals an RMS or a LayerNorm of its input (eps read from the module
                 or solved for), scaled by w or by (1 + w)

and a mistake is then made by replacing that module's forward with a variant of the same math
(norm_variant, ACTIVATIONS).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _gelu(x):
    import torch

    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _gelu_tanh(x):
    import torch

    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x):
    import torch

    return x * torch.sigmoid(x)


def _relu(x):
    return x.clamp(min=0)


def _quick_gelu(x):
    import torch

    return x * torch.sigmoid(1.702 * x)


def _tanh(x):
    import torch

    return torch.tanh(x)


# name -> (words, function of a tensor)
ACTIVATIONS: dict[str, tuple[str, Callable]] = {
    "gelu": ("exact GELU", _gelu),
    "gelu_tanh": ("the tanh approximation of GELU", _gelu_tanh),
    "silu": ("SiLU", _silu),
    "relu": ("ReLU", _relu),
    "quick_gelu": ("quick GELU (x * sigmoid(1.702 x))", _quick_gelu),
    "tanh": ("tanh", _tanh),
}


def _leaf_module(m) -> bool:
    return not any(True for _ in m.children())


def activation_of(m) -> str | None:
    """The name in ACTIVATIONS of what a parameterless leaf module computes, or None."""
    import torch

    if not _leaf_module(m) or any(True for _ in m.parameters()):
        return None
    x = torch.linspace(-5, 5, 201, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = m(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    for name, (_, fn) in ACTIVATIONS.items():
        # 1e-6: a float32 computation inside (GELUTanh's partial runs in the input's dtype;
        # a module computing in float32 still is what it is)
        if float((y.double() - fn(x)).abs().max()) <= 1e-6:
            return name
    return None


@dataclass(frozen=True)
class Norm:
    """What a norm module computes: kind "rms" or "layer", eps, where eps sits ("inside":
    rsqrt(var + eps); "outside": 1 / (sqrt(var) + eps)), and whether it scales by (1 + w)."""

    kind: str
    eps: float
    place: str = "inside"
    one_plus: bool = False

    def words(self) -> str:
        what = "RMSNorm" if self.kind == "rms" else "LayerNorm"
        return f"{what} (eps={self.eps:g}{', scale 1 + w' if self.one_plus else ''})"


def _norm_params(m) -> tuple[Any, Any] | None:
    """(weight, bias or None) of a leaf module holding one weight vector (and maybe a bias)."""
    if not _leaf_module(m):
        return None
    params = dict(m.named_parameters(recurse=False))
    vectors = {k: p for k, p in params.items() if p.ndim == 1}
    if len(params) != len(vectors) or not 1 <= len(vectors) <= 2:
        return None
    weight = next((p for k, p in vectors.items() if "bias" not in k), None)
    bias = next((p for k, p in vectors.items() if "bias" in k), None)
    if weight is None or (bias is not None and bias.shape != weight.shape):
        return None
    return weight, bias


def norm_forward(x, weight, bias, n: Norm):
    """What a norm computes, in x's dtype: (x - mean) / sqrt(var + eps) for LayerNorm, x /
    sqrt(mean(x^2) + eps) for RMSNorm (eps outside the root: / (sqrt(.) + eps)), then * w
    (or * (1 + w)) + bias."""
    w = weight.to(x.dtype)
    if n.kind == "layer":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        centred = x - mean
    else:
        var = (x * x).mean(-1, keepdim=True)
        centred = x
    y = centred / (var.sqrt() + n.eps) if n.place == "outside" else centred / (var + n.eps).sqrt()
    y = y * (1 + w if n.one_plus else w)
    return y if bias is None else y + bias.to(x.dtype)


def _eps_attrs(m) -> list[float]:
    return [float(v) for k, v in vars(m).items() if "eps" in k.lower() and isinstance(v, (int, float))
            and not isinstance(v, bool) and 0 < v < 1]


def norm_of(m, d: int | None = None) -> Norm | None:
    """What a leaf module holding one weight vector computes, when it is a norm of its
    input's last axis; None otherwise. Recognised on a probe with a large mean (which tells
    LayerNorm from RMSNorm), its eps read from the module
    (any float attribute named *eps*) or else the common values tried."""
    import torch

    held = _norm_params(m)
    if held is None:
        return None
    weight, bias = held
    d = weight.shape[0]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, d, generator=g, dtype=torch.float64) * 0.02 + 0.01).to(weight.dtype)
    try:
        with torch.no_grad():
            y = m(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    y = y.double()
    x = x.double()
    scale = float(y.abs().max()) or 1.0
    eps_values = _eps_attrs(m) or [1e-5, 1e-6, 1e-12, 1e-8, 1e-3, 0.0]
    tried: list[tuple[float, Norm]] = []
    with torch.no_grad():
        for kind in ("rms", "layer"):
            for eps in eps_values:
                for place in ("inside", "outside"):
                    for one_plus in (False, True):
                        n = Norm(kind, eps, place, one_plus)
                        got = norm_forward(x, weight.double(), None if bias is None else bias.double(), n)
                        tried.append((float((got - y).abs().max()) / scale, n))
    least = min(err for err, _ in tried)
    if least > 1e-4:  # float32 inside (LlamaRMSNorm) is a norm all the same
        return None
    # the first in this order among the closest: a float32 module cannot tell eps 1e-12
    # inside the root from outside, nor 1e-12 from 0
    return next(n for err, n in tried if err <= max(2 * least, 1e-13))
