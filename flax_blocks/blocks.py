"""Residual transformer blocks in Flax NNX: ResidualMHA, FeedForward, TransformerBlock, Encoder.

Each is built as `X(cfg, rngs=nnx.Rngs(0))` (the Encoder also takes `num_layers=`) and
called on x of shape (batch, seq, d_model) or (seq, d_model), returning that shape.
Masks follow flax's convention: True means "may attend" (see `attention.build_mask`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Attention, build_mask
from .config import BlockConfig, check_width, init_spec, residual_update
from .init import initializer

ACTIVATION_FNS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def layer_norm(cfg: BlockConfig, *, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """torch-equivalent LayerNorm: torch's eps, two-pass variance."""
    return nnx.LayerNorm(
        cfg.d_model, epsilon=cfg.layer_norm_eps, use_bias=cfg.bias, use_fast_variance=False,
        dtype=None if cfg.dtype is None else jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs,
    )


def linear(cfg: BlockConfig, n_in: int, n_out: int, role: str, *, rngs: nnx.Rngs) -> nnx.Linear:
    """Linear map with kernel (n_in, n_out), drawn from the shared init table."""
    return nnx.Linear(
        n_in, n_out, use_bias=cfg.bias,
        kernel_init=initializer(init_spec(cfg, f"{role}_weight")),
        bias_init=initializer(init_spec(cfg, f"{role}_bias")),
        dtype=None if cfg.dtype is None else jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs,
    )


def gate(cfg: BlockConfig, *, rngs: nnx.Rngs) -> nnx.Param | None:
    """ReZero's scalar or LayerScale's per-channel gate; None for other schemes."""
    if cfg.scaling not in ("rezero", "layerscale"):
        return None
    shape = () if cfg.scaling == "rezero" else (cfg.d_model,)
    return nnx.Param(initializer(init_spec(cfg, "scale"))(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))


def _identity(x: jax.Array) -> jax.Array:
    return x


def _as_batched(cfg: BlockConfig, x: jax.Array) -> tuple[jax.Array, bool]:
    check_width(cfg, x.shape)
    # Cast to the computation dtype (cfg.dtype, else x promoted with the parameters), as flax
    # layers cast their inputs: the residual stream then keeps one dtype, and the Encoder's
    # scan carry has the same dtype in and out.
    dtype = jnp.dtype(cfg.dtype) if cfg.dtype is not None else jnp.promote_types(x.dtype, cfg.param_dtype)
    x = jnp.asarray(x, jax.dtypes.canonicalize_dtype(dtype))
    return (x, False) if x.ndim == 3 else (x[None], True)


class _Residual(nnx.Module):
    """What every block shares: config, dropout after the sublayer, and the residual update."""

    cfg: BlockConfig

    def _update(self, x, sublayer, norm, dropout, scale):
        s = None if scale is None else scale[...].astype(x.dtype)
        return residual_update(self.cfg, x, sublayer, norm if norm is not None else _identity, dropout, s)

    def _sa(self, x, attn, norm, dropout, scale, mask, rows):
        return self._update(x, lambda h: attn(h, mask, rows), norm, dropout, scale)

    def _ff(self, x, linear1, linear2, dropout_act, norm, dropout, scale):
        act = ACTIVATION_FNS[self.cfg.activation]

        def ffn(h):  # (B, T, E): both matmuls on the (B*T, E) token matrix, as 2-D GEMMs,
            # which ran ~10% faster per CPU train step than on (B, T, E) (issue 6's note)
            y = linear2(dropout_act(act(linear1(h.reshape(-1, h.shape[-1])))))
            return y.reshape(h.shape), None

        return self._update(x, ffn, norm, dropout, scale)


class ResidualMHA(_Residual):
    """post: LN(x + Dropout(MHA(x)));  pre: x + Dropout(MHA(LN(x))). Params: mha, norm, scale."""

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg = cfg.resolve()
        self.mha = Attention(cfg, rngs=rngs)
        self.norm = layer_norm(cfg, rngs=rngs) if cfg.norm != "none" else None
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.scale = gate(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, *, attention_mask=None, key_mask=None, return_intermediates: bool = False):
        """x: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights": (B, H, T, T)}."""
        x, unbatched = _as_batched(self.cfg, x)
        mask, rows = build_mask(self.cfg, x.shape[0], x.shape[1], attention_mask, key_mask)
        y, w = self._sa(x, self.mha, self.norm, self.dropout, self.scale, mask, rows)
        return _finish(y, unbatched, {"attention_weights": w}, return_intermediates)


