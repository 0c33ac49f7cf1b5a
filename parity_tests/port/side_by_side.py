"""compare: run a torch module and its Flax NNX port side by side, module by module (the
module is not named compare.py: `parity_tests.port.compare` is the function)."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .errors import rel_err, rel_err_leaves
from .explain import explain
from .record import Call, is_float, leaves, map_nested, record_flax, record_torch, to_numpy
from .report import Divergence, PortReport, Row
from .weights import PortError, flax_modules, flax_variables, plan

TOL64 = 1e-12  # float64: both sides round at 1e-16; a real mistake is far above
FLOOR32 = 1e-6  # float32: a module's tolerance is 10x torch's own float32 noise, at least this
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
    import torch

    m = copy.deepcopy(module).to(getattr(torch, dtype))  # in the mode it was given
    for p in m.parameters():
        p.requires_grad_(True)
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
            v.set_value(v.get_value().astype(want))
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


def _inputs(inputs: tuple, dtype: str) -> tuple[list, list]:
    import jax.numpy as jnp
    import torch

    t_in, f_in = [], []
    for x in inputs:
        a = np.asarray(x)
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(dtype)
        t_in.append(torch.from_numpy(np.ascontiguousarray(a)))
        f_in.append(jnp.asarray(a))
    return t_in, f_in


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
    """By path (and the how-many-th call), then by `match` globs, then by order and output
    shape among modules that hold parameters."""
    by_key = {(c.path, c.index): c for c in fcalls}
    used: set[int] = set()
    pairs: list[tuple[Call, Call]] = []
    left: list[Call] = []
    for t in tcalls:
        f = by_key.get((t.path, t.index))
        if match:
            for tg, fg in match.items():
                if fnmatch.fnmatchcase(t.path, tg):
                    f = next((c for c in fcalls if id(c) not in used and fnmatch.fnmatchcase(c.path, fg)), None)
                    break
        if f is not None and id(f) not in used:
            used.add(id(f))
            pairs.append((t, f))
        else:
            left.append(t)
    last = -1
    for t in sorted(left, key=lambda c: c.start):
        if not _has_params(t.module):
            continue
        tshape = [a.shape for a in _float_leaves(t.output)]
        for f in fcalls:
            if id(f) in used or f.start <= last or not _has_params(f.module):
                continue
            adapt = adapt_of(t, f)
            if [a.shape for a in _float_leaves(f.output)][:1] == [a.shape for a in _float_leaves(t.output, adapt)][:1] \
                    and tshape:
                used.add(id(f))
                pairs.append((t, f))
                last = f.start
                break
    return sorted(pairs, key=lambda p: p[0].start)


def _skeleton(obj: Any, arrays: list) -> Any:
    """A hashable stand-in for nested args with every array leaf moved to `arrays`."""
    import jax

    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_skeleton(o, arrays) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, _skeleton(v, arrays)) for k, v in obj.items()))
    if isinstance(obj, (jax.Array, np.ndarray)) or hasattr(obj, "aval"):
        arrays.append(obj)
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
    """One module's call, compiled per (module structure, call structure): a model's
    repeated layers share one program."""
    from flax import nnx

    m = nnx.merge(graphdef, state)
    args, kwargs = _rebuild(skel, arrays)
    out = m(*args, **kwargs)
    return out, nnx.state(m)


_APPLY = None


def call_module(module, args: tuple, kwargs: dict) -> Any:
    """module(*args, **kwargs) compiled (eager where the module cannot be traced); the
    module's state (RNG counts, statistics) is updated as an eager call would."""
    global _APPLY
    import jax
    from flax import nnx

    if _APPLY is None:
        _APPLY = jax.jit(_apply, static_argnums=(0, 1))
    arrays: list = []
    skel = _skeleton((args, kwargs), arrays)
    graphdef, state = nnx.split(module)
    try:
        hash(skel)
        out, new = _APPLY(graphdef, skel, state, arrays)
    except (TypeError, jax.errors.JAXTypeError, jax.errors.ConcretizationTypeError, jax.errors.UnexpectedTracerError):
        with jax.disable_jit():
            return module(*args, **kwargs)
    nnx.update(module, new)
    return out


