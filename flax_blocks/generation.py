"""Token generation from a `flax_blocks.lm.LanguageModel`: greedy or sampled, compiled whole.

    out = fb.generate(model, input_ids, attention_mask, max_new_tokens=16)       # greedy
    out = fb.generate(model, ids, mask, max_new_tokens=16, temperature=0.8, top_p=0.9, key=jax.random.key(0))

The prompt goes through the model in one chunk, then one token per step inside a
`jax.lax.while_loop`, the whole of it in one `jax.jit`: one compile per (shapes, settings),
none per step. Left-padded prompts (HF's convention: attention_mask 1 = real token, the
padding on the left) get HF's positions, cumsum(mask) - 1 (0 at padding), and each row then
continues from its own position. Sampling warps the logits as HF's logits warpers do, in
HF's order: temperature, then top-k (ties at the k-th value kept), then top-p (HF's rule to its
boundary: the least likely tokens whose cumulative probability, summed from the least likely,
stays at or below 1 - top_p are dropped; at least one token kept). Arguments left None come
from the model's generation settings (`model.lm.generation`, read by `from_hf` from the
checkpoint's generation_config.json), as HF's generate takes them. Everything is
checked before anything is computed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from .caches import decoding_cache, layer_weights
from .core.lm_config import resolve
from .lm import check_token_ids, check_token_mask
from .sharding import batch_spec, explicit_mesh


def warp_logits(logits: jax.Array, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> jax.Array:
    """logits (..., V) -> warped logits, -inf where a token can no longer be drawn:
    HF's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in that order."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:  # HF's TopPLogitsWarper, to its boundary
        order = jnp.argsort(logits, axis=-1, stable=True)  # least likely first, as HF's torch.sort
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        keep_sorted = cumulative > 1 - top_p  # removed: the least likely whose sum stays <= 1 - top_p
        keep_sorted = keep_sorted.at[..., -1].set(True)  # min_tokens_to_keep=1: the most likely stays
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def _choose(logits, key, step, temperature, top_k, top_p):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    warped = warp_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(jax.random.fold_in(key, step), warped, axis=-1).astype(jnp.int32)


def _auto(fn, args, out_spec):
    """`fn(*args)`, on a mesh of Explicit axes (`jax.make_mesh`'s) computed with them Auto and
    its output resharded to `out_spec` (a prefix of its tree); elsewhere as it is."""
    mesh = explicit_mesh(args)
    if mesh is None:
        return fn(*args)
    named = jax.tree.map(lambda p: NamedSharding(mesh, p), out_spec, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=named)(*args)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _layer_weights(graphdef, state):
    """The stack's per-layer weights (`layer_weights`), in a program of their own: cut inside
    `_generate`, as one ~100 MB temporary (d512 8 layers), they made a call's fixed cost
    35 ms where it is 22 ms now (docs/generate.md)."""
    return layer_weights(nnx.merge(graphdef, state).encoder)  # slices: each keeps its stacked array's placement


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "eos", "pad"))
def _generate(graphdef, state, layers, ids, mask, key, *, max_new_tokens, temperature, top_k, top_p, eos, pad):
    """(B, T) prompts -> (B, T + max_new_tokens) tokens, in one program (see `generate`)."""
    run = functools.partial(_decode, graphdef, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos=eos, pad=pad)
    return _auto(run, (state, layers, ids, mask, key), batch_spec(ids))


