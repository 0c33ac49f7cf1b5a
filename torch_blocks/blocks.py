"""Residual transformer blocks in PyTorch: ResidualMHA, FeedForward, TransformerBlock, Encoder.

Twins of `flax_blocks`, with parameter names of torch's own modules:
`TransformerBlock` is named like `nn.TransformerEncoderLayer` (self_attn.in_proj_weight,
linear1, norm1, ...) and `Encoder` like `nn.TransformerEncoder` (layers.{i}., norm.), so
stock state dicts load with strict=True, and masks are taken as stock torch takes them. A block's modules and sublayers come from
`declarations.BLOCKS`, the residual formula from `config.residual_update`, both shared
with the Flax twins. Masks follow torch's convention: a True entry means "may NOT attend"
(a float mask is added, as in stock torch). Rows in which every key is masked give a zero
attention output (flax_blocks does the same), where torch's own MultiheadAttention gives NaN.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flax_blocks import declarations
from flax_blocks.config import BlockConfig, check_width, residual_update
from flax_blocks.declarations import FINAL_NORM, Sublayer

from .attention import Attention, Mask, build_mask
from .layers import DTYPES, Linear, Norm, create_params

ACTIVATION_FNS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}
MODULES = {"linear": Linear, "norm": Norm, "attention": Attention}


def _batched(cfg: BlockConfig, x: Tensor) -> tuple[Tensor, bool]:
    check_width(cfg, tuple(x.shape))
    return (x, False) if x.dim() == 3 else (x[None], True)


def _finish(y: Tensor, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None and v.dim() else v) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y


class _Block(nn.Module):
    """A block of residual sublayers, its modules named and built from the declarations.
    Every sublayer has a dropout on its output; MLP sublayers one more after the activation."""

    kind: str

    def __init__(self, cfg: BlockConfig, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg = cfg.resolve()
        component = declarations.block(cfg, self.kind)
        self.sublayers: tuple[Sublayer, ...] = declarations.BLOCKS[self.kind]
        create_params(self, component, cfg, generator)
        for name, child in component.children:
            setattr(self, name, MODULES[child.kind](cfg, child, generator=generator))
        for sub in self.sublayers:  # modules of options that are off (no norm, no gate...)
            for name in (*sub.modules, sub.norm, sub.norm_out, sub.scale):
                if not hasattr(self, name):
                    setattr(self, name, None)
        self.dropout_act = nn.Dropout(cfg.dropout)
        self.dropouts = nn.ModuleList(nn.Dropout(cfg.dropout) for _ in self.sublayers)

    def apply_prepared(self, x: Tensor, mask: Mask | None, need_weights: bool = False):
        """x: (B, T, E) with a prepared mask (`build_mask`) -> (y (B, T, E), {"attention_weights": (B, H, T, T),
        "attention_logits_max": ()} (None unless need_weights) for a block with attention)."""
        extras: dict[str, Any] = {}
        for sub, dropout in zip(self.sublayers, self.dropouts):
            if sub.kind == "attention":
                fn = functools.partial(_attention, getattr(self, sub.modules[0]), mask=mask,
                                       need_weights=need_weights)
            else:
                fn = functools.partial(self._mlp, sub)
            x, aux = residual_update(self.cfg, x, fn, getattr(self, sub.norm) or nn.Identity(), dropout,
                                     getattr(self, sub.scale), getattr(self, sub.norm_out))
            extras.update(aux)
        return x, extras

    def _mlp(self, sub: Sublayer, h: Tensor) -> tuple[Tensor, dict]:
        """dense: down(Dropout(act(up(h))));  gated: down(Dropout(act(gate(h)) * up(h)))."""
        up, gate, down = (getattr(self, name) for name in sub.modules)
        act = ACTIVATION_FNS[self.cfg.activation]
        a = act(up(h)) if gate is None else act(gate(h)) * up(h)
        return down(self.dropout_act(a)), {}

    def _forward(self, x, attn_mask, key_padding_mask, return_intermediates):
        x, unbatched = _batched(self.cfg, x)
        mask = build_mask(self.cfg, x.shape[0], x.shape[1], attn_mask, key_padding_mask, x.device)
        y, extras = self.apply_prepared(x, mask, return_intermediates)
        return _finish(y, unbatched, extras, return_intermediates)


def _attention(attn: Attention, h: Tensor, *, mask, need_weights):
    out, weights, logit_max = attn(h, mask, need_weights)
    return out, {"attention_weights": weights, "attention_logits_max": logit_max}


class ResidualMHA(_Block):
    """post: Norm(x + Dropout(MHA(x)));  pre: x + Dropout(MHA(Norm(x)));  peri: the pre
    form with a second norm on MHA's output. Params: mha.*, norm.*, norm_out.*, scale."""

    kind = "ResidualMHA"

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False):
        """x: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights":
        (B, H, T, T), "attention_logits_max": ()}."""
        return self._forward(x, attn_mask, key_padding_mask, return_intermediates)


