"""Residual transformer blocks in PyTorch: ResidualMHA, FeedForward, TransformerBlock and
DecoderBlock (their stacks Encoder, Decoder and Transformer are in `stacks.py`).

Twins of `flax_blocks`, with parameter names of torch's own modules:
`TransformerBlock` is named like `nn.TransformerEncoderLayer` (self_attn.in_proj_weight,
linear1, norm1, ...), `DecoderBlock` like `nn.TransformerDecoderLayer` (+ multihead_attn,
norm3), `Encoder` / `Decoder` like `nn.TransformerEncoder` / `nn.TransformerDecoder`
(layers.{i}., norm.) and `Transformer` like `nn.Transformer` (encoder., decoder.), so stock
state dicts load with strict=True, and masks are taken as stock torch takes them. A
block's modules and sublayers come from `declarations.BLOCKS`, shared with the Flax twins;
each placement's order of operations is written out in `_Block.residual` (and
`_Block.parallel`), as in the Flax twin's method of the same name. Masks follow torch's
convention: a True entry means "may NOT attend" (a float mask is added, as in stock
torch). Rows in which every key is masked give a zero attention output (flax_blocks does
the same), where torch's own MultiheadAttention gives NaN.

Causal modules decode incrementally, as their Flax twins: `cache = m.init_cache(batch,
max_length)` (a decoder also takes the memory), then `y, cache = m(x_chunk, cache=cache)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flax_blocks.core import declarations
from flax_blocks.core.config import BlockConfig, check_parallel, layer_scale, residual_add
from flax_blocks.core.declarations import Sublayer

from .attention import Attention, Mask, attention_path, build_mask
from .caches import Cache, cached_call, new_cache
from .layers import Linear, Norm, as_batched, batched_memory, create_params

ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}
MODULES = {"linear": Linear, "norm": Norm, "attention": Attention}


def _finish(y: Tensor, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None and v.dim() else v) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y


class _Configured(Protocol):
    """A block or a stack, as `prepare_self_attention` reads it."""

    cfg: BlockConfig
    training: bool


class _Block(nn.Module):
    """A block of residual sublayers, its modules named and built from the declarations.
    Every sublayer has a dropout on its output; MLP sublayers one more after the activation."""

    kind: str
    # The modules and parameters are registered from the declarations (declarations.block(cfg,
    # kind), named by declarations.BLOCKS); each subclass annotates its own, so that type
    # checkers and IDEs see them. None: an option that is off (no norm, no gate, no residual scale).

    def __init__(self, cfg: BlockConfig, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg = cfg.resolve()
        component = declarations.block(cfg, self.kind)
        self.sublayers: tuple[Sublayer, ...] = declarations.BLOCKS[self.kind]
        check_parallel(cfg, self.kind, self.sublayers)
        create_params(self, component, cfg, generator)
        for name, child in component.children:
            setattr(self, name, MODULES[child.kind](cfg, child, generator=generator))
        for sub in self.sublayers:  # modules of options that are off (no norm, no gate...)
            for name in (*sub.modules, sub.norm, sub.norm_out, sub.scale):
                if not hasattr(self, name):
                    setattr(self, name, None)
        self.dropout_act = nn.Dropout(cfg.dropout)
        self.dropouts = nn.ModuleList(nn.Dropout(cfg.dropout) for _ in self.sublayers)

    def run_prepared(self, x: Tensor, masks: dict[str, Mask | None], *, need_weights: bool = False,
                     path: str | None = None, memory: Tensor | None = None, cache: Cache | None = None,
                     index: int = 0, layer: int = 1):
        """x (B, T, E) with prepared masks {"self": Mask, "cross": Mask} -> (y (B, T, E),
        intermediates, the block's updated cache or None). path: the self-attention's
        (`attention_path`; None: from cfg and need_weights); a cross-attention takes
        "dense" with weights or cfg.attention="dense", else SDPA. Intermediates (None unless
        need_weights): "attention_weights" (B, H, T, S), "attention_logits_max" (), and the
        "cross_" ones of a decoder. memory (B, S, E): what a decoder attends to (not needed
        with a cache); cache: {"self": {"k", "v"}, "cross": {"k", "v"}}, index: the chunk's
        first position. layer: this block's index in its stack, from 1, read by
        layernorm_scaling; a block called alone is layer 1."""
        extras: dict[str, Any] = {}
        new_cache: Cache = {}
        branches = []  # a parallel residual's (sublayer, f, dropout), summed by `parallel`
        for sub, drop in zip(self.sublayers, self.dropouts, strict=True):
            part = "cross" if sub.kind == "cross_attention" else "self"
            if sub.kind == "mlp":
                f = functools.partial(self._mlp, sub)
            else:
                f = functools.partial(
                    _attention, getattr(self, sub.modules[0]), prefix="cross_" if part == "cross" else "",
                    mask=masks.get(part), need_weights=need_weights, cross=part == "cross", memory=memory,
                    cache=None if cache is None else cache[part], index=index,
                    path=None if part == "cross" else path, layer=layer, positions=masks.get("positions"),
                )
            if self.cfg.parallel_residual != "none":
                branches.append((sub, f, drop))
                continue
            x, aux = self.residual(sub, x, f, drop, layer)
            if "cache" in aux:
                new_cache[part] = aux.pop("cache")
            extras.update(aux)
        if branches:  # (a parallel block's one attention is a self-attention: its cache is "self")
            x, aux = self.parallel(x, branches, layer)
            if "cache" in aux:
                new_cache["self"] = aux.pop("cache")
            extras.update(aux)
        return x, extras, (new_cache if cache is not None else None)

    def residual(self, sub: Sublayer, x: Tensor, f: Callable, drop: Callable,
                 layer: Tensor | int = 1) -> tuple[Tensor, dict]:
        """One residual sublayer of this block: x (B, T, E) -> (y (B, T, E), what f returned
        beside its output). f: the sublayer (attention or MLP) on (B, T, E); drop: its output
        dropout; layer: the block's index in its stack, from 1. Each placement (cfg.norm):

            post:  y = Norm(alpha * x + s * Dropout(F(x)))          Vaswani et al., BERT
            pre:   y = x + s * Dropout(F(c * Norm(x)))              GPT-2, LLaMA
            peri:  y = x + s * Dropout(Norm_out(F(Norm(x))))        Peri-LN, sandwich norm
            out:   y = x + s * Dropout(Norm(F(x)))                  OLMo 2
            none:  y = x + s * Dropout(F(x))

        alpha: DeepNorm's (else 1); s: the ReZero / LayerScale gate (else 1); c = 1 / sqrt(layer)
        under LayerNorm Scaling (Sun et al. 2025; else 1); residual="none" drops the skip term.
        The Flax twin's `_Block.residual` computes the same, step for step."""
        cfg, norm, s = self.cfg, getattr(self, sub.norm), getattr(self, sub.scale)
        h = norm(x) if cfg.norm in ("pre", "peri") else x  # pre-LN, Peri-LN: the norm first
        if cfg.layernorm_scaling:
            h = h * layer_scale(layer, h)  # c * Norm(x)
        h, aux = f(h)  # the sublayer
        if cfg.norm == "peri":
            h = getattr(self, sub.norm_out)(h)  # Peri-LN: its own norm on the output too
        elif cfg.norm == "out":
            h = norm(h)  # OLMo 2: the norm on the output only
        h = drop(h)
        if s is not None:
            h = s * h  # the ReZero / LayerScale gate
        y = residual_add(cfg, x, h)  # x + h; DeepNorm: alpha * x + h
        if cfg.norm == "post":
            y = norm(y)  # post-LN: the norm last, on the sum
        return y, aux

    def parallel(self, x: Tensor, branches: Sequence[tuple[Sublayer, Callable, Callable]],
                 layer: Tensor | int = 1) -> tuple[Tensor, dict]:
        """The parallel residual (GPT-J, GPT-NeoX, StableLM; PaLM) over this block's attention and
        MLP, branches [(sublayer, f, drop)] in order: x (B, T, E) -> (y (B, T, E), their aux merged).

            y = x + s1 * Dropout(F1(c * Norm1(x))) + s2 * Dropout(F2(c * Norm2(x)))

        with Norm2 = Norm1 under parallel_residual="shared_norm" (computed once), s and c as in
        `residual`. The Flax twin's `_Block.parallel` computes the same, step for step."""
        cfg, y, aux, h_in = self.cfg, x, {}, None
        for sub, f, drop in branches:
            if h_in is None or cfg.parallel_residual == "two_norms":
                norm = getattr(self, sub.norm)
                h_in = x if norm is None else norm(x)  # each branch's norm, or the shared one
                if cfg.layernorm_scaling:
                    h_in = h_in * layer_scale(layer, h_in)
            h, a = f(h_in)  # the sublayer, on the normed input
            h = drop(h)
            s = getattr(self, sub.scale)
            y = y + (h if s is None else s * h)  # both added to the same x
            aux.update(a)
        return y, aux

    def _mlp(self, sub: Sublayer, h: Tensor) -> tuple[Tensor, dict]:
        """dense: down(Dropout(act(up(h))));  gated: down(Dropout(act(gate(h)) * up(h)))."""
        up, gate, down = (getattr(self, name) for name in sub.modules)
        act = ACTIVATION_FNS[self.cfg.activation]
        a = act(up(h)) if gate is None else act(gate(h)) * up(h)
        return down(self.dropout_act(a)), {}

    def _block_cache(self, batch: int, length: int, dtype, device, memory: Tensor | None = None) -> Cache:
        cfg = self.cfg
        zeros = torch.zeros(batch, cfg.kv_heads, length, cfg.head_width, dtype=dtype, device=device)  # (B, K, L, hd)
        cache: Cache = {"self": {"k": zeros, "v": zeros.clone()}}
        if memory is not None:
            assert isinstance(self, DecoderBlock)  # the block with a cross-attention
            cache["cross"] = self.multihead_attn.memory_kv(memory)
        return cache

    def _forward(self, x, attn_mask, key_padding_mask, return_intermediates, *, memory=None, memory_mask=None,
                 memory_key_padding_mask=None, cache=None):
        x, unbatched = as_batched(self.cfg, x)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return cached_call(self, x, cache, key_padding_mask, attn_mask, memory, memory_mask,
                                return_intermediates)
        path, masks = prepare_self_attention(self, x, attn_mask, key_padding_mask, return_intermediates)
        if memory is not None:
            memory = batched_memory(self.cfg, memory, x, unbatched)
            masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_padding_mask,
                                        x.device, keys=memory.shape[1], causal=False)
        y, extras, _ = self.run_prepared(x, masks, need_weights=return_intermediates, path=path, memory=memory)
        return _finish(y, unbatched, extras, return_intermediates)


