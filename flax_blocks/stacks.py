"""The stacks of Flax blocks: Encoder, Decoder (`num_layers` blocks, their parameters
stacked on a leading layer axis and run by one jax.lax.scan, or unrolled) and Transformer
(an Encoder and a Decoder, torch's nn.Transformer). Twins of `torch_blocks.stacks`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import build_mask
from .blocks import DecoderBlock, TransformerBlock, _Block, call_context
from .caches import Cache, cached_context, checked_positions, new_cache
from .core import declarations
from .core.config import FINAL_NORM_BY_DEFAULT, BlockConfig, check_remat
from .core.context import Context
from .core.declarations import FINAL_NORM
from .layers import Norm, as_batched, batched_memory
from .sharding import explicit_call


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

    def run_layers(self, x, ctx: Context, return_intermediates=False):
        """The layers over x (B, T, E), each with its own context (`Context.at`: its index, cache
        and dropout key), then the final norm -> (y, per-layer intermediates, new caches)."""
        # A plain lax.scan (or its unrolled twin) over the stacked state, which it only reads:
        # it composes with any outer transform (jax.grad over split params, vmap, jit, nnx.jit).
        graphdef, state = nnx.split(self.layers)
        off = self.layers.dropouts[0].deterministic if ctx.deterministic is None else ctx.deterministic
        keys = jax.random.split(self.rngs(), self.num_layers) if self.rngs is not None and not off else None
        run = _layer_scan_body(graphdef, return_intermediates, ctx.deterministic, self.remat, ctx.path)
        if isinstance(ctx.cache, tuple):  # a decoding cache (`decoding_cache`): layer by layer, weights split out
            if return_intermediates:
                raise ValueError("return_intermediates takes the stacked cache (init_cache's), not a decoding cache")
            return self._run_split(run, x, ctx, keys)
        loop = jax.lax.scan if self.scan_layers else _unrolled_scan
        layer = jnp.arange(1, self.num_layers + 1, dtype=jnp.int32)  # each layer's index, scanned with its state
        (y, _), (per_layer, caches) = loop(run, (x, ctx.shared()), (state, keys, ctx.cache, layer))
        if self.final_norm is not None:
            y = self.final_norm(y)
        return y, per_layer, caches

    def _run_split(self, run, x, ctx: Context, keys):
        """The layers one after another, each with the weights and cache its entry of a
        decoding cache holds (`decoding_cache`) -> (y, None, the entries with updated caches)."""
        layers = ctx.cache
        if len(layers) != self.num_layers:
            raise ValueError(f"a decoding cache of {len(layers)} layers for a stack of {self.num_layers}")
        carry, new = (x, ctx.shared()), []
        for i, entry in enumerate(layers):
            carry, (_, cache) = run(carry, (entry["weights"], None if keys is None else keys[i], entry["cache"],
                                            jnp.int32(i + 1)))
            new.append({"weights": entry["weights"], "cache": cache})
        y = carry[0]
        if self.final_norm is not None:
            y = self.final_norm(y)
        return y, None, tuple(new)

    def _cached(self, x, ctx: Context, cache: Cache, return_intermediates: bool):
        """A cached call's (y, cache) or (y, intermediates, cache), the layers' caches written."""
        y, per_layer, layers = self.run_layers(x, ctx, return_intermediates)
        out = self._finish_stack(y, per_layer, False, return_intermediates)
        cache = {**cache, "layers": layers}
        return (*out, cache) if return_intermediates else (out, cache)

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
        return new_cache(self, batch_size, max_length, self._stack_cache)

    def __call__(self, x: jax.Array, *, attention_mask=None, key_mask=None, return_intermediates: bool = False,
                 deterministic: bool | None = None, cache: Cache | None = None, positions=None):
        """x: (B, T, E) or (T, E) -> same shape. deterministic: see `TransformerBlock`.

        With return_intermediates, also {"residual": (L, B, T, E), the stream after each layer,
        "attention_weights": (L, B, H, T, T), "attention_logits_max": (L,)}; the default call
        computes none of them. cache (from `init_cache`): x is the next chunk; returns (y, cache).
        positions: (B, T) integer rotary positions per row (HF's position_ids; left-padded
        rows start later); None: 0..T-1, or with a cache each row's next position onwards.
        """
        explicit = explicit_call(  # a mesh of Explicit axes (jax.make_mesh's): computed with them Auto
            self, lambda m, *a: m(a[0], attention_mask=a[1], key_mask=a[2], cache=a[3], positions=a[4],
                                  return_intermediates=return_intermediates, deterministic=deterministic),
            (x, attention_mask, key_mask, cache, positions), cache=cache, extra=return_intermediates)
        if explicit is not None:
            return explicit
        x, unbatched = as_batched(self.cfg, x)
        positions = checked_positions(positions, x.shape[:2])
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            ctx, cache = cached_context(self, x, cache, key_mask, attention_mask, None, None, deterministic, positions)
            return self._cached(x, ctx, cache, return_intermediates)
        ctx = call_context(self, x, attention_mask, key_mask, return_intermediates, deterministic)
        ctx.positions = positions
        y, per_layer, _ = self.run_layers(x, ctx, return_intermediates)
        return self._finish_stack(y, per_layer, unbatched, return_intermediates)


class Decoder(_Stack):
    """`num_layers` DecoderBlocks and an optional final norm (torch's TransformerDecoder)."""

    block = DecoderBlock
    layers: DecoderBlock

    def init_cache(self, batch_size: int, max_length: int, memory: jax.Array,
                   memory_key_mask: jax.Array | None = None) -> Cache:
        """An empty self-attention cache of `max_length` positions per layer and every layer's
        cross-attention keys and values of `memory` (B, S, E), computed once."""
        return new_cache(self, batch_size, max_length, self._stack_cache, memory, memory_key_mask)

    def __call__(self, x: jax.Array, memory: jax.Array | None = None, *, attention_mask=None, key_mask=None,
                 memory_mask=None, memory_key_mask=None, return_intermediates: bool = False,
                 deterministic: bool | None = None, cache: Cache | None = None):
        """x: (B, T, E) or (T, E); memory (B, S, E) or (S, E); masks as `DecoderBlock`.
        With return_intermediates, also {"residual": (L, B, T, E), "attention_weights",
        "attention_logits_max", "cross_attention_weights", "cross_attention_logits_max"}.
        cache (from `init_cache`, which took the memory): x is the next chunk; returns (y, cache)."""
        x, unbatched = as_batched(self.cfg, x)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            ctx, cache = cached_context(self, x, cache, key_mask, attention_mask, memory, memory_mask, deterministic)
            return self._cached(x, ctx, cache, return_intermediates)
        if memory is None:
            raise ValueError("Decoder needs a memory (B, S, d_model), or a cache made with one")
        ctx = call_context(self, x, attention_mask, key_mask, return_intermediates, deterministic)
        ctx.memory = batched_memory(self.cfg, memory, x, unbatched)
        ctx.masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_mask,
                                        keys=ctx.memory.shape[1], causal=False)
        y, per_layer, _ = self.run_layers(x, ctx, return_intermediates)
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


def _remat_policy(remat: str | None):
    """None (no remat), jax.checkpoint's default for "full", or the named policy."""
    check_remat(remat)
    return None if remat is None or remat == "full" else getattr(jax.checkpoint_policies, remat)


@functools.lru_cache(maxsize=64)
def _layer_scan_body(graphdef, return_intermediates: bool, deterministic: bool | None, remat: str | None = None,
                     path: str = "dense"):
    """A stack's scan body, one function object per (layer graphdef, flags, attention path):
    an eager call then reuses the compiled scan instead of compiling it afresh at every call
    (as a new closure would). The call's shared context (masks, memory, cache index, positions)
    rides in the carry, unchanged."""

    def run(carry, xs):
        h, shared = carry
        layer_state, key, cache, layer = xs
        block = nnx.merge(graphdef, layer_state)
        ctx = Context(**shared, path=path, deterministic=deterministic, layer=layer, cache=cache,
                      keys=block.dropout_keys(key))
        h = block.run(h, ctx)
        return (h, shared), ((h, ctx.found) if return_intermediates else None, None if cache is None else ctx.written)

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
