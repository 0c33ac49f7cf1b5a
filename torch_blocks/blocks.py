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

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from flax_blocks.core import declarations
from flax_blocks.core.config import BlockConfig, check_parallel, layer_scale, skips_attn_norm
from flax_blocks.core.context import Context
from flax_blocks.core.declarations import Sublayer

from .attention import Attention, attention_path, build_mask
from .caches import Cache, cached_context, new_cache
from .experts import Experts
from .layers import ACTIVATION_FNS, Linear, Norm, as_batched, batched_memory, create_params
from .mla import LatentAttention, latent_cache

MODULES = {"linear": Linear, "norm": Norm, "attention": Attention, "latent_attention": LatentAttention,
           "experts": Experts}


def _finish(y: Tensor, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None and v.dim() else v) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y


class _Configured(Protocol):
    """A block or a stack, as `call_context` reads it."""

    cfg: BlockConfig
    training: bool


class _Block(nn.Module):
    """A block of residual sublayers, its modules named and built from the declarations.
    Every sublayer has a dropout on its output; MLP sublayers one more after the activation."""

    kind: str
    # The modules and parameters are registered from the declarations (declarations.block(cfg,
    # kind), named by declarations.BLOCKS); each subclass annotates its own, so that type
    # checkers and IDEs see them. None: an option that is off (no norm, no gate, no residual scale).

    def __init__(self, cfg: BlockConfig, *, generator: torch.Generator | None = None, mlp: str | None = None):
        super().__init__()
        self.cfg = cfg = cfg.resolve()
        # mlp: what its MLP sublayer holds (`declarations.block`); None: layer 1's (a block alone is layer 1)
        component = declarations.block(cfg, self.kind, declarations.layer_mlp(cfg, 1) if mlp is None else mlp)
        self.sublayers: tuple[Sublayer, ...] = declarations.BLOCKS[self.kind]
        check_parallel(cfg, self.kind, self.sublayers)
        create_params(self, component, cfg, generator)
        for name, child in component.children:
            setattr(self, name, MODULES[child.kind](cfg, child, generator=generator))
        for sub in self.sublayers:  # modules of options that are off (no norm, no gate, no experts...)
            for name in (*sub.modules, sub.norm, sub.norm_out, sub.scale, declarations.EXPERTS_MODULE):
                if not hasattr(self, name):
                    setattr(self, name, None)
        self.dropout_act = nn.Dropout(cfg.dropout)
        self.dropouts = nn.ModuleList(nn.Dropout(cfg.dropout) for _ in self.sublayers)

    def residual(self, i: int, x: Tensor, f: Callable, ctx: Context) -> Tensor:
        """Sublayer i of this block as a residual: x (B, T, E) -> y (B, T, E), f(h, ctx, i) the
        sublayer (`self_attention`, `cross_attention`, `mlp`) on (B, T, E). Each placement (cfg.norm):

            post:  y = Norm(alpha * x + s * Dropout(F(x)))          Vaswani et al., BERT
            pre:   y = x + s * Dropout(F(c * Norm(x)))              GPT-2, LLaMA
            peri:  y = x + s * Dropout(Norm_out(F(Norm(x))))        Peri-LN, sandwich norm
            out:   y = x + s * Dropout(Norm(F(x)))                  OLMo 2
            none:  y = x + s * Dropout(F(x))

        alpha: DeepNorm's (else 1); s: the ReZero / LayerScale gate (else 1); c = 1 / sqrt(layer)
        under LayerNorm Scaling (Sun et al. 2025; else 1); residual="none" drops the skip term.
        The Flax twin's `_Block.residual` computes the same, line for line."""
        cfg, sub = self.cfg, self.sublayers[i]
        norm, s = getattr(self, sub.norm), getattr(self, sub.scale)
        h = norm(x) if cfg.norm in ("pre", "peri") else x  # pre-LN, Peri-LN: the norm first
        if skips_attn_norm(cfg, ctx.layer, sub.kind):  # ModernBERT: layer 1's attention reads x itself
            h = x
        if cfg.layernorm_scaling:
            h = h * layer_scale(ctx.layer, h.dtype)  # c * Norm(x)
        h = f(h, ctx, i)  # the sublayer
        if cfg.norm == "peri":
            h = getattr(self, sub.norm_out)(h)  # Peri-LN: its own norm on the output too
        elif cfg.norm == "out":
            h = norm(h)  # OLMo 2: the norm on the output only
        h = self.dropouts[i](h)
        if s is not None:
            h = s * h  # the ReZero / LayerScale gate
        if cfg.residual_multiplier != 1.0:
            h = h * cfg.residual_multiplier  # Granite: x + m * F(x)
        if cfg.residual == "add":  # the skip: x + h; DeepNorm: alpha * x + h
            alpha = cfg.residual_alpha
            h = (x if alpha == 1.0 else x * alpha) + h
        return norm(h) if cfg.norm == "post" else h  # post-LN: the norm last, on the sum

    def parallel(self, x: Tensor, fs: Sequence[Callable], ctx: Context) -> Tensor:
        """The parallel residual (GPT-J, GPT-NeoX, StableLM; PaLM) over this block's sublayers
        fs (attention, MLP) on the same x: x (B, T, E) -> y (B, T, E).

            y = x + s1 * Dropout(F1(c * Norm1(x))) + s2 * Dropout(F2(c * Norm2(x)))

        with Norm2 = Norm1 under parallel_residual="shared_norm" (computed once), s and c as in
        `residual`. The Flax twin's `_Block.parallel` computes the same, line for line."""
        cfg, y, h_in = self.cfg, x, None
        for i, f in enumerate(fs):
            sub = self.sublayers[i]
            if h_in is None or cfg.parallel_residual == "two_norms":
                norm = getattr(self, sub.norm)
                h_in = x if norm is None else norm(x)  # each branch's norm, or the shared one
                if cfg.layernorm_scaling:
                    h_in = h_in * layer_scale(ctx.layer, h_in.dtype)
            h = self.dropouts[i](f(h_in, ctx, i))
            s = getattr(self, sub.scale)
            h = h if s is None else s * h
            y = y + (h if cfg.residual_multiplier == 1.0 else h * cfg.residual_multiplier)  # both added to one x
        return y

    def self_attention(self, h: Tensor, ctx: Context, i: int) -> Tensor:
        """Sublayer i, a self-attention, on h (B, T, E): its mask, path, positions and cache."""
        attention = getattr(self, self.sublayers[i].modules[0])
        out, weights, logit_max, cache = attention(h, ctx.attention_call("self"), ctx.weights)
        ctx.found.update(attention_weights=weights, attention_logits_max=logit_max)
        ctx.written["self"] = cache
        return out

    def cross_attention(self, h: Tensor, ctx: Context, i: int) -> Tensor:
        """Sublayer i, a cross-attention, on h (B, T, E): queries from h, keys and values from the
        memory (or the cache's, computed once); the path by the rule (`attention_path`)."""
        attention = getattr(self, self.sublayers[i].modules[0])
        out, weights, logit_max, cache = attention(h, ctx.attention_call("cross"), ctx.weights)
        ctx.found.update(cross_attention_weights=weights, cross_attention_logits_max=logit_max)
        ctx.written["cross"] = cache  # handed back unchanged
        return out

    def mlp(self, h: Tensor, ctx: Context, i: int) -> Tensor:
        """Sublayer i, the MLP, on h (B, T, E). dense: down(Dropout(act(up(h))));  gated:
        down(Dropout(act(gate(h)) * up(h))). With experts (cfg.num_experts), the experts MLP
        instead (`Experts`; its router logits (B, T, X) in ctx.found["router_logits"]). Each layer
        holds its own MLP (a mixed stack's dense layers: dense, their router logits zeros)."""
        experts: Experts | None = getattr(self, declarations.EXPERTS_MODULE)
        if not self.cfg.num_experts:
            return self.dense_mlp(h, ctx, i)
        t = h.reshape(-1, h.shape[-1])
        if experts is not None:
            y, logits = experts(t)
        else:
            y, logits = self.dense_mlp(t, ctx, i), t.new_zeros(t.shape[0], self.cfg.num_experts)
        ctx.found["router_logits"] = logits.reshape(*h.shape[:-1], self.cfg.num_experts)
        return y.reshape(h.shape)

    def dense_mlp(self, h: Tensor, ctx: Context, i: int) -> Tensor:
        """The dense MLP of sublayer i on h (..., E) -> (..., E)."""
        up, gate, down = (getattr(self, name) for name in self.sublayers[i].modules)
        act = ACTIVATION_FNS[self.cfg.activation]
        a = act(up(h)) if gate is None else act(gate(h)) * up(h)
        return down(self.dropout_act(a))

    def _block_cache(self, batch: int, length: int, dtype, device, memory: Tensor | None = None) -> Cache:
        cfg = self.cfg
        zeros = torch.zeros(batch, cfg.kv_heads, length, cfg.head_width, dtype=dtype, device=device)  # (B, K, L, hd)
        cache: Cache = {"self": latent_cache(cfg, batch, length, dtype, device) if cfg.latent
                        else {"k": zeros, "v": zeros.clone()}}
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
            ctx, cache = cached_context(self, x, cache, key_padding_mask, attn_mask, memory, memory_mask,
                                        return_intermediates)
            y = self.run(x, ctx)
            cache = {**cache, "layers": ctx.written}
            return (y, ctx.found, cache) if return_intermediates else (y, cache)
        ctx = call_context(self, x, attn_mask, key_padding_mask, return_intermediates)
        if memory is not None:
            ctx.memory = batched_memory(self.cfg, memory, x, unbatched)
            ctx.masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_padding_mask,
                                            x.device, keys=ctx.memory.shape[1], causal=False)
        y = self.run(x, ctx)
        return _finish(y, unbatched, ctx.found, return_intermediates)

    def run(self, x: Tensor, ctx: Context) -> Tensor:
        """x (B, T, E) -> y (B, T, E): the block's sublayers in order, each through the
        placement's residual; what they find and write in `ctx`."""
        raise NotImplementedError


