"""Attention without the (T, S) logits: `blocked_attention`, FlashAttention-2 style (an
online softmax over key blocks and a custom VJP that recomputes the probabilities block by
block), and `fused_attention` through jax.nn.dot_product_attention. `Attention` chooses
between them and the dense path (`attention.attention_path`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .core.config import chunk_start, same_chunk


def _block_pairs(nq: int, nk: int, bq: int, bk: int, causal: bool,
                 window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The (query block i, key block j) pairs that hold an allowed pair of positions,
    i-major: every pair without causal; with it, the key blocks whose first key is at or
    before query block i's last query (blocks wholly above the diagonal are not visited);
    with a sliding window W also those whose last key is after query block i's first query
    minus W (blocks wholly before every query's window are not visited)."""
    pairs = [(i, j) for i in range(nq) for j in range(nk) if (not causal or j * bk <= i * bq + bq - 1)
             and (window is None or j * bk + bk - 1 > i * bq - window)]
    i, j = np.asarray(pairs, np.int32).T
    return i, j


def _pair_groups(nq: int, nk: int, bq: int, bk: int, causal: bool, window: int | None, skip: bool,
                 chunks: bool = False):
    """The pairs of `_block_pairs` in two groups, [(i, j, masked)]: first those in which every
    (query, key) pair is allowed by the causal mask and a statically local window (no
    position mask needed: below the diagonal, inside the window), then the rest (masked; with
    chunks, whose edges move with each row's start, every pair)."""
    i, j = _block_pairs(nq, nk, bq, bk, causal, window if skip else None)
    full = np.full(len(i), not chunks)
    if causal:
        full &= j * bk + bk - 1 <= i * bq  # the block's last key at or before its first query
    if window is not None:
        full &= skip & (j * bk > i * bq + bq - 1 - window)  # its first key inside the last query's window
    return [(i[g], j[g], not f) for f, g in ((True, full), (False, ~full)) if g.any()]


