"""The two runs a comparison stands on: copies of both models in the precision asked for;
torch's run recorded, its float32 islands watched and rerun promoted to float64 for the noise
they carry (or, for a float32 comparison, torch's float64 run); the port's run recorded and
compiled with its gradients; and one module of the port run alone."""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import islands
from .errors import rel_err_leaves
from .gradients import FLOOR32, cotangents, flax_loss, torch_grads
from .record import Call, float_leaves, record_flax, record_torch
from .weights import flax_modules, flax_variables


@dataclass
class Runs:
    """Both runs of one comparison: the models' copies, their inputs, their outputs and
    recorded calls; the float32 islands torch made (id of a call -> the functions), each
    call's noise ((path, index) -> (output, input): against torch's float64 or promoted run),
    the cotangents and the port's gradients (by dotted path) when gradients are compared,
    and torch's float64 copy for a float32 comparison."""

    dtype: str
    tm: Any
    fm: Any
    t_in: list
    t_kw: dict
    f_in: list
    f_kw: dict
    t_out: Any
    f_out: Any
    tcalls: list[Call]
    fcalls: list[Call]
    names: dict[str, Any]
    found: dict[int, set[str]] = field(default_factory=dict)
    noise: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    cots: list[np.ndarray] | None = None
    fgrads: dict[str, np.ndarray] = field(default_factory=dict)
    t64: Any = None
    constants: list = field(default_factory=list)  # islands.Constant: float32 tables made at init


def run_both(torch_module, flax_module, inputs: tuple, named: dict, dtype: str, grads: bool, seed: int) -> Runs:
    """Copies of both models in `dtype`, run on the same inputs, recorded (call within
    precision(dtype))."""
    import torch

    tm = _torch_copy(torch_module, dtype)
    fm = _flax_copy(flax_module, dtype)
    t_in, f_in, t_kw, f_kw = _inputs(inputs, named, dtype)
    t_in, t_kw = by_name(tm, fm, t_in, t_kw)
    t_out, tcalls, found = _torch_run(tm, t_in, t_kw, watch_islands=dtype == "float64")
    constants = islands.init_constants(tm) if dtype == "float64" else []
    _mark_constants(tcalls, constants, found)
    names = flax_modules(fm)
    cots = cotangents(t_out, seed) if grads else None
    f_out, fcalls, fgrads = _flax_run(fm, f_in, f_kw, names, cots)
    runs = Runs(dtype, tm, fm, t_in, t_kw, f_in, f_kw, t_out, f_out, tcalls, fcalls, names, found, cots=cots,
                fgrads=fgrads, constants=constants)
    if dtype == "float32":
        runs.t64 = _torch_copy(torch_module, "float64")
        _, calls64, _ = _torch_run(runs.t64, [_double(x) for x in t_in], {k: _double(v) for k, v in t_kw.items()},
                                   watch_islands=False)
        runs.noise = _noise(tcalls, calls64)
    elif found:
        with torch.no_grad(), record_torch(tm) as rec, islands.promoted(), islands.wobbled(constants):
            tm(*t_in, **t_kw)
        runs.noise = _noise(tcalls, rec.calls)
    return runs


# ----------------------------------------------------------------------------------------
# Copies, precision, inputs
# ----------------------------------------------------------------------------------------


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
def precision(dtype: str) -> Iterator[None]:
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


def by_name(tm, fm, t_in: list, t_kw: dict) -> tuple[list, dict]:
    """torch's positional inputs handed over by the names the port's call gives them, where
    torch's forward has parameters of those names (GPT-J's second parameter is its cache,
    the port's is attention_mask); as they are otherwise. Keywords pass through."""
    import inspect

    def params(fn) -> list[inspect.Parameter]:
        try:
            return list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return []

    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    fnames = [p.name for p in params(fm.__call__) if p.kind in kinds][:len(t_in)]
    tparams = {p.name: p for p in params(tm.forward)}
    if [n for n, p in tparams.items() if p.kind in kinds][:len(t_in)] == fnames:
        return t_in, t_kw  # the same names in the same places
    if len(fnames) < len(t_in) or any(n not in tparams or tparams[n].kind not in
                                      (*kinds[1:], inspect.Parameter.KEYWORD_ONLY) or n in t_kw for n in fnames):
        return t_in, t_kw
    return [], {**dict(zip(fnames, t_in, strict=True)), **t_kw}


# ----------------------------------------------------------------------------------------
# One module of the port run alone
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


# ----------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------


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