def call_context(module: _Configured, x: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                 return_intermediates: bool) -> Context:
    """The context of an uncached call on x (B, T, E): the self-attention's path
    (`attention_path`, checked as in Flax) and its prepared mask."""
    cfg = module.cfg
    path = attention_path(cfg, x.shape[1], need_weights=return_intermediates, explicit_mask=attn_mask is not None,
                          dropout_active=module.training and cfg.dropout > 0, platform=x.device.type)
    return Context({"self": build_mask(cfg, x.shape[0], x.shape[1], attn_mask, key_padding_mask, x.device)},
                   path=path, weights=return_intermediates)


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

    def run(self, x: Tensor, ctx: Context) -> Tensor:
        """The attention through the placement's residual."""
        return self.residual(0, x, self.self_attention, ctx)


class FeedForward(_Block):
    """post: Norm(x + Dropout(MLP(x)));  pre: x + Dropout(MLP(Norm(x)));  MLP dense
    W2 Dropout(act(W1 x)) or gated W2 Dropout(act(Wg x) * W1 x).
    Params: linear1.*, linear_gate.* (gated), linear2.*, norm.*, norm_out.*, scale."""

    kind = "FeedForward"
    linear1: Linear | None  # None: an experts layer (`declarations.layer_mlp`)
    linear_gate: Linear | None
    linear2: Linear | None
    experts: Experts | None  # cfg.num_experts > 0
    norm: Norm | None
    norm_out: Norm | None
    scale: nn.Parameter | None

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, T, E) or (T, E) -> same shape."""
        return self._forward(x, None, None, False)

    def run(self, x: Tensor, ctx: Context) -> Tensor:
        """The MLP through the placement's residual."""
        return self.residual(0, x, self.mlp, ctx)


