"""Residual transformer blocks in Flax NNX: ResidualMHA, FeedForward, TransformerBlock and
DecoderBlock (their stacks Encoder, Decoder and Transformer are in `stacks.py`).

Each is built as `X(cfg, rngs=nnx.Rngs(0))` (the stacks also take `num_layers=`) and called
on x of shape (batch, seq, d_model) or (seq, d_model), returning that shape. Masks follow
flax's convention: True means "may attend" (see `attention.build_mask`). A block's modules
and sublayers come from `declarations.BLOCKS`, shared with the torch twins; each placement's
order of operations is written out in `_Block.residual` (and `_Block.parallel`), as in the
torch twin's method of the same name.

Causal modules decode incrementally: `cache = m.init_cache(batch, max_length)` (a decoder
also takes the memory, whose keys and values are computed once), then
`y, cache = m(x_chunk, cache=cache)` for each chunk of one or more new positions.
A chunk that passes max_length is an error: eagerly a ValueError; in traced code (jit,
jax.export, where raising would need a host callback, which an exported program cannot
hold) it sets the cache's sticky flag `cache["overflow"]` (a bool array), and the
outputs from then on are meaningless: check the flag, e.g. once after a generation loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Attention, attention_path, build_mask, self_attention_masks
from .caches import Cache, cached_call, new_cache
from .core import declarations
from .core.config import BlockConfig, check_parallel, layer_scale, residual_add
from .core.declarations import Sublayer
from .layers import Linear, Norm, as_batched, batched_memory, create_params, dropout, initial_values

ACTIVATION_FNS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}
MODULES = {"linear": Linear, "norm": Norm, "attention": Attention}


class _Block(nnx.Module):
    """A block of residual sublayers, its modules named and built from the declarations.

    Every sublayer has a dropout on its output; MLP sublayers one more after the
    activation (`dropout_act`). Call-time dropout keys: one per block, split."""

    kind: str
    # The modules and parameters are set from the declarations (declarations.block(cfg, kind),
    # named by declarations.BLOCKS); each subclass annotates its own, so that type checkers
    # and IDEs see them. None: an option that is off (no norm, no gate, no residual scale).

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg = cfg.resolve()
        component = declarations.block(cfg, self.kind)
        self.sublayers: tuple[Sublayer, ...] = declarations.BLOCKS[self.kind]
        check_parallel(cfg, self.kind, self.sublayers)
        values = initial_values(rngs.params(), component, cfg)  # the whole block in one jitted draw
        create_params(self, component, cfg, rngs, values)
        for name, child in component.children:
            setattr(self, name, MODULES[child.kind](cfg, child, rngs=rngs, values=values[name]))
        for sub in self.sublayers:  # modules of options that are off (no norm, no gate...)
            for name in (*sub.modules, sub.norm, sub.norm_out, sub.scale):
                if not hasattr(self, name):
                    setattr(self, name, None)
        self.dropout_act = dropout(cfg, rngs)
        self.dropouts = nnx.List([dropout(cfg, rngs) for _ in self.sublayers])

    def run_prepared(
        self, x: jax.Array, masks: dict[str, Any], *, key: jax.Array | None = None,
        deterministic: bool | None = None, path: str = "dense", memory: jax.Array | None = None,
        cache: Cache | None = None, index: jax.Array | int = 0, layer: jax.Array | int = 1,
    ) -> tuple[jax.Array, dict[str, jax.Array], Cache | None]:
        """x (B, T, E) with prepared masks {"self": (mask, rows), "cross": (mask, rows),
        "key_valid" (blocked / fused paths)} -> (y (B, T, E), intermediates, the block's
        updated cache or None). path: the self-attention's (`attention_path`); a
        cross-attention is always dense.

        Intermediates: "attention_weights" (B, H, T, S) and "attention_logits_max" () of the
        self-attention; "cross_attention_weights" / "cross_attention_logits_max" of a
        decoder's cross-attention. memory (B, S, E): what a decoder attends to (not needed
        with a cache, which holds its keys and values). cache: {"self": {"k", "v"},
        "cross": {"k", "v"}} of this block, index: the chunk's first position.
        key: one dropout key for the whole block (the stacks pass one per layer); None
        uses the dropouts' own RNG streams. deterministic: True turns dropout off for this
        call, False on; None follows the module's train / eval mode. layer: this block's
        index in its stack, from 1 (an int or a traced integer; the stacks scan it), read
        by layernorm_scaling; a block called alone is layer 1."""
        n = len(self.sublayers)
        keys = [None] * (2 * n) if key is None else list(jax.random.split(key, 2 * n))
        extras: dict[str, jax.Array] = {}
        new_cache: Cache = {}
        branches = []  # a parallel residual's (sublayer, f, dropout), summed by `parallel`
        for i, sub in enumerate(self.sublayers):
            k_inner, k_out = keys[2 * i], keys[2 * i + 1]
            part = "cross" if sub.kind == "cross_attention" else "self"
            if sub.kind == "mlp":
                f = functools.partial(self._mlp, sub, k_inner, deterministic)
            else:
                mask, rows = masks.get(part, (None, None))
                f = functools.partial(
                    _attention, getattr(self, sub.modules[0]), prefix="cross_" if part == "cross" else "",
                    mask=mask, rows=rows, key=k_inner, deterministic=deterministic, cross=part == "cross",
                    memory=memory, cache=None if cache is None else cache[part], index=index,
                    path="dense" if part == "cross" else path, key_valid=masks.get("key_valid"), layer=layer,
                    positions=masks.get("positions"),
                )
            drop = _with_key(self.dropouts[i], k_out, deterministic)
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

    def residual(self, sub: Sublayer, x: jax.Array, f: Callable, drop: Callable,
                 layer: jax.Array | int = 1) -> tuple[jax.Array, dict]:
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
        The torch twin's `_Block.residual` computes the same, step for step."""
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
            h = s[...].astype(x.dtype) * h  # the ReZero / LayerScale gate
        y = residual_add(cfg, x, h)  # x + h; DeepNorm: alpha * x + h
        if cfg.norm == "post":
            y = norm(y)  # post-LN: the norm last, on the sum
        return y, aux

    def parallel(self, x: jax.Array, branches: Sequence[tuple[Sublayer, Callable, Callable]],
                 layer: jax.Array | int = 1) -> tuple[jax.Array, dict]:
        """The parallel residual (GPT-J, GPT-NeoX, StableLM; PaLM) over this block's attention and
        MLP, branches [(sublayer, f, drop)] in order: x (B, T, E) -> (y (B, T, E), their aux merged).

            y = x + s1 * Dropout(F1(c * Norm1(x))) + s2 * Dropout(F2(c * Norm2(x)))

        with Norm2 = Norm1 under parallel_residual="shared_norm" (computed once), s and c as in
        `residual`. The torch twin's `_Block.parallel` computes the same, step for step."""
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
            y = y + (h if s is None else s[...].astype(x.dtype) * h)  # both added to the same x
            aux.update(a)
        return y, aux

    def _mlp(self, sub: Sublayer, key: jax.Array | None, deterministic: bool | None,
             h: jax.Array) -> tuple[jax.Array, dict]:
        """dense: down(Dropout(act(up(h))));  gated: down(Dropout(act(gate(h)) * up(h))).
        Both matmuls on the (B*T, E) token matrix, as 2-D GEMMs (faster on XLA:CPU than on
        (B, T, E))."""
        up, gate, down = (getattr(self, name) for name in sub.modules)
        act = ACTIVATION_FNS[self.cfg.activation]
        t = h.reshape(-1, h.shape[-1])
        a = act(up(t)) if gate is None else act(gate(t)) * up(t)
        return down(self.dropout_act(a, deterministic=deterministic, rngs=key)).reshape(h.shape), {}

    def _block_cache(self, batch: int, length: int, dtype) -> Cache:
        cfg = self.cfg
        zeros = jnp.zeros((batch, cfg.kv_heads, length, cfg.head_width), dtype)  # head-major (B, K, L, hd)
        return {"self": {"k": zeros, "v": zeros}}

    def _forward(self, x, attention_mask, key_mask, return_intermediates, deterministic=None, *,
                 memory=None, memory_mask=None, memory_key_mask=None, cache=None):
        x, unbatched = as_batched(self.cfg, x)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return cached_call(self, x, cache, key_mask, attention_mask, memory, memory_mask,
                                return_intermediates, deterministic, stacked=False)
        path, masks = prepare_self_attention(self, x, attention_mask, key_mask, return_intermediates, deterministic)
        if memory is not None:
            memory = batched_memory(self.cfg, memory, x, unbatched)
            masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_mask,
                                        keys=memory.shape[1], causal=False)
        y, extras, _ = self.run_prepared(x, masks, deterministic=deterministic, path=path, memory=memory)
        return _finish(y, unbatched, extras, return_intermediates)


