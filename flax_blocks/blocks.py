"""Residual transformer blocks in Flax NNX: ResidualMHA, FeedForward, TransformerBlock,
DecoderBlock, and the stacks Encoder, Decoder and Transformer.

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

from . import declarations
from .attention import Attention, attention_path, build_mask, cache_mask, self_attention_masks
from .config import (
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
from .declarations import FINAL_NORM, Sublayer
from .layers import Linear, Norm, create_params, dropout, initial_values

ACTIVATION_FNS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}
MODULES = {"linear": Linear, "norm": Norm, "attention": Attention}
Cache = dict[str, Any]


def _compute_dtype(cfg: BlockConfig, x_dtype) -> Any:
    dtype = jnp.dtype(cfg.dtype) if cfg.dtype is not None else jnp.promote_types(x_dtype, cfg.param_dtype)
    return jax.dtypes.canonicalize_dtype(dtype)


def _as_batched(cfg: BlockConfig, x: jax.Array, what: str = "input") -> tuple[jax.Array, bool]:
    check_width(cfg, x.shape, what)
    # Cast to the computation dtype (cfg.dtype, else x promoted with the parameters), as flax
    # layers cast their inputs: the residual stream then keeps one dtype, and the Encoder's
    # scan carry has the same dtype in and out.
    x = jnp.asarray(x, _compute_dtype(cfg, x.dtype))
    return (x, False) if x.ndim == 3 else (x[None], True)


def _batched_memory(cfg: BlockConfig, memory: jax.Array, x: jax.Array, unbatched: bool) -> jax.Array:
    """memory (B, S, E), or (S, E) beside an unbatched x: batched like x, and of x's batch."""
    memory, _ = _as_batched(cfg, memory[None] if unbatched else memory, "memory")
    if memory.shape[0] != x.shape[0]:
        raise ValueError(f"memory has batch {memory.shape[0]}, the input {x.shape[0]}")
    return memory


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
        x, unbatched = _as_batched(self.cfg, x)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return _cached_call(self, x, cache, key_mask, attention_mask, memory, memory_mask,
                                return_intermediates, deterministic, stacked=False)
        path, masks = _prepare_self_attention(self, x, attention_mask, key_mask, return_intermediates, deterministic)
        if memory is not None:
            memory = _batched_memory(self.cfg, memory, x, unbatched)
            masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_mask,
                                        keys=memory.shape[1], causal=False)
        y, extras, _ = self.run_prepared(x, masks, deterministic=deterministic, path=path, memory=memory)
        return _finish(y, unbatched, extras, return_intermediates)


