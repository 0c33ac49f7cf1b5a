"""Caches for incremental decoding, shared by the Flax blocks and stacks: a new cache
(`new_cache`), the context of a cached call over the next chunk (`cached_context`), and a stack's cache laid out
for a decoding loop (`decoding_cache`, `layer_weights`). Twins of `torch_blocks.caches`.

A cache: {"index": () the next position, "valid": (B, L) the keys written and not padding,
"overflow": () bool (a traced call past the cache's end sets it, see `flax_blocks.blocks`),
"position": (B,) each row's next rotary position, "layers": the modules' key / value caches,
with a memory "memory_valid": (B, S), and with a window (a LanguageModel's cache_window) "window":
() the keys a chunk sees besides its own, plus one}."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import cache_mask
from .core import declarations
from .core.config import check_cached_call, check_new_cache, overflow_message
from .core.context import Context
from .layers import as_batched, stream_dtype

Cache = dict[str, Any]


def new_cache(module, batch_size: int, max_length: int, make, memory=None, memory_key_mask=None) -> Cache:
    """An empty cache of `max_length` positions for `module` (a block or a stack; its
    `init_cache`): `make(batch, length, dtype, ...)` builds the modules' key / value caches,
    from `memory` (B, S, E) too for a decoder (their cross-attention keys and values, once)."""
    cfg = module.cfg
    check_new_cache(cfg, type(module).__name__, batch_size, max_length)
    dtype = stream_dtype(cfg, jnp.float32)
    cache: Cache = {"index": jnp.zeros((), jnp.int32), "valid": jnp.zeros((batch_size, max_length), jnp.bool_),
                    "overflow": jnp.zeros((), jnp.bool_),
                    "position": jnp.zeros((batch_size,), jnp.int32)}  # each row's next (rotary) position
    if memory is not None:
        memory, _ = as_batched(cfg, memory, "memory")
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


class Stacked(Protocol):
    """A stack as `layer_weights` and `decoding_cache` read it (`flax_blocks.stacks`' Encoder, Decoder)."""

    layers: nnx.Module  # one block whose parameters have a leading layer axis
    num_layers: int


def layer_weights(stack: Stacked) -> tuple[Any, ...]:
    """Each layer's state (weights) cut out of a stack's stacked state: a tuple of num_layers.
    A mixed stack's (`mlp_kinds`): {"block": its block's state, "mlp": its own MLP's}."""
    _, state = nnx.split(stack.layers)
    out = [jax.tree.map(lambda a, i=i: a[i], state) for i in range(stack.num_layers)]
    kinds = getattr(stack, "mlp_kinds", None)
    if not kinds:
        return tuple(out)
    groups = {k: nnx.split(getattr(stack, name))[1] for k, name in declarations.LAYER_MLPS.items() if k in kinds}
    index = [kinds[:i].count(k) for i, k in enumerate(kinds)]  # each layer's place among its kind's
    return tuple({"block": w, "mlp": jax.tree.map(lambda a, j=j: a[j], groups[k])}
                 for w, k, j in zip(out, kinds, index, strict=True))


def decoding_cache(stack: Stacked, cache: Cache, weights: tuple[nnx.State, ...] | None = None) -> Cache:
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


def checked_positions(positions, shape) -> jax.Array | None:
    """positions (B, T) as an int32 array, checked against x's (B, T); None stays None."""
    if positions is None:
        return None
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.shape != tuple(shape):
        raise ValueError(f"positions must be an integer (batch, seq) = {tuple(shape)} array (HF's position_ids), "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    return positions.astype(jnp.int32)


def cached_context(module, x, cache, key_mask, attention_mask, memory, memory_mask, deterministic,
                   positions=None) -> tuple[Context, Cache]:
    """The context of a cached call of `module` (a block or a stack) over x (B, T, E), the chunk
    after the cache's positions, and the cache after it but for its "layers" (which the
    call writes: the context's `written`, or the stack's)."""
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
    shown = valid  # a cache_window keeps the last W - 1 keys before the chunk (HF's sliding-window cache)
    if "window" in cache:
        shown = valid & (jnp.arange(length)[None, :] > index - cache["window"])
    masks = {"self": cache_mask(index, t, shown)}
    if positions is None and "position" in cache:  # per-row positions: given, or each row's next ones
        positions = cache["position"][:, None] + jnp.arange(t, dtype=jnp.int32)
    if "memory_valid" in cache:
        mv = cache["memory_valid"]
        m = jnp.broadcast_to(mv[:, None, None, :], (b, 1, t, mv.shape[1]))
        rows = jnp.any(m, axis=-1, keepdims=True)
        masks["cross"] = (m | ~rows, rows)
    ctx = Context(masks, index=index, positions=positions, deterministic=deterministic, cache=cache["layers"])
    new = {**cache, "index": index + t, "valid": valid, "overflow": overflow}
    if "position" in cache:
        new["position"] = positions[:, -1] + 1
    return ctx, new
