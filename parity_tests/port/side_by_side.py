"""compare: run a torch module and its Flax NNX port side by side, module by module (the
module is not named compare.py: `parity_tests.port.compare` is the function)."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import islands
from .errors import rel_err_leaves
from .explain import explain
from .gradients import FLOOR32, cotangents, flax_loss, gradients, torch_grads, weight_states
from .locate import Context, Paired, locate, never_called, within
from .pairing import Pairing, compare_values, named_leaves, pair_arguments, paired_outputs
from .record import Call, is_float, leaves, map_nested, record_flax, record_torch, to_numpy
from .report import Divergence, PortReport, Row
from .weights import flax_modules, flax_variables

TOL64 = 1e-12  # float64: both sides round at 1e-16; a real mistake is far above
EPS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-3)


# ----------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------


def _builtin_adapter(tm, fm) -> Callable[[np.ndarray], np.ndarray] | None:
    """Known layout differences between a torch layer and its NNX counterpart."""
    import torch.nn as nn

    if isinstance(tm, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return lambda a: np.moveaxis(a, 1, -1) if a.ndim >= 3 else a  # (B, C, ...) -> (B, ..., C)
    if isinstance(tm, nn.MultiheadAttention) and not tm.batch_first:
        return lambda a: np.swapaxes(a, 0, 1) if a.ndim == 3 else a  # (T, B, E) -> (B, T, E)
    return None


def _float_leaves(obj: Any, adapt: Callable | None = None) -> list[np.ndarray]:
    out = [to_numpy(a) for a in leaves(obj) if is_float(a)]
    return [adapt(a) for a in out] if adapt else out


# ----------------------------------------------------------------------------------------
# Refusals, copies, precision
# ----------------------------------------------------------------------------------------


def _refuse_self_comparison(torch_module, flax_module) -> None:
    import jax
    import torch
    from flax import nnx

    if isinstance(torch_module, nnx.Module) and isinstance(flax_module, nnx.Module):
        raise TypeError("compare: both modules are Flax NNX modules: a framework compared with itself proves "
                        "nothing; give the torch module first")
    if not isinstance(torch_module, torch.nn.Module):
        raise TypeError(f"compare: expected a torch.nn.Module first, got {type(torch_module).__name__}")
    if not isinstance(flax_module, nnx.Module):
        kind = "another torch module: torch compared with itself proves nothing" \
            if isinstance(flax_module, torch.nn.Module) else type(flax_module).__name__
        raise TypeError(f"compare: expected a flax.nnx.Module second, got {kind}")
    for name, m in torch_module.named_modules():
        for attr, v in vars(m).items():
            if isinstance(v, (nnx.Module, jax.Array)):
                raise TypeError(f"compare: the torch module runs JAX code (torch {name or '(root)'}.{attr} is a "
                                f"{type(v).__name__}): the Flax port would be compared with itself")
    for path, node in nnx.iter_graph(flax_module):
        if isinstance(node, nnx.Module):
            for attr, v in vars(node).items():
                if isinstance(v, (torch.nn.Module, torch.Tensor)):
                    raise TypeError(f"compare: the Flax module runs torch code "
                                    f"(flax {'.'.join(map(str, path)) or '(root)'}"
                                    f".{attr} is a {type(v).__name__}): torch would be compared with itself")


def _torch_copy(module, dtype: str):
    """A copy in `dtype`, in the mode it was given, every parameter requiring gradients; an
    HF model's key / value cache off (a replayed layer would read the run's cache)."""
    import torch

    m = copy.deepcopy(module).to(getattr(torch, dtype))  # in the mode it was given
    for p in m.parameters():
        p.requires_grad_(True)
    config = getattr(m, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    return m


def _flax_copy(module, dtype: str):
    """A copy with every floating variable and every floating dtype / param_dtype attribute
    in `dtype` (nnx.Embed computes in its dtype, which defaults to its param_dtype), in the
    mode it was given (a port left in train mode is a porting mistake to find)."""
    import jax.numpy as jnp
    from flax import nnx

    m = nnx.clone(module)
    want = jnp.dtype(dtype)
    for v in flax_variables(m).values():
        if (isinstance(v, nnx.Variable) and hasattr(v.get_value(), "dtype")
                and jnp.issubdtype(v.get_value().dtype, jnp.floating)):
            v.set_value(jnp.asarray(np.asarray(v.get_value()).astype(want)))  # in numpy: no program per shape
    for node in flax_modules(m).values():
        for attr in ("dtype", "param_dtype"):
            val = getattr(node, attr, None)
            if val is not None:
                try:
                    floating = jnp.issubdtype(jnp.dtype(val), jnp.floating)
                except TypeError:
                    continue
                if floating:
                    object.__setattr__(node, attr, want)
    return m


def _exact_dot_product_attention(original):
    """jax.nn.dot_product_attention without its float32 softmax, which it applies to every
    input dtype (1.6e-7 from exact in float64 on CPU; nnx.MultiHeadAttention's default
    attention calls it): the same logits, masks and scale in the inputs' own dtype. Arguments
    it does not cover (sequence lengths, local windows, residuals) go to the original."""
    import jax
    import jax.numpy as jnp

    def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, query_seq_lengths=None,
                  key_value_seq_lengths=None, local_window_size=None, implementation=None, return_residual=False):
        if query_seq_lengths is not None or key_value_seq_lengths is not None or local_window_size is not None \
                or return_residual or jnp.asarray(query).dtype != jnp.float64:
            return original(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                            local_window_size=local_window_size, implementation=implementation,
                            return_residual=return_residual)
        q, k, v = (jnp.asarray(a) for a in (query, key, value))
        unbatched = q.ndim == 3
        if unbatched:
            q, k, v = q[None], k[None], v[None]
        if k.shape[-2] != q.shape[-2]:  # grouped heads
            k, v = (jnp.repeat(a, q.shape[-2] // a.shape[-2], axis=-2) for a in (k, v))
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if bias is not None:
            logits = logits + (bias[None] if unbatched else bias)
        keep = None if mask is None else (mask[None] if unbatched else mask).astype(bool)
        if is_causal:
            causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
            keep = causal if keep is None else keep & causal
        if keep is not None:
            logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
        out = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v)
        return out[0] if unbatched else out

    return attention


@contextlib.contextmanager
def _precision(dtype: str) -> Iterator[None]:
    """x64 on for a float64 run, the highest matmul precision, and in float64
    jax.nn.dot_product_attention without its float32 softmax; all restored after."""
    import jax

    original = jax.nn.dot_product_attention
    with jax.enable_x64(dtype == "float64"), jax.default_matmul_precision("highest"):
        try:
            if dtype == "float64":
                jax.nn.dot_product_attention = _exact_dot_product_attention(original)
            yield
        finally:
            jax.nn.dot_product_attention = original


def _inputs(inputs: tuple, named: dict, dtype: str) -> tuple[list, list, dict, dict]:
    """The inputs (numpy; float ones cast to `dtype`) for torch and for the port: positional
    ones, then named ones."""
    import jax.numpy as jnp
    import torch

    def both(x):
        a = np.asarray(x)
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(dtype)
        return torch.from_numpy(np.ascontiguousarray(a)), jnp.asarray(a)

    pos = [both(x) for x in inputs]
    kw = {k: both(x) for k, x in named.items()}
    return [t for t, _ in pos], [f for _, f in pos], {k: t for k, (t, _) in kw.items()}, \
        {k: f for k, (_, f) in kw.items()}


# ----------------------------------------------------------------------------------------
# Running one module alone
# ----------------------------------------------------------------------------------------


def _skeleton(obj: Any, arrays: list, seen: dict[int, int] | None = None) -> Any:
    """A hashable stand-in for nested args with every array leaf moved to `arrays` (an
    array met again, as a module's output is the next one's input, is held once when `seen`
    is given)."""
    import jax

    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_skeleton(o, arrays, seen) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, _skeleton(v, arrays, seen)) for k, v in obj.items()))
    if isinstance(obj, (jax.Array, np.ndarray)) or hasattr(obj, "aval"):
        if seen is not None and id(obj) in seen:
            return ("array", seen[id(obj)])
        arrays.append(obj)
        if seen is not None:
            seen[id(obj)] = len(arrays) - 1
        return ("array", len(arrays) - 1)
    return ("literal", obj)


def _rebuild(skel: Any, arrays: list) -> Any:
    kind, body = skel
    if kind == "tuple":
        return tuple(_rebuild(s, arrays) for s in body)
    if kind == "list":
        return [_rebuild(s, arrays) for s in body]
    if kind == "dict":
        return {k: _rebuild(s, arrays) for k, s in body}
    return arrays[body] if kind == "array" else body


def _apply(graphdef, skel, state, arrays):
    """One module's call as a function of its state and arrays (lowered to read its program)."""
    from flax import nnx

    m = nnx.merge(graphdef, state)
    args, kwargs = _rebuild(skel, arrays)
    out = m(*args, **kwargs)
    return out, nnx.state(m)