def _prepare_self_attention(module, x, attention_mask, key_mask, return_intermediates,
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
        return _new_cache(self, batch_size, max_length, self._block_cache)

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
        return _new_cache(self, batch_size, max_length, self._block_cache, memory, memory_key_mask)

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


class _Stack(nnx.Module):
    """`num_layers` independently initialised blocks plus an optional final norm.

    The layers' parameters are stacked on a leading axis of size num_layers (created with
    nnx.vmap, applied with a jax.lax.scan over the stacked state), so compile time does not
    grow with depth. `final_norm` defaults to True for pre-LN, Peri-LN and "out" (OLMo 2)
    (such a stack needs it), False otherwise. Params: layers (each leaf has a leading layer axis), norm.

    remat: rematerialisation inside each layer, trading compute for memory in the
    backward pass: None (keep every activation), "full" (keep only each layer's input and
    recompute the rest) or the name of a `jax.checkpoint_policies` policy (e.g.
    "dots_saveable", keep the matmul outputs). Outputs and gradients are unchanged.

    scan_layers: True (default) runs the layers as one jax.lax.scan: compile time flat in
    depth. False unrolls them into one program (parameters stay stacked, so checkpoints,
    conversion and sharding are unchanged): compile time grows with depth, but the backward
    pass skips the scan's bookkeeping of stacked activations (docs/speed.md has the
    measured step times). Outputs and gradients are the same up to rounding. Not with
    remat: unrolled, XLA merges the recomputation back into the forward (the same temp
    memory with and without), so the pair is refused."""

    block: type[_Block]
    layers: _Block  # one block whose parameters have a leading layer axis
    norm: Norm | None  # the final norm (declarations.FINAL_NORM), set by name

    def __init__(self, cfg: BlockConfig, *, num_layers: int, final_norm: bool | None = None,
                 remat: str | None = None, scan_layers: bool = True, rngs: nnx.Rngs):
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(scan_layers, bool):
            raise ValueError(f"scan_layers must be True or False, got {scan_layers!r}")
        _remat_policy(remat)  # a bad name fails here, not at the first call
        if remat is not None and not scan_layers:
            raise ValueError(f"remat={remat!r} needs scan_layers=True: with the layers unrolled XLA merges the "
                             "recomputation back into the forward pass and keeps every activation")
        self.remat = remat
        self.scan_layers = scan_layers
        self.cfg = cfg = cfg.resolve(num_layers)
        self.num_layers = num_layers
        block = self.block

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: declarations.LAYER_AXIS})
        def make_layers(rngs: nnx.Rngs) -> _Block:
            return block(cfg, rngs=rngs)

        self.layers = make_layers(rngs)
        for _, v in nnx.iter_graph(self.layers):  # nnx.vmap adds "layers" only to non-empty annotations
            if isinstance(v, nnx.Variable) and v.get_metadata().get("out_sharding") == ():
                v.set_metadata(out_sharding=(declarations.LAYER_AXIS,))
        # The stacked layers' dropouts get one key per layer per call from this stream,
        # drawn outside the layer scan, so the scan never mutates RNG state.
        self.rngs = rngs["dropout"].fork() if cfg.dropout > 0 else None
        if final_norm is None:
            final_norm = cfg.norm in FINAL_NORM_BY_DEFAULT
        norm = Norm(cfg, declarations.norm(cfg, cfg.d_model), rngs=rngs) if final_norm else None
        setattr(self, FINAL_NORM, norm)

    @property
    def final_norm(self) -> Norm | None:
        return getattr(self, FINAL_NORM)

    def _stack_cache(self, batch: int, length: int, dtype, memory=None) -> Cache:
        """Every layer's block cache, stacked on a leading layer axis."""
        graphdef, state = nnx.split(self.layers)

        def one(layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return layer._block_cache(batch, length, dtype, *(() if memory is None else (memory,)))

        return jax.vmap(one)(state)

    def run_prepared(self, x, masks, *, deterministic=None, path="dense", memory=None, cache=None, index=0,
                     return_intermediates=False):
        """The layers over x (B, T, E) with prepared masks (as `_Block.run_prepared`), then
        the final norm -> (y, per-layer intermediates, new caches)."""
        # A plain lax.scan (or its unrolled twin) over the stacked state, which it only reads:
        # it composes with any outer transform (jax.grad over split params, vmap, jit, nnx.jit).
        graphdef, state = nnx.split(self.layers)
        off = self.layers.dropouts[0].deterministic if deterministic is None else deterministic
        keys = jax.random.split(self.rngs(), self.num_layers) if self.rngs is not None and not off else None
        run = _layer_scan_body(graphdef, return_intermediates, deterministic, self.remat, path)
        if isinstance(cache, tuple):  # a decoding cache (`decoding_cache`): layer by layer, weights split out
            if return_intermediates:
                raise ValueError("return_intermediates takes the stacked cache (init_cache's), not a decoding cache")
            return self._run_split(run, x, masks, memory, index, keys, cache)
        loop = jax.lax.scan if self.scan_layers else _unrolled_scan
        layer = jnp.arange(1, self.num_layers + 1, dtype=jnp.int32)  # each layer's index, scanned with its state
        (y, _, _, _), (per_layer, caches) = loop(run, (x, masks, memory, index), (state, keys, cache, layer))
        if self.final_norm is not None:
            y = self.final_norm(y)
        return y, per_layer, caches

    def _run_split(self, run, x, masks, memory, index, keys, layers):
        """The layers one after another, each with the weights and cache its entry of a
        decoding cache holds (`decoding_cache`) -> (y, None, the entries with updated caches)."""
        if len(layers) != self.num_layers:
            raise ValueError(f"a decoding cache of {len(layers)} layers for a stack of {self.num_layers}")
        carry, new = (x, masks, memory, index), []
        for i, entry in enumerate(layers):
            carry, (_, cache) = run(carry, (entry["weights"], None if keys is None else keys[i], entry["cache"],
                                            jnp.int32(i + 1)))
            new.append({"weights": entry["weights"], "cache": cache})
        y = carry[0]
        if self.final_norm is not None:
            y = self.final_norm(y)
        return y, None, tuple(new)

    def _finish_stack(self, y, per_layer, unbatched, return_intermediates):
        if not return_intermediates:
            return y[0] if unbatched else y
        residual, extras = per_layer
        extras = {"residual": residual, **extras}
        if unbatched:
            extras = {k: (v[:, 0] if v.ndim > 1 else v) for k, v in extras.items()}
        return (y[0] if unbatched else y), extras


class Encoder(_Stack):
    """`num_layers` TransformerBlocks and an optional final norm (torch's TransformerEncoder)."""

    block = TransformerBlock
    layers: TransformerBlock

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """An empty cache for incremental decoding of up to `max_length` positions (causal only):
        {"index": (), "valid": (B, L), "overflow": () bool (see the module's notes),
        "layers": {"self": {"k", "v"}} with leading layer axis}."""
        return _new_cache(self, batch_size, max_length, self._stack_cache)

    def __call__(self, x: jax.Array, *, attention_mask=None, key_mask=None, return_intermediates: bool = False,
                 deterministic: bool | None = None, cache: Cache | None = None, positions=None):
        """x: (B, T, E) or (T, E) -> same shape. deterministic: see `TransformerBlock`.

        With return_intermediates, also {"residual": (L, B, T, E), the stream after each layer,
        "attention_weights": (L, B, H, T, T), "attention_logits_max": (L,)}; the default call
        computes none of them. cache (from `init_cache`): x is the next chunk; returns (y, cache).
        positions: (B, T) integer rotary positions per row (HF's position_ids; left-padded
        rows start later); None: 0..T-1, or with a cache each row's next position onwards.
        """
        x, unbatched = _as_batched(self.cfg, x)
        positions = _checked_positions(positions, x.shape[:2])
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return _cached_call(self, x, cache, key_mask, attention_mask, None, None, return_intermediates,
                                deterministic, stacked=True, positions=positions)
        path, masks = _prepare_self_attention(self, x, attention_mask, key_mask, return_intermediates, deterministic)
        if positions is not None:
            masks["positions"] = positions
        y, per_layer, _ = self.run_prepared(x, masks, deterministic=deterministic, path=path,
                                            return_intermediates=return_intermediates)
        return self._finish_stack(y, per_layer, unbatched, return_intermediates)


class Decoder(_Stack):
    """`num_layers` DecoderBlocks and an optional final norm (torch's TransformerDecoder)."""

    block = DecoderBlock
    layers: DecoderBlock

    def init_cache(self, batch_size: int, max_length: int, memory: jax.Array,
                   memory_key_mask: jax.Array | None = None) -> Cache:
        """An empty self-attention cache of `max_length` positions per layer and every layer's
        cross-attention keys and values of `memory` (B, S, E), computed once."""
        return _new_cache(self, batch_size, max_length, self._stack_cache, memory, memory_key_mask)

    def __call__(self, x: jax.Array, memory: jax.Array | None = None, *, attention_mask=None, key_mask=None,
                 memory_mask=None, memory_key_mask=None, return_intermediates: bool = False,
                 deterministic: bool | None = None, cache: Cache | None = None):
        """x: (B, T, E) or (T, E); memory (B, S, E) or (S, E); masks as `DecoderBlock`.
        With return_intermediates, also {"residual": (L, B, T, E), "attention_weights",
        "attention_logits_max", "cross_attention_weights", "cross_attention_logits_max"}.
        cache (from `init_cache`, which took the memory): x is the next chunk; returns (y, cache)."""
        x, unbatched = _as_batched(self.cfg, x)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            return _cached_call(self, x, cache, key_mask, attention_mask, memory, memory_mask,
                                return_intermediates, deterministic, stacked=True)
        if memory is None:
            raise ValueError("Decoder needs a memory (B, S, d_model), or a cache made with one")
        memory = _batched_memory(self.cfg, memory, x, unbatched)
        path, masks = _prepare_self_attention(self, x, attention_mask, key_mask, return_intermediates, deterministic)
        masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_mask,
                                    keys=memory.shape[1], causal=False)
        y, per_layer, _ = self.run_prepared(x, masks, deterministic=deterministic, path=path, memory=memory,
                                            return_intermediates=return_intermediates)
        return self._finish_stack(y, per_layer, unbatched, return_intermediates)


