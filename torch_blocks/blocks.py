"""Residual transformer blocks in PyTorch: ResidualMHA, FeedForward, TransformerBlock,
DecoderBlock, and the stacks Encoder, Decoder and Transformer.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from flax_blocks import declarations
from flax_blocks.config import (
    FINAL_NORM_BY_DEFAULT,
    BlockConfig,
    check_cached_call,
    check_new_cache,
    check_parallel,
    check_remat,
    check_width,
    layer_scale,
    overflow_message,
    residual_add,
)
from flax_blocks.declarations import FINAL_NORM, Sublayer

from .attention import Attention, Mask, attention_path, build_mask, cache_mask
from .layers import Linear, Norm, create_params

ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}
MODULES = {"linear": Linear, "norm": Norm, "attention": Attention}
Cache = dict[str, Any]


def _as_batched(cfg: BlockConfig, x: Tensor, what: str = "input") -> tuple[Tensor, bool]:
    check_width(cfg, tuple(x.shape), what)
    return (x, False) if x.dim() == 3 else (x[None], True)


def _batched_memory(cfg: BlockConfig, memory: Tensor, x: Tensor, unbatched: bool) -> Tensor:
    """memory (B, S, E), or (S, E) beside an unbatched x: batched like x, and of x's batch."""
    memory, _ = _as_batched(cfg, memory[None] if unbatched else memory, "memory")
    if memory.shape[0] != x.shape[0]:
        raise ValueError(f"memory has batch {memory.shape[0]}, the input {x.shape[0]}")
    return memory


def _finish(y: Tensor, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None and v.dim() else v) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y


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
        x, unbatched = _as_batched(self.cfg, x)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return _cached_call(self, x, cache, key_padding_mask, attn_mask, memory, memory_mask,
                                return_intermediates)
        path, masks = _prepare_self_attention(self, x, attn_mask, key_padding_mask, return_intermediates)
        if memory is not None:
            memory = _batched_memory(self.cfg, memory, x, unbatched)
            masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_padding_mask,
                                        x.device, keys=memory.shape[1], causal=False)
        y, extras, _ = self.run_prepared(x, masks, need_weights=return_intermediates, path=path, memory=memory)
        return _finish(y, unbatched, extras, return_intermediates)


def _prepare_self_attention(module: _Block | _Stack, x: Tensor, attn_mask: Tensor | None,
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
        return _new_cache(self, batch_size, max_length, self._block_cache)

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
        return _new_cache(self, batch_size, max_length, self._block_cache, memory, memory_key_padding_mask)

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


class _Stack(nn.Module):
    """`num_layers` independently initialised blocks and an optional final norm (layers.{i}.*,
    norm.*). `final_norm` defaults to True for pre-LN, Peri-LN and "out" (OLMo 2), False
    otherwise.
    remat: None, or any of the Flax twin's values ("full", a policy name): each layer is
    recomputed in the backward pass (torch.utils.checkpoint; torch has no named policies)."""

    block: type[_Block]
    norm: Norm | None  # the final norm (declarations.FINAL_NORM), set by name

    def __init__(self, cfg: BlockConfig, *, num_layers: int, final_norm: bool | None = None,
                 remat: str | None = None, generator: torch.Generator | None = None):
        super().__init__()
        check_remat(remat)
        self.remat = remat
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.cfg = cfg = cfg.resolve(num_layers)
        self.num_layers = num_layers
        self.layers = nn.ModuleList(self.block(cfg, generator=generator) for _ in range(num_layers))
        if final_norm is None:
            final_norm = cfg.norm in FINAL_NORM_BY_DEFAULT
        norm = Norm(cfg, declarations.norm(cfg, cfg.d_model), generator=generator) if final_norm else None
        setattr(self, FINAL_NORM, norm)

    @property
    def final_norm(self) -> Norm | None:
        return getattr(self, FINAL_NORM)

    def _blocks(self) -> Iterable[_Block]:
        """The layers, typed as the blocks they are (nn.ModuleList yields plain Modules)."""
        return cast("Iterable[_Block]", self.layers)

    def _stack_cache(self, batch, length, dtype, device, memory=None) -> Cache:
        """Every layer's block cache."""
        return {"layers": [layer._block_cache(batch, length, dtype, device, memory) for layer in self._blocks()]}

    def run_prepared(self, x, masks, *, need_weights=False, path=None, memory=None, cache=None, index=0):
        """The layers over x (B, T, E) with prepared masks (as `_Block.run_prepared`), then the
        final norm -> (y, stacked intermediates, cache)."""
        per_layer: list[dict[str, Tensor]] = []
        caches = []
        recompute = self.remat is not None and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self._blocks()):
            if recompute:
                x, extras, c = torch.utils.checkpoint.checkpoint(
                    layer.run_prepared, x, masks, need_weights=need_weights, path=path, memory=memory, layer=i + 1,
                    use_reentrant=False)
            else:
                x, extras, c = layer.run_prepared(x, masks, need_weights=need_weights, path=path, memory=memory,
                                                  index=index, cache=None if cache is None else cache["layers"][i],
                                                  layer=i + 1)
            caches.append(c)
            if need_weights:
                per_layer.append({"residual": x, **extras})
        if self.final_norm is not None:
            x = self.final_norm(x)
        stacked = {k: torch.stack([d[k] for d in per_layer]) for k in per_layer[0]} if need_weights else {}
        return x, stacked, ({"layers": caches} if cache is not None else None)

    def _finish_stack(self, y, stacked, unbatched, return_intermediates):
        if not return_intermediates:
            return y[0] if unbatched else y
        if unbatched:
            stacked = {k: (v[:, 0] if v.dim() > 1 else v) for k, v in stacked.items()}
        return (y[0] if unbatched else y), stacked


