"""A whole language model in Flax NNX: tokens -> logits (or the last hidden state).

    lm = LanguageModel(cfg, LMConfig(vocab_size=100, num_layers=2), rngs=nnx.Rngs(0))
    logits = lm(input_ids, attention_mask=mask, positions=positions)      # (B, T, V)
    cache = lm.init_cache(batch, max_length); logits, cache = lm(chunk, cache=cache)

The parts around the stack (token embedding, learned positions, token types, embedding norm,
head tied or not) are declared in `flax_blocks.core.lm_config`, shared with the torch twin
`torch_blocks.lm.LanguageModel`; the stack is the library's `Encoder`. Masks take Hugging
Face's convention for token masks: attention_mask (B, T), 1 / True = a real token, 0 / False
= padding (the same on both twins). positions (B, T) are HF's position_ids: for rotary
models they go to the blocks, for learned ones they index the position table (position p
reads row p + position_offset: OPT's 2, HF adding it too; RoBERTa's padding_idx + 1, where
HF's position_ids are the rows themselves); None means HF's forward default (0..T-1;
OPT's numbered from the mask, RoBERTa's from the ids: LMConfig.default_positions), or with
a cache each row's next position (the cache keeps one per row). `fb.generate` derives HF's
positions for left-padded prompts (cumsum(mask) - 1, 0 at padding).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .attention import _concrete
from .core import declarations
from .core.config import BlockConfig, check_cache_window
from .core.lm_config import OPTIONAL, LMConfig, build_order, default_positions
from .layers import Linear, Norm, compute_dtype, create_params
from .sharding import explicit_call
from .stacks import Encoder

Cache = dict[str, Any]


class Embedding(nnx.Module):
    """A lookup table. Params: embedding (rows, E)."""

    embedding: nnx.Param[jax.Array]  # set by create_params

    def __init__(self, cfg: BlockConfig, component: declarations.Component, *, rngs: nnx.Rngs):
        self.dtype = compute_dtype(cfg)
        create_params(self, component, cfg, rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids (...) integers -> (..., E)."""
        table = self.embedding[...]
        return jnp.take(table if self.dtype is None else table.astype(self.dtype), ids, axis=0)


_MODULES = {"embedding": Embedding, "norm": Norm, "linear": Linear}


def check_token_mask(mask, shape: tuple[int, ...], name: str = "attention_mask") -> jax.Array | None:
    """A token mask in HF's convention (B, T), 1 / True = real token, as a bool array.

    Refused where the values can be read (eager or constant): other shapes; numbers other
    than 0 / 1 (an additive float mask, 0 = keep, -inf = drop: not this convention); a row
    with no real token (the mark of a mask in torch's key_padding_mask convention, True =
    padding, or of an empty row)."""
    if mask is None:
        return None
    dtype = jnp.result_type(mask)
    if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"{name} must hold booleans or 0 / 1 numbers, got dtype {dtype}")
    if tuple(jnp.shape(mask)) != tuple(shape):
        raise ValueError(f"{name} must have the tokens' shape (batch, seq) = {tuple(shape)}, "
                         f"got {tuple(jnp.shape(mask))}")
    values = _concrete(mask)
    if values is not None:
        odd = values[~np.isin(values, (0, 1))]
        if odd.size:
            raise ValueError(f"{name} holds {np.unique(odd)[:3].tolist()}: a token mask holds 1 (real token) and 0 "
                             "(padding), HF's convention; an additive mask (0 = keep, -inf = drop) is not one: pass "
                             "`mask == 0` instead")
        empty = np.flatnonzero(~(values > 0).any(axis=1))
        if empty.size:
            raise ValueError(f"{name} marks no real token in row(s) {empty.tolist()}: 1 / True means a real token "
                             "(HF's convention); a mask with True = padding (torch's key_padding_mask) is the "
                             "inverse: pass ~mask")
    return jnp.asarray(mask) > 0


def check_token_ids(ids, vocab_size: int, name: str = "input_ids") -> jax.Array:
    """Integer token ids (B, T), each in [0, vocab_size) where the values can be read."""
    dtype = jnp.result_type(ids)
    if not jnp.issubdtype(dtype, jnp.integer) or jnp.ndim(ids) != 2:
        raise ValueError(f"{name} must be an integer (batch, seq) array, got {dtype} of shape {tuple(jnp.shape(ids))}")
    values = _concrete(ids)
    if values is not None and values.size and (values.min() < 0 or values.max() >= vocab_size):
        bad = values[(values < 0) | (values >= vocab_size)]
        raise ValueError(f"{name} holds {np.unique(bad)[:3].tolist()}, outside the vocabulary [0, {vocab_size})")
    return jnp.asarray(ids)