def _run_alone(fcall: Call, torch_in: list[np.ndarray]) -> Any:
    """The Flax module's call with its float inputs replaced, in order, by torch's (adapted)."""
    import jax.numpy as jnp

    flat = [a for a in leaves((fcall.args, fcall.kwargs)) if is_float(a)]
    # strict=False: torch_in may hold more leaves than flat (the extra ones go unused)
    if len(torch_in) < len(flat) or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(flat, torch_in, strict=False)):
        return None
    swap = {id(a): jnp.asarray(b, dtype=a.dtype) for a, b in zip(flat, torch_in, strict=False)}

    args, kwargs = map_nested(lambda o: swap.get(id(o), o), (fcall.args, fcall.kwargs))
    return call_module(fcall.module, args, kwargs)


def _flax_run(fm, f_in: list, names: dict[str, Any]) -> tuple[Any, list[Call]]:
    """Run the port compiled, recording its submodule calls (their arrays leave the program
    as outputs); eager where it cannot be (a call recorded inside a scan or a jit of its own)."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(fm)
    box: dict[str, Any] = {}

    def program(state, xs):
        m = nnx.merge(graphdef, state)
        with record_flax(m, flax_modules(m)) as calls:
            out = m(*xs)
        arrays: list = []
        box["skel"] = [_skeleton((c.args, c.kwargs, c.output), arrays) for c in calls]
        box["calls"] = calls
        return out, arrays

    try:
        out, arrays = jax.jit(program)(state, list(f_in))
    except Exception:
        with jax.disable_jit(), record_flax(fm, names) as calls:
            out = fm(*f_in)
        return out, calls
    calls = box["calls"]
    for c, skel in zip(calls, box["skel"], strict=True):
        c.args, c.kwargs, c.output = _rebuild(skel, arrays)
        c.module = names[c.path]
    return out, calls


# ----------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------


def _torch_grads(tm, t_in, cots) -> dict[str, np.ndarray]:
    import torch

    with torch.enable_grad():
        tm.zero_grad(set_to_none=True)
        out = [a for a in leaves(tm(*t_in)) if a.is_floating_point()]
        sum((a * torch.from_numpy(c).to(a.dtype)).sum() for a, c in zip(out, cots, strict=True)).backward()
    return {n: (p.grad.detach().numpy() if p.grad is not None else np.zeros(tuple(p.shape)))
            for n, p in tm.named_parameters()}


def _grad_err(got: np.ndarray, want: np.ndarray, floor: float) -> float:
    """max|got - want| over the larger of max|want| and `floor`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max()) if want.size else 0.0, floor)
    if got.shape != want.shape or not np.isfinite(got).all() or scale == 0:
        return rel_err(got, want)
    return float(np.abs(got - want).max() / scale)