class FeedForward(_Block):
    """post: Norm(x + Dropout(MLP(x)));  pre: x + Dropout(MLP(Norm(x)));  MLP dense
    W2 Dropout(act(W1 x)) or gated W2 Dropout(act(Wg x) * W1 x).
    Params: linear1.*, linear_gate.* (gated), linear2.*, norm.*, norm_out.*, scale."""

    kind = "FeedForward"

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, T, E) or (T, E) -> same shape."""
        return self._forward(x, None, None, False)


class TransformerBlock(_Block):
    """Attention sublayer then MLP sublayer; names as nn.TransformerEncoderLayer.

    Params: self_attn.{in_proj_weight, in_proj_bias, out_proj.*, q_norm.*, k_norm.*},
    linear1.*, linear_gate.* (gated), linear2.*, norm1.*, norm2.*, norm1_out.* / norm2_out.*
    (peri), and scale1 / scale2 for ReZero and LayerScale.
    """

    kind = "TransformerBlock"

    def forward(self, src: Tensor, src_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False):
        """src: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights":
        (B, H, T, T), "attention_logits_max": ()}."""
        return self._forward(src, src_mask, src_key_padding_mask, return_intermediates)


class Encoder(nn.Module):
    """`num_layers` independently initialised TransformerBlocks and an optional final norm,
    named like nn.TransformerEncoder (layers.{i}.*, norm.*). `final_norm` defaults to True
    for pre-LN and Peri-LN, False otherwise."""

    def __init__(self, cfg: BlockConfig, *, num_layers: int, final_norm: bool | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.cfg = cfg = cfg.resolve(num_layers)
        self.num_layers = num_layers
        self.layers = nn.ModuleList(TransformerBlock(cfg, generator=generator) for _ in range(num_layers))
        if final_norm is None:
            final_norm = cfg.norm in ("pre", "peri")
        norm = Norm(cfg, declarations.norm(cfg, cfg.d_model), generator=generator) if final_norm else None
        setattr(self, FINAL_NORM, norm)

    @property
    def final_norm(self) -> Norm | None:
        return getattr(self, FINAL_NORM)

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False):
        """src: (B, T, E) or (T, E) -> same shape. With return_intermediates, also
        {"residual": (L, B, T, E), "attention_weights": (L, B, H, T, T), "attention_logits_max": (L,)}."""
        x, unbatched = _batched(self.cfg, src)
        prepared = build_mask(self.cfg, x.shape[0], x.shape[1], mask, src_key_padding_mask, x.device)
        per_layer: list[dict[str, Tensor]] = []
        for layer in self.layers:
            x, extras = layer.apply_prepared(x, prepared, return_intermediates)
            if return_intermediates:
                per_layer.append({"residual": x, **extras})
        if self.final_norm is not None:
            x = self.final_norm(x)
        if not return_intermediates:
            return x[0] if unbatched else x
        stacked = {k: torch.stack([d[k] for d in per_layer]) for k in per_layer[0]}
        if unbatched:
            stacked = {k: (v[:, 0] if v.dim() > 1 else v) for k, v in stacked.items()}
        return (x[0] if unbatched else x), stacked
