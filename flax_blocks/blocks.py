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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Attention, attention_path, build_mask, self_attention_masks
from .caches import Cache, cached_context, new_cache
from .core import declarations
from .core.config import BlockConfig, check_parallel, layer_scale, skips_attn_norm
from .core.context import Context
from .core.declarations import Sublayer
from .experts import Experts
from .layers import ACTIVATION_FNS, Linear, Norm, as_batched, batched_memory, create_params, dropout, initial_values
from .mla import LatentAttention, latent_cache

MODULES = {"linear": Linear, "norm": Norm, "attention": Attention, "latent_attention": LatentAttention,
           "experts": Experts}


class _Block(nnx.Module):
    """A block of residual sublayers, its modules named and built from the declarations.

    Every sublayer has a dropout on its output; MLP sublayers one more after the
    activation (`dropout_act`). Call-time dropout keys: one per block, split."""

    kind: str
    # The modules and parameters are set from the declarations (declarations.block(cfg, kind),
    # named by declarations.BLOCKS); each subclass annotates its own, so that type checkers
    # and IDEs see them. None: an option that is off (no norm, no gate, no residual scale).

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs, mlp: str | None = None):
        self.cfg = cfg = cfg.resolve()
        # mlp: what its MLP sublayer holds (`declarations.block`); None: layer 1's (a block alone is layer 1)
        component = declarations.block(cfg, self.kind, declarations.layer_mlp(cfg, 1) if mlp is None else mlp)
        self.sublayers: tuple[Sublayer, ...] = declarations.BLOCKS[self.kind]
        check_parallel(cfg, self.kind, self.sublayers)
        values = initial_values(rngs.params(), component, cfg)  # the whole block in one jitted draw
        create_params(self, component, cfg, rngs, values)
        for name, child in component.children:
            setattr(self, name, MODULES[child.kind](cfg, child, rngs=rngs, values=values[name]))
        for sub in self.sublayers:  # modules of options that are off (no norm, no gate, no experts...)
            for name in (*sub.modules, sub.norm, sub.norm_out, sub.scale, declarations.EXPERTS_MODULE):
                if not hasattr(self, name):
                    setattr(self, name, None)
        self.dropout_act = dropout(cfg, rngs)
        self.dropouts = nnx.List([dropout(cfg, rngs) for _ in self.sublayers])

    def dropout_keys(self, key: jax.Array | None) -> jax.Array | None:
        """A block's dropout keys from its one key: two per sublayer (inside, output); None
        without a key (the dropouts' own RNG streams)."""
        return None if key is None else jax.random.split(key, 2 * len(self.sublayers))

    def residual(self, i: int, x: jax.Array, f: Callable, ctx: Context) -> jax.Array:
        """Sublayer i of this block as a residual: x (B, T, E) -> y (B, T, E), f(h, ctx, i) the
        sublayer (`self_attention`, `cross_attention`, `mlp`) on (B, T, E). Each placement (cfg.norm):

            post:  y = Norm(alpha * x + s * Dropout(F(x)))          Vaswani et al., BERT
            pre:   y = x + s * Dropout(F(c * Norm(x)))              GPT-2, LLaMA
            peri:  y = x + s * Dropout(Norm_out(F(Norm(x))))        Peri-LN, sandwich norm
            out:   y = x + s * Dropout(Norm(F(x)))                  OLMo 2
            none:  y = x + s * Dropout(F(x))

        alpha: DeepNorm's (else 1); s: the ReZero / LayerScale gate (else 1); c = 1 / sqrt(layer)
        under LayerNorm Scaling (Sun et al. 2025; else 1); residual="none" drops the skip term.
        The torch twin's `_Block.residual` computes the same, line for line."""
        cfg, sub = self.cfg, self.sublayers[i]
        norm, s = getattr(self, sub.norm), getattr(self, sub.scale)
        h = norm(x) if cfg.norm in ("pre", "peri") else x  # pre-LN, Peri-LN: the norm first
        skip = skips_attn_norm(cfg, ctx.layer, sub.kind)  # ModernBERT: layer 1's attention reads x itself
        if skip is not False:
            h = jnp.where(skip, x, h)
        if cfg.layernorm_scaling:
            h = h * layer_scale(ctx.layer, h.dtype)  # c * Norm(x)
        h = f(h, ctx, i)  # the sublayer
        if cfg.norm == "peri":
            h = getattr(self, sub.norm_out)(h)  # Peri-LN: its own norm on the output too
        elif cfg.norm == "out":
            h = norm(h)  # OLMo 2: the norm on the output only
        h = self.dropouts[i](h, deterministic=ctx.deterministic, rngs=ctx.key(2 * i + 1))
        if s is not None:
            h = s[...].astype(x.dtype) * h  # the ReZero / LayerScale gate
        if cfg.residual_multiplier != 1.0:
            h = h * cfg.residual_multiplier  # Granite: x + m * F(x)
        if cfg.residual == "add":  # the skip: x + h; DeepNorm: alpha * x + h
            alpha = cfg.residual_alpha
            h = (x if alpha == 1.0 else x * alpha) + h
        return norm(h) if cfg.norm == "post" else h  # post-LN: the norm last, on the sum

    def parallel(self, x: jax.Array, fs: Sequence[Callable], ctx: Context) -> jax.Array:
        """The parallel residual (GPT-J, GPT-NeoX, StableLM; PaLM) over this block's sublayers
        fs (attention, MLP) on the same x: x (B, T, E) -> y (B, T, E).

            y = x + s1 * Dropout(F1(c * Norm1(x))) + s2 * Dropout(F2(c * Norm2(x)))

        with Norm2 = Norm1 under parallel_residual="shared_norm" (computed once), s and c as in
        `residual`. The torch twin's `_Block.parallel` computes the same, line for line."""
        cfg, y, h_in = self.cfg, x, None
        for i, f in enumerate(fs):
            sub = self.sublayers[i]
            if h_in is None or cfg.parallel_residual == "two_norms":
                norm = getattr(self, sub.norm)
                h_in = x if norm is None else norm(x)  # each branch's norm, or the shared one
                if cfg.layernorm_scaling:
                    h_in = h_in * layer_scale(ctx.layer, h_in.dtype)
            h = self.dropouts[i](f(h_in, ctx, i), deterministic=ctx.deterministic, rngs=ctx.key(2 * i + 1))
            s = getattr(self, sub.scale)
            h = h if s is None else s[...].astype(x.dtype) * h
            y = y + (h if cfg.residual_multiplier == 1.0 else h * cfg.residual_multiplier)  # both added to one x
        return y

    def self_attention(self, h: jax.Array, ctx: Context, i: int) -> jax.Array:
        """Sublayer i, a self-attention, on h (B, T, E): its masks, path, positions and cache."""
        attention = getattr(self, self.sublayers[i].modules[0])
        out, weights, logit_max, cache = attention(h, ctx.attention_call("self"), ctx.key(2 * i), ctx.deterministic)
        ctx.found.update(attention_weights=weights, attention_logits_max=logit_max)
        ctx.written["self"] = cache
        return out

    def cross_attention(self, h: jax.Array, ctx: Context, i: int) -> jax.Array:
        """Sublayer i, a cross-attention, on h (B, T, E): queries from h, keys and values from the
        memory (or the cache's, computed once); always the dense path."""
        attention = getattr(self, self.sublayers[i].modules[0])
        out, weights, logit_max, cache = attention(h, ctx.attention_call("cross"), ctx.key(2 * i), ctx.deterministic)
        ctx.found.update(cross_attention_weights=weights, cross_attention_logits_max=logit_max)
        ctx.written["cross"] = cache  # handed back unchanged
        return out

    def mlp(self, h: jax.Array, ctx: Context, i: int) -> jax.Array:
        """Sublayer i, the MLP, on h (B, T, E). dense: down(Dropout(act(up(h))));  gated:
        down(Dropout(act(gate(h)) * up(h))). Both matmuls on the (B*T, E) token matrix, as 2-D
        GEMMs (faster on XLA:CPU than on (B, T, E)). With experts (cfg.num_experts), the experts
        MLP instead (`Experts`; its router logits (B, T, X) in ctx.found["router_logits"]). Each
        layer holds its own MLP: a mixed stack's dense layers run a dense one (router logits
        zeros), its MLPs held apart from the blocks and handed in as ctx.mlp (a `LayerMLP`)."""
        t = h.reshape(-1, h.shape[-1])
        owner = self if ctx.mlp is None else ctx.mlp
        experts: Experts | None = getattr(owner, declarations.EXPERTS_MODULE)
        n_experts = self.cfg.num_experts
        if not n_experts:
            return self.dense_mlp(t, ctx, i).reshape(h.shape)
        if experts is not None:
            y, logits = experts(t)
        else:
            y, logits = self.dense_mlp(t, ctx, i), jnp.zeros((t.shape[0], n_experts), t.dtype)
        ctx.found["router_logits"] = logits.reshape(*h.shape[:-1], n_experts)
        return y.reshape(h.shape)

    def dense_mlp(self, t: jax.Array, ctx: Context, i: int) -> jax.Array:
        """The dense MLP of sublayer i (this block's modules, or ctx.mlp's, a `LayerMLP`) on a
        token matrix t (N, E) -> (N, E)."""
        owner = self if ctx.mlp is None else ctx.mlp  # (no module as an argument: nnx.tabulate reprs them)
        up, gate, down = (getattr(owner, name) for name in self.sublayers[i].modules)
        act = ACTIVATION_FNS[self.cfg.activation]
        a = act(up(t)) if gate is None else act(gate(t)) * up(t)
        return down(self.dropout_act(a, deterministic=ctx.deterministic, rngs=ctx.key(2 * i)))

    def _block_cache(self, batch: int, length: int, dtype) -> Cache:
        cfg = self.cfg
        if cfg.latent:  # multi-head latent attention caches its latent and rotary key
            return {"self": latent_cache(cfg, batch, length, dtype)}
        zeros = jnp.zeros((batch, cfg.kv_heads, length, cfg.head_width), dtype)  # head-major (B, K, L, hd)
        return {"self": {"k": zeros, "v": zeros}}

    def _forward(self, x, attention_mask, key_mask, return_intermediates, deterministic=None, *,
                 memory=None, memory_mask=None, memory_key_mask=None, cache=None):
        x, unbatched = as_batched(self.cfg, x)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            ctx, cache = cached_context(self, x, cache, key_mask, attention_mask, memory, memory_mask, deterministic)
            y = self.run(x, ctx)
            cache = {**cache, "layers": ctx.written}
            return (y, ctx.found, cache) if return_intermediates else (y, cache)
        ctx = call_context(self, x, attention_mask, key_mask, return_intermediates, deterministic)
        if memory is not None:
            ctx.memory = batched_memory(self.cfg, memory, x, unbatched)
            ctx.masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_mask,
                                            keys=ctx.memory.shape[1], causal=False)
        y = self.run(x, ctx)
        return _finish(y, unbatched, ctx.found, return_intermediates)

    def run(self, x: jax.Array, ctx: Context) -> jax.Array:
        """x (B, T, E) -> y (B, T, E): the block's sublayers in order, each through the
        placement's residual; what they find and write in `ctx`."""
        raise NotImplementedError


