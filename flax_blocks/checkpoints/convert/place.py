"""Planned values (`flax_blocks.checkpoints.stream.Lazy`) -> placed JAX arrays, without the whole model
ever in one place.

    place_all(variables, values, mesh=None, rules=None)

Each value becomes a `jax.Array` with the variable's sharding: with a mesh, the
`NamedSharding` its declared logical axes give through `rules` (default: attention heads
and the FFN width over "model", the rest replicated; an axis a mesh axis does not divide is
replicated over it: `flax_blocks.sharding`); without one, the default device. For each
distinct slice its devices hold, the slice alone is read from the checkpoint (a process of
a multi-host run reads only its own devices' slices), once, and copied to those devices. A
slice larger than CHUNK_BYTES is built on the device a chunk at a time (one layer's rows,
along the file's rows; an in-place update of a donated buffer), so the host never holds
more than a chunk of it. All values are made before any is written: a read that fails
leaves the module as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import stream
from ..io import ConversionError

CHUNK_BYTES = 4 * 2**20  # a slice above this is built on its device a chunk of about this size at a time


def sharding_for(var: Any, mesh: Any, rules: Any, name: str = "") -> Any:
    """The sharding a variable's value is placed with: on `mesh`, its annotation through
    `rules` (`flax_blocks.sharding.variable_sharding`, as `shard_model` gives it); else the
    sharding of a value it already has (a module loaded in place keeps its placement); else
    None (the default device, uncommitted)."""
    import jax

    from ...sharding import TENSOR_PARALLEL, variable_sharding

    if mesh is not None:
        try:
            return variable_sharding((name,), var, TENSOR_PARALLEL if rules is None else rules, mesh)
        except KeyError as e:
            raise ConversionError([str(e.args[0])], header="cannot place these weights") from None
    value = var.get_value()
    if isinstance(value, jax.Array) and getattr(value, "committed", False):
        return value.sharding
    return None


def _problems(variables: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    problems = []
    for path, a in values.items():
        want = tuple(variables[path].get_value().shape)
        if tuple(a.shape) != want:
            problems.append(f"{path}: planned shape {tuple(a.shape)}, the parameter's is {want}")
    return problems


def place_all(variables: Mapping[str, Any], values: Mapping[str, Any], *, mesh: Any = None, rules: Any = None,
              what: str = "loading weights") -> None:
    """Write `values` ({path: Lazy or array}) into `variables` ({path: nnx.Variable}), each
    placed with `sharding_for` its variable; all are made before any is written."""
    values = {p: stream.lazy(a) for p, a in values.items()}
    problems = _problems(variables, values)
    if problems:
        raise ConversionError(problems, header="cannot place these weights")
    shardings = {p: sharding_for(variables[p], mesh, rules, p) for p in values}
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
    """`a[index]` on each of `devices` (None: the default device), read once. A slice above
    CHUNK_BYTES is built on the devices a chunk at a time (`_chunks`)."""
    import jax

    shape = tuple(stream._size(i, n) for i, n in zip(index, a.shape, strict=True))
    if int(np.prod(shape)) * a.dtype.itemsize <= CHUNK_BYTES:
        x = a._read(index)
        return [jax.device_put(x, d) for d in devices]
    import jax.numpy as jnp

    bufs = [jnp.zeros(shape, a.dtype, device=d) for d in devices]
    for box in _chunks(a, shape):
        sub = tuple(i if axis not in box else (np.arange(n) if i is None else i)[box[axis][0]:box[axis][1]]
                    for axis, (i, n) in enumerate(zip(index, a.shape, strict=True)))
        x = a._read(sub).astype(a.dtype, copy=False)
        starts = tuple(box[axis][0] if axis in box else 0 for axis in range(len(shape)))
        bufs = [_update()(b, x, starts) for b in bufs]
        jax.block_until_ready(bufs)  # one chunk in flight: the host holds one at a time
    return bufs


def _chunks(a: stream.Lazy, shape: tuple[int, ...]) -> list[dict[int, tuple[int, int]]]:
    """Boxes covering a slice of `shape`: {axis: (start, stop)} each, along the axis the
    file's rows run (so each box reads a contiguous span), one layer of a stacked parameter
    at a time, about CHUNK_BYTES each."""
    item, outer = (a.items[0], [0]) if isinstance(a, stream.Stacked) else (a, [])
    inner_shape = shape[len(outer):]
    major = item.major_axis()
    boxes: list[dict[int, tuple[int, int]]] = [{}]
    if major is not None:
        per_row = int(np.prod(inner_shape)) // max(inner_shape[major], 1) * a.dtype.itemsize
        step = max(1, CHUNK_BYTES // max(per_row, 1))
        n = inner_shape[major]
        boxes = [{len(outer) + major: (s, min(n, s + step))} for s in range(0, n, step)]
    if outer:
        boxes = [{0: (j, j + 1), **box} for j in range(shape[0]) for box in boxes]
    return boxes


@functools.cache
def _update() -> Any:
    import jax

    def update(buf: Any, x: Any, starts: Any) -> Any:
        return jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), starts)

    return jax.jit(update, donate_argnums=0)