def prepare_self_attention(module, x, attention_mask, key_mask, return_intermediates,
                            deterministic) -> tuple[str, dict]:
    """The self-attention's path of an uncached call on x (B, T, E) (`attention_path`, from
    static facts of this call) and its prepared masks. Dropout on the weights is active when
    the rate is positive and the call (deterministic) or else the module's mode turns it on
    (a block's or a stack's layers' dropouts)."""
    cfg = module.cfg
    off = getattr(module, "layers", module).dropouts[0].deterministic if deterministic is None else deterministic
    path = attention_path(cfg, x.shape[1], need_weights=return_intermediates,
                          explicit_mask=attention_mask is not None, dropout_active=cfg.dropout > 0 and not off)
    return path, self_attention_masks(cfg, path, x.shape[0], x.shape[1], attention_mask, key_mask)


def _attention(attn: Attention, h, *, prefix, mask, rows, key, deterministic, cross, memory, cache, index, path,
               key_valid, layer, positions=None):
    out, weights, logit_max, new_cache = attn(h, mask, rows, key=key, deterministic=deterministic, cross=cross,
                                              memory=memory, cache=cache, index=index, path=path,
                                              key_valid=key_valid, layer=layer, positions=positions)
    aux: dict[str, Any] = {f"{prefix}attention_weights": weights, f"{prefix}attention_logits_max": logit_max}
    if cache is not None:
        aux["cache"] = new_cache  # a cross-attention hands its memory's k/v back unchanged
    return out, aux