class Transformer(nnx.Module):
    """An Encoder and a Decoder (torch's nn.Transformer: names encoder.*, decoder.*).

    `cfg` serves both; the encoder is never causal (its `causal` is turned off), the
    decoder's self-attention is causal when cfg.causal. Both have a final norm by default,
    as nn.Transformer. Params: encoder, decoder."""

    def __init__(self, cfg: BlockConfig, *, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 final_norm: bool = True, rngs: nnx.Rngs):
        from dataclasses import replace

        self.cfg = cfg
        self.encoder = Encoder(replace(cfg, causal=False), num_layers=num_encoder_layers, final_norm=final_norm,
                               rngs=rngs)
        self.decoder = Decoder(cfg, num_layers=num_decoder_layers, final_norm=final_norm, rngs=rngs)

    def __call__(self, src: jax.Array, tgt: jax.Array, *, src_mask=None, tgt_mask=None, memory_mask=None,
                 src_key_mask=None, tgt_key_mask=None, memory_key_mask=None,
                 deterministic: bool | None = None) -> jax.Array:
        """src (B, S, E), tgt (B, T, E) -> (B, T, E). Masks in flax's convention (True = may
        attend): src_mask (S, S), tgt_mask (T, T), memory_mask (T, S), key masks (B, S) / (B, T);
        memory_key_mask defaults to src_key_mask."""
        memory = self.encoder(src, attention_mask=src_mask, key_mask=src_key_mask, deterministic=deterministic)
        return self.decoder(tgt, memory, attention_mask=tgt_mask, key_mask=tgt_key_mask, memory_mask=memory_mask,
                            memory_key_mask=src_key_mask if memory_key_mask is None else memory_key_mask,
                            deterministic=deterministic)