def _decode(graphdef, state, layers, ids, mask, key, *, max_new_tokens, temperature, top_k, top_p, eos, pad):
    b, t = ids.shape
    model = nnx.merge(graphdef, state)
    out = jnp.full((b, max_new_tokens), pad if pad is not None else 0, jnp.int32)
    token, cache, done, out = _prefill(model, layers, ids, mask, key, 0, out, max_new_tokens, temperature, top_k,
                                       top_p, eos)

    def cond(carry):
        i, stop, _, _, done, _ = carry
        return (i < stop) & ~jnp.all(done)

    def body(carry):
        i, stop, token, cache, done, out = carry
        m = nnx.merge(graphdef, state)
        h, cache = m.hidden(token[:, None], cache=cache)
        nxt = _choose(m.logits(h[:, -1]), key, i, temperature, top_k, top_p)
        if eos is not None:
            nxt = jnp.where(done, pad, nxt)
            done = done | _is_eos(nxt, eos)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (jnp.zeros((), i.dtype), i))
        return i + 1, stop, nxt, cache, done, out

    again = model.lm.recompute_length  # HF's Phi-3 generate: all keys recomputed once the sequence passes it
    step = None if again is None else again + 1 - t  # the step whose input first holds again + 1 tokens
    if step is not None and 1 <= step < max_new_tokens:
        one = jnp.ones((), jnp.int32)
        _, _, token, cache, done, out = jax.lax.while_loop(cond, body, (one, one * step, token, cache, done, out))
        so_far = jnp.concatenate([ids.astype(jnp.int32), out[:, :step]], axis=1)  # (B, t + step)
        full = jnp.concatenate([mask, jnp.ones((b, step), mask.dtype)], axis=1)
        nxt, cache, now_done, new_out = _prefill(model, layers, so_far, full, key, step, out, max_new_tokens,
                                                 temperature, top_k, top_p, eos)
        if eos is not None:  # rows already done stay as they were
            nxt, new_out = jnp.where(done, pad, nxt), jnp.where(done[:, None], out, new_out)
            now_done = done | now_done
        token, done, out = nxt, now_done, new_out
        start = step + 1
    else:
        start = 1
    carry = (jnp.full((), start, jnp.int32), jnp.full((), max_new_tokens, jnp.int32), token, cache, done, out)
    out = jax.lax.while_loop(cond, body, carry)[-1]
    return jnp.concatenate([ids.astype(jnp.int32), out], axis=1)  # the cache holds t + max_new_tokens: no overflow


def _is_eos(tokens: jax.Array, eos: tuple[int, ...]) -> jax.Array:
    """tokens (B,) -> (B,) bool: the token is one of the eos ids."""
    return (tokens[:, None] == jnp.asarray(eos, tokens.dtype)).any(axis=-1)


def _prefill(model, layers, ids, mask, key, step, out, max_new_tokens, temperature, top_k, top_p, eos):
    """A chunk `ids` (B, T') from a fresh cache of the whole generation's length (HF's position_ids
    from the mask) and the token it chooses at `step`: (token, cache, done, out with it written)."""
    b, t = ids.shape
    cache = decoding_cache(model.encoder, model.init_cache(b, t - step + max_new_tokens), layers)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    h, cache = model.hidden(ids, attention_mask=mask, positions=positions, cache=cache)
    token = _choose(model.logits(h[:, -1]), key, step, temperature, top_k, top_p)
    done = _is_eos(token, eos) if eos is not None else jnp.zeros((b,), jnp.bool_)
    return token, cache, done, out.at[:, step].set(token)


def _ended(out: np.ndarray, t: int, eos: tuple[int, ...] | None) -> int:
    """The length of HF's output: generation stops after the step at which every row has
    emitted an eos (the rows ended earlier are padded up to it)."""
    new = out[:, t:]
    if eos is None or not new.size:
        return out.shape[1]
    hit = np.isin(new, eos)
    if not hit.any(axis=1).all():
        return out.shape[1]
    return t + int(hit.argmax(axis=1).max()) + 1