def _noise(calls: list[Call], ref: list[Call]) -> dict[tuple, tuple[float, float]]:
    """(path, index) -> (output noise, input noise): torch's run against a reference run of
    the same model (float64 for a float32 run; float32 islands promoted for a float64 one)."""
    by_key = {(c.path, c.index): c for c in ref}
    out: dict[tuple, tuple[float, float]] = {}
    for c in calls:
        r = by_key.get((c.path, c.index))
        if r is None:
            continue
        out[(c.path, c.index)] = (rel_err_leaves(float_leaves(c.output), float_leaves(r.output)),
                                  rel_err_leaves(float_leaves((c.args, c.kwargs)), float_leaves((r.args, r.kwargs)))
                                  if float_leaves((c.args, c.kwargs)) else 0.0)
    return out


def _mark_constants(calls: list[Call], constants: list, found: dict[int, set[str]]) -> None:
    """Each call of a module holding a float32 constant made at init is an island ("init:"
    and the constant's name); a constant whose owner is never called marks the innermost call
    enclosing it."""
    for k in constants:
        own = [c for c in calls if c.module is k.owner]
        if not own:
            around = [c for c in calls if any(m is k.owner for m in c.module.modules())]
            own = [c for c in around if not any(d is not c and within_call(d, c) for d in around)]
        for c in own:
            found.setdefault(id(c), set()).add(f"init:{k.name}")


def within_call(c: Call | None, ancestor: Call) -> bool:
    while c is not None:
        if c is ancestor:
            return True
        c = c.parent
    return False


def local_noise(t: Call, constants: list | None = None) -> float:
    """How far torch's own module is, on its recorded input, from the same computation with
    its float32 islands in float64 (and its constants made at init moved by float32's
    rounding)."""
    import torch

    try:
        with torch.no_grad(), islands.promoted(), islands.wobbled(constants or []):
            again = t.module(*t.args, **t.kwargs)
    except Exception:
        return 0.0
    return rel_err_leaves(float_leaves(t.output), float_leaves(again))


def island_lines(calls: list[Call], found: dict[int, set[str]]) -> list[str]:
    """One line per class of module that computes in float32 inside torch's float64 run, and
    one per float32 constant made at init."""
    by_class: dict[str, list[str]] = {}
    made: dict[tuple[str, str], list[str]] = {}
    for c in calls:
        if id(c) in found and c.index == 0:
            held = ", ".join(sorted(f[5:] for f in found[id(c)] if f.startswith("init:")))
            if held:
                made.setdefault((type(c.module).__name__, held), []).append(c.path or "(root)")
            if any(not f.startswith("init:") for f in found[id(c)]):
                by_class.setdefault(type(c.module).__name__, []).append(c.path or "(root)")
    lines = [f"{cls} holds {name}, made at init: torch's `{paths[0]}` table was computed in float32 at init "
             f"(a constant holding float32's precision in the float64 run): judged at float32's floor (ten times the "
             f"noise of its float32 rounding, at least {FLOOR32:g}), as is what it feeds "
             f"[{', '.join(paths[:3])}{f', ... ({len(paths)} modules)' if len(paths) > 3 else ''}]"
             for (cls, name), paths in made.items()]
    for cls, paths in by_class.items():
        where = ", ".join(paths[:3]) + (f", ... ({len(paths)} modules)" if len(paths) > 3 else "")
        lines.append(f"{cls} computes in float32 in torch: judged at float32's floor (ten times torch's own "
                     f"float32 noise there, at least {FLOOR32:g}), as is what it feeds [{where}]")
    return lines


def holding(calls: list[Call], found: dict[int, set[str]]) -> set[int]:
    """The ids of the calls that are, or enclose, a float32 island."""
    out: set[int] = set()
    for c in calls:
        if id(c) in found:
            while c is not None and id(c) not in out:
                out.add(id(c))
                c = c.parent
    return out


def _double(v):
    import torch

    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def reference_grads(runs: Runs) -> Callable[[list[np.ndarray]], dict[str, np.ndarray]] | None:
    """torch's gradients in float64 for given cotangents, the reference a float32 run (the
    float64 model) or a float64 run with float32 islands (the islands promoted) judges its
    gradients by; None when there is nothing to judge by."""
    if runs.dtype == "float32":
        return lambda cots: torch_grads(runs.t64, [_double(x) for x in runs.t_in],
                                        {k: _double(v) for k, v in runs.t_kw.items()}, cots)
    if runs.found:
        def promoted(cots):
            with islands.promoted(), islands.wobbled(runs.constants):
                return torch_grads(runs.tm, runs.t_in, runs.t_kw, cots)
        return promoted
    return None