# ----------------------------------------------------------------------------------------
# Cached incremental decoding
# ----------------------------------------------------------------------------------------


def _new_cache(module, batch_size: int, max_length: int, make, memory=None, memory_key_mask=None) -> Cache:
    cfg = module.cfg
    check_new_cache(cfg, type(module).__name__, batch_size, max_length)
    dtype = _compute_dtype(cfg, jnp.float32)
    cache: Cache = {"index": jnp.zeros((), jnp.int32), "valid": jnp.zeros((batch_size, max_length), jnp.bool_),
                    "overflow": jnp.zeros((), jnp.bool_),
                    "position": jnp.zeros((batch_size,), jnp.int32)}  # each row's next (rotary) position
    if memory is not None:
        memory, _ = _as_batched(cfg, memory, "memory")
        if memory.shape[0] != batch_size:
            raise ValueError(f"memory has batch {memory.shape[0]}, the cache batch_size {batch_size}")
        cache["layers"] = make(batch_size, max_length, dtype, memory)
        mk = jnp.ones(memory.shape[:2], jnp.bool_) if memory_key_mask is None else jnp.asarray(memory_key_mask)
        if mk.dtype != jnp.bool_ or mk.shape != memory.shape[:2]:
            raise ValueError(f"memory_key_mask must be a boolean (batch, memory length) = {memory.shape[:2]} array, "
                             f"got {mk.dtype} {tuple(mk.shape)}")
        cache["memory_valid"] = mk
    else:
        cache["layers"] = make(batch_size, max_length, dtype)
    return cache