def _check_arguments(lm, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id):
    """generate's arguments as given (None: not given), each refused by name."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be a bool or None, got {do_sample!r}")
    if temperature is not None and not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an int >= 0 (0: off, as HF), got {top_k!r}")
    eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    for name, toks in (("eos_token_id", eos), ("pad_token_id", [pad_token_id])):
        for tok in toks:
            if tok is not None and not (isinstance(tok, (int, np.integer)) and 0 <= tok < lm.vocab_size):
                raise ValueError(f"{name} must be a token id in [0, {lm.vocab_size}) (or, for eos, a list of them), "
                                 f"got {tok!r}")


def generate(model, input_ids, attention_mask=None, *, max_new_tokens: int, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             key: jax.Array | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None) -> jax.Array:
    """Generate up to `max_new_tokens` tokens after each prompt row -> (B, T + N) int32 (the
    prompt, then the new tokens), as HF's `generate`: N = max_new_tokens, or fewer once every
    row has emitted an eos (a row that ended is padded with pad_token_id after its eos).

    model: a causal `LanguageModel` with a head. input_ids (B, T): the prompts, left-padded;
    attention_mask (B, T): 1 / True = real token (HF's convention), None = all real.
    The model's generation settings (`model.lm.generation`, read by `from_hf` from the
    checkpoint's generation_config.json) give every argument left None, as HF's generate
    (`flax_blocks.core.lm_config.resolve`): eos_token_id (an int or a list: a row
    ends at any of them), pad_token_id (None: eos[0]), do_sample, temperature, top_k, top_p
    (HF's defaults where neither names one: greedy; sampling with temperature 1, top_k 50).
    Greedy: argmax; sampling draws from the warped logits (`warp_logits`) with `key` (needed;
    the same key gives the same tokens). temperature > 0 given without do_sample samples,
    temperature=0 is greedy; top_k=0 switches top-k off. Refused, before anything runs: ids
    outside the vocabulary; a mask in another convention (numbers other than 0 / 1, a row
    without a real token, a prompt whose last token is padding, i.e. right padding or True =
    padding); a prompt, or prompt plus max_new_tokens, past the model's learned positions;
    top_p outside (0, 1], top_k < 0, temperature < 0; sampling without a key."""
    lm = getattr(model, "lm", None)
    if lm is None or not hasattr(model, "hidden"):
        raise TypeError(f"generate takes a flax_blocks LanguageModel, got {type(model).__name__}")
    if lm.head == "none":
        raise ValueError("generate needs a model with a head (from_hf(..., part='causal-lm'))")
    if not model.cfg.causal:
        raise ValueError("generate needs a causal model (cfg.causal=True)")
    _check_arguments(lm, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id)
    run = resolve(lm.generation, eos_token_id=eos_token_id, pad_token_id=pad_token_id, do_sample=do_sample,
                  temperature=temperature, top_k=top_k, top_p=top_p)
    if run.sample and not run.temperature > 0:
        raise ValueError(f"sampling needs a temperature > 0, got {run.temperature!r}")
    if run.sample and key is None:
        raise ValueError("sampling (do_sample, or temperature > 0) needs key= (a jax.random key)")
    ids = check_token_ids(np.asarray(input_ids), lm.vocab_size)
    b, t = ids.shape
    mask = np.ones((b, t), bool) if attention_mask is None else np.asarray(check_token_mask(np.asarray(attention_mask),
                                                                                            (b, t)))
    if not mask[:, -1].all():
        rows = np.flatnonzero(~mask[:, -1]).tolist()
        raise ValueError(f"the last prompt token of row(s) {rows} is padding: generate takes left-padded prompts with "
                         "attention_mask 1 / True = real token (HF's convention); a mask with True = padding is "
                         "the inverse (pass ~mask)")
    if lm.max_positions is not None:
        longest = int(mask.sum(axis=1).max())
        if t > lm.max_positions:
            raise ValueError(f"a prompt of {t} tokens, but the model has {lm.max_positions} learned positions")
        if longest + max_new_tokens > lm.max_positions:
            raise ValueError(f"a prompt of {longest} real tokens plus max_new_tokens={max_new_tokens} passes the "
                             f"model's {lm.max_positions} learned positions")
    graphdef, state = nnx.split(model)
    key = jax.random.key(0) if key is None else key
    layers = _layer_weights(graphdef, state)
    out = _generate(graphdef, state, layers, ids, jnp.asarray(mask), key, max_new_tokens=max_new_tokens,
                    temperature=run.temperature, top_k=run.top_k, top_p=run.top_p, eos=run.eos, pad=run.pad)
    if run.eos is None:
        return out
    return out[:, :_ended(np.asarray(out), t, run.eos)]
