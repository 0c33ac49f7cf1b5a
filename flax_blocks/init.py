"""Sample Flax parameters from the framework-free specs in `config.init_spec`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import Spec


def sample(key: jax.Array, spec: Spec, shape: tuple[int, ...], dtype) -> jax.Array:
    """Draw an array of `shape` whose entries follow `spec` (iid)."""
    kind, value = spec
    if kind == "const":
        return jnp.full(shape, value, dtype)
    if kind == "uniform":
        return jax.random.uniform(key, shape, dtype, -value, value)
    if kind == "normal":
        return value * jax.random.normal(key, shape, dtype)
    raise ValueError(f"unknown init spec {spec!r}")


def initializer(spec: Spec):
    """A flax-style initializer `(key, shape, dtype) -> array` for one spec."""
    return lambda key, shape, dtype=jnp.float32: sample(key, spec, shape, dtype)