def _gradients(tm, fm, t_in, f_in, seed: int, rules, t64=None) -> tuple[dict[str, float], dict[str, float], str]:
    """Per copied parameter (by Flax path): the error of Flax's gradient against torch's
    (through the copy's transform) under one random cotangent on the float outputs, and, given
    torch's model in float64 (a float32 run), each gradient's tolerance: ten times torch's own
    float32 error on it, at least 1e-6."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    try:
        pairs = plan(tm, fm, rules)
    except PortError as e:
        return {}, {}, f"gradients not compared: the parameters do not pair ({e.problems[0]})"
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        shapes = [tuple(a.shape) for a in leaves(tm(*t_in)) if a.is_floating_point()]
    cots = [rng.standard_normal(s) for s in shapes]
    tgrads = _torch_grads(tm, t_in, cots)
    graphdef, params, rest = nnx.split(fm, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        outs = [a for a in leaves(m(*f_in)) if jnp.issubdtype(a.dtype, jnp.floating)]
        # strict=False: a wrong port may give more or fewer float outputs than torch, whose shapes made cots
        return sum(jnp.vdot(a, jnp.asarray(c, a.dtype)) for a, c in zip(outs, cots, strict=False))

    g = jax.jit(jax.grad(loss))(params)
    gm = nnx.merge(graphdef, g, rest)
    fgrads = {k: np.asarray(v.get_value()) for k, v in flax_variables(gm, nnx.Param).items()}
    # Each gradient relative to the larger of its own size and a thousandth of the model's
    # largest: a gradient that is zero in exact arithmetic (a key bias's, which softmax
    # cancels) is rounding noise on both sides, not a 100% error.
    floor = 1e-3 * max((float(np.abs(g).max()) for g in tgrads.values() if g.size), default=0.0)
    g64 = _torch_grads(t64, [x.double() if x.is_floating_point() else x for x in t_in], cots) if t64 is not None else {}
    errs, tols = {}, {}
    for t, f, tf in pairs:
        if f is not None and t in tgrads and f in fgrads:
            errs[f] = _grad_err(fgrads[f], tf(tgrads[t]), floor)
            if t in g64:
                tols[f] = max(10 * _grad_err(tf(tgrads[t]), tf(g64[t]), floor), FLOOR32)
    return errs, tols, ""


# ----------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------


def compare(torch_module, flax_module, *inputs, dtype: str = "float64", grads: bool = True,
            match: dict[str, str] | None = None, adapters: dict[str, Callable] | None = None,
            rules=None, seed: int = 0) -> PortReport:
    """Run `torch_module` and `flax_module` (its NNX port, weights already copied) on the same
    `inputs` (numpy arrays; float ones cast to `dtype`) and report every paired submodule.

    dtype: "float64" runs copies of both in float64 (x64 on for the call, highest matmul
    precision; tolerance 1e-12); "float32" runs them in float32 and judges each module
    against torch's own float32 noise (torch in float32 against torch in float64).
    match: {torch glob: flax glob} pairs submodules whose paths differ.
    adapters: {torch glob: f(numpy array) -> array} puts a torch module's inputs and outputs
    in the Flax layout (conv's (B, C, T) -> (B, T, C) and nn.MultiheadAttention's
    sequence-first layout are built in).
    rules: copy_weights' rules, used to pair parameters for the gradients.
    Both run as copies in the modes they were given (a port left in train mode, dropout on,
    is a mistake it names). Nothing is left changed: hooks and wrapped classes
    are removed, JAX's x64 flag and matmul precision are restored."""
    import torch

    if dtype not in ("float64", "float32"):
        raise ValueError(f"compare: dtype must be 'float64' or 'float32', got {dtype!r}")
    _refuse_self_comparison(torch_module, flax_module)
    with _precision(dtype):
        tm = _torch_copy(torch_module, dtype)
        fm = _flax_copy(flax_module, dtype)
        t_in, f_in = _inputs(inputs, dtype)
        try:
            with torch.no_grad(), record_torch(tm) as tcalls:
                t_out = tm(*t_in)
        except Exception as e:
            given = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in t_in)
            raise ValueError(f"compare: the torch module cannot run on the inputs given ({given}): "
                             f"{type(e).__name__}: {e}") from e
        names = flax_modules(fm)
        f_out, fcalls = _flax_run(fm, f_in, names)
        noise: dict[tuple[str, int], float] = {}
        if dtype == "float32":
            t64 = _torch_copy(torch_module, "float64")
            with torch.no_grad(), record_torch(t64) as calls64:
                t64(*[x.double() if x.is_floating_point() else x for x in t_in])
            # strict=False: the float64 copy may record other calls (a module that branches on dtype)
            for c32, c64 in zip(tcalls, calls64, strict=False):
                noise[(c32.path, c32.index)] = rel_err_leaves(_float_leaves(c32.output), _float_leaves(c64.output))

        def adapt_of(t: Call, f: Call) -> Callable | None:
            for glob, fn in (adapters or {}).items():
                if fnmatch.fnmatchcase(t.path, glob):
                    return fn
            return _builtin_adapter(t.module, f.module)

        def tol_of(t: Call) -> float:
            if dtype == "float64":
                return TOL64
            return max(10 * noise.get((t.path, t.index), 0.0), FLOOR32)

        pairs = _pair_calls(tcalls, fcalls, match, adapt_of)
        rows, locals_ = [], {}
        for t, f in pairs:
            adapt = adapt_of(t, f)
            t_outs = _float_leaves(t.output, adapt)
            t_ins = _float_leaves((t.args, t.kwargs), adapt)
            acc = rel_err_leaves(_float_leaves(f.output), t_outs)
            f_ins = _float_leaves((f.args, f.kwargs))
            inp = rel_err_leaves(f_ins, t_ins) if f_ins and t_ins else 0.0
            try:
                alone = _run_alone(f, t_ins)
            except Exception as e:  # a module that cannot run alone is reported, not fatal
                alone, note = None, f"cannot run alone ({type(e).__name__})"
            else:
                note = "" if alone is not None else "cannot run alone (inputs differ in structure)"
            local = rel_err_leaves(_float_leaves(alone), t_outs) if alone is not None else None
            locals_[id(t)] = alone
            rows.append(Row(t.path, f.path, t.index, acc, inp, local, None, tol_of(t), note=note))

        grad_errs, grad_note = {}, ""
        if grads:
            grad_errs, grad_tols, grad_note = _gradients(tm, fm, t_in, f_in, seed, rules,
                                                         t64 if dtype == "float32" else None)
            for row in rows:
                own = [p for p in grad_errs if p.rsplit(".", 1)[0] == row.flax_path or
                       ("." not in p and row.flax_path == "")]
                if own:  # the parameter furthest past (or nearest to) its tolerance speaks for the module
                    worst = max(own, key=lambda p: grad_errs[p] / grad_tols.get(p, row.tol))
                    row.grad, row.grad_tol = grad_errs[worst], grad_tols.get(worst, row.tol)
        out_err = rel_err_leaves(_float_leaves(f_out), _float_leaves(t_out))
        first = _locate(pairs, rows, locals_, adapt_of)
        if first is None and grads:
            first = _grad_divergence(rows)
        _statuses(rows, first)
        paired_t = {id(t) for t, _ in pairs}
        unpaired = sorted({c.path or "(root)" for c in tcalls if id(c) not in paired_t and _has_params(c.module)})
        report = PortReport(dtype, TOL64 if dtype == "float64" else FLOOR32, rows, first, out_err,
                            unpaired=unpaired, grads=grad_errs)
        if grad_note:
            report.unpaired.append(grad_note)
        return report