class Encoder(_Stack):
    """TransformerBlocks and an optional final norm, named like nn.TransformerEncoder."""

    block = TransformerBlock

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """An empty cache for incremental decoding of up to `max_length` positions (causal only)."""
        return _new_cache(self, batch_size, max_length, self._stack_cache)

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False, cache: Cache | None = None, positions: Tensor | None = None):
        """src: (B, T, E) or (T, E) -> same shape. With return_intermediates, also
        {"residual": (L, B, T, E), "attention_weights": (L, B, H, T, T), "attention_logits_max": (L,)}.
        cache (from `init_cache`): src is the next chunk; returns (y, cache).
        positions: (B, T) integer rotary positions per row (HF's position_ids); None: 0..T-1,
        or with a cache each row's next position onwards."""
        x, unbatched = _as_batched(self.cfg, src)
        positions = _checked_positions(positions, tuple(x.shape[:2]))
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return _cached_call(self, x, cache, src_key_padding_mask, mask, None, None, return_intermediates,
                                positions=positions)
        path, masks = _prepare_self_attention(self, x, mask, src_key_padding_mask, return_intermediates)
        if positions is not None:
            masks["positions"] = positions
        y, stacked, _ = self.run_prepared(x, masks, need_weights=return_intermediates, path=path)
        return self._finish_stack(y, stacked, unbatched, return_intermediates)


class Decoder(_Stack):
    """DecoderBlocks and an optional final norm, named like nn.TransformerDecoder."""

    block = DecoderBlock

    def init_cache(self, batch_size: int, max_length: int, memory: Tensor,
                   memory_key_padding_mask: Tensor | None = None) -> Cache:
        """An empty self-attention cache per layer and every layer's cross-attention keys
        and values of `memory` (B, S, E), computed once."""
        return _new_cache(self, batch_size, max_length, self._stack_cache, memory, memory_key_padding_mask)

    def forward(self, tgt: Tensor, memory: Tensor | None = None, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, *, return_intermediates: bool = False,
                cache: Cache | None = None):
        """tgt (B, T, E) or (T, E), memory (B, S, E) or (S, E); masks as `DecoderBlock`."""
        x, unbatched = _as_batched(self.cfg, tgt)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return _cached_call(self, x, cache, tgt_key_padding_mask, tgt_mask, memory, memory_mask,
                                return_intermediates)
        if memory is None:
            raise ValueError("Decoder needs a memory (B, S, d_model), or a cache made with one")
        memory = _batched_memory(self.cfg, memory, x, unbatched)
        path, masks = _prepare_self_attention(self, x, tgt_mask, tgt_key_padding_mask, return_intermediates)
        masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_padding_mask,
                                    x.device, keys=memory.shape[1], causal=False)
        y, stacked, _ = self.run_prepared(x, masks, need_weights=return_intermediates, path=path, memory=memory)
        return self._finish_stack(y, stacked, unbatched, return_intermediates)


