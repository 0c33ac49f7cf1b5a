"""Sharding rules for flax_blocks: logical axis names -> mesh axes -> jax.sharding.PartitionSpec.

Every parameter carries Flax's standard sharding annotation, `out_sharding` metadata (what
`nnx.with_partitioning` sets), holding the *logical* names of its axes (what the axis is:
"embed", "heads", "kv_heads", "mlp", ...), set where it is created from its declaration
(`flax_blocks.core.declarations`). The Encoder / Decoder stack their layers with nnx.vmap, which
puts "layers" in front (`transform_metadata={nnx.PARTITION_NAME: "layers"}`). That
annotation is the one source of truth: `nnx.get_partition_spec`, `nnx.get_named_sharding`,
nnx.Optimizer (whose moments copy their parameter's metadata) and this module all read it.

*Sharding rules* map logical names to the axes of a `jax.sharding.Mesh` (where the axis goes):

    DATA_PARALLEL   = {"batch": "data"}                                      params replicated
    TENSOR_PARALLEL = {"heads": "model", "kv_heads": "model", "mlp": "model"}  Megatron-style split
    HYBRID          = DATA_PARALLEL | TENSOR_PARALLEL                         2-D mesh (data, model)
    FSDP            = DATA_PARALLEL | {"embed": "data"}                       params and optimizer
                                                                              state split over "data"
    EXPERT_PARALLEL = {"expert": "expert"}                                    each device holds its
                                                                              share of the experts

Tensor parallelism splits the attention heads (the q/k/v kernel by key/value head group,
each group with its query heads, so no head crosses devices; the output kernel row-wise)
and the MLP width (linear1 / linear_gate column-wise, linear2 row-wise); XLA's SPMD
partitioner inserts the all-reduces after the output projection and linear2. FSDP splits
every parameter with a d_model axis over "data" (XLA all-gathers it where it is used);
`FSDP | TENSOR_PARALLEL` does both on a 2-D mesh. Expert parallelism splits an experts MLP's
stacked expert matrices (X, ., .) over an "expert" mesh axis (`make_mesh(expert=n)`), the router
replicated; the grouped dispatch then reads each block's expert where it lives (XLA gathers). It
composes with the others (`HYBRID | EXPERT_PARALLEL` on a (data, model, expert) mesh). Unlisted
logical names replicate.

The rules are a `ShardingRules` mapping; `.as_flax_rules()` is the same rules in Flax's form
(a tuple of (logical, mesh) pairs naming every logical axis of the library), for
`flax.linen.logical_axis_rules`. Both routes give the same specs:

    mesh = make_mesh(data=2, model=4)
    shard_model(model, mesh, HYBRID)            # places every Variable, in place
    shard_model(optimizer, mesh, HYBRID)        # Adam's moments follow their parameters

    with nn.logical_axis_rules(HYBRID.as_flax_rules()):   # Flax's recipe
        specs = nnx.get_partition_spec(nnx.state(model))

An axis that its mesh axes do not divide is never refused: on a mesh, each parameter axis
keeps the longest leading part of its mesh axes whose sizes' product divides it, and is
replicated over the rest (`fit_spec`). A single mesh axis that does not divide it is dropped:
2 KV heads on a 4-way "model" axis replicate the q/k/v kernel over "model", while the query
heads of the output projection and the FFN width stay split. `partition_specs(..., mesh=)`,
`named_shardings`, `shard_model`, `misplaced` and loading with `mesh=` all give this one
placement (Flax's own recipe, `nnx.get_named_sharding`, does not: JAX refuses the uneven split).

What `shard_model` / `partition_specs` do with each Variable:
  - annotated (`out_sharding`, ours or a user's `nnx.with_partitioning`): each name is
    looked up in the rules, else taken as a mesh axis name (Flax's convention), else (a
    logical name of this library the rules leave out) replicated; a name that is none of
    these is refused;
  - a Param without annotation, or an array of optimizer state (nnx.OptState) with more
    than one element and no annotation: refused, every such path listed at once (it would
    otherwise be replicated silently);
  - anything else (RNG keys and counts, the optimizer's step and Adam's count): replicated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .core.declarations import LAYER_AXIS
from .layers import param_metadata  # noqa: F401 - created with the parameters (layers); named here too

# The library's logical axis names: parameters' (from flax_blocks.core.declarations; a test
# checks that they cover every declared axis), the stacked layer axis, and activations'.
PARAM_AXES: tuple[str, ...] = ("embed", "heads", "kv_heads", "qkv", "head_dim", "mlp", "expert", "vocab")
# Activations: (batch, seq, d_model). Their width axis has its own name, so FSDP can split
# the parameters' "embed" over "data" while the batch takes "data" too.
ACTIVATION_AXES: tuple[str, ...] = ("batch", "seq", "activation_embed")
LOGICAL_AXES: tuple[str, ...] = (LAYER_AXIS, *PARAM_AXES, *ACTIVATION_AXES)

MeshAxes = str | tuple[str, ...] | None


def _mesh_axes(name: str, value: Any) -> MeshAxes:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"rule {name!r}: expected a mesh axis name, a tuple of them or None, got {value!r}")


class ShardingRules(Mapping[str, MeshAxes]):
    """Sharding rules: logical axis name -> mesh axis name, tuple of mesh axis names, or
    None (replicated). Logical names it does not list replicate.

    Built from a mapping or from Flax's (logical, mesh) pairs; `a | b` merges (b wins);
    `as_flax_rules()` gives the pairs for `flax.linen.logical_axis_rules`."""

    __slots__ = ("_rules",)

    def __init__(self, rules: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), /):
        items = rules.items() if isinstance(rules, Mapping) else rules
        out: dict[str, MeshAxes] = {}
        for name, value in items:
            if not isinstance(name, str):
                raise TypeError(f"a rule's logical name must be a str, got {name!r}")
            value = _mesh_axes(name, value)
            if name in out and out[name] != value:
                raise ValueError(f"two rules for {name!r}: {out[name]!r} and {value!r}")
            out[name] = value
        self._rules = out

    def __getitem__(self, name: str) -> MeshAxes:
        return self._rules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __hash__(self) -> int:
        return hash(tuple(self._rules.items()))

    def __or__(self, other: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> ShardingRules:
        return ShardingRules({**self._rules, **as_rules(other)._rules})

    def __ror__(self, other: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> ShardingRules:
        return as_rules(other) | self

    def __repr__(self) -> str:
        return f"ShardingRules({self._rules!r})"

    def as_flax_rules(self) -> tuple[tuple[str, MeshAxes], ...]:
        """The same rules in Flax's form, for `flax.linen.logical_axis_rules` (and so
        `nnx.get_partition_spec`): every listed pair, then (name, None) for each logical
        name of the library the rules leave out (Flax would otherwise read it as a mesh axis)."""
        return tuple(self._rules.items()) + tuple((n, None) for n in LOGICAL_AXES if n not in self._rules)


def as_rules(rules: ShardingRules | Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> ShardingRules:
    """`rules` as ShardingRules (None: no rules, everything logical replicated)."""
    if isinstance(rules, ShardingRules):
        return rules
    return ShardingRules(() if rules is None else rules)


REPLICATED = ShardingRules()
DATA_PARALLEL = ShardingRules({"batch": "data"})
TENSOR_PARALLEL = ShardingRules({"heads": "model", "kv_heads": "model", "mlp": "model"})
HYBRID = DATA_PARALLEL | TENSOR_PARALLEL
FSDP = DATA_PARALLEL | {"embed": "data"}
EXPERT_PARALLEL = ShardingRules({"expert": "expert"})


def loading_rules(mesh: Mesh) -> ShardingRules:
    """The rules a load onto `mesh` takes unless told: TENSOR_PARALLEL, and EXPERT_PARALLEL
    where the mesh has an "expert" axis."""
    return TENSOR_PARALLEL | (EXPERT_PARALLEL if "expert" in mesh.axis_names else REPLICATED)


def _key_str(k: Any) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def path_str(path: Sequence[Any]) -> str:
    """('layers', 'self_attn', 'in_kernel') -> 'layers/self_attn/in_kernel'."""
    return "/".join(_key_str(k) for k in path)


def logical_to_spec(axes: Sequence[Any], rules: Any, mesh: Mesh | None = None) -> PartitionSpec:
    """Map axis names to a PartitionSpec through `rules`: a name the rules list takes its
    mesh axes; else a mesh axis name stays (on `mesh`, when given; without a mesh, any
    name but the library's logical ones); else a library logical name replicates.
    Raises ValueError for any other name, or when two axes land on one mesh axis."""
    rules = as_rules(rules)
    mesh_names = None if mesh is None else set(mesh.axis_names)

    def one(name: str) -> tuple[str, ...]:
        if name in rules:
            m = rules[name]
            targets = () if m is None else (m,) if isinstance(m, str) else m
            missing = [t for t in targets if mesh_names is not None and t not in mesh_names]
            if missing:
                assert mesh is not None  # (missing needs mesh_names)
                raise ValueError(f"rule {name!r} -> {m!r}: the mesh has no axis {missing[0]!r} (its axes: "
                                 f"{tuple(mesh.axis_names)}); map {name!r} to one of them, or to None to replicate")
            return targets
        if mesh_names is not None and name in mesh_names:
            return (name,)
        if name in LOGICAL_AXES:
            return ()
        if mesh is None:  # (mesh_names is None)
            return (name,)
        raise ValueError(f"axis name {name!r} of {tuple(axes)} is neither a logical name the rules map "
                         f"({sorted(rules)}) nor a mesh axis {tuple(mesh.axis_names)}; add a rule for it "
                         "(None replicates)")

    mesh_axes: list[MeshAxes] = []
    for a in axes:
        if a is None:
            mesh_axes.append(None)
            continue
        names = (a,) if isinstance(a, str) else tuple(a)
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"axis {a!r} of {tuple(axes)}: expected a name, a tuple of names or None")
        flat = tuple(m for n in names for m in one(n))
        mesh_axes.append(None if not flat else flat[0] if len(flat) == 1 else flat)
    used = [n for m in mesh_axes if m is not None for n in ((m,) if isinstance(m, str) else m)]
    if len(used) != len(set(used)):
        raise ValueError(f"the rules map two axes of {tuple(axes)} onto one mesh axis: {mesh_axes}")
    return PartitionSpec(*mesh_axes)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def annotation(var: nnx.Variable) -> tuple[Any, ...] | None:
    """A Variable's sharding annotation (`out_sharding` metadata) as a tuple, or None."""
    meta = var.get_metadata()
    if "out_sharding" not in meta or meta["out_sharding"] is None:
        return None
    a = meta["out_sharding"]
    if isinstance(a, NamedSharding):
        a = a.spec
    return tuple(a)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """`spec` for an array of `shape` on `mesh`, each dimension keeping the longest leading
    part of its mesh axes whose sizes' product divides it (the rest replicate): the policy
    for a parameter axis that its mesh axes do not divide (e.g. 2 KV heads, "model" = 4)."""
    out: list[MeshAxes] = []
    for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n, keep = 1, 0
        for name in names:
            if size % (n * mesh.shape[name]):
                break
            n, keep = n * mesh.shape[name], keep + 1
        kept = names[:keep]
        out.append(None if not kept else kept[0] if isinstance(entry, str) else kept)
    while out and out[-1] is None and len(out) > len(spec):
        out.pop()
    return PartitionSpec(*out)


def _variable_spec(path: Sequence[Any], leaf: Any, rules: ShardingRules, mesh: Mesh | None) -> PartitionSpec:
    """The spec of one leaf of a state (on `mesh`: fitted to its shape, `fit_spec`); raises
    KeyError for a leaf that must be annotated."""
    value = leaf.get_value() if _is_variable(leaf) else leaf
    shape = getattr(value, "shape", None)
    if shape is None or jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return PartitionSpec()
    p = path_str(path)
    if not _is_variable(leaf):
        raise KeyError(f"{p!r} is a bare array: pass the Variables (nnx.state(model), "
                       "not nnx.to_pure_dict), whose metadata holds the sharding annotation")
    axes = annotation(leaf)
    if axes is None:
        if isinstance(leaf, nnx.Param):
            raise KeyError(f"{p!r}: a Param of shape {tuple(shape)} without a sharding annotation "
                           "(create it with nnx.with_partitioning / out_sharding=...)")
        if isinstance(leaf, nnx.OptState) and value.size > 1:
            raise KeyError(f"{p!r}: optimizer state of shape {tuple(shape)} without a sharding annotation "
                           "(its parameter has none, or the optimizer does not keep its parameters' tree)")
        return PartitionSpec()
    if len(axes) > len(shape):
        raise KeyError(f"{p!r}: annotation {axes} has more axes than its shape {tuple(shape)}")
    try:
        spec = logical_to_spec(axes, rules, mesh)
    except ValueError as e:
        raise KeyError(f"{p!r}: {e}") from None
    return spec if mesh is None else fit_spec(spec, shape, mesh)


def variable_sharding(path: Sequence[Any], var: Any, rules: Any, mesh: Mesh) -> NamedSharding:
    """The NamedSharding one Variable is placed with on `mesh` by `rules` (what `shard_model`
    gives it); raises KeyError for a Param without annotation."""
    return NamedSharding(mesh, _variable_spec(path, var, as_rules(rules), mesh))


def partition_specs(state: Any, rules: Any, *, mesh: Mesh | None = None) -> Any:
    """`state` (an nnx.State of Variables: `nnx.state(model)`, `nnx.state(optimizer)`) with a
    PartitionSpec in place of every array; Variables are kept as containers
    (`Variable.replace(spec)`, as `nnx.get_partition_spec` does), so the result matches
    `state` for jit's in_shardings. Each spec comes from the Variable's annotation through
    `rules` (see the module docstring), fitted to its shape on `mesh` when given
    (`fit_spec`); every leaf that is refused is reported at once."""
    rules = as_rules(rules)
    errors: list[str] = []

    def spec(path, leaf):
        try:
            out = _variable_spec(path, leaf, rules, mesh)
        except KeyError as e:
            errors.append(str(e.args[0]))
            out = PartitionSpec()
        return leaf.replace(out) if _is_variable(leaf) else out

    specs = jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_variable)
    if errors:
        raise KeyError("sharding: these leaves cannot be placed:\n  " + "\n  ".join(errors))
    return specs


