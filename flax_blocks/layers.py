"""Flax parameters made from the declarations, and the two leaf layers: Linear and Norm.

`create_params` turns a component's declared `Param`s into `nnx.Param` attributes (each
carrying its logical axes as Flax's sharding annotation, `out_sharding` metadata, which
`nnx.get_partition_spec` and `flax_blocks.sharding` read), drawn from the declared
distributions. Children are built by the caller. Also the input helpers every block and
stack uses: `as_batched` (the stream's dtype, a batch axis) and `batched_memory`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd

from .core.config import BlockConfig, check_width
from .core.declarations import Component, Param

ACTIVATION_FNS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def _walk(comp: Component, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Param]]:
    """(path of the owning module, Param) of every parameter of `comp` and its children."""
    for p in comp.params:
        yield path, p
    for name, child in comp.children:
        yield from _walk(child, path + (name,))


@functools.lru_cache(maxsize=256)
def _entries(component: Component, cfg: BlockConfig) -> tuple[list, dict[str, int]]:
    """[(module path, Param, [(chunk shape, spec)])] of every parameter of `component` and its
    children, and how many values each random kind ("uniform", "normal") needs in all. Cached:
    `initial_values` reads the sizes at every construction, `_assemble` the entries when it
    traces (both read only)."""
    entries = []
    for path, p in _walk(component):
        shapes = [p.flax_shape(cfg)] if len(p.init) == 1 else [(rows, *p.shape[1:]) for rows, _ in p.init]
        entries.append((path, p, [(shape, spec) for shape, (_, spec) in zip(shapes, p.init, strict=True)]))
    for *_, chunks in entries:
        for _, spec in chunks:
            if spec[0] not in ("const", "uniform", "normal"):
                raise ValueError(f"unknown init spec {spec!r}")
    sizes = {kind: sum(math.prod(shape) for *_, chunks in entries for shape, spec in chunks if spec[0] == kind)
             for kind in ("uniform", "normal")}
    return entries, sizes


def _bucket(n: int) -> int:
    """n rounded up to one of four sizes an octave (at most 25 % more; at least 256)."""
    if n <= 256:
        return 256
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _pool(key: jax.Array, kind: str, size: int, dtype: Any) -> jax.Array:
    """`size` draws of U(-1, 1) or N(0, 1): one program per (kind, size, dtype), shared by every
    component whose draw rounds up to that size (`_bucket`)."""
    if kind == "uniform":
        return jax.random.uniform(key, (size,), dtype, -1.0, 1.0)
    return jax.random.normal(key, (size,), dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _assemble(pools: dict[str, jax.Array | None], component: Component, cfg: BlockConfig) -> dict[str, Any]:
    """The parameters of `component` cut from the pools in order, scaled, in the Flax layout."""
    dtype = jnp.dtype(cfg.param_dtype)
    entries, _ = _entries(component, cfg)
    used = {"uniform": 0, "normal": 0}

    def draw(shape: tuple[int, ...], spec: tuple[str, float]) -> jax.Array:
        kind, value = spec
        if kind == "const":
            return jnp.full(shape, value, dtype)
        n, start, pool = math.prod(shape), used[kind], pools[kind]
        assert pool is not None  # drawn: this kind has entries
        used[kind] += n
        return (value * pool[start:start + n]).reshape(shape)

    out: dict[str, Any] = {}
    for path, p, chunks in entries:
        parts = [draw(shape, spec) for shape, spec in chunks]
        node = out
        for name in path:
            node = node.setdefault(name, {})
        node[p.flax] = parts[0] if len(parts) == 1 else p.transform.to_flax(jnp.concatenate(parts, axis=0), cfg)
    return out


def initial_values(key: jax.Array, component: Component, cfg: BlockConfig) -> dict[str, Any]:
    """The initial values of every parameter of `component` and its children, nested by
    name ({flax name: array, child name: {...}}), in the Flax layout. All "uniform"
    entries are one U(-1, 1) draw scaled per chunk, all "normal" ones one N(0, 1) draw;
    a parameter of one distribution is drawn directly in the Flax layout, one of several
    (q / k / v chunks) in torch's layout, then moved.

    A block draws its tree once and hands each child its part (`values=`); a module built
    alone draws its own. Compile time, not arithmetic, is what construction costs on a CPU
    (a threefry kernel takes ~0.3-0.5 s to compile; a 2-layer d64 Encoder once took 5-7 s
    to build): the draws are one program per pool size (`_pool`, sizes rounded up by
    `_bucket`, so components of many configs share it), the cutting one small program per
    component. The threefry stream is prefix-stable (element i depends on the key and i
    only), so a rounded-up pool gives the values a draw of the exact size would."""
    _, sizes = _entries(component, cfg)
    dtype = jnp.dtype(cfg.param_dtype)
    k_uniform, k_normal = jax.random.split(key)
    pools = {kind: _pool(k, kind, _bucket(sizes[kind]), dtype) if sizes[kind] else None  # an unused kind: no draw
             for kind, k in (("uniform", k_uniform), ("normal", k_normal))}
    return _assemble(pools, component, cfg)


def create_params(module: nnx.Module, component: Component, cfg: BlockConfig, rngs: nnx.Rngs,
                  values: dict[str, Any] | None = None) -> None:
    """Set one nnx.Param attribute per declared parameter of `component` on `module`.
    values: `initial_values` of the component (its parent drew them); None draws them
    here, from one key of the params stream."""
    if values is None:
        values = initial_values(rngs.params(), component, cfg)
    for p in component.params:
        setattr(module, p.flax, nnx.Param(values[p.flax], **param_metadata(p.axes)))


def param_metadata(axes: Sequence[str | None]) -> dict[str, Any]:
    """The metadata of a library parameter with logical `axes`: Flax's sharding annotation.

    Flax shards an annotated Variable when it is created (eager sharding, on by default)
    and then needs a mesh; the library's parameters are sharded so only inside a mesh
    context (`jax.set_mesh`), where the logical names must resolve through the rules in
    Flax's context (`nn.logical_axis_rules(rules.as_flax_rules())`). Elsewhere they are
    created unplaced and `shard_model` (or Flax's recipe) places them. (A parameter made
    inside a mesh keeps Flax's eager flag, which nnx.Optimizer copies onto its moments: make
    the optimizer inside the same context too.)"""
    mesh = jax.sharding.get_abstract_mesh()
    eager = nnx.using_eager_sharding() and not mesh.empty
    if eager:
        for name in core_spmd.apply_rules(tuple(axes), None):
            for n in (name,) if isinstance(name, str) or name is None else name:
                if n is not None and n not in mesh.axis_names:
                    raise ValueError(
                        f"a parameter with logical axes {tuple(axes)} is created inside a mesh context with "
                        f"axes {mesh.axis_names}, where Flax shards it at once, and {n!r} is no mesh axis: create "
                        "it under `flax.linen.logical_axis_rules(RULES.as_flax_rules())` as well, or outside the "
                        "mesh context (then place it with flax_blocks.sharding.shard_model)")
    return {"out_sharding": tuple(axes), "eager_sharding": eager}


def compute_dtype(cfg: BlockConfig):
    return None if cfg.dtype is None else jnp.dtype(cfg.dtype)


def dropout(cfg: BlockConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    """An nnx.Dropout of rate cfg.dropout. At rate 0 it holds no RNG stream: a dropout-free
    module carries no RNG state (nnx.state(m, nnx.RngState) is empty, parameter counts
    match the torch twin's, and Linen's init through nnx.bridge.to_linen needs only a
    params key), yet still follows .train() / .eval() and `deterministic`."""
    return nnx.Dropout(cfg.dropout, rngs=rngs if cfg.dropout > 0 else None)


class Linear(nnx.Module):
    """y = x @ kernel + bias on the last axis. Params: kernel (in, out), bias (out,)."""

    # Set by create_params from the declarations (declarations.linear); annotated here so
    # that type checkers and IDEs see them.
    kernel: nnx.Param[jax.Array]
    bias: nnx.Param[jax.Array] | None

    def __init__(self, cfg: BlockConfig, component: Component, *, rngs: nnx.Rngs,
                 values: dict[str, Any] | None = None):
        self.dtype = compute_dtype(cfg)
        create_params(self, component, cfg, rngs, values)
        if not hasattr(self, "bias"):
            self.bias = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., in) -> (..., out)."""
        bias = None if self.bias is None else self.bias[...]
        x, kernel, bias = nnx.nn.dtypes.promote_dtype((x, self.kernel[...], bias), dtype=self.dtype)
        y = jnp.dot(x, kernel)
        return y if bias is None else y + bias