def layer_weights(stack: _Stack) -> tuple[nnx.State, ...]:
    """Each layer's state (weights) cut out of a stack's stacked state: a tuple of num_layers."""
    _, state = nnx.split(stack.layers)
    return tuple(jax.tree.map(lambda a, i=i: a[i], state) for i in range(stack.num_layers))


def decoding_cache(stack: _Stack, cache: Cache, weights: tuple[nnx.State, ...] | None = None) -> Cache:
    """A stack's cache (init_cache's) made ready for a decoding loop: "layers" becomes a tuple
    of per-layer entries {"cache": that layer's cache, "weights": that layer's state, cut out
    of the stacked state once (`layer_weights`; or given as `weights`)}. In a loop body (a
    lax.while_loop of `generate`) a scan over the stacked state would copy every layer's
    weights out of the stacked arrays at every step (XLA:CPU does not hoist the slices), and
    rewrite the whole stacked cache; with the weights in the loop's carry it does neither
    (d512 8 layers, batch 1: 2.7x the tokens/s; experiments/results/generate/). The stack
    computes the same with either form and hands back the form it was given. For `generate`;
    the weights are a snapshot of `stack`'s."""
    weights = layer_weights(stack) if weights is None else weights
    if len(weights) != stack.num_layers:
        raise ValueError(f"weights for {len(weights)} layers, but the stack has {stack.num_layers}")
    layers = cache["layers"]
    return {**cache, "layers": tuple({"cache": jax.tree.map(lambda a, i=i: a[i], layers), "weights": w}
                                     for i, w in enumerate(weights))}


def _overflows(index: jax.Array, chunk: int, length: int) -> jax.Array:
    """Whether a chunk of `chunk` positions at `index` passes the cache's end: a bool ().
    Eagerly (a concrete index) an overflow is a ValueError. Traced (jit, export) it cannot
    raise without a host callback, which jax.export cannot serialise: the caller sets the
    cache's "overflow" flag instead."""
    if not isinstance(index, jax.core.Tracer):
        message = overflow_message(chunk, int(index), length)
        if message:
            raise ValueError(message)
    return index + chunk > length