def call_module(module, args: tuple, kwargs: dict) -> Any:
    """module(*args, **kwargs), op by op: each operation is compiled once per shape and
    shared by every module and every comparison in the process, which costs less than a
    program per module for the many small calls a check makes (the port checker's two test
    files, measured side by side: 44.5 / 47.6 s of CPU against 47.1 / 54.5 s with a program
    per module); the module's state (RNG counts, statistics) is updated as any eager call
    does."""
    return module(*args, **kwargs)


def computes_in_float32(module, args: tuple, kwargs: dict, cache: dict) -> bool:
    """Whether the Flax module's computation on these arguments holds a float32 (or float16,
    bfloat16) value: in a float64 run, a float32 island of the port's own (an astype to
    float32 around a softmax or a norm, as HF's code does). Read from its jaxpr (the module's
    static attributes need not be hashable); remembered per module."""
    import jax
    from flax import nnx

    if id(module) not in cache:
        arrays: list = []
        skel = _skeleton((args, kwargs), arrays)
        graphdef, state = nnx.split(module)
        try:
            text = str(jax.make_jaxpr(lambda st, xs: _apply(graphdef, skel, st, xs))(state, arrays))
        except Exception:
            text = ""
        cache[id(module)] = bool(re.search(r"\b(f32|f16|bf16)\[", text))
    return cache[id(module)]