def _pair_logits(qi, kj, bias_j, i, j, bq, bk, causal, acc_dt, softcap=None, window=None, local=True,
                 transposed=False, chunks=None):
    """Logits of query block i, already scaled, against key block j (soft-capped,
    c tanh(s / c), before the masks), -inf where a pair is not allowed (a padded or masked
    key, or with `causal` one after the query, or with a sliding window W before
    query - W + 1 where `local`, a bool array, or outside the query's chunk where chunks =
    (start (B,), chunked: a bool array, size) says, `same_chunk`):
    qi (B, K, R, hd) with R = G * bq rows (query head g's row q at g * bq + q), kj (B, K, bk, hd),
    bias_j (B, bk) of 0 / -inf or None -> (logits (B, K, R, bk), or (B, K, bk, R) `transposed`;
    d logits / d s: 1 - tanh^2 with a soft-cap, else None). Masks are applied only where asked:
    the pairs that need none skip the passes over the logits."""
    if transposed:
        s = jnp.einsum("bksd,bkrd->bksr", kj, qi, preferred_element_type=acc_dt)
    else:
        s = jnp.einsum("bkrd,bksd->bkrs", qi, kj, preferred_element_type=acc_dt)
    slope = None
    if softcap is not None:
        t = jnp.tanh(s / softcap)
        s, slope = softcap * t, 1.0 - t * t
    if bias_j is not None:
        s = s + (bias_j[:, None, :, None] if transposed else bias_j[:, None, None, :])
    if not causal and window is None and chunks is None:
        return s, slope
    qpos = i * bq + jnp.tile(jnp.arange(bq), qi.shape[2] // bq)
    kpos = j * bk + jnp.arange(bk)
    if chunks is not None:  # (B, 1, R, bk) or (B, 1, bk, R)
        start, chunked, size = chunks
        inside = same_chunk(size, qpos, kpos, start)[:, None]
        s = jnp.where((inside.swapaxes(-1, -2) if transposed else inside) | ~chunked, s, -jnp.inf)
    kpos, qpos = (kpos[:, None], qpos[None, :]) if transposed else (kpos[None, :], qpos[:, None])
    if causal:
        s = jnp.where(kpos <= qpos, s, -jnp.inf)
    if window is not None:
        s = jnp.where((kpos > qpos - window) | ~local, s, -jnp.inf)
    return s, slope


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _flash(qb, kb, vb, validb, local, causal: bool, bq: int, scale: float, softcap: float | None,
           window: int | None, skip: bool, sink, chunks):
    return _flash_fwd(qb, kb, vb, validb, local, causal, bq, scale, softcap, window, skip, sink, chunks)[0]


def _with_sink(m, denom, sink):
    """The online softmax's end with a sink logit per row (K, R) (GPT-OSS): -> (the rows' new max m',
    the factor exp(m - m') on the running sums, the denominator with exp(sink - m') added)."""
    m_all = jnp.maximum(m, sink)
    corr = jnp.exp(m - m_all)  # m = -inf (a row without keys): 0
    return m_all, corr, denom * corr + jnp.exp(sink - m_all)


def _flash_fwd(qb, kb, vb, validb, local, causal, bq, scale, softcap, window, skip, sink=None, chunks=None):
    """qb (nq, B, K, R, hd) (R = G * bq rows), kb / vb (nk, B, K, bk, hd), validb (nk, B, bk)
    or None (every key real) -> out (nq, B, K, R, hd) (0 for rows without keys), and the
    residuals (the inputs, out, each row's log-sum-exp, 0 where a row has no key). The
    softmax's row sums ride on the P V product (V gets a column of ones): one pass over the
    probabilities fewer. sink (K, R) or None: each row's sink logit, in the denominator alone.
    chunks: chunked attention's (start (B,), chunked, size) (`_pair_logits`), or None."""
    nq, b, kv, r, d = qb.shape
    nk, bk = kb.shape[0], kb.shape[3]
    acc_dt = jnp.promote_types(qb.dtype, jnp.float32)
    qs = (qb.astype(acc_dt) * scale).astype(qb.dtype)  # the logits' scale, folded into the queries
    bias = None if validb is None else jnp.where(validb, 0.0, -jnp.inf).astype(acc_dt)  # (nk, B, bk)
    v1 = jnp.concatenate([vb, jnp.ones(vb.shape[:-1] + (1,), vb.dtype)], axis=-1)  # (nk, B, K, bk, hd + 1)

    def step(masked):
        def body(carry, ij):
            m, acc = carry  # (nq, B, K, R), (nq, B, K, R, hd + 1): P V and the row sums
            i, j = ij
            logits, _ = _pair_logits(qs[i], kb[j], None if bias is None else bias[j], i, j, bq, bk,
                                     causal and masked, acc_dt, softcap, window if masked else None, local,
                                     chunks=chunks)
            mi = m[i]
            m_new = jnp.maximum(mi, logits.max(axis=-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row without a key so far: exp(-inf) = 0
            p = jnp.exp(logits - shift[..., None])
            corr = jnp.exp(mi - shift)
            pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(vb.dtype), v1[j], preferred_element_type=acc_dt)
            return (m.at[i].set(m_new), acc.at[i].set(acc[i] * corr[..., None] + pv)), None
        return body

    carry = (jnp.full((nq, b, kv, r), -jnp.inf, acc_dt), jnp.zeros((nq, b, kv, r, d + 1), acc_dt))
    for pi, pj, masked in _pair_groups(nq, nk, bq, bk, causal, window, skip, chunks is not None):
        carry, _ = jax.lax.scan(step(masked), carry, (jnp.asarray(pi), jnp.asarray(pj)))
    m, acc = carry
    denom, pv = acc[..., d], acc[..., :d]  # the softmax's running sum (flash attention's l), P V
    if sink is not None:
        m, corr, denom = _with_sink(m, denom, sink.astype(acc_dt))
        pv = pv * corr[..., None]
    has = denom > 0
    out = (pv / jnp.where(has, denom, 1.0)[..., None]).astype(vb.dtype)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, denom, 1.0)), 0.0)
    return out, (qs, kb, vb, validb, local, out, lse, sink, chunks)