def _locate(pairs, rows, locals_, adapt_of) -> Divergence | None:
    """Walk the pairs in the order their calls started (a parent before its children): the
    first whose input differs is given a wrong input by its parent's code ("between"); the
    first that is wrong on a right input is searched for a child that explains it, else the
    fault is its own ("inside")."""
    cand = None
    for (t, f), row in zip(pairs, rows, strict=True):
        if cand is not None and not _within(t, cand[0][0]):
            break
        bad_local = row.local is not None and row.local > row.tol
        if row.input > row.tol:
            parent = _paired_parent(t, pairs)
            prev = _previous(t, parent, pairs)
            gap = _gap(t, prev, parent)
            if parent is None:
                return Divergence(t.path, f.path, "inherited", row.local or float("nan"),
                                  "the inputs differ before any module runs (an adapter?)")
            pf = next(ff for tt, ff in pairs if tt is parent)
            pr = rows[[tt for tt, _ in pairs].index(parent)]
            why = _swapped_axes(t, f, adapt_of(t, f), row.tol) or _explain(parent, pf, locals_, adapt_of, pr.tol)
            return Divergence(t.path, f.path, "between", row.local if row.local is not None else float("nan"),
                              why + gap, parent=parent.path, previous=prev.path if prev else None)
        if bad_local or (row.local is None and row.accumulated > row.tol):
            cand = ((t, f), row)
    if cand is None:
        return None
    (t, f), row = cand
    why = _explain(t, f, locals_, adapt_of, row.tol)
    return Divergence(t.path, f.path, "inside", row.local if row.local is not None else row.accumulated, why)