def prepare_self_attention(module: _Configured, x: Tensor, attn_mask: Tensor | None,
                            key_padding_mask: Tensor | None, return_intermediates: bool) -> tuple[str, dict]:
    """The self-attention's path of an uncached call on x (B, T, E) (`attention_path`,
    checked as in Flax) and its prepared masks {"self": Mask or None}."""
    cfg = module.cfg
    path = attention_path(cfg, need_weights=return_intermediates, explicit_mask=attn_mask is not None,
                          dropout_active=module.training and cfg.dropout > 0)
    return path, {"self": build_mask(cfg, x.shape[0], x.shape[1], attn_mask, key_padding_mask, x.device)}


def _attention(attn: Attention, h: Tensor, *, prefix, mask, need_weights, cross, memory, cache, index, path, layer,
               positions=None):
    out, weights, logit_max, new_cache = attn(h, mask, need_weights, cross=cross, memory=memory, cache=cache,
                                              index=index, path=path, layer=layer, positions=positions)
    aux: dict[str, Any] = {f"{prefix}attention_weights": weights, f"{prefix}attention_logits_max": logit_max}
    if cache is not None:
        aux["cache"] = new_cache  # a cross-attention hands its memory's k/v back unchanged
    return out, aux


class ResidualMHA(_Block):
    """post: Norm(x + Dropout(MHA(x)));  pre: x + Dropout(MHA(Norm(x)));  peri: the pre
    form with a second norm on MHA's output. Params: mha.*, norm.*, norm_out.*, scale."""

    kind = "ResidualMHA"
    mha: Attention
    norm: Norm | None
    norm_out: Norm | None
    scale: nn.Parameter | None

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
    linear1: Linear
    linear_gate: Linear | None
    linear2: Linear
    norm: Norm | None
    norm_out: Norm | None
    scale: nn.Parameter | None

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
    self_attn: Attention
    linear1: Linear
    linear_gate: Linear | None
    linear2: Linear
    norm1: Norm | None
    norm2: Norm | None
    norm1_out: Norm | None
    norm2_out: Norm | None
    scale1: nn.Parameter | None
    scale2: nn.Parameter | None

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """An empty cache for incremental decoding of up to `max_length` positions (causal only)."""
        return new_cache(self, batch_size, max_length, self._block_cache)

    def forward(self, src: Tensor, src_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False, cache: Cache | None = None):
        """src: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights":
        (B, H, T, T), "attention_logits_max": ()}. cache (from `init_cache`): src is the next
        chunk (B, T, E); returns (y, cache)."""
        return self._forward(src, src_mask, src_key_padding_mask, return_intermediates, cache=cache)