def _flash_bwd(causal, bq, scale, softcap, window, skip, res, dout):
    """FlashAttention-2's backward: the probabilities recomputed pair by pair from the
    log-sum-exp, D = rowsum(dO * O); dQ, dK, dV accumulated over the same pairs (through
    the soft-cap's slope 1 - tanh^2 when there is one). The pair's logits are formed
    transposed, (keys, rows), so that every product is a plain matrix product (dV = P^T dO,
    dK = dS^T (scale Q) and dQ^T = K^T dS^T: no operand transposed inside the loop; XLA:CPU's
    products with a transposed left operand ran 3-4x slower)."""
    qs, kb, vb, validb, local, out, lse, sink, chunks = res  # qs: the queries times the scale (the forward's)
    nq, b, kv, r, d = qs.shape
    nk, bk = kb.shape[0], kb.shape[3]
    acc_dt = jnp.promote_types(qs.dtype, jnp.float32)
    delta = (dout.astype(acc_dt) * out.astype(acc_dt)).sum(axis=-1)  # (nq, B, K, R)
    bias = None if validb is None else jnp.where(validb, 0.0, -jnp.inf).astype(acc_dt)  # (nk, B, bk)

    def step(masked):
        def body(carry, ij):
            dqt, dk, dv = carry
            i, j = ij
            qi, kj, vj, doi = qs[i], kb[j], vb[j], dout[i]
            logits, slope = _pair_logits(qi, kj, None if bias is None else bias[j], i, j, bq, bk, causal and masked,
                                         acc_dt, softcap, window if masked else None, local,
                                         transposed=True, chunks=chunks)  # (B, K, bk, R)
            p = jnp.exp(logits - lse[i][:, :, None, :])
            dv = dv.at[j].add(jnp.einsum("bksr,bkrd->bksd", p.astype(doi.dtype), doi, preferred_element_type=acc_dt))
            dp = jnp.einsum("bksd,bkrd->bksr", vj, doi, preferred_element_type=acc_dt)
            ds = p * (dp - delta[i][:, :, None, :])
            ds = (ds if slope is None else ds * slope).astype(qi.dtype)
            dk = dk.at[j].add(jnp.einsum("bksr,bkrd->bksd", ds, qi, preferred_element_type=acc_dt))
            dqt = dqt.at[i].add(jnp.einsum("bkds,bksr->bkdr", kj.swapaxes(-1, -2), ds, preferred_element_type=acc_dt))
            return (dqt, dk, dv), None
        return body

    carry = (jnp.zeros((nq, b, kv, d, r), acc_dt), jnp.zeros(kb.shape, acc_dt), jnp.zeros(vb.shape, acc_dt))
    for pi, pj, masked in _pair_groups(nq, nk, bq, bk, causal, window, skip, chunks is not None):
        carry, _ = jax.lax.scan(step(masked), carry, (jnp.asarray(pi), jnp.asarray(pj)))
    dqt, dk, dv = carry
    dq = dqt.swapaxes(-1, -2) * jnp.asarray(scale, acc_dt)
    dsink = None  # a sink's probability p_s = exp(s - lse); d s = -sum over rows of p_s * D
    if sink is not None:
        dsink = -jnp.sum(jnp.exp(sink.astype(acc_dt) - lse) * delta, axis=(0, 1)).astype(sink.dtype)
    return dq.astype(qs.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None, None, dsink, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, key_valid: jax.Array | None,
                      block: int, scale: float | None = None, softcap: float | None = None,
                      window: int | None = None, local=True, sinks: jax.Array | None = None,
                      chunk: int | None = None, chunked=True) -> tuple[jax.Array, jax.Array]:
    """softmax(q k^T * scale) v (scale default 1 / sqrt(hd); soft-capped logits c tanh(s / c)
    with softcap c, Gemma 2; a causal sliding window W, keys i - W < j <= i, where `local`, a
    Python bool or a traced one, with the key blocks wholly outside it skipped when `local` is
    a Python True) without the (T, S) logits, FlashAttention-2 style: lax.scans over the
    (query block, key block) pairs that hold an allowed pair (for causal, query block i
    visits key blocks 0..i only), first those that need no position mask, then those that
    straddle the diagonal or the window's edge (`_pair_groups`); an online softmax forward
    that keeps the output and each row's log-sum-exp, and a custom VJP that recomputes the
    probabilities pair by pair (no stored per-block carries). Memory O(T * hd + block^2);
    grouped-query heads without repeating k and v (a key block serves the G * block rows of
    its query heads).

    sinks (K * G,) or None: a logit per query head in each row's denominator (GPT-OSS), head
    k * G + g (d sinks from the same log-sum-exp).
    chunk: chunked attention (Llama 4) where `chunked` (a Python bool or a traced one): query i sees key j
    only in its chunk, the chunks counted from each row's first real key (`same_chunk`, `chunk_start`).
    q (B, T, K, G, hd), k and v (B, S, K, hd); key_valid (B, S) or None. Returns (out
    (B, T, K, G, hd), has_key (B, T)); rows without any key give 0 (and zero gradients),
    as the dense path."""
    b, t, kv, g, d = q.shape
    s = k.shape[1]
    bq, bk = min(block, t), min(block, s)
    nq, nk = -(-t // bq), -(-s // bk)
    valid = jnp.ones((b, s), jnp.bool_) if key_valid is None else key_valid.astype(jnp.bool_)
    ragged = key_valid is not None or nk * bk != s  # padded keys to mask

    def pad(a: jax.Array, n: int, axis: int) -> jax.Array:  # zeros after the end of `axis`, up to length n
        return jnp.pad(a, [(0, n - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)])

    qb = pad(q, nq * bq, 1).reshape(b, nq, bq, kv, g, d).transpose(1, 0, 3, 4, 2, 5).reshape(nq, b, kv, g * bq, d)
    kb = pad(k, nk * bk, 1).reshape(b, nk, bk, kv, d).transpose(1, 0, 3, 2, 4)  # (nk, B, K, bk, hd)
    vb = pad(v, nk * bk, 1).reshape(b, nk, bk, kv, d).transpose(1, 0, 3, 2, 4)  # (nk, B, K, bk, hd)
    validb = pad(valid, nk * bk, 1).reshape(b, nk, bk).swapaxes(0, 1) if ragged else None  # padded keys invalid
    if local is False:
        window = None
    skip = window is not None and local is True  # statically local: skip the blocks outside the window
    scale = d ** -0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    sink = None if sinks is None else jnp.broadcast_to(sinks.reshape(kv, g, 1), (kv, g, bq)).reshape(kv, g * bq)
    if chunked is False:
        chunk = None
    if chunk is not None and not causal:
        raise ValueError(f"chunk={chunk!r} is causal attention within chunks (Llama 4): it needs causal=True")
    start = None if chunk is None else chunk_start(valid[:, None, None, :])  # (B,): each row's left padding
    chunks = None if start is None else (start, jnp.asarray(chunked, jnp.bool_), jnp.asarray(chunk, start.dtype))
    out = _flash(qb, kb, vb, validb, jnp.asarray(local, jnp.bool_), causal, bq, scale, softcap, window, skip, sink,
                 chunks)
    out = out.reshape(nq, b, kv, g, bq, d).transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, kv, g, d)[:, :t]
    if causal:  # a real key at or before the query (and inside its window, its chunk)
        has_key = _keys_seen(valid, t, window, local)
        if chunk is not None and start is not None:
            has_key = has_key & (_keys_in_chunk(valid, t, chunk, start) | ~jnp.asarray(chunked, jnp.bool_))
    else:
        has_key = jnp.broadcast_to(valid.any(axis=1, keepdims=True), (b, t))
    return out, has_key