def _port_islands(paired: list[Paired], cache: dict) -> list[str]:
    """In a float64 run: the modules whose local error (within float32's reach, 1e-5) comes
    from a float32 computation of the port's own; each is judged at float32's floor, and so
    is what every later module is given and gives. Returns one line per class of the
    innermost such modules."""
    marked = [p for p in paired if p.row.local is not None and p.row.tol_local < p.row.local <= 1e-5
              and computes_in_float32(p.f.module, *_alone_args(p.f, p.args), cache)]
    if not marked:
        return []
    inner = [p for p in marked if not any(q is not p and within(q.t, p.t) for q in marked)]
    first = min(p.t.start for p in inner)
    for p in paired:
        row = p.row
        if p in marked:
            row.local_tol, row.tol = max(row.tol_local, FLOOR32), max(row.tol, FLOOR32)
        if p in inner:
            row.note = (row.note + " " if row.note else "") + "float32 in the port"
        if p.t.start > first:
            row.input_tol, row.tol = max(row.tol_in, FLOOR32), max(row.tol, FLOOR32)
    found: dict[str, list[str]] = {}
    for p in inner:
        found.setdefault(type(p.f.module).__name__, []).append(p.f.path or "(root)")
    return [f"{cls} computes in float32 in the port ({', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}): "
            f"judged at float32's floor ({FLOOR32:g}), as is what follows it" for cls, paths in found.items()]


def _alone_args(fcall: Call, pairing: Pairing) -> tuple[tuple, dict]:
    """The Flax call's (args, kwargs) with torch's values swapped in where they pair."""
    import jax.numpy as jnp

    swap = {id(p.flax.ref): jnp.asarray(p.fitted, dtype=p.flax.value.dtype)
            for p in pairing.pairs if p.torch is not None and not p.note and p.fitted is not None}
    return map_nested(lambda o: swap.get(id(o), o), (fcall.args, fcall.kwargs))


def _run_alone(fcall: Call, pairing: Pairing) -> Any:
    """The Flax module's call with each argument torch's holds the same values for replaced
    by torch's (in the port's own shape and representation); an argument that could not be
    reconciled keeps the port's own value."""
    args, kwargs = _alone_args(fcall, pairing)
    return call_module(fcall.module, args, kwargs)