class Norm(nnx.Module):
    """LayerNorm (two-pass variance) or RMSNorm over the last axis, with the config's eps,
    statistics in float32 at least, times scale (or offset + scale, cfg.norm_weight_offset:
    Gemma's RMSNorm); or DyT (Zhu et al. 2025), scale * tanh(alpha * x) + bias,
    in the compute dtype. Params: scale (width,), bias (width,) for LayerNorm and DyT with
    cfg.has_norm_bias, alpha () for DyT."""

    # Set by create_params from the declarations (declarations.norm); alpha exists for DyT only.
    scale: nnx.Param[jax.Array]
    bias: nnx.Param[jax.Array] | None
    alpha: nnx.Param[jax.Array]

    def __init__(self, cfg: BlockConfig, component: Component, *, rngs: nnx.Rngs,
                 values: dict[str, Any] | None = None):
        self.rms = cfg.norm_type == "rmsnorm"
        self.dyt = cfg.norm_type == "dyt"
        self.eps = cfg.layer_norm_eps
        self.offset = float(cfg.norm_weight_offset)
        self.dtype = compute_dtype(cfg)
        create_params(self, component, cfg, rngs, values)
        if not hasattr(self, "bias"):
            self.bias = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., width) -> same shape."""
        bias = None if self.bias is None else self.bias[...]
        if self.dyt:
            x, scale, alpha, bias = nnx.nn.dtypes.promote_dtype(
                (x, self.scale[...], self.alpha[...], bias), dtype=self.dtype)
            y = jnp.tanh(alpha * x) * (scale + self.offset if self.offset else scale)
            return y if bias is None else y + bias
        x, scale, bias = nnx.nn.dtypes.promote_dtype((x, self.scale[...], bias), dtype=self.dtype)
        h = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        if self.rms:
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        else:
            h = h - jnp.mean(h, axis=-1, keepdims=True)
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        # Gemma (offset): times (offset + w) in the statistics' dtype, then cast
        y = (h * (self.offset + scale.astype(h.dtype))).astype(x.dtype) if self.offset else h.astype(x.dtype) * scale
        return y if bias is None else y + bias


def stream_dtype(cfg: BlockConfig, x_dtype) -> Any:
    """The residual stream's dtype: cfg.dtype, else x's dtype promoted with the parameters'."""
    dtype = jnp.dtype(cfg.dtype) if cfg.dtype is not None else jnp.promote_types(x_dtype, cfg.param_dtype)
    return jax.dtypes.canonicalize_dtype(dtype)


def as_batched(cfg: BlockConfig, x: jax.Array, what: str = "input") -> tuple[jax.Array, bool]:
    """x (B, T, E) or (T, E), its width checked -> ((B, T, E) in the stream's dtype, whether a
    batch axis was added)."""
    check_width(cfg, x.shape, what)
    # Cast to the computation dtype (cfg.dtype, else x promoted with the parameters), as flax
    # layers cast their inputs: the residual stream then keeps one dtype, and the Encoder's
    # scan carry has the same dtype in and out.
    x = jnp.asarray(x, stream_dtype(cfg, x.dtype))
    return (x, False) if x.ndim == 3 else (x[None], True)


def batched_memory(cfg: BlockConfig, memory: jax.Array, x: jax.Array, unbatched: bool) -> jax.Array:
    """memory (B, S, E), or (S, E) beside an unbatched x: batched like x, and of x's batch."""
    memory, _ = as_batched(cfg, memory[None] if unbatched else memory, "memory")
    if memory.shape[0] != x.shape[0]:
        raise ValueError(f"memory has batch {memory.shape[0]}, the input {x.shape[0]}")
    return memory