class LayerMLP(nnx.Module):
    """One layer's MLP held apart from its block: a mixed stack (cfg.mixed_mlp) stacks its
    blocks without MLPs (mlp="none") and the dense layers' and experts layers' MLPs in two
    stacks of these, each as long as its kind's layers (`stacks._Stack`). mlp: "dense"
    (linear1, linear_gate when gated, linear2) or "experts"; the others are None."""

    linear1: Linear | None
    linear_gate: Linear | None
    linear2: Linear | None
    experts: Experts | None

    def __init__(self, cfg: BlockConfig, kind: str, mlp: str, *, rngs: nnx.Rngs):
        names = (*declarations.MLP_MODULES, declarations.EXPERTS_MODULE)
        children = tuple((n, c) for n, c in declarations.block(cfg, kind, mlp).children if n in names)
        values = initial_values(rngs.params(), declarations.Component("block", (), children=children), cfg)
        for name in names:
            child = dict(children).get(name)
            setattr(self, name, None if child is None else MODULES[child.kind](cfg, child, rngs=rngs,
                                                                                values=values[name]))


def call_context(module, x, attention_mask, key_mask, return_intermediates, deterministic) -> Context:
    """The context of an uncached call on x (B, T, E): the self-attention's path
    (`attention_path`, from static facts of this call) and its prepared masks. Dropout on the
    weights is active when the rate is positive and the call (deterministic) or else the
    module's mode turns it on (a block's or a stack's layers' dropouts)."""
    cfg = module.cfg
    off = getattr(module, "layers", module).dropouts[0].deterministic if deterministic is None else deterministic
    path = attention_path(cfg, x.shape[1], need_weights=return_intermediates,
                          explicit_mask=attention_mask is not None, dropout_active=cfg.dropout > 0 and not off)
    masks = self_attention_masks(cfg, path, x.shape[0], x.shape[1], attention_mask, key_mask)
    return Context({"self": masks["self"]}, path=path, key_valid=masks.get("key_valid"), weights=return_intermediates,
                   deterministic=deterministic)


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

    def run(self, x: jax.Array, ctx: Context) -> jax.Array:
        """The attention through the placement's residual."""
        return self.residual(0, x, self.self_attention, ctx)