def _flax_run(fm, f_in: list, f_kw: dict, names: dict[str, Any], cots: list[np.ndarray] | None
              ) -> tuple[Any, list[Call], dict[str, np.ndarray]]:
    """Run the port compiled, recording its submodule calls (their arrays leave the program
    as outputs), and with `cots` the gradient of sum(out * cot) for every parameter (by
    dotted path) in the same program; eager where it cannot be compiled (a call recorded
    inside a scan or a jit of its own)."""
    import jax
    from flax import nnx

    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)
    box: dict[str, Any] = {}

    def run(params, rest, xs, kw):
        m = nnx.merge(graphdef, params, rest)
        with record_flax(m, flax_modules(m)) as calls:
            out = m(*xs, **kw)
        arrays: list = []
        seen: dict[int, int] = {}
        box["skel"] = [_skeleton((c.args, c.kwargs, c.output), arrays, seen) for c in calls]
        box["calls"] = calls
        return (flax_loss(out, cots) if cots is not None else 0.0), (out, arrays)

    def program(params, rest, xs, kw):
        if cots is None:
            return run(params, rest, xs, kw)[1], None
        grads, aux = jax.grad(run, has_aux=True)(params, rest, xs, kw)
        return aux, grads

    try:
        (out, arrays), grads = jax.jit(program)(params, rest, list(f_in), dict(f_kw))
    except Exception:
        with jax.disable_jit(), record_flax(fm, names) as calls:
            out = fm(*f_in, **f_kw)
        grads = jax.grad(lambda p: run(p, rest, f_in, f_kw)[0])(params) if cots is not None else None
    else:
        calls = box["calls"]
        for c, skel in zip(calls, box["skel"], strict=True):
            c.args, c.kwargs, c.output = _rebuild(skel, arrays)
            c.module = names[c.path]
    fgrads: dict[str, np.ndarray] = {}
    if grads is not None:
        gm = nnx.merge(graphdef, grads, rest)
        fgrads = {k: np.asarray(v.get_value()) for k, v in flax_variables(gm, nnx.Param).items()}
    return out, calls, fgrads


# ----------------------------------------------------------------------------------------
# torch's runs: as recorded, and with its float32 islands in float64
# ----------------------------------------------------------------------------------------


def _torch_run(tm, t_in: list, t_kw: dict, watch_islands: bool) -> tuple[Any, list[Call], dict[int, set[str]]]:
    """torch's recorded run, and the calls inside which it made float32 tensors (by id)."""
    import torch

    found: dict[int, set[str]] = {}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            rec = stack.enter_context(record_torch(tm))
            if watch_islands:
                stack.enter_context(islands.watch(rec.stack, found))
            out = tm(*t_in, **t_kw)
    except Exception as e:
        given = ", ".join([f"{tuple(x.shape)} {x.dtype}" for x in t_in] +
                          [f"{k}={tuple(x.shape)} {x.dtype}" for k, x in t_kw.items()])
        raise ValueError(f"compare: the torch module cannot run on the inputs given ({given}): "
                         f"{type(e).__name__}: {e}") from e
    return out, rec.calls, found


def _noise(calls: list[Call], ref: list[Call], adapt_of_t: Callable[[Call], Any]) -> dict[tuple, tuple[float, float]]:
    """(path, index) -> (output noise, input noise): torch's run against a reference run of
    the same model (float64 for a float32 run; float32 islands promoted for a float64 one)."""
    by_key = {(c.path, c.index): c for c in ref}
    out: dict[tuple, tuple[float, float]] = {}
    for c in calls:
        r = by_key.get((c.path, c.index))
        if r is None:
            continue
        out[(c.path, c.index)] = (rel_err_leaves(_float_leaves(c.output), _float_leaves(r.output)),
                                  rel_err_leaves(_float_leaves((c.args, c.kwargs)), _float_leaves((r.args, r.kwargs)))
                                  if _float_leaves((c.args, c.kwargs)) else 0.0)
    return out


def _local_noise(t: Call) -> float:
    """How far torch's own module is, on its recorded input, from the same computation with
    its float32 islands in float64."""
    import torch

    try:
        with torch.no_grad(), islands.promoted():
            again = t.module(*t.args, **t.kwargs)
    except Exception:
        return 0.0
    return rel_err_leaves(_float_leaves(t.output), _float_leaves(again))


