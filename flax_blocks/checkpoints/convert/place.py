"""Planned values (`flax_blocks.checkpoints.stream.Lazy`) -> placed JAX arrays, without the whole model
ever in one place.

    place_all(variables, values, mesh=None, rules=None)

Each value becomes a `jax.Array` with the variable's sharding: with a mesh, the
`NamedSharding` its declared logical axes give through `rules` (default: attention heads
and the FFN width over "model", the rest replicated; an axis a mesh axis does not divide is
replicated over it: `flax_blocks.sharding`); without one, the default device.

For each distinct slice its devices hold, the slice alone is read from the checkpoint (a
process of a multi-host run reads only its own devices' slices), once, straight into a
64-byte-aligned host buffer of its final shape and dtype (`stream.Lazy.read_into`: the
transposes, q/k/v packing and casts happen in that one copy), by READERS threads at once
(a task per layer of a stacked parameter, or about TASK_BYTES of rows), then handed to
`jax.device_put`. On a CPU, XLA adopts such a buffer as the array's own memory (no copy;
the array keeps the buffer alive); other devices holding the same slice get a copy from the
first. On an accelerator the buffer is copied to the device while the next slice is read;
at most INFLIGHT_BYTES of host buffers wait for their copies. All values are made before
any is written: a read that fails leaves the module as it was.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import stream
from ..io import ConversionError

READERS = min(4, os.cpu_count() or 1)  # threads reading at once (numpy's copies and preadv release the GIL)
TASK_BYTES = 8 * 2**20  # a slice above this is read as several tasks (layers, then spans of the file's rows)
INFLIGHT_BYTES = 512 * 2**20  # on an accelerator: host buffers waiting for their copy to the device
ALIGN = 64  # XLA's CPU client adopts host memory aligned to this instead of copying it


def sharding_for(var: Any, mesh: Any, rules: Any, name: str = "") -> Any:
    """The sharding a variable's value is placed with: on `mesh`, its annotation through
    `rules` (`flax_blocks.sharding.variable_sharding`, as `shard_model` gives it); else the
    sharding of a value it already has (a module loaded in place keeps its placement); else
    None (the default device, uncommitted)."""
    import jax

    from ...sharding import loading_rules, variable_sharding

    if mesh is not None:
        try:
            return variable_sharding((name,), var, loading_rules(mesh) if rules is None else rules, mesh)
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
    pool = ThreadPoolExecutor(READERS, thread_name_prefix="place") if READERS > 1 else None
    try:
        inflight = _Inflight()
        for p, a in values.items():
            made[p] = place(a, shardings[p], pool=pool, inflight=inflight)
            progress.update(a.nbytes)
        inflight.wait(0)
    finally:
        progress.close()
        if pool is not None:
            pool.shutdown()
    for p, v in made.items():
        variables[p].set_value(v)


def place(a: stream.Lazy, sharding: Any = None, *, pool: ThreadPoolExecutor | None = None,
          inflight: _Inflight | None = None) -> Any:
    """One Lazy tensor as a jax.Array with `sharding` (None: the default device): each
    distinct slice its addressable devices hold read once into its own host buffer (by
    `pool`'s threads when given), put on the first of them, copied from there to the rest."""
    import jax

    inflight = _Inflight() if inflight is None else inflight
    if sharding is None:
        return inflight.put(read(a, None, pool), None)
    groups: dict[tuple, tuple[Any, list]] = {}
    for device, index in sharding.addressable_devices_indices_map(a.shape).items():
        key = tuple((s.start, s.stop) for s in index)
        groups.setdefault(key, (index, []))[1].append(device)
    shards = []
    for index, devices in groups.values():
        first = inflight.put(read(a, index, pool), devices[0])
        shards += [first] + [jax.device_put(first, d) for d in devices[1:]]
    return jax.make_array_from_single_device_arrays(a.shape, sharding, shards)


def read(a: stream.Lazy, index: Any = None, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """`a[index]` (index: None or a tuple of slices, as a sharding's indices) read into a new
    host buffer aligned for XLA, by `pool`'s threads in tasks of about TASK_BYTES."""
    index = stream._norm_index(index, a.shape)
    out = host_buffer(tuple(stream._size(i, n) for i, n in zip(index, a.shape, strict=True)), a.dtype)
    if not out.size:
        return out
    _run(pool, [functools.partial(populate, piece) for piece in _pieces(out)])  # the pages first
    _run(pool, [functools.partial(lazy._read_into, view, sub) for lazy, sub, view in _tasks(a, index, out)])
    return out


def _run(pool: ThreadPoolExecutor | None, calls: list[Callable[[], None]]) -> None:
    """Each call, on `pool`'s threads when there is a pool and more than one call; the first
    error raised."""
    if pool is None or len(calls) < 2:
        for call in calls:
            call()
        return
    for f in [pool.submit(call) for call in calls]:
        f.result()


def host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-order array of its own anonymous memory map (page-aligned, so XLA
    adopts it), in the kernel's small pages: numpy's own large arrays ask for transparent
    huge pages, whose first touch is 3-4x slower on this VM (the load bench's two limit rows).
    Unmapped when the last array on it goes."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < mmap.PAGESIZE or not hasattr(mmap, "MAP_ANONYMOUS"):  # numpy's allocator, aligned by hand
        raw = np.empty(nbytes + ALIGN, np.uint8)
        start = -raw.ctypes.data % ALIGN
        return raw[start:start + nbytes].view(dtype).reshape(shape)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(memory, dtype, count=int(np.prod(shape))).reshape(shape)


def _pieces(out: np.ndarray) -> list[np.ndarray]:
    """`out`'s bytes in contiguous pieces of about TASK_BYTES."""
    flat = out.reshape(-1).view(np.uint8)
    return [flat[s:s + TASK_BYTES] for s in range(0, flat.size, TASK_BYTES)]


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, in one call


@functools.cache
def _madvise() -> Any:
    """libc's madvise through ctypes (which lets go of the GIL while it runs), or None."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def populate(piece: np.ndarray) -> None:
    """Fault in the pages under `piece` (C-contiguous) before they are written: one call does
    what a page fault per 4 KiB page would, for less, and the reader threads do it side by
    side. Where the kernel lacks it (before Linux 5.14), the copies fault them in."""
    fn = _madvise()
    if fn is not None and piece.nbytes >= mmap.PAGESIZE:  # (smaller buffers are numpy's own)
        start = piece.ctypes.data
        first = start - start % mmap.PAGESIZE
        fn(first, start + piece.nbytes - first, _MADV_POPULATE_WRITE)  # failed (an older kernel): no harm


def _tasks(a: stream.Lazy, index: stream.Index, out: np.ndarray) -> list[tuple[stream.Lazy, stream.Index, Any]]:
    """(lazy, index, out view) pieces of one read for the reader threads, about TASK_BYTES
    each: a stacked parameter by layer, then along the axis the file's rows run (so each
    piece reads its own span of the file)."""
    if out.nbytes <= TASK_BYTES:
        return [(a, index, out)]
    if isinstance(a, stream.Stacked):
        which = range(a.shape[0]) if index[0] is None else index[0]
        if all(a.items[int(i)].dtype == a.dtype for i in which) or out.dtype == a.dtype:
            return [t for j, i in enumerate(which) for t in _tasks(a.items[int(i)], index[1:], out[j, ...])]
    m = a.major_axis()
    if m is None or out.shape[m] < 2:
        return [(a, index, out)]
    positions = stream._positions(index[m], a.shape[m])
    step = max(1, TASK_BYTES * out.shape[m] // out.nbytes)
    return [(a, index[:m] + (positions[s:s + step],) + index[m + 1:], out[stream._along(m, s, s + step)])
            for s in range(0, out.shape[m], step)]


class _Inflight:
    """Host buffers handed to `jax.device_put` whose copy to an accelerator may still run;
    beyond INFLIGHT_BYTES the oldest is waited for. (A CPU adopts the buffer: nothing waits.)"""

    def __init__(self) -> None:
        self.queue: deque[tuple[Any, int]] = deque()
        self.bytes = 0

    def put(self, host: np.ndarray, device: Any) -> Any:
        import jax

        x = jax.device_put(host, device)
        if next(iter(x.devices())).platform != "cpu":
            self.queue.append((x, host.nbytes))
            self.bytes += host.nbytes
            self.wait(INFLIGHT_BYTES)
        return x

    def wait(self, limit: int) -> None:
        while self.queue and self.bytes > limit:
            x, nbytes = self.queue.popleft()
            x.block_until_ready()
            self.bytes -= nbytes
