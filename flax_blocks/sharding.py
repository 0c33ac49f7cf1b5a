"""Sharding rules for flax_blocks: parameter paths -> named axes -> jax.sharding.PartitionSpec.

Every parameter carries the *logical* names of its axes (what the axis is: "embed",
"heads", "kv_heads", "mlp", ...) as `axes` metadata on its nnx.Param, set where it is
created from its declaration (`flax_blocks.declarations`). *Sharding rules* map logical
names to the axes of a `jax.sharding.Mesh` (where the axis goes):

    DATA_PARALLEL   = {"batch": "data"}                                      params replicated
    TENSOR_PARALLEL = {"heads": "model", "kv_heads": "model", "mlp": "model"}  Megatron-style split
    HYBRID          = DATA_PARALLEL | TENSOR_PARALLEL                         2-D mesh (data, model)

Tensor parallelism splits the attention heads (the q/k/v kernel by key/value head group,
each group with its query heads, so no head crosses devices; the output kernel row-wise)
and the MLP width (linear1 / linear_gate column-wise, linear2 row-wise); XLA's SPMD
partitioner inserts the all-reduces after the output projection and linear2.
The Encoder's stacked layer axis is named "layers" (replicated unless the rules map
it). Non-parameter state (dropout RNG keys and counts) is replicated.

    mesh = make_mesh(data=2, model=4)
    shard_model(model, mesh, HYBRID)            # places every Variable, in place
    x = jax.device_put(x, input_sharding(mesh, HYBRID))
    y = nnx.jit(lambda m, x: m(x))(model, x)     # XLA propagates the shardings

The axes travel with the parameters, so one rule serves `nnx.State`s of any nesting (a
TransformerBlock, an Encoder, or a model that contains them). Parameters without axes
(a user's own embedding, say) raise, listing every such path.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .declarations import LAYERS

# Leading axes that transforms stack in front of a parameter, by the path key that
# holds them: the Encoder's nnx.vmap-created layers.
STACKED_AXES: tuple[tuple[str, str], ...] = ((LAYERS, "layers"),)

# Activations: (batch, seq, d_model).
ACTIVATION_AXES: tuple[str, ...] = ("batch", "seq", "embed")

# Sharding rules: logical axis -> mesh axis name (or None: replicated). Unlisted names replicate.
ShardingRules = Mapping[str, str | tuple[str, ...] | None]
REPLICATED: ShardingRules = {}
DATA_PARALLEL: ShardingRules = {"batch": "data"}
TENSOR_PARALLEL: ShardingRules = {"heads": "model", "kv_heads": "model", "mlp": "model"}
HYBRID: ShardingRules = {**DATA_PARALLEL, **TENSOR_PARALLEL}


def _key_str(k: Any) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def path_str(path: Sequence[Any]) -> str:
    """('layers', 'self_attn', 'in_kernel') -> 'layers/self_attn/in_kernel'."""
    return "/".join(_key_str(k) for k in path)


def param_axes(path: Sequence[Any] | str, ndim: int, axes: Sequence[str | None] | None) -> tuple[str | None, ...]:
    """Logical axis names of the parameter at `path` with `ndim` dimensions, from its
    declared `axes`. Leading dimensions beyond those are named from STACKED_AXES (one per
    matching key in the path, outermost first). Raises KeyError if they do not fit."""
    p = path if isinstance(path, str) else path_str(path)
    stacked = [name for key in p.split("/") for k, name in STACKED_AXES if key == k]
    extra = ndim - len(axes) if axes is not None else -1
    if axes is None or not 0 <= extra <= len(stacked):
        raise KeyError(f"no declared axes for parameter {p!r} with {ndim} dims")
    return tuple(stacked[len(stacked) - extra:]) + tuple(axes)


def logical_to_spec(axes: Sequence[str | None], rules: ShardingRules) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec through `rules`."""
    mesh_axes = [rules.get(a) if a is not None else None for a in axes]
    used = [m for m in mesh_axes if m is not None]
    flat = [n for m in used for n in ((m,) if isinstance(m, str) else m)]
    if len(flat) != len(set(flat)):
        raise ValueError(f"the rules map two axes of {tuple(axes)} onto one mesh axis: {mesh_axes}")
    return PartitionSpec(*mesh_axes)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def partition_specs(state: Any, rules: ShardingRules) -> Any:
    """`state` (an nnx.State of Variables, e.g. `nnx.state(model)`) with a PartitionSpec in
    place of every array; Variables are kept as containers (`Variable.replace(spec)`, as
    `nnx.get_partition_spec` does), so the result matches `state` for jit's in_shardings.
    Params follow the axes declared on them (their `axes` metadata); other Variables (RNG
    keys, counts) are replicated. A bare array (a pure dict) carries no axes and is reported
    as such. Every unmatched Param path is reported at once."""
    errors: list[str] = []

    def spec(path, leaf):
        value = leaf.get_value() if _is_variable(leaf) else leaf
        ndim = getattr(value, "ndim", None)
        is_param = isinstance(leaf, nnx.Param) or not _is_variable(leaf)
        is_key = ndim is not None and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        out = PartitionSpec()
        if is_param and ndim is not None and not is_key:
            if not _is_variable(leaf):
                errors.append(f"{path_str(path)!r} is a bare array: pass the Variables (nnx.state(model), "
                              "not nnx.to_pure_dict), whose metadata holds the declared axes")
                return out
            try:
                out = logical_to_spec(param_axes(path, ndim, leaf.get_metadata().get("axes")), rules)
            except KeyError as e:
                errors.append(str(e.args[0]))
        return leaf.replace(out) if _is_variable(leaf) else out

    specs = jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_variable)
    if errors:
        raise KeyError("sharding: parameters without declared axes:\n  " + "\n  ".join(errors))
    return specs


