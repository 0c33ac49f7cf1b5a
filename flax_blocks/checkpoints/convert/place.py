"""A flax_blocks module's parameters: which it has, in torch's naming and in Flax's (derived
from the declarations: the one map both conversion directions read), and values placed into
them without the whole model ever in one place.

    module_params(kind, cfg, ...)      (torch name, Flax path, Param, layer) of a module of `kind`
    expected_torch_params(module)      {torch name: Expected} of a module
    place_named(model, tensors, ...)   a read checkpoint's tensors ({torch name: Lazy}) into an
                                       abstract model (nnx.eval_shape), as fb.from_hf places them
    place_all(variables, values, mesh=None, rules=None)

A stack's layer i is torch's `layers.{i}.` and index i of the Flax layers' leading (stacked)
axis (a mixed stack's MLPs: index j of their kind's); a Transformer holds an encoder and a
decoder stack.

Placing: planned values (`flax_blocks.checkpoints.stream.Lazy`) -> JAX arrays. Each value
becomes a `jax.Array` with the variable's sharding: with a mesh, the `NamedSharding` its
declared logical axes give through `rules` (default: attention heads and the FFN width over
"model", the rest replicated; an axis a mesh axis does not divide is replicated over it:
`flax_blocks.sharding`); without one, the default device.

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
import math
import mmap
import os
import re
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core import declarations
from ...core.config import BlockConfig, dtype_name
from ...core.declarations import FINAL_NORM, LAYERS, Param
from ...core.lm_config import ENCODER, components
from .. import stream
from ..io import ConversionError, few

# --- which parameters a module has ------------------------------------------------------------------

LAYER = re.compile(rf"{LAYERS}\.(\d+)\.(.+)")
BLOCK_KINDS = tuple(declarations.BLOCKS)
KINDS = (*BLOCK_KINDS, *declarations.STACKS, "Transformer")


def module_params(kind: str, cfg: BlockConfig, *, num_layers: Any = None,
                  final_norm: Any = False) -> list[tuple[str, str, Param, int | None]]:
    """(torch name, dotted Flax path, Param, layer index or None) of every parameter of a
    module of `kind`, derived from the declarations. A stack's layer i is torch's
    `layers.{i}.` and index i of the Flax layers' leading (stacked) axis; each layer holds its
    own MLP (`declarations.layer_mlp`), and a stack mixing the two kinds holds them in Flax
    apart (`declarations.LAYER_MLPS`: index j among that kind's layers). A Transformer
    takes num_layers and final_norm as (encoder, decoder) pairs; its encoder is never causal
    (which changes no parameter)."""
    if kind in BLOCK_KINDS:
        block = declarations.block(cfg, kind, declarations.layer_mlp(cfg, 1))  # a block alone is layer 1
        return [(t, f, p, None) for t, f, p in declarations.flatten(block)]
    if kind == "Transformer":
        out = []
        for (prefix, stack), n, fn in zip(declarations.TRANSFORMER.items(), num_layers, final_norm, strict=True):
            out += [(f"{prefix}.{t}", f"{prefix}.{f}", p, i)
                    for t, f, p, i in module_params(stack, cfg, num_layers=n, final_norm=fn)]
        return out
    if kind not in declarations.STACKS:
        raise TypeError(f"expected one of {KINDS}, got {kind!r}")
    out = []
    kinds = [declarations.layer_mlp(cfg, i + 1) for i in range(num_layers or 0)]
    mixed = len(set(kinds)) > 1
    for i, mlp in enumerate(kinds):
        for t, f, p in declarations.flatten(declarations.block(cfg, declarations.STACKS[kind], mlp)):
            if mixed and f.split(".")[0] in (*declarations.MLP_MODULES, declarations.EXPERTS_MODULE):
                # a mixed stack's MLPs: Flax stacks each kind apart, index j among that kind's layers
                out.append((f"{LAYERS}.{i}.{t}", f"{declarations.LAYER_MLPS[mlp]}.{f}", p, kinds[:i].count(mlp)))
            else:
                out.append((f"{LAYERS}.{i}.{t}", f"{LAYERS}.{f}", p, i))
    if final_norm:
        norm = declarations.norm(cfg, cfg.d_model)
        out += [(t, f, p, None) for t, f, p in declarations.flatten(norm, f"{FINAL_NORM}.")]
    return out



def flax_params(module) -> dict[str, Any]:
    """{dotted Flax path: nnx.Param} of a flax_blocks module."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(str(p) for p in path): var for path, var in flat}


def module_kind(module) -> str:
    kind = type(module).__name__
    if getattr(module, "cfg", None) is None or kind not in KINDS:
        raise TypeError(f"expected a flax_blocks module ({', '.join(KINDS)}), got {kind}")
    return kind


@dataclass
class Expected:
    """One torch-named tensor a module expects: where it goes and how it is laid out."""

    flax_path: str
    layer: int | None
    param: Param
    torch_shape: tuple[int, ...]


def stack_shape(module) -> tuple[Any, Any]:
    """(num_layers, final_norm) of a module, as `module_params` takes them."""
    kind = module_kind(module)
    if kind == "Transformer":
        return ((module.encoder.num_layers, module.decoder.num_layers),
                (module.encoder.final_norm is not None, module.decoder.final_norm is not None))
    if kind in declarations.STACKS:
        return module.num_layers, module.final_norm is not None
    return None, False


def expected_torch_params(module) -> dict[str, Expected]:
    """{torch name: Expected} for every parameter of `module`, in torch's naming."""
    num_layers, final = stack_shape(module)
    params = module_params(module_kind(module), module.cfg, num_layers=num_layers, final_norm=final)
    return {t: Expected(f, layer, p, p.shape) for t, f, p, layer in params}


# --- placing values into them ---------------------------------------------------------------------

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


# --- a read checkpoint's tensors, placed ----------------------------------------------------------

def np_dtype(dtype: Any):
    """A dtype given as a name or a numpy / JAX / torch dtype object -> a numpy dtype."""
    name = dtype_name(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise TypeError(f"dtype must be float32, float64, bfloat16 or float16 (a name or a dtype object), "
                        f"got {dtype!r}") from None


def materialize_rng_state(module, seed: int, *, mesh: Any = None) -> None:
    """Give an abstract (nnx.eval_shape) module's RNG keys and counts concrete values, in
    place: keys derived from `seed` and the variable's path (so each dropout gets its own
    stream, and stacked layers one key per layer), counts zero. Parameters must already be
    concrete (loaded); a non-RNG variable left abstract raises RuntimeError. mesh: the
    values are replicated on it (as a global array, on every process)."""
    import zlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    root = None  # made on first use: a module without dropout has no key, and no program compiles
    left = []
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable) or not isinstance(node.get_value(), jax.ShapeDtypeStruct):
            continue
        shape, name = node.get_value().shape, ".".join(map(str, path))
        if isinstance(node, nnx.RngKey):
            root = jax.random.key(seed) if root is None else root
            key = jax.random.fold_in(root, zlib.crc32(name.encode()))
            keys = jax.random.split(key, math.prod(shape)).reshape(shape)
            node.set_value(keys if mesh is None else jax.random.wrap_key_data(
                _replicated(np.asarray(jax.random.key_data(keys)), mesh), impl=jax.random.key_impl(keys)))
        elif isinstance(node, nnx.RngCount):
            zeros = np.zeros(shape, node.get_value().dtype)
            node.set_value(jnp.asarray(zeros) if mesh is None else _replicated(zeros, mesh))
        else:
            left.append(f"{name} ({type(node).__name__}, shape {shape})")
    if left:
        raise RuntimeError("these variables are still abstract (nothing loaded them): " + ", ".join(left))



def _replicated(a: np.ndarray, mesh: Any) -> Any:
    """`a` replicated on every device of `mesh` (a global array on every process)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, PartitionSpec()), lambda index: a[index])


def named_params(model) -> dict[str, tuple[str, int | None, Param]]:
    """{torch name: (Flax path, layer index or None, Param)} of a stack, a block or a whole
    `LanguageModel` (its own parts, then its stack's under "encoder.")."""
    if getattr(model, "lm", None) is None:
        return {t: (e.flax_path, e.layer, e.param) for t, e in expected_torch_params(model).items()}
    out: dict[str, tuple[str, int | None, Param]] = {
        t: (f, None, p) for name, comp in components(model.lm, model.cfg)
        for t, f, p in declarations.flatten(comp, f"{name}.")}
    out.update({f"{ENCODER}.{t}": (f"{ENCODER}.{e.flax_path}", e.layer, e.param)
                for t, e in expected_torch_params(getattr(model, ENCODER)).items()})
    return out


def check_dtypes(tensors: Mapping[str, Any], dtype: Any = None) -> None:
    """Raise one ConversionError naming every tensor of a non-floating dtype, and the float64
    ones that would silently become float32 (jax_enable_x64 off and no `dtype` to cast to)."""
    import jax

    cast = None if dtype is None else np_dtype(dtype)
    problems = [f"dtype of {k}: expected a floating dtype, found {a.dtype}" for k, a in tensors.items()
                if not np.issubdtype(a.dtype, np.floating) and str(a.dtype) != "bfloat16"]
    silent64 = [k for k, a in tensors.items() if cast is None and a.dtype == np.float64]
    if silent64 and not jax.config.read("jax_enable_x64"):
        problems.append(f"{len(silent64)} tensor(s) are float64 ({few(silent64)}) but jax_enable_x64 is off (they "
                        "would silently become float32): enable it before creating arrays, or pass dtype=jnp.float32")
    if problems:
        raise ConversionError(problems, header="cannot place these weights")


def place_named(model, tensors: Mapping[str, Any], named: Mapping[str, tuple[str, int | None, Param]],
                *, dtype: Any = None, mesh: Any = None, rules: Any = None, what: str = "loading weights") -> None:
    """Write `tensors` ({torch name: stream.Lazy or array}, every name and shape of `model`'s
    own, `named_params(model)`; their dtypes, names and shapes checked first by the caller:
    `check_dtypes`, `checkpoint.check_shapes`) into `model`'s parameters, in place: each
    tensor laid out for Flax (`Param.transform`), cast to `dtype` when given (None keeps each
    tensor's), a stacked parameter's layers read into one array, placed by `place_all` (on
    `mesh` by `rules`)."""
    cast = None if dtype is None else np_dtype(dtype)
    variables = flax_params(model)
    values: dict[str, Any] = {}
    layers: dict[str, list] = {}
    for t, (path, layer, p) in named.items():
        a = p.transform.to_flax(stream.lazy(tensors[t]), model.cfg)
        a = a if cast is None else a.astype(cast)
        if layer is None:
            values[path] = a
        else:
            layers.setdefault(path, [None] * variables[path].get_value().shape[0])[layer] = a
    values.update({path: stream.Stacked(items) for path, items in layers.items()})
    place_all(variables, values, mesh=mesh, rules=rules, what=what)
