"""Residual transformer blocks in PyTorch: ResidualMHA, FeedForward, TransformerBlock, Encoder.

Twins of `flax_blocks`, with parameter names of torch's own modules:
`TransformerBlock` is named like `nn.TransformerEncoderLayer` (self_attn.in_proj_weight,
linear1, norm1, ...) and `Encoder` like `nn.TransformerEncoder` (layers.{i}., norm.), so
stock state dicts load with strict=True. Masks follow torch's convention: a True entry
means "may NOT attend". Rows in which every key is masked give a zero attention output
(flax_blocks does the same), where torch's own MultiheadAttention would give NaN.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flax_blocks.config import BlockConfig, check_width, init_spec, residual_update

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATION_FNS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


# ----------------------------------------------------------------------------------------
# Initialisation from the shared table
# ----------------------------------------------------------------------------------------


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


def _init_attention(cfg: BlockConfig, mha: nn.MultiheadAttention, generator) -> None:
    for chunk, spec in zip(mha.in_proj_weight.data.chunk(3, dim=0), init_spec(cfg, "qkv_weight")):
        _fill(chunk, spec, generator)
    _fill(mha.out_proj.weight, init_spec(cfg, "out_weight"), generator)
    if cfg.bias:
        _fill(mha.in_proj_bias, init_spec(cfg, "qkv_bias"), generator)
        _fill(mha.out_proj.bias, init_spec(cfg, "out_bias"), generator)


def _init_linear(cfg: BlockConfig, lin: nn.Linear, role: str, generator) -> None:
    _fill(lin.weight, init_spec(cfg, f"{role}_weight"), generator)
    if lin.bias is not None:
        _fill(lin.bias, init_spec(cfg, f"{role}_bias"), generator)


def _gate(cfg: BlockConfig) -> nn.Parameter | None:
    if cfg.scaling not in ("rezero", "layerscale"):
        return None
    shape = () if cfg.scaling == "rezero" else (cfg.d_model,)
    return nn.Parameter(torch.full(shape, init_spec(cfg, "scale")[1]))


def _layer_norm(cfg: BlockConfig) -> nn.LayerNorm | None:
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias) if cfg.norm != "none" else None


def _mha(cfg: BlockConfig) -> nn.MultiheadAttention:
    return nn.MultiheadAttention(cfg.d_model, cfg.num_heads, dropout=cfg.dropout, bias=cfg.bias, batch_first=True)


# ----------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------


def _check_mask(name: str, mask: Tensor, shapes: list[tuple[int, ...]]) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a boolean tensor (True = may NOT attend), got dtype {mask.dtype}")
    if tuple(mask.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(mask.shape)}")


def build_mask(
    cfg: BlockConfig, batch: int, seq: int, attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None, device: Any = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Combine the causal flag and the user's masks (True = may NOT attend).

    attn_mask: (seq, seq) or (batch, seq, seq); key_padding_mask: (batch, seq), True = padding.
    Returns (masked of shape (batch or 1, seq, seq) or None,
             rows (batch or 1, seq, 1): True where a query has at least one key, or None).
    """
    masked = None
    if cfg.causal:
        masked = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None]
    if attn_mask is None and key_padding_mask is None:
        return masked, None
    if attn_mask is not None:
        _check_mask("attn_mask", attn_mask, [(seq, seq), (batch, seq, seq)])
        m = attn_mask.reshape(-1, seq, seq)
        masked = m if masked is None else masked | m
    if key_padding_mask is not None:
        _check_mask("key_padding_mask", key_padding_mask, [(batch, seq)])
        m = key_padding_mask[:, None, :]
        masked = m if masked is None else masked | m
    masked = masked.expand(-1, seq, seq)  # a key-padding mask alone is (batch, 1, seq); MHA needs (.., seq, seq)
    rows = ~masked.all(dim=-1, keepdim=True)
    return masked & rows, rows


def _attend(mha: nn.MultiheadAttention, x: Tensor, masked: Tensor | None, rows: Tensor | None, need_weights: bool):
    """x (B, T, E) -> (out (B, T, E), weights (B, H, T, T) or None)."""
    if masked is not None:
        masked = masked[0] if masked.shape[0] == 1 else masked.repeat_interleave(mha.num_heads, dim=0)
    out, w = mha(x, x, x, attn_mask=masked, need_weights=need_weights, average_attn_weights=False)
    if rows is not None:
        out = torch.where(rows, out, 0.0)
        w = None if w is None else torch.where(rows[:, None], w, 0.0)
    return out, w


def _batched(cfg: BlockConfig, x: Tensor) -> tuple[Tensor, bool]:
    check_width(cfg, tuple(x.shape))
    return (x, False) if x.dim() == 3 else (x[None], True)


def _finish(y: Tensor, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None else None) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y


# ----------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------


class _Residual(nn.Module):
    cfg: BlockConfig

    def _update(self, x, sublayer, norm, dropout, scale):
        return residual_update(self.cfg, x, sublayer, norm if norm is not None else nn.Identity(), dropout, scale)

    def _sa(self, x, mha, norm, dropout, scale, masked, rows, need_weights):
        return self._update(x, lambda h: _attend(mha, h, masked, rows, need_weights), norm, dropout, scale)

    def _ff(self, x, linear1, linear2, dropout_act, norm, dropout, scale):
        act = ACTIVATION_FNS[self.cfg.activation]
        return self._update(x, lambda h: (linear2(dropout_act(act(linear1(h)))), None), norm, dropout, scale)