class TransformerBlock(_Block):
    """Attention sublayer then MLP sublayer; names as nn.TransformerEncoderLayer.

    Params: self_attn.{in_proj_weight, in_proj_bias, out_proj.*, q_norm.*, k_norm.*},
    linear1.*, linear_gate.* (gated), linear2.*, norm1.*, norm2.*, norm1_out.* / norm2_out.*
    (peri), and scale1 / scale2 for ReZero and LayerScale.
    """

    kind = "TransformerBlock"
    self_attn: Attention
    linear1: Linear | None  # None: an experts layer (`declarations.layer_mlp`)
    linear_gate: Linear | None
    linear2: Linear | None
    experts: Experts | None  # cfg.num_experts > 0
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

    def run(self, x: Tensor, ctx: Context) -> Tensor:
        """Self-attention, then the MLP, each through the placement's residual; under a
        parallel residual both on the same x."""
        if self.cfg.parallel_residual != "none":
            return self.parallel(x, (self.self_attention, self.mlp), ctx)
        x = self.residual(0, x, self.self_attention, ctx)
        x = self.residual(1, x, self.mlp, ctx)
        return x


class DecoderBlock(_Block):
    """Self-attention, cross-attention to a memory, then MLP; names as nn.TransformerDecoderLayer.

    Params: self_attn.*, multihead_attn.*, linear1.*, linear_gate.* (gated), linear2.*,
    norm1.*, norm2.*, norm3.*, norm1_out..norm3_out (peri), scale1..scale3.
    """

    kind = "DecoderBlock"
    self_attn: Attention
    multihead_attn: Attention
    linear1: Linear | None  # None: an experts layer (`declarations.layer_mlp`)
    linear_gate: Linear | None
    linear2: Linear | None
    experts: Experts | None  # cfg.num_experts > 0
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

    def run(self, x: Tensor, ctx: Context) -> Tensor:
        """Self-attention, then cross-attention to the memory, then the MLP, each through the
        placement's residual."""
        x = self.residual(0, x, self.self_attention, ctx)
        x = self.residual(1, x, self.cross_attention, ctx)
        x = self.residual(2, x, self.mlp, ctx)
        return x