def _unwrap(x: Any) -> Any:
    return x.get_value() if _is_variable(x) else x


def _is_spec(x: Any) -> bool:
    return isinstance(x, (PartitionSpec, NamedSharding))


def _check_divisible(state: Any, specs: Any, mesh: Mesh) -> None:
    errors: list[str] = []

    def check(path, leaf, spec):
        shape, spec = getattr(_unwrap(leaf), "shape", ()), _unwrap(spec)
        for dim, (size, axis) in enumerate(zip(shape, spec)):
            if axis is None:
                continue
            n = 1
            for name in (axis,) if isinstance(axis, str) else axis:
                n *= mesh.shape[name]
            if size % n:
                errors.append(f"{path_str(path)}: dim {dim} of size {size} is not divisible by {axis}={n}")

    jax.tree_util.tree_map_with_path(check, state, specs, is_leaf=_is_variable)
    if errors:
        raise ValueError("cannot shard on this mesh:\n  " + "\n  ".join(errors))


def named_shardings(state: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """Like `partition_specs`, with a NamedSharding on `mesh` in place of every spec
    (checked: every sharded dimension divides by its mesh axes)."""
    specs = partition_specs(state, rules)
    _check_divisible(state, specs, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_state(state: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """`state` with every array placed on `mesh` by `rules` (jax.device_put)."""
    shardings = named_shardings(state, mesh, rules)

    def put(leaf, s):
        if _is_variable(leaf):
            return leaf.replace(jax.device_put(leaf.get_value(), s.get_value()))
        return jax.device_put(leaf, s)

    return jax.tree.map(put, state, shardings, is_leaf=_is_variable)


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules) -> nnx.Module:
    """Place every Variable of `model` on `mesh` by `rules`, in place; returns `model`."""
    nnx.update(model, shard_state(nnx.state(model), mesh, rules))
    return model


def input_sharding(mesh: Mesh, rules: ShardingRules, axes: Sequence[str | None] = ACTIVATION_AXES) -> NamedSharding:
    """Sharding of an input whose axes are `axes` (default (batch, seq, embed))."""
    return NamedSharding(mesh, logical_to_spec(axes, rules))


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "model") mesh of data * model devices, with Auto axes (XLA propagates
    shardings through jit; jax.make_mesh's default is Explicit axes)."""
    devices = list(jax.devices() if devices is None else devices)
    if data * model > len(devices):
        raise ValueError(f"mesh {data} x {model} needs {data * model} devices, {len(devices)} available")
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: data * model])


def describe(state: Any, rules: ShardingRules) -> list[tuple[str, tuple[int, ...], PartitionSpec]]:
    """(path, shape, spec) for every Param of `state`: a readable table of the rules."""
    rows: list[tuple[str, tuple[int, ...], PartitionSpec]] = []

    def add(path, leaf, spec):
        if isinstance(leaf, nnx.Param):
            rows.append((path_str(path), tuple(leaf.get_value().shape), _unwrap(spec)))

    jax.tree_util.tree_map_with_path(add, state, partition_specs(state, rules), is_leaf=_is_variable)
    return rows
