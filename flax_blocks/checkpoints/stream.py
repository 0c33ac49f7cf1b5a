"""Tensors read when they are needed: a checkpoint's shapes and dtypes now, its values a
slice at a time, later.

A `Lazy` tensor has a shape and a dtype and reads any part of itself on demand:
`read(index)` returns the numpy array of the rows / columns `index` picks. The loaders
translate and lay out a checkpoint with these (a transpose, a reshape, rows picked or
concatenated, a cast: the few moves `flax_blocks.checkpoints.dialects` and the parameter transforms
make), so that validation reads only the files' headers and placement reads each
parameter (or each device's slice of it) from the files once, through a memory map:

    sd = read_safetensors("model.safetensors")   # headers only: {name: FileTensor}
    w = sd["layers.0.mlp.weight"].T              # Lazy, shape known, nothing read
    w.read((None, np.arange(0, 128)))            # reads the 128 rows of the file it needs

Numpy functions on a Lazy (`np.concatenate`, `np.stack`, `np.transpose`, `np.reshape`,
`np.swapaxes`) stay lazy; any other one reads the tensor whole (`np.asarray(lazy)`).
`bytes_read()` counts the bytes read from files, for tests and progress bars.

Placement writes a value straight into its final buffer: `read_into(out, index)` hands each
move a view of `out` (a transpose writes through a transposed view, picked or concatenated
rows land in their rows, a cast happens in the copy), so the bytes of a file go from the page
cache into `out` in one copy: `os.preadv` where `out` takes whole rows as they are stored,
else a copy from a memory map of the rows it needs, in blocks that stay in cache where it
transposes. A move with no view (an elementwise function, a reshape the view's strides cannot
take) goes through a temporary of at most STAGE_BYTES at a time; `staged_bytes()` counts
those bytes.

An index is one entry per axis: None (the whole axis) or a 1-D array of positions.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Index = tuple[Any, ...]

_READ = {"bytes": 0, "staged": 0}
_LOCK = threading.Lock()  # the counters are added to from placement's reader threads

RUN_BYTES = 256  # a copy that transposes writes runs of this many bytes (64 bytes: 2.6x slower, measured)
STAGE_BYTES = 4 * 2**20  # a move with no view goes through temporaries of about this size


def bytes_read() -> int:
    """Bytes read from checkpoint files by this process so far (every Lazy source)."""
    return _READ["bytes"]


def staged_bytes() -> int:
    """Bytes `read_into` passed through a temporary array (moves it could not do in the copy)."""
    return _READ["staged"]


def _count(nbytes: int, key: str = "bytes") -> None:
    with _LOCK:
        _READ[key] += int(nbytes)


def _norm_index(index: Any, shape: tuple[int, ...]) -> Index:
    """`index` (None, or one entry per axis: None, a slice or positions) -> one entry per
    axis, None or a 1-D int array."""
    if index is None:
        return (None,) * len(shape)
    index = tuple(index) + (None,) * (len(shape) - len(tuple(index)))
    out = []
    for i, n in zip(index, shape, strict=True):
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            i = None if (start, stop, step) == (0, n, 1) else np.arange(start, stop, step)
        elif i is not None:
            i = np.asarray(i, dtype=np.int64).reshape(-1)
            i = np.where(i < 0, i + n, i)
        out.append(i)
    return tuple(out)


def _size(i: Any, n: int) -> int:
    return n if i is None else len(i)


def _take(a: np.ndarray, index: Index, start: int = 0) -> np.ndarray:
    """`a` with each restricted axis from `start` on taken at its positions."""
    for axis in range(start, len(index)):
        if index[axis] is not None:
            a = np.take(a, index[axis], axis=axis)
    return a


def _positions(i: Any, n: int) -> np.ndarray:
    return np.arange(n) if i is None else i


def _runs(i: Any, n: int) -> list[tuple[int, int, int]]:
    """Positions `i` (None: 0..n-1) as runs of consecutive ones: (first, stop, where the run
    starts in `i`)."""
    if i is None:
        return [(0, n, 0)]
    if not len(i):
        return []
    breaks = np.flatnonzero(np.diff(i) != 1) + 1
    starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(i)]])
    return [(int(i[a]), int(i[a]) + int(b - a), int(a)) for a, b in zip(starts, stops, strict=True)]


def _along(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    """The key of positions start..stop on `axis` (every position on the axes before it)."""
    return (slice(None),) * axis + (slice(start, stop),)


def _fastest(a: np.ndarray) -> int:
    """The axis along which `a`'s elements lie closest in memory (size-1 axes skipped)."""
    axes = [ax for ax in range(a.ndim) if a.shape[ax] > 1] or [a.ndim - 1]
    return min(axes, key=lambda ax: abs(a.strides[ax]))


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """np.copyto(dst, src), cast as astype casts. Where the two are laid out across each other
    (a transpose), in blocks of RUN_BYTES along dst's fastest axis: numpy's own loop walks one
    side across memory, a cache miss per element (8x slower on a (2816, 1024) float32 matrix,
    measured); a block writes runs of RUN_BYTES into dst and reads rows of src that stay in
    cache."""
    if dst.dtype == src.dtype and dst.itemsize in (2, 4, 8):  # a move of bytes: numpy's own integer loops
        dst, src = dst.view(f"u{dst.itemsize}"), src.view(f"u{src.itemsize}")  # (bfloat16's: 13% slower)
    step = max(1, RUN_BYTES // dst.itemsize)
    if dst.ndim < 2 or _fastest(dst) == _fastest(src) or dst.shape[_fastest(dst)] <= step:
        np.copyto(dst, src, casting="unsafe")
        return
    axis = _fastest(dst)
    for s in range(0, dst.shape[axis], step):
        key = _along(axis, s, s + step)
        np.copyto(dst[key], src[key], casting="unsafe")


def _through_temporary(a: Lazy, out: np.ndarray, index: Index, dtype: np.dtype | None = None) -> None:
    """`a`'s values at `index` (cast to `dtype` first, when given) written into `out` through
    temporaries of about STAGE_BYTES, along the axis the source's rows run."""
    m = a.major_axis()
    if m is None or not out.ndim or out.nbytes <= STAGE_BYTES:
        pieces = [(index, out)]
    else:
        pos, step = _positions(index[m], a.shape[m]), max(1, STAGE_BYTES * out.shape[m] // out.nbytes)
        pieces = [(index[:m] + (pos[s:s + step],) + index[m + 1:], out[_along(m, s, s + step)])
                  for s in range(0, out.shape[m], step)]
    for sub, view in pieces:
        x = a._read(sub)
        _count(x.nbytes, "staged")
        _copy(view, x if dtype is None else x.astype(dtype))


def _into(src: Lazy, out: np.ndarray, index: Index, dtype: np.dtype) -> None:
    """Write `src`'s values cast to `dtype` into `out` (of any dtype): in the one copy where
    one of the two casts is none, else through a temporary (a rounding to keep)."""
    if not out.size:
        return
    if src.dtype == dtype or out.dtype == dtype:
        src._read_into(out, index)
    else:
        _through_temporary(src, out, index, dtype)


def _copy_rows(src: np.ndarray, out: np.ndarray, index: Index) -> int:
    """`src` (in memory, or mapped from a file) at `index` written into `out`: each run of
    rows and of columns picked is a view, copied in one piece (positions picked on the axes
    past the second are taken through a temporary). Returns the bytes of `src` read."""
    if not src.ndim:
        np.copyto(out, src, casting="unsafe")
        return src.nbytes
    columns = _runs(index[1], src.shape[1]) if src.ndim > 1 else [(0, 0, 0)]
    deeper, read = any(i is not None for i in index[2:]), 0
    for first, stop, at in _runs(index[0], src.shape[0]):
        for c_first, c_stop, c_at in columns:
            key = (slice(first, stop),) + ((slice(c_first, c_stop),) if src.ndim > 1 else ())
            block = src[key]
            read += block.nbytes
            if deeper:
                block = _take(block, index, 2)
                _count(block.nbytes, "staged")
            _copy(out[(slice(at, at + stop - first),) + ((slice(c_at, c_at + c_stop - c_first),)
                                                          if src.ndim > 1 else ())], block)
    return read


def _pread(fd: int, buf: np.ndarray, offset: int, path: str) -> None:
    """Fill `buf` (C-contiguous) with the file's bytes from `offset`: the kernel copies from
    the page cache into it, nothing mapped."""
    view, done = memoryview(buf.reshape(-1).view(np.uint8).data), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            from .io_errors import CheckpointReadError

            raise CheckpointReadError(f"{path}: the file ended at byte {offset + done} while reading (it changed "
                                      "after its header was read)")
        done += n


def _flat_positions(picks: Sequence[Any], dims: Sequence[int]) -> np.ndarray:
    """The positions on one axis of size prod(dims) that a read picking `picks` (None: all)
    on each of the axes it splits into (of sizes `dims`) reads."""
    flat = np.zeros(1, np.int64)
    for p, n in zip(picks, dims, strict=True):
        flat = (flat[:, None] * n + (np.arange(n) if p is None else p)[None, :]).reshape(-1)
    return flat


def _view_as(out: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """`out` reshaped to `shape` as a view of the same memory, or None where its strides
    cannot take that shape."""
    try:
        return np.reshape(out, shape, copy=False)
    except ValueError:
        return None


class Lazy:
    """A tensor known by its shape and dtype, read (all or part) on demand; see the module
    docstring. Subclasses implement `_read(index)` for a full-length normalised index."""

    shape: tuple[int, ...]
    dtype: np.dtype

    # -- reading
    def read(self, index: Any = None) -> np.ndarray:
        """The values at `index` (None: all), as a new numpy array."""
        return self._read(_norm_index(index, self.shape))

    def _read(self, index: Index) -> np.ndarray:
        raise NotImplementedError

    def read_into(self, out: np.ndarray, index: Any = None) -> None:
        """Write the values at `index` (None: all) into `out`, a numpy array (or a view of one,
        any strides) of the read's shape and any dtype: the values cast as astype casts,
        the moves done in the copy where they can be (see the module docstring)."""
        index = _norm_index(index, self.shape)
        want = tuple(_size(i, n) for i, n in zip(index, self.shape, strict=True))
        if tuple(out.shape) != want:
            raise ValueError(f"read_into: out has shape {tuple(out.shape)}, the read gives {want}")
        if out.size:
            self._read_into(out, index)

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        """`read_into` for a full-length normalised index and a non-empty `out`; by default
        through a temporary (a subclass whose move has a view overrides it)."""
        _through_temporary(self, out, index)

    def major_axis(self) -> int | None:
        """The axis along which the source's rows run (a slice of it reads whole rows of the
        file, a contiguous span), or None where no one axis does."""
        return 0 if self.shape else None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.read()
        return a if dtype is None else a.astype(dtype)

    # -- what numpy code asks of an array
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"

    @property
    def T(self) -> Lazy:  # noqa: N802 (numpy's name)
        return self.transpose()

    def transpose(self, *axes: Any) -> Lazy:
        if len(axes) == 1 and not isinstance(axes[0], int):
            axes = tuple(axes[0]) if axes[0] is not None else ()
        axes = tuple(axes) or tuple(reversed(range(self.ndim)))
        return self if axes == tuple(range(self.ndim)) else Transposed(self, axes)

    def swapaxes(self, a: int, b: int) -> Lazy:
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self.transpose(axes)

    def reshape(self, *shape: Any) -> Lazy:
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return Reshaped(self, _resolve_shape(shape, self.size))

    def astype(self, dtype: Any, copy: bool = True) -> Lazy:
        dtype = np.dtype(dtype)
        return self if dtype == self.dtype else Cast(self, dtype)

    def __getitem__(self, key: Any) -> Lazy:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis or k is None for k in key) or len(key) > self.ndim:
            return Array(np.asarray(self)[key])
        drop = [axis for axis, k in enumerate(key) if isinstance(k, (int, np.integer))]
        index = tuple([k] if axis in drop else k for axis, k in enumerate(key))
        out: Lazy = Picked(self, _norm_index(index, self.shape))
        if drop:
            out = out.reshape([n for axis, n in enumerate(out.shape) if axis not in drop])
        return out

    def __mul__(self, other: Any) -> Lazy:
        if np.ndim(other) != 0:
            return Array(np.asarray(self) * other)
        if other == 0:
            return Zeros(self.shape, self.dtype)
        return Mapped(self, lambda a: a * other)

    __rmul__ = __mul__

    def __array_function__(self, func: Callable, types: Any, args: Any, kwargs: Any) -> Any:
        handler = _HANDLED.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        return func(*_materialise(args), **_materialise(kwargs))


def _materialise(x: Any) -> Any:
    if isinstance(x, Lazy):
        return x.read()
    if isinstance(x, (list, tuple)):
        return type(x)(_materialise(v) for v in x)
    if isinstance(x, dict):
        return {k: _materialise(v) for k, v in x.items()}
    return x


def _resolve_shape(shape: Sequence[int], size: int) -> tuple[int, ...]:
    shape = [int(n) for n in shape]
    if shape.count(-1) == 1:
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = size // known if known else 0
    if math.prod(shape) != size:
        raise ValueError(f"cannot reshape a tensor of {size} elements into {tuple(shape)}")
    return tuple(shape)


def to_numpy(value: Any) -> np.ndarray:
    """Array or torch tensor -> numpy (a view where it can be), keeping bfloat16 (as
    ml_dtypes.bfloat16)."""
    if type(value).__module__.startswith("torch"):
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch

            return t.view(dtype=torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(value)


def lazy(a: Any) -> Lazy:
    """`a` as a Lazy tensor (a numpy array or anything np.asarray reads is wrapped)."""
    return a if isinstance(a, Lazy) else Array(np.asarray(a))


# ----------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------


class Array(Lazy):
    """An array already in memory."""

    def __init__(self, a: np.ndarray):
        self.a, self.shape, self.dtype = a, tuple(a.shape), a.dtype

    def _read(self, index: Index) -> np.ndarray:
        return np.array(_take(self.a, index))

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        _copy_rows(self.a, out, index)


class FileTensor(Lazy):
    """A tensor stored contiguously (C order) at `offset` bytes into a file. `read` maps the
    file, copies the rows asked for, and unmaps it; `read_into` reads rows with `os.preadv`
    straight into `out` where `out` holds them as stored (contiguous, this dtype), else copies
    them from a map of just those rows, dropped when done."""

    def __init__(self, path: str, offset: int, shape: tuple[int, ...], dtype: np.dtype, name: str = ""):
        self.path, self.offset, self.shape, self.dtype, self.name = path, offset, tuple(shape), dtype, name

    def _read(self, index: Index) -> np.ndarray:
        out_shape = tuple(_size(i, n) for i, n in zip(index, self.shape, strict=True))
        if self.size == 0 or math.prod(out_shape) == 0:
            return np.empty(out_shape, self.dtype)
        mm = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape or (1,))
        if not self.shape:
            _count(self.nbytes)
            a = np.array(mm.reshape(()))
        else:
            rows = mm[_rows(index[0], self.shape[0])]
            if len(self.shape) > 1 and index[1] is not None:  # the span of columns each row needs
                lo, hi = int(index[1].min()), int(index[1].max()) + 1
                rows, index = rows[:, lo:hi], index[:1] + (index[1] - lo,) + index[2:]
            _count(rows.size * self.dtype.itemsize)
            a = np.array(_take(rows, index, 1))
            del rows
        del mm  # unmapped: the pages read leave this process's memory
        return a

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        runs = _runs(index[0], self.shape[0]) if self.shape else [(0, 1, 0)]
        whole_rows = (self.shape and all(i is None for i in index[1:]) and out.dtype == self.dtype
                      and hasattr(os, "preadv"))  # (not on Windows: the map below)
        if whole_rows and all(out[at:at + stop - first].flags.c_contiguous for first, stop, at in runs):
            row = math.prod(self.shape[1:]) * self.dtype.itemsize
            fd = os.open(self.path, os.O_RDONLY)
            try:  # straight into place: the kernel copies from the page cache, nothing mapped
                for first, stop, at in runs:
                    _pread(fd, out[at:at + stop - first], self.offset + first * row, self.path)
                    _count((stop - first) * row)
            finally:
                os.close(fd)
            return
        # rearranged (a transpose, a cast, columns picked): from a map of the rows it needs,
        # dropped when done (the pages read leave this process's memory)
        first, stop = min(r[0] for r in runs), max(r[1] for r in runs)
        rows = self._map(first, stop)
        _count(_copy_rows(rows, out, index if not self.shape else (_positions(index[0], self.shape[0]) - first,
                                                                    *index[1:])))
        del rows

    def _map(self, first: int, stop: int) -> np.ndarray:
        """Rows first..stop of the tensor (a scalar: itself), mapped read-only from the file."""
        row_items = math.prod(self.shape[1:]) if self.shape else 1
        start = self.offset + first * row_items * self.dtype.itemsize
        skew = start % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as f:
            m = mmap.mmap(f.fileno(), skew + (stop - first) * row_items * self.dtype.itemsize,
                          access=mmap.ACCESS_READ, offset=start - skew)
        a = np.frombuffer(m, self.dtype, count=(stop - first) * row_items, offset=skew)
        return a.reshape((stop - first, *self.shape[1:]) if self.shape else ())


def _rows(i: Any, n: int) -> Any:
    """An axis-0 selector for a memmap: a slice where the positions are a run (a view, no
    copy), else the positions."""
    if i is None:
        return slice(0, n)
    if len(i) and np.all(np.diff(i) == 1):
        return slice(int(i[0]), int(i[-1]) + 1)
    return i


class TorchTensor(Lazy):
    """A torch tensor (e.g. from torch.load(mmap=True)), read a slice at a time."""

    def __init__(self, t: Any):
        self.t, self.shape = t, tuple(t.shape)
        self.dtype = to_numpy(t.new_empty(0)).dtype

    def _read(self, index: Index) -> np.ndarray:
        t = self.t
        if self.shape and index[0] is not None:
            r = _rows(index[0], self.shape[0])
            t = t[r] if isinstance(r, slice) else t[_torch_index(r)]
        _count(t.numel() * t.element_size())
        return np.array(_take(to_numpy(t), index, 1))

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        _count(_copy_rows(to_numpy(self.t), out, index))


def _torch_index(i: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(i)


# ----------------------------------------------------------------------------------------
# Moves
# ----------------------------------------------------------------------------------------


class Transposed(Lazy):
    def __init__(self, src: Lazy, axes: Sequence[int]):
        self.src, self.axes = src, tuple(axes)
        self.shape, self.dtype = tuple(src.shape[a] for a in self.axes), src.dtype

    def _read(self, index: Index) -> np.ndarray:
        inner: list[Any] = [None] * self.ndim
        for out_axis, src_axis in enumerate(self.axes):
            inner[src_axis] = index[out_axis]
        return self.src._read(tuple(inner)).transpose(self.axes)

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        inner: list[Any] = [None] * self.ndim
        for out_axis, src_axis in enumerate(self.axes):
            inner[src_axis] = index[out_axis]
        self.src._read_into(out.transpose(np.argsort(self.axes)), tuple(inner))

    def major_axis(self) -> int | None:
        m = self.src.major_axis()
        return None if m is None else self.axes.index(m)


class Picked(Lazy):
    """Positions picked on each axis (a slice, or numpy's fancy index on one axis)."""

    def __init__(self, src: Lazy, index: Index):
        self.src, self.index = src, index
        self.shape = tuple(_size(i, n) for i, n in zip(index, src.shape, strict=True))
        self.dtype = src.dtype

    def _inner(self, index: Index) -> Index:
        return tuple(mine if theirs is None else (theirs if mine is None else mine[theirs])
                     for mine, theirs in zip(self.index, index, strict=True))

    def _read(self, index: Index) -> np.ndarray:
        return self.src._read(self._inner(index))

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        self.src._read_into(out, self._inner(index))

    def major_axis(self) -> int | None:
        return self.src.major_axis()


class Reshaped(Lazy):
    """A reshape. A read restricted on the axes that split one axis of the source reads only
    those positions of it; one restricted on axes merged from several reads them whole."""

    def __init__(self, src: Lazy, shape: tuple[int, ...]):
        self.src, self.shape, self.dtype = src, shape, src.dtype
        self.groups = _groups(src.shape, shape)

    def _read(self, index: Index) -> np.ndarray:
        inner: list[Any] = []
        after: list[Any] = []  # positions still to take once reshaped (merged groups)
        sizes: list[int] = []
        for old, new in self.groups:
            picks = [index[a] for a in new]
            if all(p is None for p in picks):
                inner += [None] * len(old)
                after += [None] * len(new)
                sizes += [self.shape[a] for a in new]
            elif len(old) == 1:  # one axis split in several: the flat positions picked
                dims = [self.shape[a] for a in new]
                inner.append(_flat_positions(picks, dims))
                after += [None] * len(new)
                sizes += [_size(p, n) for p, n in zip(picks, dims, strict=True)]
            else:
                inner += [None] * len(old)
                after += picks
                sizes += [self.shape[a] for a in new]
        a = self.src._read(tuple(inner)).reshape(sizes)
        return _take(a, tuple(after))

    MAX_PIECES = 4096  # a read into `out` that splits into more pieces goes through a temporary

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        """Through views of `out` reshaped to the source's shape: a read picking positions on
        an axis merged from several is cut into runs within the last of them (GPT-NeoX's
        per-head rows: one run per head and part), each a view."""
        pieces: list[tuple[list[Any], list[Any]]] = [([], [])]  # (the source's index, the key into out)
        for old, new in self.groups:
            picks = [index[a] for a in new]
            options: list[tuple[list[Any], list[Any]]]
            if all(p is None for p in picks):
                options = [([None] * len(old), [slice(None)] * len(new))]
            elif len(old) == 1:
                options = [([_flat_positions(picks, [self.shape[a] for a in new])], [slice(None)] * len(new))]
            elif len(new) == 1 and old:
                options = self._segments([self.src.shape[a] for a in old], picks[0])
            else:
                options = []
            pieces = [(i + oi, k + ok) for i, k in pieces for oi, ok in options]
            if not options or len(pieces) > self.MAX_PIECES:
                _through_temporary(self, out, index)
                return
        for inner, key in pieces:
            view = out[tuple(key)]
            shape = tuple(_size(i, n) for i, n in zip(inner, self.src.shape, strict=True))
            as_src = _view_as(view, shape)
            if as_src is None:  # strides a view cannot take: this piece through a temporary
                x = self.src._read(tuple(inner))
                _count(x.nbytes, "staged")
                _copy(view, x.reshape(view.shape))
            else:
                self.src._read_into(as_src, tuple(inner))

    def _segments(self, dims: list[int], picks: np.ndarray) -> list[tuple[list[Any], list[Any]]]:
        """Positions picked on one axis merged from axes of sizes `dims`, as runs that stay
        within one row of the last: ([one position on each axis but the last, a range on the
        last], [the run's positions in the read]) each; [] where they are too many."""
        if not len(picks):
            return []
        last = dims[-1]
        breaks = np.flatnonzero((np.diff(picks) != 1) | (picks[1:] % last == 0)) + 1
        if len(breaks) >= self.MAX_PIECES:
            return []
        starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(picks)]])
        out = []
        for a, b in zip(starts, stops, strict=True):
            coords = np.unravel_index(int(picks[a]), dims)
            out.append(([np.array([c]) for c in coords[:-1]] + [np.arange(coords[-1], coords[-1] + b - a)],
                        [slice(int(a), int(b))]))
        return out

    def major_axis(self) -> int | None:
        m = self.src.major_axis()
        for old, new in self.groups:
            if m in old:
                return new[0] if old[0] == m and new else None
        return None