def _checked_positions(positions, shape) -> jax.Array | None:
    """positions (B, T) as an int32 array, checked against x's (B, T); None stays None."""
    if positions is None:
        return None
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.shape != tuple(shape):
        raise ValueError(f"positions must be an integer (batch, seq) = {tuple(shape)} array (HF's position_ids), "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    return positions.astype(jnp.int32)


def _cached_call(module, x, cache, key_mask, attention_mask, memory, memory_mask, return_intermediates,
                 deterministic, *, stacked: bool, positions=None):
    b, t, length = check_cached_call(module.cfg, type(module).__name__, cache, x.shape,
                                     masks=attention_mask is not None or memory_mask is not None,
                                     memory=memory is not None)
    index = cache["index"]
    overflow = cache["overflow"] | _overflows(index, t, length)
    km = jnp.ones((b, t), jnp.bool_) if key_mask is None else jnp.asarray(key_mask)
    if km.dtype != jnp.bool_ or km.shape != (b, t):
        raise ValueError(f"key_mask of a cached call must be a boolean (batch, chunk) = {(b, t)} array, "
                         f"got {km.dtype} {tuple(km.shape)}")
    valid = jax.lax.dynamic_update_slice(cache["valid"], km, (0 * index, index))
    masks = {"self": cache_mask(index, t, valid)}
    if positions is None and "position" in cache:  # per-row positions: given, or each row's next ones
        positions = cache["position"][:, None] + jnp.arange(t, dtype=jnp.int32)
    if positions is not None:
        masks["positions"] = positions
    if "memory_valid" in cache:
        mv = cache["memory_valid"]
        m = jnp.broadcast_to(mv[:, None, None, :], (b, 1, t, mv.shape[1]))
        rows = jnp.any(m, axis=-1, keepdims=True)
        masks["cross"] = (m | ~rows, rows)
    if stacked:
        y, per_layer, layers = module.run_prepared(x, masks, deterministic=deterministic, cache=cache["layers"],
                                                   index=index, return_intermediates=return_intermediates)
        out = module._finish_stack(y, per_layer, False, return_intermediates)
    else:
        y, extras, layers = module.run_prepared(x, masks, deterministic=deterministic, cache=cache["layers"],
                                                index=index)
        out = (y, extras) if return_intermediates else y
    new = {**cache, "index": index + t, "valid": valid, "layers": layers, "overflow": overflow}
    if "position" in cache:
        new["position"] = positions[:, -1] + 1
    return (*out, new) if return_intermediates else (out, new)


def _remat_policy(remat: str | None):
    """None (no remat), jax.checkpoint's default for "full", or the named policy."""
    check_remat(remat)
    return None if remat is None or remat == "full" else getattr(jax.checkpoint_policies, remat)


@functools.lru_cache(maxsize=64)
def _layer_scan_body(graphdef, return_intermediates: bool, deterministic: bool | None, remat: str | None = None,
                     path: str = "dense"):
    """A stack's scan body, one function object per (layer graphdef, flags, attention path):
    an eager call then reuses the compiled scan instead of compiling it afresh at every call
    (as a new closure would). Masks, memory and the cache index ride in the carry, unchanged."""

    def run(carry, xs):
        h, masks, memory, index = carry
        layer_state, key, cache, layer = xs
        h, extras, cache = nnx.merge(graphdef, layer_state).run_prepared(
            h, masks, key=key, deterministic=deterministic, path=path, memory=memory, cache=cache, index=index,
            layer=layer)
        return (h, masks, memory, index), ((h, extras) if return_intermediates else None, cache)

    if remat is not None:  # recompute inside each layer in the backward pass (prevent_cse off, as in a scan)
        run = jax.checkpoint(run, policy=_remat_policy(remat), prevent_cse=False)
    return run


def _unrolled_scan(run, carry, xs):
    """jax.lax.scan's contract (carry, stacked ys) as a Python loop over the leading axis of
    xs. The stacked leaves are cut with one lax.split each, whose transpose is one
    concatenate (indexing each layer would transpose to a full-size pad per layer). After
    each layer the stream passes `_layer_boundary`."""
    leaves, treedef = jax.tree.flatten(xs)
    n = leaves[0].shape[0]
    per_layer = [[s[0] for s in jax.lax.split(a, (1,) * n)] if jnp.issubdtype(a.dtype, jnp.inexact)
                 else [a[i] for i in range(n)]  # PRNG keys, integers: plain indexing (no gradient to transpose)
                 for a in leaves]
    ys = []
    for i in range(n):
        carry, y = run(carry, jax.tree.unflatten(treedef, [p[i] for p in per_layer]))
        carry = (_layer_boundary(carry[0]), *carry[1:])
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


@jax.custom_jvp
def _layer_boundary(h: jax.Array) -> jax.Array:
    """The identity on the stream after each unrolled layer; its derivative is a fusion
    barrier. Without one, XLA fuses the stream's cotangent (a sum over every later layer)
    into each layer's gradient fusions, recomputing it there: O(L^2) work in depth (the
    depth-linearity test in tests/test_unrolled_layers.py measures it).
    XLA:CPU drops optimization barriers before fusing, so there the tangent goes through a
    matmul with the identity matrix (exact for finite values: an inf becomes NaNs across
    its row; ~3% of a layer's train FLOPs at d64); on other platforms through an
    optimization barrier. The platform is the one the program is lowered for."""
    return h


def _identity_matmul(t: jax.Array) -> jax.Array:
    return jnp.dot(t, jnp.eye(t.shape[-1], dtype=t.dtype), precision=jax.lax.Precision.HIGHEST)


@_layer_boundary.defjvp
def _layer_boundary_jvp(primals, tangents):
    (h,), (t,) = primals, tangents
    return h, jax.lax.platform_dependent(t, cpu=_identity_matmul, default=jax.lax.optimization_barrier)


def _with_key(dropout: nnx.Dropout, key: jax.Array | None, deterministic: bool | None = None):
    return lambda h: dropout(h, deterministic=deterministic, rngs=key)


def _finish(y: jax.Array, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: (v[0] if v is not None and v.ndim else v) for k, v in extras.items()}
    return (y, extras) if return_intermediates else y