class DecoderBlock(_Block):
    """Self-attention, cross-attention to a memory, then MLP; names as nn.TransformerDecoderLayer.

    Params: self_attn.*, multihead_attn.*, linear1.*, linear_gate.* (gated), linear2.*,
    norm1.*, norm2.*, norm3.*, norm1_out..norm3_out (peri), scale1..scale3.
    """

    kind = "DecoderBlock"
    self_attn: Attention
    multihead_attn: Attention
    linear1: Linear
    linear_gate: Linear | None
    linear2: Linear
    norm1: Norm | None
    norm2: Norm | None
    norm3: Norm | None
    norm1_out: Norm | None
    norm2_out: Norm | None
    norm3_out: Norm | None
    scale1: nn.Parameter | None
    scale2: nn.Parameter | None
    scale3: nn.Parameter | None

    def init_cache(self, batch_size: int, max_length: int, memory: Tensor,
                   memory_key_padding_mask: Tensor | None = None) -> Cache:
        """An empty self-attention cache of `max_length` positions and the cross-attention
        keys and values of `memory` (B, S, E), computed once; memory_key_padding_mask (B, S)."""
        return new_cache(self, batch_size, max_length, self._block_cache, memory, memory_key_padding_mask)

    def forward(self, tgt: Tensor, memory: Tensor | None = None, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, *, return_intermediates: bool = False,
                cache: Cache | None = None):
        """tgt: (B, T, E) or (T, E); memory: (B, S, E) or (S, E); masks as stock torch's
        (tgt_mask (T, T), memory_mask (T, S), key padding masks (B, T) / (B, S); True = may
        NOT attend, or float masks added). With return_intermediates, also the attention
        weights and largest logits of both ("attention_*", "cross_attention_*"). cache (from
        `init_cache`): tgt is the next chunk; returns (y, cache)."""
        if cache is None and memory is None:
            raise ValueError("DecoderBlock needs a memory (B, S, d_model), or a cache made with one")
        return self._forward(tgt, tgt_mask, tgt_key_padding_mask, return_intermediates, memory=memory,
                             memory_mask=memory_mask, memory_key_padding_mask=memory_key_padding_mask, cache=cache)