def _groups(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Axes of `old` and `new` paired into the smallest groups of equal size (size-1 axes
    join the group before them)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj = [i] if i < len(old) else [], [j] if j < len(new) else []
        a = old[i] if i < len(old) else 1
        b = new[j] if j < len(new) else 1
        i, j = i + bool(gi), j + bool(gj)
        while a != b:
            if a < b:
                a *= old[i]
                gi.append(i)
                i += 1
            else:
                b *= new[j]
                gj.append(j)
                j += 1
        while i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            gi.append(i)
            i += 1
        while j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


class Concat(Lazy):
    """Tensors joined along one axis; a read takes from each only the positions asked."""

    def __init__(self, parts: Sequence[Lazy], axis: int = 0):
        self.parts = [lazy(p) for p in parts]
        ndim = self.parts[0].ndim
        self.axis = axis % ndim
        shapes = [p.shape for p in self.parts]
        if any(len(s) != ndim or s[:self.axis] + s[self.axis + 1:] != shapes[0][:self.axis] + shapes[0][self.axis + 1:]
               for s in shapes):
            raise ValueError(f"cannot concatenate shapes {shapes} along axis {axis}")
        self.starts = np.cumsum([0] + [s[self.axis] for s in shapes])
        self.shape = shapes[0][:self.axis] + (int(self.starts[-1]),) + shapes[0][self.axis + 1:]
        self.dtype = np.result_type(*[p.dtype for p in self.parts])

    def _read(self, index: Index) -> np.ndarray:
        ax, picks = self.axis, index[self.axis]
        if picks is None:
            return np.concatenate([p._read(index).astype(self.dtype, copy=False) for p in self.parts], axis=ax)
        which = np.searchsorted(self.starts, picks, side="right") - 1
        shape = list(s if i is None else len(i) for s, i in zip(self.shape, index, strict=True))
        out = np.empty(shape, self.dtype)
        for k, p in enumerate(self.parts):
            mine = np.nonzero(which == k)[0]
            if len(mine):
                sub = index[:ax] + (picks[mine] - self.starts[k],) + index[ax + 1:]
                np.moveaxis(out, ax, 0)[mine] = np.moveaxis(p._read(sub), ax, 0)
        return out

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        ax, picks = self.axis, index[self.axis]
        for k, part in enumerate(self.parts):
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            if picks is None:
                _into(part, out[_along(ax, lo, hi)], index, self.dtype)
                continue
            mine = np.flatnonzero((picks >= lo) & (picks < hi))  # where this part's rows go in out
            for first, stop, _ in _runs(mine, len(picks)):
                sub = index[:ax] + (picks[first:stop] - lo,) + index[ax + 1:]
                _into(part, out[_along(ax, first, stop)], sub, self.dtype)

    def major_axis(self) -> int | None:
        axes = {p.major_axis() for p in self.parts}
        return axes.pop() if len(axes) == 1 else None


class Stacked(Lazy):
    """Tensors of one shape stacked along a new first axis (the layers of a stack)."""

    def __init__(self, items: Sequence[Any]):
        self.items = [lazy(a) for a in items]
        shapes = {a.shape for a in self.items}
        if len(shapes) != 1:
            raise ValueError(f"cannot stack tensors of shapes {sorted(shapes)}")
        self.shape = (len(self.items), *shapes.pop())
        self.dtype = np.result_type(*[a.dtype for a in self.items])

    def _read(self, index: Index) -> np.ndarray:
        which = range(self.shape[0]) if index[0] is None else index[0]
        out = np.empty(tuple(_size(i, n) for i, n in zip(index, self.shape, strict=True)), self.dtype)
        for j, i in enumerate(which):
            out[j] = self.items[int(i)]._read(index[1:])
        return out

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        which = range(self.shape[0]) if index[0] is None else index[0]
        for j, i in enumerate(which):
            _into(self.items[int(i)], out[j, ...], index[1:], self.dtype)


class Cast(Lazy):
    def __init__(self, src: Lazy, dtype: np.dtype):
        self.src, self.shape, self.dtype = src, src.shape, dtype

    def _read(self, index: Index) -> np.ndarray:
        return self.src._read(index).astype(self.dtype)

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        _into(self.src, out, index, self.dtype)

    def major_axis(self) -> int | None:
        return self.src.major_axis()


class Mapped(Lazy):
    """An elementwise function of a tensor (same shape and dtype)."""

    def __init__(self, src: Lazy, fn: Callable[[np.ndarray], np.ndarray]):
        self.src, self.fn, self.shape, self.dtype = src, fn, src.shape, src.dtype

    def _read(self, index: Index) -> np.ndarray:
        return np.asarray(self.fn(self.src._read(index)), self.dtype)

    def major_axis(self) -> int | None:
        return self.src.major_axis()


class Zeros(Lazy):
    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def _read(self, index: Index) -> np.ndarray:
        return np.zeros(tuple(_size(i, n) for i, n in zip(index, self.shape, strict=True)), self.dtype)

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        out[...] = 0


def _concatenate(arrays: Sequence[Any], axis: int = 0, **kw: Any) -> Lazy:
    if kw.get("out") is not None or axis is None:
        return np.concatenate(_materialise(list(arrays)), axis=axis, **kw)
    arrays = list(arrays)
    return arrays[0] if len(arrays) == 1 and isinstance(arrays[0], Lazy) else Concat(arrays, axis)


def _stack(arrays: Sequence[Any], axis: int = 0, **kw: Any) -> Lazy:
    if kw.get("out") is not None:
        return np.stack(_materialise(list(arrays)), axis=axis, **kw)
    s = Stacked(list(arrays))
    return s if axis == 0 else s.transpose([*range(1, axis % s.ndim + 1), 0, *range(axis % s.ndim + 1, s.ndim)])


_HANDLED: dict[Callable, Callable] = {
    np.concatenate: _concatenate,
    np.stack: _stack,
    np.transpose: lambda a, axes=None: lazy(a).transpose(axes),
    np.reshape: lambda a, shape=None, **kw: lazy(a).reshape(kw.get("newshape", shape)),
    np.swapaxes: lambda a, a1, a2: lazy(a).swapaxes(a1, a2),
    np.shape: lambda a: lazy(a).shape,
    np.ndim: lambda a: lazy(a).ndim,
}


def array_equal(a: Any, b: Any, rows: int = 4096) -> bool:
    """np.array_equal of two tensors, read `rows` rows at a time (bounded memory)."""
    a, b = lazy(a), lazy(b)
    if a.shape != b.shape:
        return False
    n = a.shape[0] if a.shape else 1
    for s in range(0, n, rows):
        index = None if not a.shape else (np.arange(s, min(n, s + rows)),)
        if not np.array_equal(a.read(index), b.read(index)):
            return False
    return True


# ----------------------------------------------------------------------------------------
# safetensors, read through its header
# ----------------------------------------------------------------------------------------


def _dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
            "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64),
            "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
            "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
            "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


def read_safetensors(path: str | os.PathLike) -> dict[str, FileTensor]:
    """{name: FileTensor} of a .safetensors file, from its header alone (no weight is read).

    Raises CheckpointReadError (one line naming the file and the tensor) for a header that
    is not a safetensors header, a dtype it does not know, or a tensor whose bytes do not
    fit its shape or lie past the end of the file (a truncated file)."""
    from .io_errors import CheckpointReadError

    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > size - 8:
            raise CheckpointReadError(f"{path}: not a safetensors file (its first 8 bytes give a header of {n} "
                                      f"bytes, the file has {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointReadError(f"{path}: its safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointReadError(f"{path}: its safetensors header is a {type(header).__name__}, expected an object")
    dtypes, data = _dtypes(), size - 8 - n
    out: dict[str, FileTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointReadError(f"{path}: tensor {name!r} has no dtype / shape / data_offsets in the header "
                                      f"({info!r})") from None
        if dtype not in dtypes:
            raise CheckpointReadError(f"{path}: tensor {name!r} has dtype {dtype!r}, expected one of {sorted(dtypes)}")
        want = math.prod(shape) * dtypes[dtype].itemsize
        if end - begin != want or begin < 0 or min(shape, default=0) < 0:
            raise CheckpointReadError(f"{path}: tensor {name!r} of shape {shape} ({dtype}) needs {want} bytes, its "
                                      f"header gives {end - begin} (offsets {begin}-{end})")
        if end > data:
            raise CheckpointReadError(f"{path}: tensor {name!r} ends at byte {end} of the data but the file holds "
                                      f"{data} bytes of data: the file is truncated")
        out[name] = FileTensor(path, 8 + n + begin, shape, dtypes[dtype], name)
    return out


# ----------------------------------------------------------------------------------------
# A progress bar over bytes
# ----------------------------------------------------------------------------------------


class Progress:
    """A one-line bar on stderr over `total` bytes, drawn only for loads of at least
    `threshold` bytes and when stderr is a terminal (quiet in logs and tests)."""

    THRESHOLD = 256 * 2**20

    def __init__(self, total: int, what: str = "loading weights", threshold: int | None = None,
                 stream: Any = None):
        self.total, self.what, self.done, self.start = total, what, 0, time.perf_counter()
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.on = total >= (self.THRESHOLD if threshold is None else threshold) and isatty()

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.on:
            frac = self.done / max(self.total, 1)
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.what}: [{bar:<30}] {self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB "
                              f"({time.perf_counter() - self.start:.1f} s)")
            self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\n")
            self.stream.flush()
