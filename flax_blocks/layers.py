"""Flax parameters made from the declarations, and the two leaf layers: Linear and Norm.

`create_params` turns a component's declared `Param`s into `nnx.Param` attributes (each
carrying its logical axes as Flax's sharding annotation, `out_sharding` metadata, which
`nnx.get_partition_spec` and `flax_blocks.sharding` read), drawn from the declared
distributions. Children are built by the caller.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .config import BlockConfig
from .declarations import Component, Param
from .sharding import param_metadata


def _draw(key: jax.Array, spec: tuple[str, float], shape: tuple[int, ...], dtype) -> jax.Array:
    kind, value = spec
    if kind == "const":
        return jnp.full(shape, value, dtype)
    if kind == "uniform":
        return jax.random.uniform(key, shape, dtype, -value, value)
    if kind == "normal":
        return value * jax.random.normal(key, shape, dtype)
    raise ValueError(f"unknown init spec {spec!r}")


def sample(key: jax.Array, p: Param, cfg: BlockConfig, dtype) -> jax.Array:
    """The initial value of `p`, in the Flax layout. One distribution: drawn directly in
    that layout; several (q / k / v chunks): drawn in torch's layout, then moved."""
    if len(p.init) == 1:
        return _draw(key, p.init[0][1], p.flax_shape(cfg), dtype)
    keys = jax.random.split(key, len(p.init))
    parts = [_draw(k, spec, (rows, *p.shape[1:]), dtype) for k, (rows, spec) in zip(keys, p.init)]
    return p.transform.to_flax(jnp.concatenate(parts, axis=0), cfg)


def create_params(module: nnx.Module, component: Component, cfg: BlockConfig, rngs: nnx.Rngs) -> None:
    """Set one nnx.Param attribute per declared parameter of `component` on `module`."""
    dtype = jnp.dtype(cfg.param_dtype)
    for p in component.params:
        setattr(module, p.flax, nnx.Param(sample(rngs.params(), p, cfg, dtype), **param_metadata(p.axes)))


def compute_dtype(cfg: BlockConfig):
    return None if cfg.dtype is None else jnp.dtype(cfg.dtype)


class Linear(nnx.Module):
    """y = x @ kernel + bias on the last axis. Params: kernel (in, out), bias (out,)."""

    def __init__(self, cfg: BlockConfig, component: Component, *, rngs: nnx.Rngs):
        self.dtype = compute_dtype(cfg)
        create_params(self, component, cfg, rngs)
        if not hasattr(self, "bias"):
            self.bias = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., in) -> (..., out)."""
        bias = None if self.bias is None else self.bias[...]
        x, kernel, bias = nnx.nn.dtypes.promote_dtype((x, self.kernel[...], bias), dtype=self.dtype)
        y = jnp.dot(x, kernel)
        return y if bias is None else y + bias


class Norm(nnx.Module):
    """LayerNorm (two-pass variance) or RMSNorm over the last axis, with the config's eps.
    Statistics in float32 at least. Params: scale (width,), bias (width,) for LayerNorm
    with cfg.bias."""

    def __init__(self, cfg: BlockConfig, component: Component, *, rngs: nnx.Rngs):
        self.rms = cfg.norm_type == "rmsnorm"
        self.eps = cfg.layer_norm_eps
        self.dtype = compute_dtype(cfg)
        create_params(self, component, cfg, rngs)
        if not hasattr(self, "bias"):
            self.bias = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., width) -> same shape."""
        bias = None if self.bias is None else self.bias[...]
        x, scale, bias = nnx.nn.dtypes.promote_dtype((x, self.scale[...], bias), dtype=self.dtype)
        h = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        if self.rms:
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        else:
            h = h - jnp.mean(h, axis=-1, keepdims=True)
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        y = h.astype(x.dtype) * scale
        return y if bias is None else y + bias
