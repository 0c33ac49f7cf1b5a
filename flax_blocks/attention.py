"""Multi-head attention for Flax NNX (twin of `torch_blocks.attention`), owning every option:
masks, causal, grouped-query heads, QK-norm, rotary positions and the attention weights. The
twins hold the same helpers under the same names in the same order, on the same layouts:
queries (B, H, T, hd), keys and values (B, K, S, hd); query head h reads key/value head h // G.
An attention call takes the input x (B, T, E) and one `AttentionCall` (mask, path, cache,
positions, layer; `flax_blocks.core.context`).

The paths (`AttentionCall.path`): "dense" (the explicit softmax: weights, every mask),
"blocked" (an online softmax over key blocks, O(T * block) memory) and "fused" (one
library kernel); BlockConfig.attention chooses, and `attention_path` resolves "auto" from
static facts of the call (no global state) by the rule both twins share
(`flax_blocks.core.attention_paths`). Flax's "blocked" and "fused" are `flash.py`'s.

Masks follow flax's convention: True means "may attend"; Flax's own mask helpers are taken
as they come (nnx.make_attention_mask / make_causal_mask: (B, 1, T, S) of 0 / 1 floats),
and per-head masks (B, H, T, S). Rows in which every key is masked give a zero attention
output (and zero attention weights) on both sides of the project, so a residual block
passes such a position through its skip path unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .core import declarations, rope
from .core.alibi import alibi_slopes
from .core.attention_paths import AUTO_MIN_KEYS, PATHS, choose_path  # noqa: F401 (AUTO_MIN_KEYS: tests read it here)
from .core.config import (
    BlockConfig,
    check_attention_call,
    chunk_start,
    has_rotary,
    is_chunked,
    is_local,
    query_temperature,
    same_chunk,
    warn_fully_masked,
)
from .core.context import AttentionCall
from .core.rope import RopeScaling
from .flash import blocked_attention, fused_attention
from .layers import Norm, compute_dtype, create_params, dropout, initial_values


def attention_path(cfg: BlockConfig, seq, *, need_weights: bool, explicit_mask: bool, dropout_active: bool,
                   platform: str | None = None) -> str:
    """The path of an attention call over `seq` keys by the rule both twins share
    (`flax_blocks.core.attention_paths.choose_path`, whose docstring states it): "dense" when
    the call needs the weights or `seq` is not a concrete int (a symbolic dimension of
    jax.export is never compared in Python); else "fused" on a GPU and "blocked" from
    AUTO_MIN_KEYS keys on, each where the twin's kernel computes the call; else "dense".
    A forced "blocked" or "fused" that the call cannot honour raises the same ValueError in
    both twins (`check_attention_call`), so a call fails alike on both sides.
    Flax's kernels serve an uncached self-attention with causal and key masks (no explicit
    mask, no dropout on the weights). platform: default `jax.default_backend()`, read when
    this runs (at trace time): a program traced for another platform than the process's
    default (jax.export(platforms=...)) gets the default's choice (lax.platform_dependent
    would trace every branch: not worth it for a choice that only changes speed and memory)."""
    check_attention_call(cfg, need_weights=need_weights, explicit_mask=explicit_mask, dropout_active=dropout_active)
    gpu = (jax.default_backend() if platform is None else platform) == "gpu"
    return choose_path(cfg, "flax", seq, need_weights=need_weights, explicit_mask=explicit_mask,
                       dropout_active=dropout_active, gpu=gpu)


def _concrete(a) -> np.ndarray | None:
    """a's values when Python can read them (numpy, an eager or constant jax array), else
    None (a tracer: jit's or export's arguments)."""
    return None if a is None or isinstance(a, jax.core.Tracer) else np.asarray(a)


def as_bool_mask(name: str, mask, shapes: list[tuple[int, ...]]) -> jax.Array:
    """`mask` as a boolean array (True = may attend), checked against `shapes`.

    Flax's conventions are taken: booleans, and numbers 0 / 1 (1 = may attend) as
    nnx.make_attention_mask / make_causal_mask make them (float32 by default). A numeric
    mask holding other values (torch's additive masks: 0 = may attend, -inf = may not)
    is refused where its values can be read (eagerly, or a constant under jit); a traced
    one is read as mask > 0 (an additive mask then masks every key)."""
    dtype = jnp.result_type(mask)
    if dtype != jnp.bool_ and not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{name} must be a boolean array (True = may attend) or 0 / 1 numbers as "
                        f"nnx.make_attention_mask makes them (1 = may attend), got dtype {dtype}")
    if tuple(jnp.shape(mask)) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, dict.fromkeys(shapes)))}, "
                         f"got {tuple(jnp.shape(mask))}")
    if dtype == jnp.bool_:
        return jnp.asarray(mask)
    values = _concrete(mask)
    if values is not None and not np.isin(values, (0, 1)).all():
        odd = np.unique(values[~np.isin(values, (0, 1))])[:3].tolist()
        raise ValueError(
            f"{name} of dtype {dtype} holds {odd}: a numeric mask must hold 1 (may attend) and 0 (may not), as "
            f"Flax's nnx.make_attention_mask / make_causal_mask make it. An additive mask (0 = may attend, -inf = "
            f"may not: torch's float convention) is not Flax's; pass `mask == 0` (a boolean, True = may attend)")
    return jnp.asarray(mask) > 0


def build_mask(
    cfg: BlockConfig,
    batch: int,
    seq: int,
    attention_mask: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    *,
    keys: int | None = None,
    causal: bool | None = None,
) -> tuple[jax.Array | None, jax.Array | None]:
    """Combine the causal flag and the user's masks into one boolean mask.

    attention_mask: (seq, keys), (batch, seq, keys), or Flax's 4-D (batch, 1, seq, keys)
    and per-head (batch, heads, seq, keys) (a leading 1 broadcasts over the batch);
    True (or 1, as nnx.make_attention_mask makes it) = query may attend to key.
    key_mask: (batch, keys), True (or 1) = real key (False = padding).
    keys: the number of keys (default seq; a cross-attention's memory length);
    causal: default cfg.causal (cross-attention passes False).
    Returns (mask of shape (batch or 1, heads or 1, seq, keys) or None,
             rows of shape (batch or 1, heads or 1, seq, 1) that have at least one key, or None).
    Masked-out rows are opened up in `mask` and zeroed after attention with `rows`.
    Batch elements left without any key warn (`FullyMaskedWarning`) where the masks'
    values are known in Python.
    """
    keys = seq if keys is None else keys
    causal = cfg.causal if causal is None else causal
    h = cfg.num_heads
    mask = None
    if causal:
        mask = jnp.tril(jnp.ones((seq, keys), jnp.bool_))[None, None]
    if attention_mask is None and key_mask is None:
        return mask, None
    if attention_mask is not None:
        shapes = [(seq, keys), (batch, seq, keys)] + [(n, m, seq, keys) for n in (batch, 1) for m in (1, h)]
        am = as_bool_mask("attention_mask", attention_mask, shapes)
        am = am if am.ndim == 4 else am.reshape((-1, 1, seq, keys))
        mask = am if mask is None else mask & am
    if key_mask is not None:
        km = as_bool_mask("key_mask", key_mask, [(batch, keys)])[:, None, None, :]
        mask = km if mask is None else mask & km
    _warn_if_fully_masked(batch, seq, keys, causal, attention_mask, key_mask)
    assert mask is not None  # one of the masks was given
    rows = jnp.any(mask, axis=-1, keepdims=True)
    return mask | ~rows, rows


# "auto" takes the blocked path on a CPU (or other non-GPU platform) from this many keys on.


def self_attention_masks(cfg: BlockConfig, path: str, batch: int, seq: int, attention_mask, key_mask) -> dict:
    """The prepared masks of a self-attention taking `path`: {"self": (mask, rows)} from
    `build_mask` for "dense"; {"self": (None, None), "key_valid": key_mask (B, S) or None}
    for "blocked" / "fused", which never materialise the (T, S) mask (and take no
    attention_mask: `attention_path` saw to that)."""
    if path == "dense":
        return {"self": build_mask(cfg, batch, seq, attention_mask, key_mask)}
    if attention_mask is not None:
        raise ValueError(f"the {path} attention path takes no attention_mask (a key mask only)")
    if key_mask is not None:
        checked = as_bool_mask("key_mask", key_mask, [(batch, seq)])
        _warn_if_fully_masked(batch, seq, seq, cfg.causal, None, key_mask)  # as build_mask warns
        key_mask = checked
    return {"self": (None, None), "key_valid": key_mask}


def cache_mask(index: jax.Array | int, seq: int, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The causal mask of a chunk of `seq` queries at positions index .. index+seq-1 over a
    cache of L keys, `valid` (B, L) marking the keys written and not padding: its mask
    (B, 1, seq, L) and rows (B, 1, seq, 1) as `build_mask` returns them."""
    positions = index + jnp.arange(seq)
    keys = jnp.arange(valid.shape[1])
    allowed = (keys[None, :] <= positions[:, None])[None, None] & valid[:, None, None, :]  # (B, 1, seq, L)
    rows = allowed.any(axis=-1, keepdims=True)
    return allowed | ~rows, rows


def _within(mask: jax.Array | None, rows: jax.Array | None, inside: jax.Array, on) -> tuple[jax.Array, jax.Array]:
    """mask (True: may attend) and rows narrowed to the keys `inside` (B|1, 1, T, S) where `on` (a bool,
    traced in a Flax layer scan) holds; a query left without a key has none (rows False, its mask opened
    up). mask None: `inside` alone."""
    inside = inside if on is True else inside | ~on
    m = inside if mask is None else mask & inside
    has = jnp.any(m, axis=-1, keepdims=True)
    return m | ~has, (has if rows is None else rows & has)


def _warn_if_fully_masked(batch: int, seq: int, keys: int, causal: bool, attention_mask, key_mask) -> None:
    """The FullyMaskedWarning for batch elements that the user's masks leave without any
    key, read in numpy where the masks' values are known in Python (eager calls, constants
    under jit or grad); traced masks are not checked. (A causal mask alone leaves every
    query its own position.)"""
    am, km = _concrete(attention_mask), _concrete(key_mask)
    if (attention_mask is not None and am is None) or (key_mask is not None and km is None):
        return
    if am is None and km is None:
        return  # no mask (build_mask does not call it then)
    if not all(isinstance(n, int) for n in (batch, seq, keys)):
        return  # symbolic shapes (jax.export)
    if am is None:  # a key mask alone: an element has a key if one it may see is real
        assert km is not None
        has_key = (km[:, :min(seq, keys)] if causal else km).any(axis=1)
    else:  # (booleans, or 0 / 1 numbers that as_bool_mask checked)
        allowed = (am > 0) if am.ndim == 4 else (am > 0).reshape(-1, 1, seq, keys)
        if causal:
            allowed = allowed & np.tri(seq, keys, dtype=bool)
        if km is not None:
            allowed = allowed & (km > 0)[:, None, None, :]
        has_key = np.broadcast_to(allowed.reshape(allowed.shape[0], -1).any(axis=1), (batch,))
    warn_fully_masked(np.flatnonzero(~has_key), batch, "flax")


def rotary(x: jax.Array, positions: jax.Array, theta: float | jax.Array, dim: int | None = None,
           scaling: RopeScaling | None = None, interleaved: bool = False) -> jax.Array:
    """Rotary position embedding, rotate-half convention (HF LLaMA / GPT-NeoX).

    x (B, T, heads, hd), positions (T,) or per batch row (B, T): dims i and i + hd/2 rotate
    together by the angle position * theta^(-2i/hd). Angles in float32 at least (float64
    under float64).
    dim: rotate only the first `dim` dims, hd read as dim above, and pass the rest through
    (partial rotary, HF GPT-NeoX); an odd dim rotates dim + 1 dims, the frequencies still
    theta^(-2i/dim), as HF's rotary does; None: all.
    scaling: a scaled rotary (`flax_blocks.core.rope`): its frequencies, with the sequence
    length max(positions) + 1 where the type reads one, and its factor on cos and sin.
    interleaved: dims 2i and 2i + 1 rotate together instead (GPT-J, Cohere): rotate-half on the
    rotated dims reordered evens first (`flax_blocks.core.rope.interleave_order`)."""
    dim = x.shape[-1] if dim is None else dim
    width = dim + dim % 2  # HF's cos and sin cover ceil(dim / 2) frequencies, twice
    if width < x.shape[-1]:
        rotated = rotary(x[..., :width], positions, theta, dim, scaling, interleaved)
        return jnp.concatenate([rotated, x[..., width:]], axis=-1)
    if interleaved:
        order, inverse = rope.interleave_order(width)
        rotated = rotary(x[..., order], positions, theta, dim, scaling)
        return rotated[..., inverse]
    dt = jnp.promote_types(x.dtype, jnp.float32)
    base: float | jax.Array = theta
    if scaling is not None and scaling.rope_type == "dynamic":  # the base grows past max_position_embeddings
        length = jnp.maximum(positions.max() + 1, scaling.max_length).astype(dt)
        base = rope.dynamic_theta(scaling, theta, dim, length)
    inv_freq = 1.0 / base ** (jnp.arange(0, dim, 2, dtype=dt) / dim)  # (width/2,)
    if scaling is not None and scaling.rope_type != "dynamic":
        short, long = rope.multipliers(scaling, float(theta), dim)
        m = jnp.asarray(short, dt)
        if long is not None:  # longrope: the long factors once the sequence passes the original length
            m = jnp.where(positions.max() + 1 > scaling.original, jnp.asarray(long, dt), m)
        inv_freq = inv_freq * m
    angles = positions.astype(dt)[..., None] * inv_freq  # (T, width/2) or (B, T, width/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # (T, 1, width) or (B, T, 1, width)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling is not None and (factor := rope.attention_factor(scaling)) != 1.0:  # yarn, longrope
        cos, sin = cos * factor, sin * factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = x[..., : width // 2], x[..., width // 2:]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _bfloat16(x: jax.Array) -> jax.Array:
    """float32 x with each value rounded to the nearest bfloat16 (ties to even), by its bits: a
    cast there and back may be removed by XLA (excess precision), a bit operation is not."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = (u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _head_product(q: jax.Array, k: jax.Array, dtype) -> jax.Array:
    """q (B, K, R, hd) . k (B, K, S, hd) over hd -> (B, K, R, S), batched over (B, K)."""
    return jax.lax.dot_general(q.astype(dtype), k.astype(dtype), (((3,), (3,)), ((0, 1), (0, 1))))


def _cache_write(cache: dict[str, jax.Array], k: jax.Array, v: jax.Array, index: jax.Array | int) -> tuple:
    """A cached self-attention's keys and values (B, K, L, hd) with the chunk's k, v (B, K, T, hd)
    at positions index .. index+T-1: (keys, values, step, cache). A decoding step (T = 1) leaves
    the cache as it is and hands its new key and value over as `step`, to be written after the
    products have read the cache (`_write_after_reading`); a longer chunk is written at once
    (step None)."""
    start = (0 * index, 0 * index, index, 0 * index)  # one integer dtype (int64 under x64 too)
    k_new, v_new = k.astype(cache["k"].dtype), v.astype(cache["v"].dtype)
    if k.shape[2] == 1:  # a decoding step: see `_write_after_reading`
        return cache["k"], cache["v"], (k_new, v_new, start), cache
    k_all = jax.lax.dynamic_update_slice(cache["k"], k_new, start)
    v_all = jax.lax.dynamic_update_slice(cache["v"], v_new, start)
    return k_all, v_all, None, {"k": k_all, "v": v_all}


def _write_after_reading(k_cache, v_cache, step, scores, out) -> dict[str, jax.Array]:
    """A decoding step's cache (B, K, L, hd): the new key and value written into their slot
    once the products have read the cache as it was (scores (B, K, G, L), out (B, K, G, hd)).

    The products take the new token's key and value apart, in its slot, so the written cache's
    one reader is the caller; and each write takes a zero from its product (exact: 0 * a finite
    number), which orders it after the read. With either missing, XLA:CPU copies every layer's
    cache at every step to keep the old one for the reader (batch 1, d512 8 layers: 32 copies
    a step)."""
    k_new, v_new, start = step
    after_k = 0 * scores[:, :, :1, :1].astype(k_new.dtype)  # per row and kv head
    after_v = 0 * out[:, :, :1, :1].astype(v_new.dtype)
    return {"k": jax.lax.dynamic_update_slice(k_cache, k_new + after_k, start),
            "v": jax.lax.dynamic_update_slice(v_cache, v_new + after_v, start)}


class Attention(nnx.Module):
    """Self-attention with one packed q/k/v projection (see `declarations.attention`): K key/value
    heads, G = H / K query heads per key/value head, q_norm / k_norm (Norm over hd), sinks (H,).

    Parameters: in_kernel (E, K, G+2, hd) (per key/value head, slots [G query heads; k; v]),
    in_bias (K, G+2, hd), out_kernel (H, hd, E), out_bias (E,). The torch twin's in_proj_weight
    ((H+2K)*hd, E) is torch's nn.MultiheadAttention's when K = H.
    """

    # Registered from the declarations (declarations.attention) by create_params and __init__;
    # annotated here so that type checkers and IDEs see them. None: an option that is off.
    in_kernel: nnx.Param[jax.Array]
    in_bias: nnx.Param[jax.Array] | None
    out_kernel: nnx.Param[jax.Array]
    out_bias: nnx.Param[jax.Array] | None
    q_norm: Norm | None
    k_norm: Norm | None
    sinks: nnx.Param[jax.Array] | None

    def __init__(self, cfg: BlockConfig, component: declarations.Component | None = None, *, rngs: nnx.Rngs,
                 values: dict | None = None):
        component = component or declarations.attention(cfg)
        self.cfg = cfg
        if values is None:  # built alone: draw the whole tree (norms included) at once
            values = initial_values(rngs.params(), component, cfg)
        create_params(self, component, cfg, rngs, values)
        for name, child in component.children:
            setattr(self, name, Norm(cfg, child, rngs=rngs, values=values[name]))
        for name in ("in_bias", "out_bias", "q_norm", "k_norm", "sinks"):  # options that are off
            if not hasattr(self, name):
                setattr(self, name, None)
        self.dropout = dropout(cfg, rngs)
        self.dtype = compute_dtype(cfg)

    def qk_normed(self, norm: Norm, a: jax.Array) -> jax.Array:
        """QK-norm of a (B, T, heads, hd): over each head, or (qk_norm_over="projection", OLMo 2)
        over all of a token's heads at once, the projection's rows in order."""
        if self.cfg.qk_norm_over == "projection":
            return norm(a.reshape(*a.shape[:2], -1)).reshape(a.shape)
        return norm(a)

    def l2_normed(self, a: jax.Array) -> jax.Array:
        """Llama 4's L2 norm (qk_l2_norm) of a (B, T, heads, hd) over each head: a * rsqrt(mean(a^2) +
        eps), no weight, in float32 at least."""
        x = a.astype(jnp.promote_types(a.dtype, jnp.float32))
        return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.layer_norm_eps)).astype(a.dtype)

    def tempered(self, q: jax.Array, index: jax.Array | int, rope) -> jax.Array:
        """Llama 4's query temperature (`query_temperature`) on q (B, H, T, hd) of a layer without
        rotary (`rope` False, or a traced one), at the slots index .. index + T - 1; q elsewhere."""
        if self.cfg.query_temperature_floor is None or rope is True:
            return q
        dt = jnp.promote_types(q.dtype, jnp.float32)
        slots = (index + jnp.arange(q.shape[2])).astype(dt)
        tempered = (q * query_temperature(self.cfg, slots, jnp)[:, None]).astype(q.dtype)
        return tempered if rope is False else jnp.where(rope, q, tempered)

    def position_qk(self, q: jax.Array, k: jax.Array, positions: jax.Array,
                    local=False, rope=True) -> tuple[jax.Array, jax.Array]:
        """QK-norm, then rotary positions (OLMo 2 / Gemma 3 order). q (B, T, H, hd),
        k (B, T, K, hd), positions (T,) or (B, T); local: a sliding-window layer's (a bool, traced
        in a Flax layer scan), whose rotary base is rope_local_theta when given (Gemma 3); rope:
        whether this layer rotates (`has_rotary`: a bool, traced in a Flax layer scan; False in
        SmolLM3's NoPE layers, Cohere 2's global layers)."""
        if self.q_norm is not None:
            assert self.k_norm is not None  # declared together (cfg.qk_norm)
            q, k = self.qk_normed(self.q_norm, q), self.qk_normed(self.k_norm, k)
        if self.cfg.rope_theta is None or rope is False:
            return q, k
        rq, rk = self.rotated(q, k, positions, local)
        if self.cfg.qk_l2_norm:  # Llama 4: the rotary layers' q and k over their RMS, after rotary
            rq, rk = self.l2_normed(rq), self.l2_normed(rk)
        if rope is not True:  # a scanned layer: the layers without rotary keep q and k
            return jnp.where(rope, rq, q), jnp.where(rope, rk, k)
        return rq, rk

    def rotated(self, q: jax.Array, k: jax.Array, positions: jax.Array, local) -> tuple[jax.Array, jax.Array]:
        """q and k rotated at positions, at rope_local_theta in a local layer when given."""
        assert self.cfg.rope_theta is not None
        theta: float | jax.Array = self.cfg.rope_theta
        dim, local_theta = self.cfg.rotary_dim, self.cfg.rope_local_theta
        scaling, pairs = self.cfg.rope_scaling, self.cfg.rope_interleaved
        if local_theta is not None and local is not False:
            if scaling is not None and local is not True:  # a scanned layer: both rotations, one taken
                qg, kg = (rotary(a, positions, theta, dim, scaling, pairs) for a in (q, k))
                ql, kl = (rotary(a, positions, local_theta, dim, None, pairs) for a in (q, k))
                return jnp.where(local, ql, qg), jnp.where(local, kl, kg)
            theta = local_theta if local is True else jnp.where(local, local_theta, theta)
            scaling = None if local is True else scaling
        return rotary(q, positions, theta, dim, scaling, pairs), rotary(k, positions, theta, dim, scaling, pairs)

    def windowed(self, mask: jax.Array | None, rows: jax.Array | None, index, t: int, s: int,
                 local) -> tuple[jax.Array, jax.Array]:
        """A local layer's mask and rows (`local`: a bool, traced in a Flax layer scan): query i (at
        position index + i) sees key j (position j) only when |i - j| < W (under the causal mask:
        i - W < j); a query whose keys all lie outside its window has none (rows False, its mask
        opened up). mask None: no other mask (a bidirectional window, ModernBERT)."""
        window = self.cfg.sliding_window
        assert window is not None  # only a local layer is windowed
        qpos, kpos = index + jnp.arange(t), jnp.arange(s)
        inside = (jnp.abs(kpos[None, :] - qpos[:, None]) < window)[None, None]  # (1, 1, T, S)
        return _within(mask, rows, inside, local)

    def chunked(self, mask: jax.Array | None, rows: jax.Array | None, index, t: int, s: int,
                chunked) -> tuple[jax.Array, jax.Array]:
        """A chunked layer's mask and rows (`chunked`: a bool, traced in a Flax layer scan): query i (slot
        index + i) sees key j (slot j) only in its chunk of attention_chunk_size, the chunks counted from each
        row's first key some query may attend (its left padding: `chunk_start`, HF's left_padding_tokens), so
        cached decoding keeps the prefill's chunks. mask None: no padding, the chunks from slot 0."""
        size = self.cfg.attention_chunk_size
        assert size is not None  # only a chunked layer is chunked
        start = jnp.zeros((1,), jnp.int32) if mask is None else chunk_start(mask if rows is None else mask & rows)
        inside = same_chunk(size, index + jnp.arange(t), jnp.arange(s), start)[:, None]  # (B|1, 1, T, S)
        return _within(mask, rows, inside, chunked)

    def alibi_bias(self, mask: jax.Array | None, rows: jax.Array | None, s: int) -> jax.Array:
        """ALiBi's biases (B|1, H, 1, S) in float32 (`flax_blocks.core.alibi`): slope_h times key j's
        position among the real keys (the keys some query may attend, from mask (B|1, H|1, T, S) and
        rows; all S when mask is None), each bfloat16-rounded as Falcon's build_alibi_tensor."""
        if mask is None:
            pos = jnp.arange(s)[None]
        else:
            valid = jnp.any((mask if rows is None else mask & rows)[:, 0], axis=1)  # (B|1, S)
            pos = jnp.where(valid, jnp.cumsum(valid, axis=-1) - 1, 0)
        slopes = jnp.asarray(alibi_slopes(self.cfg.num_heads))[None, :, None, None]
        return _bfloat16(slopes * _bfloat16(pos.astype(jnp.float32))[:, None, None, :])

    def logits(self, qk: jax.Array, mask: jax.Array | None) -> jax.Array:
        """The dense path's logits from q.k (B, H, T, S): scaled by 1 / sqrt(head_dim) (or
        query_pre_attn_scalar ** -0.5, Gemma), in float32 at least, soft-capped c tanh(s / c)
        (attn_logit_softcapping, Gemma 2), then a float mask added and the masked pairs -inf."""
        a = self.cfg.query_pre_attn_scalar
        logits = qk / jnp.sqrt(jnp.asarray(self.cfg.head_width, qk.dtype)) if a is None else qk * float(a) ** -0.5
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # never softmax in bf16
        c = self.cfg.attn_logit_softcapping
        if c is not None:
            logits = c * jnp.tanh(logits / c)
        return logits if mask is None else jnp.where(mask, logits, -jnp.inf)

    def softmax(self, logits: jax.Array) -> jax.Array:
        """The dense path's softmax over the keys of logits (B, H, T, S); with attn_sinks (GPT-OSS) each
        head's sink logit joins as one more column, dropped after the softmax."""
        if self.sinks is None:
            return jax.nn.softmax(logits, axis=-1)
        sink = jnp.broadcast_to(self.sinks[...].astype(logits.dtype)[:, None, None], (*logits.shape[:-1], 1))
        return jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]

    def _project(self, x: jax.Array, part: str) -> list[jax.Array]:
        """x (B, T, E) through the in-projection's `part` ("qkv", "q" or "kv"): its tensors
        (B, T, heads, hd) (q: H heads; k, v: K), from one 2-D matmul over all B*T tokens
        (XLA:CPU runs it faster than an einsum over (B, T, H, hd))."""
        x, w, bias, _, _ = self._weights(x)  # in_kernel (E, K, G+2, hd): slots G query heads, k, v
        g = w.shape[2] - 2
        first = {"qkv": 0, "q": 0, "kv": g}[part]
        last = {"qkv": g + 2, "q": g, "kv": g + 2}[part]
        w, bias = w[:, :, first:last], None if bias is None else bias[:, first:last]
        b, t, e = x.shape
        y = jnp.dot(x.reshape(b * t, e), w.reshape(e, -1))
        if bias is not None:
            y = y + bias.reshape(-1)
        y = y.reshape(b, t, *w.shape[1:])  # (B, T, K, slots, hd)
        q = [y[:, :, :, :g].reshape(b, t, -1, y.shape[-1])] if part != "kv" else []
        return q if part == "q" else [*q, y[:, :, :, -2], y[:, :, :, -1]]

    def memory_kv(self, memory: jax.Array) -> dict[str, jax.Array]:
        """Cross-attention keys and values of `memory` (B, S, E), computed once for cached
        decoding: {"k": (B, K, S, hd), "v": (B, K, S, hd)} (k after k_norm, no rotary), head-major
        as a decoding cache."""
        k, v = self._project(memory, "kv")
        k = k if self.k_norm is None else self.qk_normed(self.k_norm, k)
        return {"k": k.swapaxes(1, 2), "v": v.swapaxes(1, 2)}

    def __call__(self, x: jax.Array, call: AttentionCall | None = None, key: jax.Array | None = None,
                 deterministic: bool | None = None,
                 ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, dict[str, jax.Array] | None]:
        """Self-attention of x (B, T, E), or (call.cross) cross-attention to call.memory (B, S, E).

        call (`AttentionCall`): mask, the prepared mask from `build_mask` / `cache_mask` (a head
        with no key gives no output; a query with none in any head none at all). cache: for
        self-attention {"k", "v"} (B, K, L, hd), head-major: x is the chunk at positions
        index .. index+T-1 (rotary continues from index); its keys and values are written there
        and the queries attend to all L cached positions (the mask hides the rest). For
        cross-attention, the memory's keys and values from `memory_kv`. positions: the rotary
        positions of x's tokens, (B, T) per batch row (HF's position_ids); None: index ..
        index+T-1 for every row. layer: this block's index in its stack (from 1; traced in a
        Flax layer scan): whether a self-attention is local (sliding_window,
        sliding_window_pattern) and which rotary base it takes. path: "dense" (the explicit
        softmax: every mask, weights, dropout) or a faster kernel (`attention_path`):
        "blocked" (`blocked_attention`, blocks of cfg.attention_block) or "fused" (`fused_attention`)
        for an uncached self-attention, which take the causal flag and key_valid (B, S) (True =
        real key) instead of the mask, return no weights and apply no dropout; None: "dense". A
        decoding step reads each head's keys in place (no copy of the cache). key: dropout key
        (None: the module's own RNG stream); deterministic: dropout off (True), on (False) or as
        the module's mode (None).

        Returns (out (B, T, E), attention weights (B, H, T, S), the largest pre-softmax logit over
        unmasked pairs (), the updated cache or None); weights and logit None on the blocked and
        fused paths."""
        call = call or AttentionCall()  # (None: an uncached self-attention, no mask)
        mask, rows = (None, None) if call.mask is None else call.mask
        b, t, _ = x.shape
        local = False if call.cross else is_local(self.cfg, call.layer)  # a sliding-window layer (traced in a scan)
        cache, step = call.cache, None  # step: a decoding step's new key and value (B, K, 1, hd) and their slot
        if call.cross:  # queries from x, keys and values from the memory (or its cache)
            q, k, v = self._cross_qkv(x, call.memory, cache)
        else:  # (B, T) per-row rotary positions (HF's position_ids), else index onwards
            positions = call.index + jnp.arange(t) if call.positions is None else call.positions
            rope = has_rotary(self.cfg, call.layer, local)  # a layer with rotary (traced in a scan)
            q, k, v = self._self_qkv(x, positions, local, rope)
            q = self.tempered(q, call.index, rope)
            if cache is not None:
                k, v, step, cache = _cache_write(cache, k, v, call.index)
        path = call.path or "dense"  # (the weights this call returns need the dense path: rule 1)
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if path != "dense" and (call.cross or call.cache is not None):
            raise ValueError(f"the {path} attention path serves uncached self-attention only; cached decoding "
                             "and cross-attention take the dense path")
        if path == "fused" and self.cfg.attention_chunk_size is not None:
            raise ValueError("the fused attention path does not compute chunked attention (attention_chunk_size): "
                             "take the dense or blocked path")
        if path != "dense":  # an uncached self-attention
            out, has_key = self._efficient(path, q, k, v, call.key_valid, local, is_chunked(self.cfg, call.layer))
            return jnp.where(has_key[..., None], self._out(out), 0.0), None, None, cache
        if local is not False:  # a sliding-window layer
            mask, rows = self.windowed(mask, rows, call.index, t, k.shape[2], local)
        if not call.cross and (chunks := is_chunked(self.cfg, call.layer)) is not False:  # Llama 4's chunks
            mask, rows = self.chunked(mask, rows, call.index, t, k.shape[2], chunks)
        alibi = self.alibi_bias(mask, rows, k.shape[2]) if self.cfg.alibi and not call.cross else None
        out, weights, logit_max, written = self._dense(q, k, v, step, mask, rows, call.index, key, deterministic,
                                                       alibi)
        cache = written if written is not None else cache  # a decoding step writes after its products
        out = self._out(out)
        if rows is not None:  # a query with no key (in any head) gets no attention output, bias included
            out = jnp.where(rows.any(axis=1), out, 0.0)
        return out, weights, logit_max, cache

    def _self_qkv(self, x: jax.Array, positions: jax.Array, local,
                  rope=True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Self-attention's q (B, H, T, hd) and k, v (B, K, T, hd) of x (B, T, E), QK-norm and
        rotary (at positions, (T,) or (B, T), where `rope`) applied."""
        q, k, v = self._project(x, "qkv")
        q, k = self.position_qk(q, k, positions, local, rope)
        return q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)

    def _cross_qkv(self, x: jax.Array, memory: jax.Array | None,
                   cache: dict[str, jax.Array] | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Cross-attention's q (B, H, T, hd) of x (B, T, E) and the memory's keys and values
        (B, K, S, hd), computed from memory (B, S, E) or read from its cache (`memory_kv`)."""
        (q,) = self._project(x, "q")
        if self.q_norm is not None:
            q = self.qk_normed(self.q_norm, q)
        mem = self.memory_kv(memory) if memory is not None else cache
        assert mem is not None  # the blocks pass a memory or a cache made with one
        return q.swapaxes(1, 2), mem["k"], mem["v"]

    def _efficient(self, path: str, q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array | None,
                   local, chunked=False) -> tuple[jax.Array, jax.Array]:
        """The blocked or fused path over q (B, H, T, hd) and k, v (B, K, S, hd): (out (B, H, T, hd),
        has_key (B, T)); `flash.py` takes q (B, T, K, G, hd) and k, v (B, S, K, hd). chunked: a chunked
        layer's (`is_chunked`; the blocked path alone computes chunks)."""
        cfg = self.cfg
        b, h, t, d = q.shape
        q, k, v = q.swapaxes(1, 2).reshape(b, t, k.shape[1], -1, d), k.swapaxes(1, 2), v.swapaxes(1, 2)
        if path == "fused":  # the accelerator path: cuDNN's fused kernel where it can
            out, has_key = fused_attention(q, k, v, causal=cfg.causal, key_valid=key_valid, scale=cfg.attention_scale,
                                           window=cfg.sliding_window if local is True else None)
        else:  # memory-efficient: no (T, S) logits
            out, has_key = blocked_attention(
                q, k, v, causal=cfg.causal, key_valid=key_valid, block=cfg.attention_block, scale=cfg.attention_scale,
                softcap=cfg.attn_logit_softcapping, window=cfg.sliding_window, local=local,
                sinks=None if self.sinks is None else self.sinks[...].astype(q.dtype),
                chunk=cfg.attention_chunk_size, chunked=chunked)
        return out.reshape(b, t, h, d).swapaxes(1, 2), has_key

    def _dense(self, q: jax.Array, k: jax.Array, v: jax.Array, step: tuple | None, mask: jax.Array | None,
               rows: jax.Array | None, index: jax.Array | int, key: jax.Array | None, deterministic: bool | None,
               alibi: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array] | None]:
        """The explicit softmax over q (B, H, T, hd) and k, v (B, K, S, hd) (a decoding step's new key
        and value in `step`; ALiBi's biases (B|1, H, 1, S) added to q.k before the scale): (out
        (B, H, T, hd), weights (B, H, T, S), the largest unmasked logit (), the cache a decoding step
        wrote, else None).

        Batched matmuls over (B, K), a key/value head's G query heads as G*T rows (query head h =
        kv * G + g): no copy of k and v per query head."""
        b, h, t, d = q.shape
        kv, s = k.shape[1], k.shape[2]
        q = q.reshape(b, kv, -1, d)  # (B, K, G*T, hd)
        # XLA:CPU runs these faster than the equivalent einsums, forward and backward; the keys are
        # contracted over hd in their (B, K, S, hd) layout, so a decoding step reads the cache as it
        # lies (a (B, K, hd, S) operand made XLA copy the whole cache, every layer, every step: 40 %
        # of a d512 batch-8 step).
        dt = jnp.promote_types(q.dtype, k.dtype)
        scores = _head_product(q, k, dt)  # (B, K, G*T, S)
        if step is not None:  # the new token's key, in its slot
            column = jnp.arange(s) == index
            scores = jnp.where(column, _head_product(q, step[0], dt), scores)
        heads = scores.reshape(b, h, t, s)
        if alibi is not None:  # ALiBi's biases, added before the scale (Falcon)
            heads = heads + alibi.astype(heads.dtype)
        logits = self.logits(heads, mask)
        logit_max = jnp.max(logits) if rows is None else jnp.max(jnp.where(rows, logits, -jnp.inf))
        weights = self.softmax(logits)
        if rows is not None:
            weights = jnp.where(rows, weights, 0.0)
        weights = weights.astype(v.dtype)
        dropped = self.dropout(weights, deterministic=deterministic, rngs=key).reshape(b, kv, -1, s)
        cache = None
        if step is None:
            out = dropped @ v
        else:  # the new token's value, in its slot
            new_weight = jnp.sum(jnp.where(column, dropped, 0), -1, keepdims=True)  # (B, K, G, 1)
            out = jnp.where(column, 0, dropped) @ v + new_weight * step[1]
            cache = _write_after_reading(k, v, step, scores, out)
        return out.reshape(b, h, t, -1), weights, logit_max, cache

    def _out(self, out: jax.Array) -> jax.Array:
        """The heads' outputs (B, H, T, hd) through the output projection -> (B, T, E)."""
        out, _, _, w, bias = self._weights(out)  # out_kernel (H, hd, E)
        b, h, t, d = out.shape
        out = jnp.dot(out.swapaxes(1, 2).reshape(b * t, h * d), w.reshape(h * d, -1)).reshape(b, t, -1)
        return out if bias is None else out + bias

    def _weights(self, x: jax.Array):
        """x and the parameters promoted to the computation dtype."""
        return nnx.nn.dtypes.promote_dtype(
            (x, self.in_kernel[...], None if self.in_bias is None else self.in_bias[...],
             self.out_kernel[...], None if self.out_bias is None else self.out_bias[...]),
            dtype=self.dtype,
        )