def _island_lines(calls: list[Call], found: dict[int, set[str]]) -> list[str]:
    """One line per class of module that computes in float32 inside torch's float64 run."""
    by_class: dict[str, list[str]] = {}
    for c in calls:
        if id(c) in found and c.index == 0:
            by_class.setdefault(type(c.module).__name__, []).append(c.path or "(root)")
    lines = []
    for cls, paths in by_class.items():
        where = ", ".join(paths[:3]) + (f", ... ({len(paths)} modules)" if len(paths) > 3 else "")
        lines.append(f"{cls} computes in float32 in torch ({where}): judged at float32's floor (ten times torch's "
                     f"own float32 noise there, at least {FLOOR32:g}), as is what it feeds")
    return lines


# ----------------------------------------------------------------------------------------
# Pairing calls
# ----------------------------------------------------------------------------------------


def _has_params(m) -> bool:
    import torch
    from flax import nnx

    if isinstance(m, torch.nn.Module):
        return any(True for _ in m.parameters())
    return any(isinstance(n, nnx.Param) for _, n in nnx.iter_graph(m))


def _pair_calls(tcalls: list[Call], fcalls: list[Call], match: dict[str, str] | None,
                adapt_of: Callable[[Call, Call], Callable | None]) -> list[tuple[Call, Call]]:
    """By path (and the how-many-th call), then by `match` globs (a module with parameters
    only with one that has them, a parameterless one only with a parameterless one: torch's
    dropout modules do not use up the port's calls), then by order and output shape among
    modules that hold parameters."""
    by_key = {(c.path, c.index): c for c in fcalls}
    used: set[int] = set()
    pairs: list[tuple[Call, Call]] = []
    left: list[Call] = []
    for t in tcalls:
        f = by_key.get((t.path, t.index))
        if match and (f is None or id(f) in used):
            for tg, fg in match.items():
                if fnmatch.fnmatchcase(t.path, tg):
                    held = _has_params(t.module)
                    f = next((c for c in fcalls if id(c) not in used and fnmatch.fnmatchcase(c.path, fg)
                              and _has_params(c.module) == held and c.start > _last_start(pairs, t)), None)
                    break
        if f is not None and id(f) not in used:
            used.add(id(f))
            pairs.append((t, f))
        else:
            left.append(t)
    for t in sorted(left, key=lambda c: c.start):
        if not _has_params(t.module):
            continue
        tshape = [a.shape for a in _float_leaves(t.output)]
        last = _last_start(pairs, t)
        for f in fcalls:
            if id(f) in used or f.start <= last or not _has_params(f.module):
                continue
            f_out = _float_leaves(f.output)
            t_out = _float_leaves(t.output, adapt_of(t, f))
            if tshape and f_out and compare_values(f_out[0], t_out[0]) is not None:
                used.add(id(f))
                pairs.append((t, f))
                break
    return sorted(pairs, key=lambda p: p[0].start)


def _last_start(pairs: list[tuple[Call, Call]], t: Call) -> int:
    """The start of the port's call paired with the latest torch call that started before `t`
    (a call paired by order or glob comes after it)."""
    before = [f.start for tt, f in pairs if tt.start < t.start]
    return max(before, default=-1)


# ----------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------


