"""torch parameters made from the declarations, and the two leaf layers: Linear and Norm.

`create_params` registers one nn.Parameter per declared `Param` (dotted torch names nest
plain submodules, e.g. out_proj.weight), drawn from the declared distributions with an
optional torch.Generator. Children are built by the caller. Also the input helpers every
block and stack uses: `as_batched` and `batched_memory`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flax_blocks.core.config import BlockConfig, check_width
from flax_blocks.core.declarations import Component

ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def _fill(t: Tensor, spec: tuple[str, float], generator: torch.Generator | None) -> None:
    kind, value = spec
    if kind == "const":
        t.fill_(value)
    elif kind == "uniform":
        t.uniform_(-value, value, generator=generator)
    elif kind == "normal":
        t.normal_(0.0, value, generator=generator)
    else:
        raise ValueError(f"unknown init spec {spec!r}")


def create_params(module: nn.Module, component: Component, cfg: BlockConfig,
                  generator: torch.Generator | None) -> None:
    """Register every declared parameter of `component` on `module`, initialised."""
    for p in component.params:
        value = torch.empty(p.shape, dtype=torch.float32)
        start = 0
        for rows, spec in p.init:  # chunks along dim 0 (q, k, v of a packed projection)
            _fill(value[start:start + rows] if value.dim() else value, spec, generator)
            start += rows
        owner = module
        *path, name = p.torch.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(name, nn.Parameter(value.to(DTYPES[cfg.param_dtype])))


class Linear(nn.Module):
    """y = x W^T + b on the last axis. Params: weight (out, in), bias (out,)."""

    # Registered by create_params from the declarations (declarations.linear); annotated
    # here so that type checkers and IDEs see them.
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, cfg: BlockConfig, component: Component, *, generator: torch.Generator | None = None):
        super().__init__()
        create_params(self, component, cfg, generator)
        if not hasattr(self, "bias"):
            self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out)."""
        return F.linear(x, self.weight, self.bias)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last axis, with the config's eps (torch's own kernels),
    or DyT (Zhu et al. 2025), weight * tanh(alpha * x) + bias; with cfg.norm_weight_offset
    (Gemma's RMSNorm: 1) every weight w enters as offset + w. Params: weight (width,), bias
    (width,) for LayerNorm and DyT with cfg.has_norm_bias, alpha () for DyT."""

    # Registered by create_params from the declarations (declarations.norm); alpha for DyT only.
    weight: nn.Parameter
    bias: nn.Parameter | None
    alpha: nn.Parameter

    def __init__(self, cfg: BlockConfig, component: Component, *, generator: torch.Generator | None = None):
        super().__init__()
        self.rms = cfg.norm_type == "rmsnorm"
        self.dyt = cfg.norm_type == "dyt"
        self.eps = cfg.layer_norm_eps
        self.offset = float(cfg.norm_weight_offset)
        self.width = component.width
        create_params(self, component, cfg, generator)
        if not hasattr(self, "bias"):
            self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        """x (..., width) -> same shape."""
        if self.dyt:
            y = torch.tanh(self.alpha * x) * (self.weight + self.offset if self.offset else self.weight)
            return y if self.bias is None else y + self.bias
        if self.offset:  # Gemma's RMSNorm: x.float() normalised, times (offset + w.float()), cast back
            dt = torch.promote_types(x.dtype, torch.float32)
            h = (F.rms_norm(x.to(dt), (self.width,), None, self.eps) if self.rms
                 else F.layer_norm(x.to(dt), (self.width,), None, None, self.eps))
            y = (h * (self.offset + self.weight.to(dt))).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.rms:
            return F.rms_norm(x, (self.width,), self.weight, self.eps)
        return F.layer_norm(x, (self.width,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        if self.dyt:
            return f"dyt({self.width})"
        return f"{'rms' if self.rms else 'layer'}norm({self.width}, eps={self.eps})"


def as_batched(cfg: BlockConfig, x: Tensor, what: str = "input") -> tuple[Tensor, bool]:
    """x (B, T, E) or (T, E), its width checked -> ((B, T, E), whether a batch axis was added)."""
    check_width(cfg, tuple(x.shape), what)
    return (x, False) if x.dim() == 3 else (x[None], True)


def batched_memory(cfg: BlockConfig, memory: Tensor, x: Tensor, unbatched: bool) -> Tensor:
    """memory (B, S, E), or (S, E) beside an unbatched x: batched like x, and of x's batch."""
    memory, _ = as_batched(cfg, memory[None] if unbatched else memory, "memory")
    if memory.shape[0] != x.shape[0]:
        raise ValueError(f"memory has batch {memory.shape[0]}, the input {x.shape[0]}")
    return memory