class ResidualMHA(_Block):
    """post: Norm(x + Dropout(MHA(x)));  pre: x + Dropout(MHA(Norm(x)));  peri: the pre
    form with a second norm on MHA's output. Params: mha, norm, norm_out, scale."""

    kind = "ResidualMHA"
    mha: Attention
    norm: Norm | None
    norm_out: Norm | None
    scale: nnx.Param[jax.Array] | None

    def __call__(self, x: jax.Array, *, attention_mask=None, key_mask=None, return_intermediates: bool = False,
                 deterministic: bool | None = None):
        """x: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights":
        (B, H, T, T), "attention_logits_max": ()}. deterministic: see `TransformerBlock`."""
        return self._forward(x, attention_mask, key_mask, return_intermediates, deterministic)


class FeedForward(_Block):
    """post: Norm(x + Dropout(MLP(x)));  pre: x + Dropout(MLP(Norm(x)));  MLP dense
    W2 Dropout(act(W1 x)) or gated W2 Dropout(act(Wg x) * W1 x).
    Params: linear1, linear_gate (gated), linear2, norm, norm_out, scale."""

    kind = "FeedForward"
    linear1: Linear
    linear_gate: Linear | None
    linear2: Linear
    norm: Norm | None
    norm_out: Norm | None
    scale: nnx.Param[jax.Array] | None

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        """x: (B, T, E) or (T, E) -> same shape. deterministic: see `TransformerBlock`."""
        return self._forward(x, None, None, False, deterministic)