class Transformer(nn.Module):
    """An Encoder and a Decoder, named like nn.Transformer (encoder.*, decoder.*).

    `cfg` serves both; the encoder is never causal, the decoder's self-attention is causal
    when cfg.causal. Both have a final norm by default, as nn.Transformer."""

    def __init__(self, cfg: BlockConfig, *, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 final_norm: bool = True, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(replace(cfg, causal=False), num_layers=num_encoder_layers, final_norm=final_norm,
                               generator=generator)
        self.decoder = Decoder(cfg, num_layers=num_decoder_layers, final_norm=final_norm, generator=generator)

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None) -> Tensor:
        """src (B, S, E), tgt (B, T, E) -> (B, T, E); masks as nn.Transformer's."""
        memory = self.encoder(src, src_mask, src_key_padding_mask)
        return self.decoder(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask)


# ----------------------------------------------------------------------------------------
# Cached incremental decoding
# ----------------------------------------------------------------------------------------


def _new_cache(module, batch_size: int, max_length: int, make, memory=None, memory_key_padding_mask=None) -> Cache:
    cfg = module.cfg
    check_new_cache(cfg, type(module).__name__, batch_size, max_length)
    p = next(module.parameters())
    # "overflow": the Flax twin's flag for traced calls; here an overflow always raises, so it stays False
    cache: Cache = {"index": 0, "valid": torch.zeros(batch_size, max_length, dtype=torch.bool, device=p.device),
                    "overflow": False,
                    "position": torch.zeros(batch_size, dtype=torch.long, device=p.device)}  # each row's next position
    if memory is not None:
        memory, _ = _as_batched(cfg, memory, "memory")
        if memory.shape[0] != batch_size:
            raise ValueError(f"memory has batch {memory.shape[0]}, the cache batch_size {batch_size}")
        with torch.no_grad():
            cache["layers"] = make(batch_size, max_length, p.dtype, p.device, memory)
        kpm = memory_key_padding_mask
        if kpm is not None and (kpm.dtype != torch.bool or tuple(kpm.shape) != tuple(memory.shape[:2])):
            raise ValueError(f"memory_key_padding_mask must be a boolean (batch, memory length) = "
                             f"{tuple(memory.shape[:2])} tensor, got {kpm.dtype} {tuple(kpm.shape)}")
        cache["memory_valid"] = torch.ones(memory.shape[:2], dtype=torch.bool, device=p.device) if kpm is None else ~kpm
    else:
        cache["layers"] = make(batch_size, max_length, p.dtype, p.device)
    return cache


def _checked_positions(positions: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    """positions (B, T), checked against x's (B, T); None stays None."""
    if positions is None:
        return None
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or tuple(positions.shape) != shape:
        raise ValueError(f"positions must be an integer (batch, seq) = {shape} tensor (HF's position_ids), "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    return positions


def _cached_call(module, x, cache, key_padding_mask, attn_mask, memory, memory_mask, return_intermediates,
                 positions=None):
    b, t, length = check_cached_call(module.cfg, type(module).__name__, cache, tuple(x.shape),
                                     masks=attn_mask is not None or memory_mask is not None,
                                     memory=memory is not None)
    index = int(cache["index"])
    message = overflow_message(t, index, length)
    if message:
        raise ValueError(message)
    kpm = key_padding_mask
    if kpm is not None and (kpm.dtype != torch.bool or tuple(kpm.shape) != (b, t)):
        raise ValueError(f"the key padding mask of a cached call must be a boolean (batch, chunk) = {(b, t)} "
                         f"tensor, got {kpm.dtype} {tuple(kpm.shape)}")
    valid = cache["valid"].clone()
    valid[:, index:index + t] = True if kpm is None else ~kpm
    masks = {"self": cache_mask(index, t, valid)}
    if positions is None and "position" in cache:  # per-row positions: given, or each row's next ones
        positions = cache["position"][:, None] + torch.arange(t, device=x.device)
    if positions is not None:
        masks["positions"] = positions
    if "memory_valid" in cache:
        mv = cache["memory_valid"][:, None, None, :].expand(b, 1, t, -1)
        rows = mv.any(dim=-1, keepdim=True)
        masks["cross"] = Mask(~mv & rows, rows)
    y, extras, layers = module.run_prepared(x, masks, need_weights=return_intermediates, cache=cache["layers"],
                                            index=index)
    new = {**cache, "index": index + t, "valid": valid, "layers": layers}
    if "position" in cache:
        new["position"] = positions[:, -1] + 1
    return (y, extras, new) if return_intermediates else (y, new)