def _keys_seen(valid: jax.Array, t: int, window: int | None = None, local=True) -> jax.Array:
    """(B, T): whether causal query i has a real key at or before it (valid (B, S)), and with
    a window W where `local` in i - W < j <= i."""
    count = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
    q = jnp.minimum(jnp.arange(t), valid.shape[1] - 1)
    seen = count[:, q] > 0
    if window is None or local is False:
        return seen
    before = jnp.where(q - window >= 0, count[:, jnp.maximum(q - window, 0)], 0)
    return jnp.where(local, count[:, q] - before > 0, seen)


def _keys_in_chunk(valid: jax.Array, t: int, chunk: int, start: jax.Array) -> jax.Array:
    """(B, T): whether query i has a real key (valid (B, S)) at or before it in its chunk, the chunks of
    `chunk` counted from each row's `start` (B,)."""
    count = jnp.pad(jnp.cumsum(valid, axis=1, dtype=jnp.int32), ((0, 0), (1, 0)))  # count[:, n]: keys before n
    q = jnp.arange(t)[None, :]
    first = start[:, None] + (q - start[:, None]) // chunk * chunk  # the chunk's first slot (B, T)
    last = jnp.minimum(q, valid.shape[1] - 1) + 1
    lo = jnp.clip(first, 0, last)
    return jnp.take_along_axis(count, last, axis=1) > jnp.take_along_axis(count, lo, axis=1)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, key_valid: jax.Array | None,
                    scale: float | None = None, window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The same as `blocked_attention` through jax.nn.dot_product_attention (query head
    k * G + g uses key/value head k, its grouping too); its softmax runs in float32, so
    float64 parity is not this path's job. Rows without keys give 0."""
    b, t, kv, g, d = q.shape
    mask = None if key_valid is None else key_valid[:, None, None, :]  # (B, 1, 1, S)
    out = jax.nn.dot_product_attention(q.reshape(b, t, kv * g, d), k, v, mask=mask, is_causal=causal, scale=scale,
                                       local_window_size=None if window is None else (window - 1, 0))
    if key_valid is None:
        has_key = jnp.ones((b, t), jnp.bool_)
    elif causal:
        has_key = _keys_seen(key_valid, t, window)  # a key at or before the query (in its window)
    else:
        has_key = jnp.broadcast_to(key_valid.any(axis=1, keepdims=True), (b, t))
    out = jnp.where(has_key[:, :, None, None], out, 0.0)
    return out.reshape(b, t, kv, g, d), has_key