def compare(torch_module, flax_module, *inputs, dtype: str = "float64", grads: bool = True,
            match: dict[str, str] | None = None, adapters: dict[str, Callable] | None = None,
            rules=None, seed: int = 0, **named_inputs) -> PortReport:
    """Run `torch_module` and `flax_module` (its NNX port, weights already copied) on the same
    `inputs` (numpy arrays; float ones cast to `dtype`; `named_inputs` go to both by name, as
    `attention_mask=mask`) and report every paired submodule.

    dtype: "float64" runs copies of both in float64 (x64 on for the call, highest matmul
    precision; tolerance 1e-12). Where torch itself computes in float32 inside the float64 run
    (HF's RMSNorm, rotary angles, eager softmax) those modules are named and judged at
    float32's floor: ten times the gap between torch's run and the same run with its float32
    computations promoted to float64, at least 1e-6, as is everything they feed; a module with
    no float32 inside, run alone on torch's input, stays at 1e-12. "float32" runs both in
    float32 and judges each module against torch's own float32 noise (torch in float32
    against torch in float64).
    Arguments pair by value, not structure: (1, T) positions against (T,), a (B, 1, T, T)
    mask against a (B, 1, 1, T) or boolean one, (cos, sin) of (1, T, D) against (T, D).
    match: {torch glob: flax glob} pairs submodules whose paths differ.
    adapters: {torch glob: f(numpy array) -> array} puts a torch module's inputs and outputs
    in the Flax layout (conv's (B, C, T) -> (B, T, C) and nn.MultiheadAttention's
    sequence-first layout are built in).
    rules: copy_weights' rules, used to pair parameters for the gradients.
    Both run as copies in the modes they were given (a port left in train mode, dropout on,
    is a mistake it names). Nothing is left changed: hooks, wrapped classes and patched
    functions are removed, JAX's x64 flag and matmul precision restored."""
    if dtype not in ("float64", "float32"):
        raise ValueError(f"compare: dtype must be 'float64' or 'float32', got {dtype!r}")
    _refuse_self_comparison(torch_module, flax_module)
    with _precision(dtype):
        tm = _torch_copy(torch_module, dtype)
        fm = _flax_copy(flax_module, dtype)
        t_in, f_in, t_kw, f_kw = _inputs(inputs, named_inputs, dtype)
        t_out, tcalls, found = _torch_run(tm, t_in, t_kw, watch_islands=dtype == "float64")
        names = flax_modules(fm)
        cots = cotangents(t_out, seed) if grads else None
        f_out, fcalls, fgrads = _flax_run(fm, f_in, f_kw, names, cots)
        noise: dict[tuple, tuple[float, float]] = {}
        t64 = None
        if dtype == "float32":
            t64 = _torch_copy(torch_module, "float64")
            _, calls64, _ = _torch_run(t64, [x.double() if x.is_floating_point() else x for x in t_in],
                                       {k: _double(v) for k, v in t_kw.items()}, watch_islands=False)
            noise = _noise(tcalls, calls64, lambda c: None)
        elif found:
            import torch

            with torch.no_grad(), record_torch(tm) as rec, islands.promoted():
                tm(*t_in, **t_kw)
            noise = _noise(tcalls, rec.calls, lambda c: None)
        holds = _holding(tcalls, found)

        def adapt_of(t: Call, f: Call) -> Callable | None:
            for glob, fn in (adapters or {}).items():
                if fnmatch.fnmatchcase(t.path, glob):
                    return fn
            return _builtin_adapter(t.module, f.module)

        def tolerances(t: Call) -> tuple[float, float, float]:
            out_n, in_n = noise.get((t.path, t.index), (0.0, 0.0))
            if dtype == "float32":  # what a module gives and is given, each at ten times torch's own noise on it
                tol = max(10 * out_n, FLOOR32)
                return tol, max(10 * in_n, FLOOR32), tol

            def judged(n: float) -> float:
                return TOL64 if n <= TOL64 / 10 else max(10 * n, FLOOR32)

            local = max(10 * _local_noise(t), FLOOR32) if id(t) in holds else TOL64
            return judged(out_n), judged(in_n), local

        paired: list[Paired] = []
        notes: dict[str, list[str]] = {}
        for t, f in _pair_calls(tcalls, fcalls, match, adapt_of):
            adapt = adapt_of(t, f)
            args = pair_arguments(named_leaves(f.module.__call__, f.args, f.kwargs),
                                  named_leaves(t.module.forward, t.args, t.kwargs, adapt))
            t_outs = _float_leaves(t.output, adapt)
            acc = paired_outputs(_float_leaves(f.output), t_outs)
            try:
                alone, note = _run_alone(f, args), ""
            except Exception as e:  # a module that cannot run alone is reported, not fatal
                alone, note = None, f"cannot run alone ({type(e).__name__}: {str(e)[:80]})"
            local = paired_outputs(_float_leaves(alone), t_outs) if alone is not None else None
            tol, tol_in, tol_local = tolerances(t)
            if tol_in > TOL64 and _unconsumed(args, t, adapt):
                tol_local = max(tol_local, tol)  # torch's noisy argument the port computes for itself
            for said in args.notes():
                notes.setdefault(said, []).append(f.path or "(root)")
            row = Row(t.path, f.path, t.index, acc, args.error, local, None, tol, note=note,
                      input_tol=None if tol_in == tol else tol_in, local_tol=None if tol_local == tol else tol_local)
            if id(t) in found:
                row.note = (row.note + " " if row.note else "") + "float32 in torch"
            paired.append(Paired(t, f, row, args, adapt, alone))
        rows = [p.row for p in paired]
        f32cache: dict = {}
        port_islands = _port_islands(paired, f32cache) if dtype == "float64" else []

        grad_errs, grad_notes = {}, []
        if grads:
            grad_errs, grad_tols, grad_notes = gradients(tm, fm, fgrads, t_in, t_kw, cots, rules,
                                                         _reference_grads(t64, tm, t_in, t_kw, dtype, found))
            for row in rows:
                own = [p for p in grad_errs if p.rsplit(".", 1)[0] == row.flax_path or
                       ("." not in p and row.flax_path == "")]
                if own:  # the parameter furthest past (or nearest to) its tolerance speaks for the module
                    worst = max(own, key=lambda p: grad_errs[p] / grad_tols.get(p, row.tol))
                    row.grad, row.grad_tol = grad_errs[worst], grad_tols.get(worst, row.tol)
                    if port_islands:  # the backward pass runs through the port's float32 everywhere
                        row.grad_tol = max(row.grad_tol, FLOOR32)
        out_err = paired_outputs(_float_leaves(f_out), _float_leaves(t_out))
        eps = _eps_values(fm)
        fcalled = {c.path for c in fcalls}
        ctx = Context(tcalls, names, fcalled, weight_states(tm, fm, rules),
                      lambda p: _explain(p, eps, f32cache if dtype == "float64" else None))
        first = locate(paired, ctx)
        if first is None and grads:
            first = _grad_divergence(rows)
        rows += _never_called_rows(tcalls, paired, ctx)
        rows.sort(key=lambda r: _start_of(r, tcalls))
        _statuses(rows, first)
        paired_t = {id(p.t) for p in paired}
        unpaired = sorted({c.path or "(root)" for c in tcalls if id(c) not in paired_t and _has_params(c.module)})
        report = PortReport(dtype, TOL64 if dtype == "float64" else FLOOR32, rows, first, out_err,
                            unpaired=unpaired, grads=grad_errs, islands=_island_lines(tcalls, found) + port_islands,
                            notes=[_note(said, where) for said, where in notes.items()] + grad_notes)
        return report