def _unwrap(x: Any) -> Any:
    return x.get_value() if _is_variable(x) else x


def _is_spec(x: Any) -> bool:
    return isinstance(x, (PartitionSpec, NamedSharding))


def named_shardings(state: Any, mesh: Mesh, rules: Any) -> Any:
    """Like `partition_specs` on `mesh`, with a NamedSharding in place of every spec (every
    split dimension divides by its mesh axes: `fit_spec`)."""
    specs = partition_specs(state, rules, mesh=mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_state(state: Any, mesh: Mesh, rules: Any) -> Any:
    """`state` with every array placed on `mesh` by `rules` (jax.device_put)."""
    shardings = named_shardings(state, mesh, rules)

    def put(leaf, s):
        if _is_variable(leaf):
            return leaf.replace(jax.device_put(leaf.get_value(), s.get_value()))
        return jax.device_put(leaf, s)

    return jax.tree.map(put, state, shardings, is_leaf=_is_variable)


def shard_model(model: Any, mesh: Mesh, rules: Any) -> Any:
    """Place every Variable of `model` (an nnx.Module, an nnx.Optimizer: any graph node) on
    `mesh` by `rules`, in place; returns `model`."""
    nnx.update(model, shard_state(nnx.state(model), mesh, rules))
    return model


def _placement(spec: Any, ndim: int, mesh: Mesh) -> tuple[tuple[str, ...], ...]:
    """A spec as one tuple of mesh axes per dimension, mesh axes of size 1 left out
    (they place nothing), padded to `ndim`."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out = []
    for e in entries:
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        out.append(tuple(n for n in names if mesh.shape[n] > 1))
    return tuple(out)


def misplaced(state: Any, mesh: Mesh, rules: Any) -> list[str]:
    """Every array of `state` whose actual sharding (`.sharding.spec`) is not the one its
    annotation and `rules` give on `mesh`, as 'path: declared ..., actual ...' (empty: all
    placed as declared)."""
    specs = partition_specs(state, rules, mesh=mesh)
    out: list[str] = []

    def check(path, leaf, spec):
        value, spec = _unwrap(leaf), _unwrap(spec)
        if not isinstance(value, jax.Array):
            return
        s = value.sharding
        ndim = value.ndim
        actual: PartitionSpec | jax.sharding.Sharding
        if isinstance(s, NamedSharding) and s.mesh.axis_names == mesh.axis_names and \
                s.mesh.devices.shape == mesh.devices.shape and (s.mesh.devices == mesh.devices).all():
            ok = _placement(s.spec, ndim, mesh) == _placement(spec, ndim, mesh)
            actual = s.spec
        else:
            ok = s.is_equivalent_to(NamedSharding(mesh, spec), ndim)
            actual = s
        if not ok:
            out.append(f"{path_str(path)}: declared {spec}, actual {actual}")

    jax.tree_util.tree_map_with_path(check, state, specs, is_leaf=_is_variable)
    return out


def input_sharding(mesh: Mesh, rules: Any, axes: Sequence[str | None] = ACTIVATION_AXES) -> NamedSharding:
    """Sharding of an input whose logical axes are `axes` (default (batch, seq,
    activation_embed): hidden states (B, T, E) into a stack); token ids (B, T) take ("batch",
    "seq"): `token_sharding`."""
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh))


def explicit_mesh(tree: Any) -> Any:
    """The mesh with Explicit axes (sharding in types: `jax.make_mesh`'s default) that the
    context (`jax.set_mesh`) or an array of `tree` is typed on; None: none (no mesh, an Auto
    mesh, or inside `on_auto_axes`, whose context mesh is Auto)."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return context if context.explicit_axes else None
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
            if mesh is not None and not mesh.empty and mesh.explicit_axes:
                return mesh
    return None


def on_auto_axes(module: Any, method: Any, arrays: Any, out_specs: Any, mesh: Any) -> Any:
    """`method(module, *arrays)` computed with `mesh`'s Explicit axes made Auto
    (`jax.sharding.auto_axes`: XLA places what the library's products leave open, as on a
    mesh of Auto axes); its output resharded to `out_specs` (PartitionSpecs, a prefix of the
    output's tree) on `mesh`. The module's Params go in as arguments (a closed-over array typed
    on the Explicit mesh would meet the Auto context); its other state (RNG counts) comes back
    replicated and is written into `module`."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]

    def body(params, rest, arrays):
        m = nnx.merge(graphdef, params, rest)
        return method(m, *arrays), nnx.state(m, nnx.Not(nnx.Param))

    named = jax.tree.map(lambda s: NamedSharding(mesh, s), (out_specs, PartitionSpec()),
                         is_leaf=lambda x: isinstance(x, PartitionSpec))
    out, rest = jax.sharding.auto_axes(body, axes=mesh.explicit_axes, out_sharding=named)(params, rest, arrays)
    nnx.update(module, rest)
    return out


def explicit_call(module: Any, call: Any, arrays: tuple[Any, ...], *, cache: Any = None,
                  extra: bool = False) -> Any:
    """`call(module, *arrays)` through `on_auto_axes` when `module`'s Params, `arrays` or the
    context sit on a mesh of Explicit axes; None otherwise (the caller computes as usual). The
    output's (batch, seq) dims keep those of `arrays[0]` (token ids (B, T) or hidden states
    (B, T, E)); a cache comes back placed as it came, intermediates (`extra`) replicated."""
    mesh = explicit_mesh((nnx.state(module, nnx.Param), arrays))
    if mesh is None:
        return None
    spec = batch_spec(arrays[0])
    if cache is not None:
        specs: Any = (spec, jax.tree.map(lambda a: jax.typeof(a).sharding.spec, cache))
    else:
        specs = (spec, PartitionSpec()) if extra else spec
    return on_auto_axes(module, call, arrays, specs, mesh)


def batch_spec(ids: Any) -> PartitionSpec:
    """The spec of the (batch, seq) dims of token ids `ids` on their mesh (P(): not sharded)."""
    if not isinstance(ids, jax.Array):
        return PartitionSpec()
    spec = tuple(getattr(jax.typeof(ids).sharding, "spec", ()) or ())
    return PartitionSpec(*spec[:2])


def token_sharding(mesh: Mesh, rules: Any = DATA_PARALLEL) -> NamedSharding:
    """The sharding of token ids, masks and positions (B, T) on `mesh`: their axes are the
    logical ("batch", "seq"), placed by `rules` (default DATA_PARALLEL: the batch over "data",
    the sequence whole; HYBRID and FSDP do the same). For a model's call, `fb.generate` and a
    train step: `jax.device_put(ids, token_sharding(mesh))`."""
    return input_sharding(mesh, rules, ("batch", "seq"))


def model_mesh(model: Any) -> Mesh | None:
    """The mesh `model`'s parameters are placed on (`from_hf(mesh=)`, `shard_model`); None: none."""
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding) \
                and isinstance(leaf.sharding.mesh, Mesh):
            return leaf.sharding.mesh
    return None


