"""Planned values (`flax_blocks.stream.Lazy`) -> placed JAX arrays, without the whole model
ever in one place.

    place_all(variables, values, mesh=None, rules=None)

Each value becomes a `jax.Array` with the variable's sharding: with a mesh, the
`NamedSharding` its declared logical axes give through `rules` (default: attention heads
and the FFN width over "model", the rest replicated; `flax_blocks.sharding`); without one,
the default device. For each distinct slice its devices hold, the slice alone is read from
the checkpoint (a process of a multi-host run reads only its own devices' slices), once,
and copied to those devices. A slice of a stacked parameter larger than FILL_BYTES is
built on the device a layer at a time (an in-place update of a donated buffer), so the host
never holds more than one layer of it. All values are made before any is written: a read
that fails leaves the module as it was.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import numpy as np

from .. import stream
from ..checkpoint_io import ConversionError

FILL_BYTES = 32 * 2**20  # a stacked slice above this is built a layer at a time on its device


def sharding_for(var: Any, mesh: Any, rules: Any) -> Any:
    """The sharding a variable's value is placed with: on `mesh`, its annotation through
    `rules`; else the sharding of a value it already has (a module loaded in place keeps
    its placement); else None (the default device, uncommitted)."""
    import jax
    from jax.sharding import NamedSharding

    from ..sharding import TENSOR_PARALLEL, annotation, logical_to_spec

    if mesh is not None:
        axes = annotation(var) or ()
        return NamedSharding(mesh, logical_to_spec(axes, TENSOR_PARALLEL if rules is None else rules, mesh))
    value = var.get_value()
    if isinstance(value, jax.Array) and getattr(value, "committed", False):
        return value.sharding
    return None


def _problems(variables: Mapping[str, Any], values: Mapping[str, Any], shardings: Mapping[str, Any]) -> list[str]:
    problems = []
    for path, a in values.items():
        want = tuple(variables[path].get_value().shape)
        if tuple(a.shape) != want:
            problems.append(f"{path}: planned shape {tuple(a.shape)}, the parameter's is {want}")
            continue
        s = shardings[path]
        if s is not None:
            for dim, (size, axis) in enumerate(zip(want, s.spec, strict=False)):
                n = 1 if axis is None else int(np.prod([s.mesh.shape[m] for m in ((axis,) if isinstance(axis, str)
                                                                                     else axis)]))
                if size % n:
                    problems.append(f"{path}: dim {dim} of size {size} is not divisible by {axis}={n} of the mesh")
    return problems


def place_all(variables: Mapping[str, Any], values: Mapping[str, Any], *, mesh: Any = None, rules: Any = None,
              what: str = "loading weights") -> None:
    """Write `values` ({path: Lazy or array}) into `variables` ({path: nnx.Variable}), each
    placed with `sharding_for` its variable; all are made before any is written."""
    values = {p: stream.lazy(a) for p, a in values.items()}
    shardings = {p: sharding_for(variables[p], mesh, rules) for p in values}
    problems = _problems(variables, values, shardings)
    if problems:
        raise ConversionError(problems, header="cannot place these weights")
    progress = stream.Progress(sum(a.nbytes for a in values.values()), what)
    made = {}
    try:
        for p, a in values.items():
            made[p] = place(a, shardings[p])
            progress.update(a.nbytes)
    finally:
        progress.close()
    for p, v in made.items():
        variables[p].set_value(v)


def place(a: stream.Lazy, sharding: Any = None) -> Any:
    """One Lazy tensor as a jax.Array with `sharding` (None: the default device)."""
    import jax

    if sharding is None:
        return _make(a, (None,) * a.ndim, [None])[0]
    groups: dict[tuple, tuple[Any, list]] = {}
    for device, index in sharding.addressable_devices_indices_map(a.shape).items():
        key = tuple((s.start, s.stop) for s in index)
        groups.setdefault(key, (index, []))[1].append(device)
    shards = []
    for index, devices in groups.values():
        shards += _make(a, stream._norm_index(index, a.shape), devices)
    return jax.make_array_from_single_device_arrays(a.shape, sharding, shards)


def _make(a: stream.Lazy, index: stream.Index, devices: list) -> list:
    """`a[index]` on each of `devices` (None: the default device), read once."""
    import jax

    shape = tuple(stream._size(i, n) for i, n in zip(index, a.shape, strict=True))
    nbytes = int(np.prod(shape)) * a.dtype.itemsize
    if isinstance(a, stream.Stacked) and nbytes > FILL_BYTES:
        return _fill(a, index, shape, devices)
    x = a._read(index)
    return [jax.device_put(x, d) for d in devices]


def _fill(a: stream.Stacked, index: stream.Index, shape: tuple[int, ...], devices: list) -> list:
    """A stacked slice built on each device a layer at a time: the host holds one layer."""
    import jax.numpy as jnp

    bufs = [jnp.zeros(shape, a.dtype, device=d) for d in devices]
    layers = range(a.shape[0]) if index[0] is None else index[0]
    for j, i in enumerate(layers):
        x = a.items[int(i)]._read(index[1:]).astype(a.dtype, copy=False)
        bufs = [_update()(b, x, j) for b in bufs]
    return bufs


@functools.cache
def _update() -> Any:
    import jax

    def update(buf: Any, x: Any, i: Any) -> Any:
        return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)

    return jax.jit(update, donate_argnums=0)