class TransformerBlock(_Block):
    """Attention sublayer then MLP sublayer, the twin of torch's TransformerEncoderLayer.

    Params: self_attn, linear1, linear_gate (gated MLPs), linear2, norm1, norm2,
    norm1_out / norm2_out (peri), scale1 / scale2 (ReZero, LayerScale).
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
    scale1: nnx.Param[jax.Array] | None
    scale2: nnx.Param[jax.Array] | None

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """An empty cache for incremental decoding of up to `max_length` positions (causal only)."""
        return new_cache(self, batch_size, max_length, self._block_cache)

    def __call__(self, x: jax.Array, *, attention_mask=None, key_mask=None, return_intermediates: bool = False,
                 deterministic: bool | None = None, cache: Cache | None = None):
        """x: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights":
        (B, H, T, T), "attention_logits_max": ()}. deterministic: True turns dropout off for
        this call (Linen's convention, forwarded by `nnx.bridge.to_linen`), False on; None
        follows the module's train / eval mode (`.train()`, `.eval()`).
        cache (from `init_cache`): x is the next chunk (B, T, E); returns (y, cache)."""
        return self._forward(x, attention_mask, key_mask, return_intermediates, deterministic, cache=cache)


class DecoderBlock(_Block):
    """Self-attention, cross-attention to a memory, then MLP, each a residual sublayer; the
    twin of torch's TransformerDecoderLayer.

    Params: self_attn, multihead_attn, linear1, linear_gate (gated), linear2, norm1, norm2,
    norm3, norm1_out..norm3_out (peri), scale1..scale3 (ReZero, LayerScale).
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
    scale1: nnx.Param[jax.Array] | None
    scale2: nnx.Param[jax.Array] | None
    scale3: nnx.Param[jax.Array] | None

    def _block_cache(self, batch: int, length: int, dtype, memory=None) -> Cache:
        cache = super()._block_cache(batch, length, dtype)
        cache["cross"] = self.multihead_attn.memory_kv(memory)
        return cache

    def init_cache(self, batch_size: int, max_length: int, memory: jax.Array,
                   memory_key_mask: jax.Array | None = None) -> Cache:
        """An empty self-attention cache of `max_length` positions and the cross-attention
        keys and values of `memory` (B, S, E), computed once; memory_key_mask (B, S)."""
        return new_cache(self, batch_size, max_length, self._block_cache, memory, memory_key_mask)

    def __call__(self, x: jax.Array, memory: jax.Array | None = None, *, attention_mask=None, key_mask=None,
                 memory_mask=None, memory_key_mask=None, return_intermediates: bool = False,
                 deterministic: bool | None = None, cache: Cache | None = None):
        """x: (B, T, E) or (T, E); memory: (B, S, E) or (S, E). attention_mask (T, T) /
        (B, T, T) and key_mask (B, T) on the self-attention, memory_mask (T, S) / (B, T, S)
        and memory_key_mask (B, S) on the cross-attention (True = may attend).
        With return_intermediates, also the attention weights and largest logits of both
        ("attention_*", "cross_attention_*"). cache (from `init_cache`, which took the
        memory): x is the next chunk; returns (y, cache)."""
        if cache is None and memory is None:
            raise ValueError("DecoderBlock needs a memory (B, S, d_model), or a cache made with one")
        return self._forward(x, attention_mask, key_mask, return_intermediates, deterministic, memory=memory,
                             memory_mask=memory_mask, memory_key_mask=memory_key_mask, cache=cache)


def _with_key(dropout: nnx.Dropout, key: jax.Array | None, deterministic: bool | None = None):
    return lambda h: dropout(h, deterministic=deterministic, rngs=key)


def _finish(y: jax.Array, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None and v.ndim else v) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y
