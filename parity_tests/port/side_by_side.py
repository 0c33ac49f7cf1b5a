"""compare: run a torch module and its Flax NNX port side by side, module by module (the
module is not named compare.py: `parity_tests.port.compare` is the function)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import numpy as np

from .explain import explain
from .gradients import FLOOR32, gradients, planned, weight_states
from .locate import Context, Paired, grad_divergence, locate, never_called, within
from .pairing import Pairing, compare_values, named_leaves, pair_arguments, paired_outputs
from .record import Call, float_leaves, leaves, map_nested, to_numpy
from .report import Divergence, PortReport, Row
from .runs import (
    Runs,
    call_module,
    computes_in_float32,
    holding,
    island_lines,
    local_noise,
    precision,
    reference_grads,
    run_both,
)
from .weights import flax_modules

TOL64 = 1e-12  # float64: both sides round at 1e-16; a real mistake is far above
EPS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-3)


# ----------------------------------------------------------------------------------------
# Refusals, layouts
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


def _builtin_adapter(tm, fm) -> Callable[[np.ndarray], np.ndarray] | None:
    """Known layout differences between a torch layer and its NNX counterpart."""
    import torch.nn as nn

    if isinstance(tm, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return lambda a: np.moveaxis(a, 1, -1) if a.ndim >= 3 else a  # (B, C, ...) -> (B, ..., C)
    if isinstance(tm, nn.MultiheadAttention) and not tm.batch_first:
        return lambda a: np.swapaxes(a, 0, 1) if a.ndim == 3 else a  # (T, B, E) -> (B, T, E)
    return None


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
        tshape = [a.shape for a in float_leaves(t.output)]
        last = _last_start(pairs, t)
        for f in fcalls:
            if id(f) in used or f.start <= last or not _has_params(f.module):
                continue
            f_out = float_leaves(f.output)
            t_out = float_leaves(t.output, adapt_of(t, f))
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
    (HF's RMSNorm, rotary angles, eager softmax), or the port does, those modules are named and
    judged at float32's floor: ten times the gap between torch's run and the same run with its
    float32 computations promoted to float64, at least 1e-6, as is everything they feed; a
    module with no float32 inside, run alone on torch's input, stays at 1e-12. "float32" runs
    both in float32 and judges each module against torch's own float32 noise (torch in
    float32 against torch in float64).
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
    with precision(dtype):
        runs = run_both(torch_module, flax_module, inputs, named_inputs, dtype, grads, seed)

        def adapt_of(t: Call, f: Call) -> Callable | None:
            for glob, fn in (adapters or {}).items():
                if fnmatch.fnmatchcase(t.path, glob):
                    return fn
            return _builtin_adapter(t.module, f.module)

        paired, notes = _paired_rows(runs, _pair_calls(runs.tcalls, runs.fcalls, match, adapt_of), adapt_of)
        rows = [p.row for p in paired]
        f32cache: dict = {}
        port_islands = _port_islands(paired, f32cache) if dtype == "float64" else []
        copied = planned(runs.tm, runs.fm, rules)
        grad_errs, grad_notes = _gradient_rows(runs, rows, copied, bool(port_islands)) if grads else ({}, [])
        eps = _eps_values(runs.fm)
        ctx = Context(runs.tcalls, runs.names, {c.path for c in runs.fcalls}, weight_states(runs.tm, runs.fm, copied),
                      lambda p: _explain(p, eps, f32cache if dtype == "float64" else None))
        first = locate(paired, ctx)
        if first is None and grads:
            first = grad_divergence(rows)
        dropout = _torch_dropout_on(torch_module)
        if first is not None and dropout:
            first.explanation = (f"torch's model is in train mode with dropout on ({dropout}): its outputs are "
                                 f"random; call .eval() on it (transformers builds a model from a config in train "
                                 f"mode). The figures otherwise say: {first.explanation}")
        rows += _never_called_rows(runs.tcalls, paired, ctx)
        rows.sort(key=lambda r: _start_of(r, runs.tcalls))
        _statuses(rows, first)
        paired_t = {id(p.t) for p in paired}
        unpaired = sorted({c.path or "(root)" for c in runs.tcalls if id(c) not in paired_t and _has_params(c.module)})
        return PortReport(dtype, TOL64 if dtype == "float64" else FLOOR32, rows, first,
                          paired_outputs(float_leaves(runs.f_out), float_leaves(runs.t_out)), unpaired=unpaired,
                          grads=grad_errs,
                          islands=island_lines(runs.tcalls, runs.found) + port_islands,
                          notes=[_note(said, where) for said, where in notes.items()] + grad_notes)


def _paired_rows(runs: Runs, pairs: list[tuple[Call, Call]], adapt_of) -> tuple[list[Paired], dict[str, list[str]]]:
    """A row for each paired call: its arguments paired by value, the accumulated, input and
    local errors, and their tolerances; and the notes on arguments that did not reconcile
    (said -> where)."""
    holds = holding(runs.tcalls, runs.found)
    paired: list[Paired] = []
    notes: dict[str, list[str]] = {}
    for t, f in pairs:
        adapt = adapt_of(t, f)
        args = pair_arguments(named_leaves(f.module.__call__, f.args, f.kwargs),
                              named_leaves(t.module.forward, t.args, t.kwargs, adapt))
        t_outs = float_leaves(t.output, adapt)
        try:
            alone, note = _run_alone(f, args), ""
        except Exception as e:  # a module that cannot run alone is reported, not fatal
            alone, note = None, f"cannot run alone ({type(e).__name__}: {str(e)[:80]})"
        local = paired_outputs(float_leaves(alone), t_outs) if alone is not None else None
        tol, tol_in, tol_local = _tolerances(runs, t, id(t) in holds)
        if tol_in > TOL64 and _unconsumed(args):
            tol_local = max(tol_local, tol)  # torch's noisy argument the port computes for itself
        for said in args.notes():
            notes.setdefault(said, []).append(f.path or "(root)")
        row = Row(t.path, f.path, t.index, paired_outputs(float_leaves(f.output), t_outs), args.error, local, None,
                  tol, note=note, input_tol=None if tol_in == tol else tol_in,
                  local_tol=None if tol_local == tol else tol_local)
        if id(t) in runs.found:
            row.note = (row.note + " " if row.note else "") + "float32 in torch"
        paired.append(Paired(t, f, row, args, adapt, alone))
    return paired, notes


def _tolerances(runs: Runs, t: Call, holds_island: bool) -> tuple[float, float, float]:
    """(accumulated, input, local) tolerances of a call. float32: ten times torch's own noise
    on what it gives and on what it is given, at least 1e-6. float64: 1e-12, or where a
    float32 island of torch's reaches, ten times the noise it carries, at least 1e-6; the
    local run of a module holding no island stays at 1e-12."""
    out_n, in_n = runs.noise.get((t.path, t.index), (0.0, 0.0))
    if runs.dtype == "float32":
        tol = max(10 * out_n, FLOOR32)
        return tol, max(10 * in_n, FLOOR32), tol

    def judged(n: float) -> float:
        return TOL64 if n <= TOL64 / 10 else max(10 * n, FLOOR32)

    local = max(10 * local_noise(t, runs.constants), FLOOR32) if holds_island else TOL64
    return judged(out_n), judged(in_n), local


def _gradient_rows(runs: Runs, rows: list[Row], copied, port_floor: bool) -> tuple[dict[str, float], list[str]]:
    """Each row's worst gradient error over its own parameters (and its tolerance); returns
    every parameter's error (by Flax path) and the notes on gradients not compared."""
    errs, tols, notes = gradients(runs.tm, copied, runs.fgrads, runs.t_in, runs.t_kw, runs.cots,
                                  reference_grads(runs))
    for row in rows:
        own = [p for p in errs if p.rsplit(".", 1)[0] == row.flax_path or ("." not in p and row.flax_path == "")]
        if own:  # the parameter furthest past (or nearest to) its tolerance speaks for the module
            worst = max(own, key=lambda p: errs[p] / tols.get(p, row.tol))
            row.grad, row.grad_tol = errs[worst], tols.get(worst, row.tol)
            if port_floor:  # the backward pass runs through the port's float32 everywhere
                row.grad_tol = max(row.grad_tol, FLOOR32)
    return errs, notes


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
    return [f"{cls} computes in float32 in the port: judged at float32's floor ({FLOOR32:g}), as is what follows "
            f"it [{', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}]" for cls, paths in found.items()]


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