def _reference_grads(t64, tm, t_in: list, t_kw: dict, dtype: str, found: dict):
    """torch's gradients in float64 for given cotangents, the reference a float32 run (the
    float64 model) or a float64 run with float32 islands (the islands promoted) judges its
    gradients by; None when there is nothing to judge by."""
    if dtype == "float32":
        return lambda cots: torch_grads(t64, [_double(x) for x in t_in], {k: _double(v) for k, v in t_kw.items()},
                                        cots)
    if found:
        def promoted(cots):
            with islands.promoted():
                return torch_grads(tm, t_in, t_kw, cots)
        return promoted
    return None


def _unconsumed(args: Pairing, t: Call, adapt) -> bool:
    """Whether torch's call holds a float argument no argument of the port's pairs with (the
    port computes it itself: a rotary table)."""
    used = {id(p.torch.ref) for p in args.pairs if p.torch is not None}
    return any(leaf.kind == "float" and id(leaf.ref) not in used
               for leaf in named_leaves(t.module.forward, t.args, t.kwargs, adapt))


def _double(v):
    import torch

    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _holding(calls: list[Call], found: dict[int, set[str]]) -> set[int]:
    """The ids of the calls that are, or enclose, a float32 island."""
    out: set[int] = set()
    for c in calls:
        if id(c) in found:
            while c is not None and id(c) not in out:
                out.add(id(c))
                c = c.parent
    return out


def _note(said: str, where: list[str]) -> str:
    """One line for an argument the pairing could not reconcile, with where (said once)."""
    at = list(dict.fromkeys(where))
    at_s = ", ".join(at[:3]) + (f", ... ({len(at)} modules)" if len(at) > 3 else "")
    return f"arguments: {said}; a local run there takes the port's own [{at_s}]"