def _swapped_axes(t: Call, f: Call, adapt, tol: float) -> str | None:
    """The Flax module was given torch's input with two axes swapped (a transpose missing or
    extra in the parent's code: a square layout fits either way)."""
    t_in, f_in = _float_leaves((t.args, t.kwargs), adapt), _float_leaves((f.args, f.kwargs))
    # strict=False: a wrong port may take more or fewer float inputs than torch
    for a, b in zip(f_in, t_in, strict=False):
        for i in range(b.ndim):
            for j in range(i + 1, b.ndim):
                if b.shape[i] == b.shape[j] and rel_err(a, np.swapaxes(b, i, j)) <= tol:
                    return (f"layout: the flax port gives {f.path} torch's input with axes {i} and {j} swapped "
                            f"(a transpose missing or extra before it; the shape is square there, so it ran)")
    return None


def _within(c: Call, ancestor: Call) -> bool:
    while c is not None:
        if c is ancestor:
            return True
        c = c.parent
    return False


def _paired_parent(t: Call, pairs) -> Call | None:
    paired = {id(tt) for tt, _ in pairs}
    c = t.parent
    while c is not None and id(c) not in paired:
        c = c.parent
    return c


def _previous(t: Call, parent: Call | None, pairs) -> Call | None:
    """The last paired call inside `parent` that ended before `t` started."""
    done = [tt for tt, _ in pairs if tt.end < t.start and tt is not parent and (parent is None or _within(tt, parent))]
    return max(done, key=lambda c: c.end) if done else None


def _gap(t: Call, prev: Call | None, parent: Call | None) -> str:
    """The torch modules that ran between `prev` and `t` (unpaired ones: activations, dropout)."""
    if parent is None:
        return ""
    after = prev.end if prev else parent.start
    ran = [c.path for c in _descendants(parent) if after < c.start and c.end < t.start]
    return f" (torch runs {', '.join(ran)} there)" if ran else ""


def _descendants(c: Call) -> Iterator[Call]:
    for k in c.children:
        yield k
        yield from _descendants(k)


def _explain(t: Call, f: Call, locals_, adapt_of, tol: float) -> str:
    """The known mistake that makes torch's module compute what the Flax module computes on
    torch's recorded input; or what else the figures say."""
    alone = locals_.get(id(t))
    if alone is None:
        return "unexplained (the flax module cannot run alone on torch's input)"
    target = _float_leaves(alone)
    if any(np.asarray(a).dtype == np.float32 for a in leaves(alone)) and \
            any(to_numpy(a).dtype == np.float64 for a in leaves(t.output)):
        return ("the flax module computes in float32 inside the float64 run (a dtype=jnp.float32 or an astype in "
                f"{f.path or 'the root'}'s code)")
    again = _float_leaves(_run_alone(f, _float_leaves((t.args, t.kwargs), adapt_of(t, f))))
    if any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(again, target, strict=True)):
        return "train mode / dropout left on: the flax module gives two outputs for the same input"
    eps = sorted({float(getattr(n, a)) for n in flax_modules(f.module).values()
                  for a in ("epsilon", "eps") if isinstance(getattr(n, a, None), (int, float))} | set(EPS))
    adapt = adapt_of(t, f)
    said = explain(t.module, t.args, t.kwargs, target, tol, lambda o: _float_leaves(o, adapt), eps)
    if said is None and not all(np.isfinite(a).all() for a in target):
        return "unexplained: the flax module gives non-finite values on torch's input (a fully masked row?)"
    return said or "unexplained (no known porting mistake closes the gap)"


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
        bad_grad = r.grad is not None and r.grad > (r.grad_tol or r.tol)
        if r.local is not None and r.local > r.tol and r.input <= r.tol:
            r.status = "inside"
        elif r.input > r.tol or (r.accumulated > r.tol and r.local is not None):
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