def sharded_optimizer(model: Any, tx: Any, *, wrt: Any = nnx.Param, rules: Any = None) -> Any:
    """An `nnx.Optimizer(model, tx, wrt=wrt)` whose whole state is placed on `model`'s mesh:
    made inside `jax.set_mesh(mesh)`, so its step counters (and optax's) are replicated over
    the mesh as the jitted step gives them back (made outside, they sit on one device and the
    second step compiles again), the moments beside their parameters; with `rules`, then
    placed by them (`shard_model`). A model on no mesh: a plain nnx.Optimizer."""
    mesh = model_mesh(model)
    if mesh is None:
        return nnx.Optimizer(model, tx, wrt=wrt)
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, tx, wrt=wrt)
    return optimizer if rules is None else shard_model(optimizer, mesh, rules)


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[Any] | None = None, *,
              expert: int | None = None) -> Mesh:
    """A ("data", "model") mesh of data * model devices, with Auto axes (XLA propagates
    shardings through jit; jax.make_mesh's default is Explicit axes); with `expert`, a third
    axis "expert" of that size (EXPERT_PARALLEL's), data * model * expert devices."""
    devices = list(jax.devices() if devices is None else devices)
    shape: tuple[int, ...] = (data, model)
    names: tuple[str, ...] = ("data", "model")
    if expert is not None:
        shape, names = (*shape, expert), (*names, "expert")
    n = math.prod(shape)
    if n > len(devices):
        raise ValueError(f"mesh {' x '.join(map(str, shape))} ({', '.join(names)}) needs {n} devices, "
                         f"{len(devices)} available")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices[:n])


def describe(state: Any, rules: Any, mesh: Mesh | None = None) -> list[tuple[str, tuple[int, ...], PartitionSpec]]:
    """(path, shape, spec) for every Param of `state`: a readable table of the rules (on
    `mesh`: the specs fitted to each shape, as placed)."""
    rows: list[tuple[str, tuple[int, ...], PartitionSpec]] = []

    def add(path, leaf, spec):
        if isinstance(leaf, nnx.Param):
            rows.append((path_str(path), tuple(leaf.get_value().shape), _unwrap(spec)))

    jax.tree_util.tree_map_with_path(add, state, partition_specs(state, rules, mesh=mesh), is_leaf=_is_variable)
    return rows