def _eps_values(fm) -> list[float]:
    """Every eps the port holds (any float attribute named *eps* of its modules), and the
    common ones."""
    found = {float(v) for n in flax_modules(fm).values() for k, v in vars(n).items()
             if "eps" in k.lower() and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1}
    return sorted(found | set(EPS))


def _explain(p: Paired, eps: list[float], f32cache: dict | None) -> str:
    """The known mistake that makes torch's module compute what the Flax module computes on
    torch's recorded input; or what else the figures say. In a float64 run, a port module
    computing in float32 is matched at float32's floor."""
    if p.alone is None:
        return "unexplained (the flax module cannot run alone on torch's input)"
    target = _float_leaves(p.alone)
    if any(np.asarray(a).dtype == np.float32 for a in leaves(p.alone)) and \
            any(to_numpy(a).dtype == np.float64 for a in leaves(p.t.output)):
        return ("the flax module computes in float32 inside the float64 run (a dtype=jnp.float32 or an astype in "
                f"{p.f.path or 'the root'}'s code)")
    again = _float_leaves(_run_alone(p.f, p.args))
    if any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(again, target, strict=True)):
        return "train mode / dropout left on: the flax module gives two outputs for the same input"
    tol = p.row.tol_local
    if f32cache is not None and computes_in_float32(p.f.module, *_alone_args(p.f, p.args), f32cache):
        tol = max(tol, FLOOR32)
    said = explain(p.t.module, p.t.args, p.t.kwargs, target, tol,
                   lambda o: _float_leaves(o, p.adapt), eps)
    if said is None and not all(np.isfinite(a).all() for a in target):
        return "unexplained: the flax module gives non-finite values on torch's input (a fully masked row?)"
    return said or "unexplained (no known porting mistake closes the gap)"


def _never_called_rows(tcalls: list[Call], paired: list[Paired], ctx: Context) -> list[Row]:
    """A row for each torch module with parameters the port holds and never calls."""
    paths = {p.t.path for p in paired}
    rows = []
    for c in tcalls:
        if c.index == 0 and c.path not in paths and never_called(c, ctx):
            rows.append(Row(c.path, c.path, 0, float("nan"), float("nan"), None, None, TOL64,
                            status="not called", note="the port never calls it"))
    return rows


def _start_of(row: Row, tcalls: list[Call]) -> int:
    return next((c.start for c in tcalls if c.path == row.torch_path and c.index == row.call), 0)


def _grad_divergence(rows: list[Row]) -> Divergence | None:
    """Forward equal everywhere but a gradient differs: the last module (in execution order)
    whose own parameters' gradients differ, the first the backward pass reaches."""
    bad = [r for r in rows if r.grad is not None and r.grad > (r.grad_tol or r.tol)]
    if not bad:
        return None
    r = bad[-1]
    return Divergence(r.torch_path, r.flax_path, "inherited", r.grad,
                      "the forward pass agrees but the gradients differ from here backward (a stop_gradient, detach or "
                      "custom gradient in one of the two?)")


def _statuses(rows: list[Row], first: Divergence | None) -> None:
    """Each row's word: ok; inside (wrong on a right input); between / the first divergence's
    kind at it; contains (an enclosing module of the first divergence); inherited (a wrong
    input, or a gradient, downstream of an earlier divergence); grad (only its gradient)."""
    for r in rows:
        if r.status == "not called":
            continue
        bad_grad = r.grad is not None and r.grad > (r.grad_tol or r.tol)
        if r.local is not None and r.local > r.tol_local and r.input <= r.tol_in:
            r.status = "inside"
        elif r.input > r.tol_in or (r.accumulated > r.tol and r.local is not None):
            r.status = "inherited"
        elif r.accumulated > r.tol:
            r.status = "inside"
        elif bad_grad:
            r.status = "inherited" if first is not None and first.kind != "inherited" else "grad"
    if first is not None:
        for r in rows:
            if r.torch_path == first.torch_path:
                r.status = first.kind
                break
            if r.status in ("inside", "inherited") and (r.torch_path == ""
                                                        or first.torch_path.startswith(r.torch_path + ".")):
                r.status = "contains"