class FeedForward(_Residual):
    """post: LN(x + Dropout(W2 Dropout(act(W1 x))));  pre: the same on LN(x), added to x.
    Params: linear1, linear2, norm, scale."""

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg = cfg.resolve()
        self.linear1 = linear(cfg, cfg.d_model, cfg.d_ff, "linear1", rngs=rngs)
        self.linear2 = linear(cfg, cfg.d_ff, cfg.d_model, "linear2", rngs=rngs)
        self.norm = layer_norm(cfg, rngs=rngs) if cfg.norm != "none" else None
        self.dropout_act = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.scale = gate(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (B, T, E) or (T, E) -> same shape."""
        x, unbatched = _as_batched(self.cfg, x)
        y, _ = self._ff(x, self.linear1, self.linear2, self.dropout_act, self.norm, self.dropout, self.scale)
        return y[0] if unbatched else y


class TransformerBlock(_Residual):
    """Attention sublayer then feed-forward sublayer, the twin of torch's TransformerEncoderLayer.

    Params: self_attn, linear1, linear2, norm1, norm2, scale1, scale2.
    """

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg = cfg.resolve()
        self.self_attn = Attention(cfg, rngs=rngs)
        self.linear1 = linear(cfg, cfg.d_model, cfg.d_ff, "linear1", rngs=rngs)
        self.linear2 = linear(cfg, cfg.d_ff, cfg.d_model, "linear2", rngs=rngs)
        has_norm = cfg.norm != "none"
        self.norm1 = layer_norm(cfg, rngs=rngs) if has_norm else None
        self.norm2 = layer_norm(cfg, rngs=rngs) if has_norm else None
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.dropout1 = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.dropout2 = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.scale1 = gate(cfg, rngs=rngs)
        self.scale2 = gate(cfg, rngs=rngs)

    def apply(
        self, x: jax.Array, mask: jax.Array | None, rows: jax.Array | None, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """x: (B, T, E) with a prepared mask; returns (y (B, T, E), attention weights (B, H, T, T)).

        key: one dropout key for the whole block (the Encoder passes one per layer);
        None uses the dropouts' own RNG streams."""
        k = [None] * 4 if key is None else list(jax.random.split(key, 4))
        attn = lambda h, m, r: self.self_attn(h, m, r, key=k[0])  # noqa: E731
        x, w = self._sa(x, attn, self.norm1, _with_key(self.dropout1, k[1]), self.scale1, mask, rows)
        x, _ = self._ff(x, self.linear1, self.linear2, _with_key(self.dropout, k[2]), self.norm2,
                        _with_key(self.dropout2, k[3]), self.scale2)
        return x, w

    def __call__(self, x: jax.Array, *, attention_mask=None, key_mask=None, return_intermediates: bool = False):
        """x: (B, T, E) or (T, E). With return_intermediates, also {"attention_weights": (B, H, T, T)}."""
        x, unbatched = _as_batched(self.cfg, x)
        mask, rows = build_mask(self.cfg, x.shape[0], x.shape[1], attention_mask, key_mask)
        y, w = self.apply(x, mask, rows)
        return _finish(y, unbatched, {"attention_weights": w}, return_intermediates)


class Encoder(nnx.Module):
    """`num_layers` independently initialised TransformerBlocks plus an optional final LayerNorm.

    The layers' parameters are stacked on a leading axis of size num_layers (created with
    nnx.vmap, applied with a jax.lax.scan over the stacked state), so compile time does not grow with depth.
    `final_norm` defaults to True for pre-LN (a pre-LN stack needs it), False otherwise.
    Params: layers (each leaf has a leading layer axis), norm.
    """

    def __init__(self, cfg: BlockConfig, *, num_layers: int, final_norm: bool | None = None, rngs: nnx.Rngs):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.cfg = cfg = cfg.resolve(num_layers)
        self.num_layers = num_layers

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> TransformerBlock:
            return TransformerBlock(cfg, rngs=rngs)

        self.layers = make_layers(rngs)
        # The stacked layers' dropouts get one key per layer per call from this stream,
        # drawn outside the layer scan, so the scan never mutates RNG state.
        self.rngs = rngs["dropout"].fork() if cfg.dropout > 0 else None
        if final_norm is None:
            final_norm = cfg.norm == "pre"
        self.norm = layer_norm(cfg, rngs=rngs) if final_norm else None

    def __call__(self, x: jax.Array, *, attention_mask=None, key_mask=None, return_intermediates: bool = False):
        """x: (B, T, E) or (T, E) -> same shape.

        With return_intermediates, also {"residual": (L, B, T, E), the stream after each layer,
        "attention_weights": (L, B, H, T, T)}; the default call computes neither.
        """
        x, unbatched = _as_batched(self.cfg, x)
        mask, rows = build_mask(self.cfg, x.shape[0], x.shape[1], attention_mask, key_mask)

        # A plain lax.scan over the stacked state, which it only reads: it composes with
        # any outer transform (jax.grad over split params, vmap, jit, nnx.jit).
        graphdef, state = nnx.split(self.layers)
        training = self.rngs is not None and not self.layers.dropout.deterministic
        keys = jax.random.split(self.rngs(), self.num_layers) if training else None

        run = _layer_scan_body(graphdef, return_intermediates)
        (y, _, _), per_layer = jax.lax.scan(run, (x, mask, rows), (state, keys))
        if self.norm is not None:
            y = self.norm(y)
        if not return_intermediates:
            return y[0] if unbatched else y
        residual, weights = per_layer
        if unbatched:
            residual, weights = residual[:, 0], weights[:, 0]
        return (y[0] if unbatched else y), {"residual": residual, "attention_weights": weights}


@functools.lru_cache(maxsize=64)
def _layer_scan_body(graphdef, return_intermediates: bool):
    """The Encoder's scan body, one function object per (layer graphdef, flag): an eager call
    then reuses the compiled scan instead of compiling it afresh at every call (as a new
    closure would). The masks ride in the carry, unchanged, rather than in a closure."""

    def run(carry, xs):
        h, mask, rows = carry
        layer_state, key = xs
        h, w = nnx.merge(graphdef, layer_state).apply(h, mask, rows, key)
        return (h, mask, rows), ((h, w) if return_intermediates else None)

    return run


def _with_key(dropout: nnx.Dropout, key: jax.Array | None):
    return lambda h: dropout(h, rngs=key)


def _finish(y: jax.Array, unbatched: bool, extras: dict[str, Any], return_intermediates: bool):
    if unbatched:
        y = y[0]
        extras = {k: v[0] for k, v in extras.items()}
    return (y, extras) if return_intermediates else y