class ResidualMHA(_Residual):
    """post: LN(x + Dropout(MHA(x)));  pre: x + Dropout(MHA(LN(x))). Params: mha.*, norm.*, scale."""

    def __init__(self, cfg: BlockConfig, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg = cfg.resolve()
        self.mha = _mha(cfg)
        self.norm = _layer_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.scale = _gate(cfg)
        _init_attention(cfg, self.mha, generator)
        self.to(DTYPES[cfg.param_dtype])

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False):
        """x: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights": (B, H, T, T)}."""
        x, unbatched = _batched(self.cfg, x)
        masked, rows = build_mask(self.cfg, x.shape[0], x.shape[1], attn_mask, key_padding_mask, x.device)
        y, w = self._sa(x, self.mha, self.norm, self.dropout, self.scale, masked, rows, return_intermediates)
        return _finish(y, unbatched, {"attention_weights": w}, return_intermediates)


class FeedForward(_Residual):
    """post: LN(x + Dropout(W2 Dropout(act(W1 x))));  pre: the same on LN(x), added to x.
    Params: linear1.*, linear2.*, norm.*, scale."""

    def __init__(self, cfg: BlockConfig, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg = cfg.resolve()
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.norm = _layer_norm(cfg)
        self.dropout_act = nn.Dropout(cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)
        self.scale = _gate(cfg)
        _init_linear(cfg, self.linear1, "linear1", generator)
        _init_linear(cfg, self.linear2, "linear2", generator)
        self.to(DTYPES[cfg.param_dtype])

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, T, E) or (T, E) -> same shape."""
        x, unbatched = _batched(self.cfg, x)
        y, _ = self._ff(x, self.linear1, self.linear2, self.dropout_act, self.norm, self.dropout, self.scale)
        return y[0] if unbatched else y


class TransformerBlock(_Residual):
    """Attention sublayer then feed-forward sublayer; names as nn.TransformerEncoderLayer.

    Params: self_attn.{in_proj_weight, in_proj_bias, out_proj.*}, linear1.*, linear2.*,
    norm1.*, norm2.*, and scale1 / scale2 for ReZero and LayerScale.
    """

    def __init__(self, cfg: BlockConfig, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg = cfg.resolve()
        self.self_attn = _mha(cfg)
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.norm1 = _layer_norm(cfg)
        self.norm2 = _layer_norm(cfg)
        self.dropout1 = nn.Dropout(cfg.dropout)
        self.dropout2 = nn.Dropout(cfg.dropout)
        self.scale1 = _gate(cfg)
        self.scale2 = _gate(cfg)
        _init_attention(cfg, self.self_attn, generator)
        _init_linear(cfg, self.linear1, "linear1", generator)
        _init_linear(cfg, self.linear2, "linear2", generator)
        self.to(DTYPES[cfg.param_dtype])

    def apply_prepared(self, x: Tensor, masked: Tensor | None, rows: Tensor | None, need_weights: bool = False):
        """x: (B, T, E) with a prepared mask -> (y (B, T, E), weights (B, H, T, T) or None)."""
        x, w = self._sa(x, self.self_attn, self.norm1, self.dropout1, self.scale1, masked, rows, need_weights)
        x, _ = self._ff(x, self.linear1, self.linear2, self.dropout, self.norm2, self.dropout2, self.scale2)
        return x, w

    def forward(self, src: Tensor, src_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False):
        """src: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights": (B, H, T, T)}."""
        x, unbatched = _batched(self.cfg, src)
        masked, rows = build_mask(self.cfg, x.shape[0], x.shape[1], src_mask, src_key_padding_mask, x.device)
        y, w = self.apply_prepared(x, masked, rows, return_intermediates)
        return _finish(y, unbatched, {"attention_weights": w}, return_intermediates)


class Encoder(nn.Module):
    """`num_layers` independently initialised TransformerBlocks and an optional final LayerNorm,
    named like nn.TransformerEncoder (layers.{i}.*, norm.*). `final_norm` defaults to True
    for pre-LN, False otherwise."""

    def __init__(self, cfg: BlockConfig, *, num_layers: int, final_norm: bool | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.cfg = cfg = cfg.resolve(num_layers)
        self.num_layers = num_layers
        self.layers = nn.ModuleList(TransformerBlock(cfg, generator=generator) for _ in range(num_layers))
        if final_norm is None:
            final_norm = cfg.norm == "pre"
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias) if final_norm else None
        self.to(DTYPES[cfg.param_dtype])

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False):
        """src: (B, T, E) or (T, E) -> same shape. With return_intermediates, also
        {"residual": (L, B, T, E), "attention_weights": (L, B, H, T, T)}."""
        x, unbatched = _batched(self.cfg, src)
        masked, rows = build_mask(self.cfg, x.shape[0], x.shape[1], mask, src_key_padding_mask, x.device)
        residual, weights = [], []
        for layer in self.layers:
            x, w = layer.apply_prepared(x, masked, rows, return_intermediates)
            if return_intermediates:
                residual.append(x)
                weights.append(w)
        if self.norm is not None:
            x = self.norm(x)
        if not return_intermediates:
            return x[0] if unbatched else x
        residual_t, weights_t = torch.stack(residual), torch.stack(weights)
        if unbatched:
            residual_t, weights_t = residual_t[:, 0], weights_t[:, 0]
        return (x[0] if unbatched else x), {"residual": residual_t, "attention_weights": weights_t}