class LanguageModel(nnx.Module):
    """Token embedding (+ learned positions, token types, embedding norm), the library's
    `Encoder`, and a head tied or not (see `LMConfig`). Params: embed, pos, token_type,
    embed_norm, encoder, head (None where the model lacks one).

    cfg: every layer's BlockConfig (causal for an LM that decodes); lm: the parts around it."""

    # Set from lm_config.build_order (names and components); None: a part this model lacks (OPTIONAL).
    embed: Embedding
    project_in: Linear | None
    pos: Embedding | None
    token_type: Embedding | None
    embed_norm: Norm | None
    encoder: Encoder  # lm_config.ENCODER
    project_out: Linear | None
    head: Linear | None
    # Set by fb.from_hf (flax_blocks.checkpoints.checkpoint.mark): the family's dialect and model_type, which
    # to_hf writes the model back in; None for a model built here.
    hf_dialect: str | None = None
    hf_family: str | None = None

    def __init__(self, cfg: BlockConfig, lm: LMConfig, *, rngs: nnx.Rngs):
        if not isinstance(lm, LMConfig):
            raise TypeError(f"lm must be an LMConfig, got {type(lm).__name__}")
        self.cfg, self.lm = cfg, lm
        for name, comp in build_order(lm, cfg):
            setattr(self, name, Encoder(cfg, num_layers=lm.num_layers, final_norm=lm.final_norm, rngs=rngs)
                    if comp is None else _MODULES[comp.kind](cfg, comp, rngs=rngs))
        for name in OPTIONAL:  # the parts this model lacks
            if not hasattr(self, name):
                setattr(self, name, None)

    # ------------------------------------------------------------------ calls

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """The stack's cache (`Encoder.init_cache`), which keeps each row's next position, and
        the model's cache_window when it has one (a chunk then sees the last W - 1 cached keys)."""
        check_cache_window(self.cfg, self.lm.cache_window)
        cache = self.encoder.init_cache(batch_size, max_length)
        if self.lm.cache_window is not None:
            cache["window"] = jnp.asarray(self.lm.cache_window, jnp.int32)
        return cache

    def embed_tokens(self, input_ids, positions=None, token_type_ids=None) -> jax.Array:
        """input_ids (B, T) -> the embedded input x_0 (B, T, E) (positions (B, T) for learned
        position embeddings, default 0..T-1, position p read from row p + position_offset;
        token_type_ids (B, T), default 0). Gemma's embed_scale multiplies the token embeddings
        in their dtype, as HF's (the scale rounded to float32 first, HF's buffer)."""
        x = self.embed(input_ids)
        if self.lm.embed_scale is not None:
            scale = jnp.asarray(self.lm.embed_scale, jnp.float32)
            x = x * (scale if jnp.dtype(x.dtype).itemsize <= 4 else jnp.asarray(self.lm.embed_scale)).astype(x.dtype)
        if self.project_in is not None:  # OPT-350m: narrower embeddings, projected to the stack's width
            x = self.project_in(x)
        if self.pos is not None:
            if positions is None:
                t = input_ids.shape[1]
                if t > self.lm.max_positions:
                    raise ValueError(f"{t} tokens, but the model has {self.lm.max_positions} learned positions")
                positions = jnp.arange(t)[None]
            x = x + self.pos(positions + self.lm.position_offset)
        if self.token_type is not None:
            types = jnp.zeros(input_ids.shape, jnp.int32) if token_type_ids is None else token_type_ids
            x = x + self.token_type(types)
        return x if self.embed_norm is None else self.embed_norm(x)

    def hidden(self, input_ids, *, attention_mask=None, positions=None, token_type_ids=None,
               cache: Cache | None = None, deterministic: bool | None = None, return_intermediates: bool = False):
        """input_ids (B, T) -> the last hidden state (B, T, E) (after the final norm);
        with a cache, (hidden, cache); with return_intermediates, (hidden, intermediates).
        Arguments as `__call__`."""
        if return_intermediates and cache is not None:
            raise ValueError("return_intermediates is for calls without a cache")
        ids = check_token_ids(input_ids, self.lm.vocab_size)
        shape = tuple(ids.shape)
        mask = check_token_mask(attention_mask, shape)
        if positions is not None:
            positions = jnp.asarray(positions)
            if positions.shape != shape or not jnp.issubdtype(positions.dtype, jnp.integer):
                raise ValueError(f"positions must be an integer (batch, seq) = {shape} array (HF's position_ids), "
                                 f"got {positions.dtype} {tuple(positions.shape)}")
        if token_type_ids is not None:
            token_type_ids = check_token_ids(token_type_ids, max(self.lm.token_types, 1), "token_type_ids")
            if self.token_type is None:
                raise ValueError("token_type_ids given, but the model has no token-type embedding")
        derived = None  # positions this call derives (OPT's from the mask, RoBERTa's from the ids)
        if cache is not None and positions is None:
            positions = cache["position"][:, None] + jnp.arange(shape[1], dtype=jnp.int32)
        elif positions is None and self.lm.default_positions != "arange":
            real = mask
            if self.lm.default_positions == "ids":
                assert self.lm.pad_token_id is not None  # LMConfig pairs it with default_positions="ids"
                real = jnp.not_equal(ids, self.lm.pad_token_id)
            if real is not None:
                positions = derived = default_positions(self.lm, real.astype(jnp.int32))
        if self.pos is not None and positions is not None:
            seen, limit = _concrete(positions), self.lm.max_positions
            assert limit is not None  # a position table (pos) comes with max_positions
            low = -1 if derived is not None else 0  # a derived -1 (padding) reads row position_offset - 1
            if seen is not None and seen.size and (seen.min() < low or seen.max() >= limit):
                raise ValueError(f"positions up to {int(seen.max())}, but the model has {limit} "
                                 f"learned positions (0..{limit - 1})")
        x = self.embed_tokens(ids, positions, token_type_ids)
        rotary = positions if self.cfg.rope_theta is not None else None
        if cache is not None:
            y, cache = self.encoder(x, key_mask=mask, positions=positions, cache=cache, deterministic=deterministic)
            return self._out(y), cache
        if not return_intermediates:
            return self._out(self.encoder(x, key_mask=mask, positions=rotary, deterministic=deterministic))
        y, inter = self.encoder(x, key_mask=mask, positions=rotary, deterministic=deterministic,
                                return_intermediates=True)
        y = self._out(y)
        return y, {"embedded": x, "output": y, **inter}

    def _out(self, y: jax.Array) -> jax.Array:
        """The stack's output as the model's last hidden state: projected back where the
        embeddings are narrower (project_out)."""
        return y if self.project_out is None else self.project_out(y)

    def logits(self, h: jax.Array) -> jax.Array:
        """Hidden states (..., E) -> logits (..., V) through the head (tied: embed.weight^T),
        times logit_scale (Cohere), soft-capped when the model has a final_logit_softcap (Gemma 2)."""
        if self.lm.head == "none":
            raise ValueError("this model has no head (head='none'): it returns hidden states")
        if self.head is not None:
            y = self.head(h)
        else:
            table = self.embed.embedding[...]
            h, table = nnx.nn.dtypes.promote_dtype((h, table), dtype=compute_dtype(self.cfg))
            y = jnp.dot(h, table.T)
        if self.lm.logit_scale is not None:  # Cohere: logits * logit_scale
            y = y * self.lm.logit_scale
        if self.lm.logits_divisor is not None:
            y = y / self.lm.logits_divisor  # Granite's logits_scaling
        cap = self.lm.final_logit_softcap
        return y if cap is None else jnp.tanh(y / cap) * cap  # HF's order: / c, tanh, * c

    def __call__(self, input_ids, *, attention_mask=None, positions=None, token_type_ids=None,
                 cache: Cache | None = None, deterministic: bool | None = None, return_intermediates: bool = False):
        """input_ids (B, T) integers -> logits (B, T, V), or the last hidden state (B, T, E)
        for head="none". attention_mask (B, T): 1 / True = real token (HF's convention);
        positions (B, T): HF's position_ids (default 0..T-1; with a cache, each row's next
        ones); token_type_ids (B, T): BERT's segments. cache (from `init_cache`): the
        tokens are the next chunk; returns (out, cache). return_intermediates (no cache):
        returns (out, {"embedded": x_0 (B, T, E), "output": the last hidden state (B, T, E),
        and the stack's "residual" (L, B, T, E), "attention_weights" (L, B, H, T, T),
        "attention_logits_max" (L,), and with experts "router_logits" (L, B, T, X), which
        `flax_blocks.experts.load_balancing_loss` turns into HF's auxiliary loss}). Bad ids,
        masks and positions are refused before anything is computed (where their values can be
        read)."""
        explicit = explicit_call(  # a mesh of Explicit axes (jax.make_mesh's): computed with them Auto
            self, lambda m, *a: m(a[0], attention_mask=a[1], positions=a[2], token_type_ids=a[3], cache=a[4],
                                  deterministic=deterministic, return_intermediates=return_intermediates),
            (input_ids, attention_mask, positions, token_type_ids, cache), cache=cache, extra=return_intermediates)
        if explicit is not None:
            return explicit
        out = self.hidden(input_ids, attention_mask=attention_mask, positions=positions, token_type_ids=token_type_ids,
                          cache=cache, deterministic=deterministic, return_intermediates=return_intermediates)
        h, extra = out if cache is not None or return_intermediates else (out, None)
        y = h if self.lm.head == "none" else self.logits(h)
        return y if extra is None else (y, extra)
