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

An index is one entry per axis: None (the whole axis) or a 1-D array of positions.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Index = tuple[Any, ...]

_READ = {"bytes": 0}


def bytes_read() -> int:
    """Bytes read from checkpoint files by this process so far (every Lazy source)."""
    return _READ["bytes"]


def _count(nbytes: int) -> None:
    _READ["bytes"] += int(nbytes)


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


class FileTensor(Lazy):
    """A tensor stored contiguously (C order) at `offset` bytes into a file; each read maps
    the file, copies the rows asked for, and unmaps it."""

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

    def major_axis(self) -> int | None:
        m = self.src.major_axis()
        return None if m is None else self.axes.index(m)


class Picked(Lazy):
    """Positions picked on each axis (a slice, or numpy's fancy index on one axis)."""

    def __init__(self, src: Lazy, index: Index):
        self.src, self.index = src, index
        self.shape = tuple(_size(i, n) for i, n in zip(index, src.shape, strict=True))
        self.dtype = src.dtype

    def _read(self, index: Index) -> np.ndarray:
        inner = tuple(mine if theirs is None else (theirs if mine is None else mine[theirs])
                      for mine, theirs in zip(self.index, index, strict=True))
        return self.src._read(inner)

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
                flat = np.zeros(1, np.int64)
                for p, n in zip(picks, dims, strict=True):
                    flat = (flat[:, None] * n + (np.arange(n) if p is None else p)[None, :]).reshape(-1)
                inner.append(flat)
                after += [None] * len(new)
                sizes += [_size(p, n) for p, n in zip(picks, dims, strict=True)]
            else:
                inner += [None] * len(old)
                after += picks
                sizes += [self.shape[a] for a in new]
        a = self.src._read(tuple(inner)).reshape(sizes)
        return _take(a, tuple(after))

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


class Cast(Lazy):
    def __init__(self, src: Lazy, dtype: np.dtype):
        self.src, self.shape, self.dtype = src, src.shape, dtype

    def _read(self, index: Index) -> np.ndarray:
        return self.src._read(index).astype(self.dtype)

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