def _torch_dropout_on(module) -> str:
    """The torch model's dropout modules that draw in its mode (train mode, p > 0), named."""
    import torch.nn as nn

    on = [name or "(root)" for name, m in module.named_modules()
          if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
    return ", ".join(on[:3]) + (f", ... ({len(on)} modules)" if len(on) > 3 else "")


def _unconsumed(args: Pairing) -> bool:
    """Whether torch's call holds a float argument no argument of the port's pairs with (the
    port computes it itself: a rotary table)."""
    used = {id(p.torch.ref) for p in args.pairs if p.torch is not None}
    return any(leaf.kind == "float" and id(leaf.ref) not in used for leaf in args.torch_leaves)


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
    target = float_leaves(p.alone)
    if any(np.asarray(a).dtype == np.float32 for a in leaves(p.alone)) and \
            any(to_numpy(a).dtype == np.float64 for a in leaves(p.t.output)):
        return ("the flax module computes in float32 inside the float64 run (a dtype=jnp.float32 or an astype in "
                f"{p.f.path or 'the root'}'s code)")
    again = float_leaves(_run_alone(p.f, p.args))
    if any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(again, target, strict=True)):
        return "train mode / dropout left on: the flax module gives two outputs for the same input"
    tol = p.row.tol_local
    if f32cache is not None and computes_in_float32(p.f.module, *_alone_args(p.f, p.args), f32cache):
        tol = max(tol, FLOOR32)
    said = explain(p.t.module, p.t.args, p.t.kwargs, target, tol,
                   lambda o: float_leaves(o, p.adapt), eps)
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