class FeedForward(_Block):
    """post: Norm(x + Dropout(MLP(x)));  pre: x + Dropout(MLP(Norm(x)));  MLP dense
    W2 Dropout(act(W1 x)) or gated W2 Dropout(act(Wg x) * W1 x).
    Params: linear1, linear_gate (gated), linear2, norm, norm_out, scale."""

    kind = "FeedForward"
    linear1: Linear | None  # None: an experts layer (`declarations.layer_mlp`)
    linear_gate: Linear | None
    linear2: Linear | None
    experts: Experts | None  # cfg.num_experts > 0
    norm: Norm | None
    norm_out: Norm | None
    scale: nnx.Param[jax.Array] | None

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        """x: (B, T, E) or (T, E) -> same shape. deterministic: see `TransformerBlock`."""
        return self._forward(x, None, None, False, deterministic)

    def run(self, x: jax.Array, ctx: Context) -> jax.Array:
        """The MLP through the placement's residual."""
        return self.residual(0, x, self.mlp, ctx)


class TransformerBlock(_Block):
    """Attention sublayer then MLP sublayer, the twin of torch's TransformerEncoderLayer.

    Params: self_attn, linear1, linear_gate (gated MLPs), linear2, norm1, norm2,
    norm1_out / norm2_out (peri), scale1 / scale2 (ReZero, LayerScale).
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

    def run(self, x: jax.Array, ctx: Context) -> jax.Array:
        """Self-attention, then the MLP, each through the placement's residual; under a
        parallel residual both on the same x."""
        if self.cfg.parallel_residual != "none":
            return self.parallel(x, (self.self_attention, self.mlp), ctx)
        x = self.residual(0, x, self.self_attention, ctx)
        x = self.residual(1, x, self.mlp, ctx)
        return x


class DecoderBlock(_Block):
    """Self-attention, cross-attention to a memory, then MLP, each a residual sublayer; the
    twin of torch's TransformerDecoderLayer.

    Params: self_attn, multihead_attn, linear1, linear_gate (gated), linear2, norm1, norm2,
    norm3, norm1_out..norm3_out (peri), scale1..scale3 (ReZero, LayerScale).
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

    def run(self, x: jax.Array, ctx: Context) -> jax.Array:
        """Self-attention, then cross-attention to the memory, then the MLP, each through the
        placement's residual."""
        x = self.residual(0, x, self.self_attention, ctx)
        x = self.residual(1, x, self.cross_attention, ctx)
        x = self.residual(2, x, self.mlp, ctx)
        return x


def _finish(y: jax.Array, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None and v.ndim else v) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y
