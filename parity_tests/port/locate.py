"""Where a port first goes wrong, and why: walk the paired calls in the order they started
(a parent before its children) and name the first module that is given a wrong input
("between": its parent's code is at fault) or computes something else on a right one
("inside"); then say what the figures show: a module the port never calls, a term left out,
an argument that differs (a mask shifted, rotary pairs interleaved), weights that are not
torch's, or the known mistake that makes torch compute what the port computes (explain.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import rel_err
from .pairing import Pairing, compare_values, fit
from .record import Call, float_leaves
from .report import Divergence, Row


@dataclass
class Paired:
    """One torch call and its Flax counterpart with their figures: the row, how their
    arguments pair, the torch-to-flax layout adapter and the Flax module's output when run
    alone on torch's input (None: it could not run)."""

    t: Call
    f: Call
    row: Row
    args: Pairing
    adapt: Callable | None
    alone: Any


@dataclass
class Context:
    """What the diagnoses need beyond the pairs: every torch call, the Flax modules by path
    and the paths the port called, the state of each copied weight (flax path -> "same" /
    "transposed" / "differs" and its torch name), and the explainer of one pair."""

    tcalls: list[Call]
    fmodules: dict[str, Any]
    fcalled: set[str]
    weights: dict[str, tuple[str, str]]
    explain: Callable[[Paired], str]


def locate(pairs: list[Paired], ctx: Context) -> Divergence | None:
    """The first divergence of the forward pass, or None."""
    index = {id(p.t): p for p in pairs}
    cand: Paired | None = None
    for p in pairs:
        if cand is not None and not within(p.t, cand.t):
            break
        row = p.row
        if row.input > row.tol_in:
            parent = paired_parent(p.t, index)
            prev = previous(p.t, parent, pairs)
            if parent is None:
                return Divergence(p.t.path, p.f.path, "inherited", row.local if row.local is not None else float("nan"),
                                  "the inputs differ before any module runs (an adapter?)")
            return _between(p, index[id(parent)], prev, pairs, ctx)
        bad_local = row.local is not None and row.local > row.tol_local
        if bad_local or (row.local is None and row.accumulated > row.tol):
            cand = p
    if cand is None:
        return None
    skipped = _skipped_inside(cand, pairs, ctx)
    if skipped is not None:
        return skipped
    local = cand.row.local if cand.row.local is not None else cand.row.accumulated
    return Divergence(cand.t.path, cand.f.path, "inside", local, _inside_why(cand, ctx))


# ----------------------------------------------------------------------------------------
# The call tree
# ----------------------------------------------------------------------------------------


def within(c: Call | None, ancestor: Call) -> bool:
    while c is not None:
        if c is ancestor:
            return True
        c = c.parent
    return False


def descendants(c: Call) -> Iterator[Call]:
    for k in c.children:
        yield k
        yield from descendants(k)


def paired_parent(t: Call, index: dict[int, Paired]) -> Call | None:
    c = t.parent
    while c is not None and id(c) not in index:
        c = c.parent
    return c


def previous(t: Call, parent: Call | None, pairs: list[Paired]) -> Call | None:
    """The last paired call inside `parent` that ended before `t` started."""
    done = [p.t for p in pairs if p.t.end < t.start and p.t is not parent and (parent is None or within(p.t, parent))]
    return max(done, key=lambda c: c.end) if done else None


def _has_params(m) -> bool:
    return any(True for _ in m.parameters())


def never_called(c: Call, ctx: Context) -> bool:
    """A torch call of a module with parameters whose Flax module exists and never ran, nor
    anything inside it (an nnx.Dict whose layers the port calls is no skipped module)."""
    if c.path not in ctx.fmodules or not _has_params(c.module):
        return False
    inside = c.path + "."
    return not any(p == c.path or p.startswith(inside) or c.path == "" for p in ctx.fcalled)


# ----------------------------------------------------------------------------------------
# Diagnoses
# ----------------------------------------------------------------------------------------


def _data_pair(p: Paired):
    """The first float (data) argument pair of a call, the one a missing term would show in."""
    return next((a for a in p.args.pairs if a.torch is not None and a.flax.kind == "float" and not a.note), None)


def _term(p: Paired, c: Call, tol: float) -> str:
    """"leaves out" / "adds" when the port's input to `p` is torch's less / plus `c`'s output
    (broadcast), else ""."""
    a = _data_pair(p)
    outs = float_leaves(c.output)
    if a is None or not outs:
        return ""
    t_in = fit(a.torch.value, a.flax.value.shape)
    if t_in is None:
        return ""
    term = fit(outs[0], a.flax.value.shape)
    if term is None:
        try:
            term = np.broadcast_to(outs[0], a.flax.value.shape)
        except ValueError:
            return ""
    for sign, words in ((-1, "leaves out"), (1, "adds")):
        if rel_err(a.flax.value, t_in + sign * term) <= max(tol, 1e-9):
            return words
    return ""


def _skipped(c: Call, parent: Call, pairs: list[Paired], more: str = "") -> Divergence:
    """`c`, a module the port holds and never calls, as the divergence in its parent's code."""
    prev = previous(c, parent, pairs)
    said = (f"the flax port never calls {c.path} ({type(c.module).__name__}): it skips what torch computes there "
            f"in {parent.path or '(root)'}'s code{more}")
    return Divergence(c.path, c.path, "between", float("nan"), said, parent=parent.path,
                      previous=prev.path if prev else None)


def _between(p: Paired, parent: Paired, prev: Call | None, pairs: list[Paired], ctx: Context) -> Divergence:
    """`p` is given a wrong input by `parent`'s code: a module the port skips there, a term
    left out, an argument that differs, axes swapped, or a known mistake in `parent`."""
    t, pt = p.t, parent.t
    paths = {q.t.path for q in pairs}
    for c in descendants(pt):  # a module torch calls there that the port never does
        if c.start < t.start and c.path not in paths and never_called(c, ctx):
            left_out = _term(p, c, p.row.tol_in) == "leaves out"
            return _skipped(c, pt, pairs, f"; its input to {t.path} leaves out {c.path}'s output, which torch "
                            f"adds" if left_out else "")
    index = {id(q.t): q for q in pairs}
    why = _argument_differs(p) or _left_out(p, pt, index) or _swapped_axes(p) or _weights_of(parent, ctx, own=True) \
        or ctx.explain(parent)
    if why.startswith("unexplained"):
        why = facts(p, why) + f" (given a wrong input by {pt.path or '(root)'}'s code)"
    ran = [c.path for c in descendants(pt) if (prev.end if prev else pt.start) < c.start and c.end < t.start]
    gap = f" (torch runs {', '.join(ran)} there)" if ran else ""
    return Divergence(t.path, p.f.path, "between", p.row.local if p.row.local is not None else float("nan"),
                      why + gap, parent=pt.path, previous=prev.path if prev else None)


def _skipped_inside(cand: Paired, pairs: list[Paired], ctx: Context) -> Divergence | None:
    """A module inside `cand` that torch calls and the port never does (a final norm skipped:
    the port then returns what torch gives that module)."""
    paths = {q.t.path for q in pairs}
    for c in descendants(cand.t):
        if c.path in paths or not never_called(c, ctx):
            continue
        parent = c.parent
        while parent is not None and parent.path not in paths:
            parent = parent.parent
        got, given = float_leaves(cand.alone), float_leaves((c.args, c.kwargs))
        err = compare_values(got[0], given[0]) if got and given else None
        returns = err is not None and err <= max(cand.row.tol_local, 1e-9)
        return _skipped(c, parent or cand.t, pairs, f"; its {cand.f.path or '(root)'} returns what torch gives "
                        f"{c.path}" if returns else "")
    return None


def _argument_differs(p: Paired) -> str:
    """Words for an argument of `p` that holds other values than torch's: a mask, positions,
    or a rotary table in the other layout."""
    for a in p.args.pairs:
        if a.torch is None or a.note or a.err <= p.row.tol_in:
            continue
        if a.differs:
            return (f"mask: the mask the flax port gives {p.f.path or '(root)'} ({a.flax.name}) differs from "
                    f"torch's ({a.torch.name}): {a.differs}")
        if a.flax.kind == "int":
            return (f"{a.flax.name}: the flax port gives {p.f.path or '(root)'} other integers than torch gives it "
                    f"({a.torch.name}: ids or positions)")
        if a.flax.kind == "float" and a is not _data_pair(p):
            for t in [a.torch] + [t for t in p.args.torch_leaves if t.kind == "float" and t is not a.torch]:
                said = _layout(a.flax.value, t.value)
                if said:
                    return f"{a.flax.name} given to {p.f.path or '(root)'}: {said}"
    return ""


def _layout(f: np.ndarray, t: np.ndarray) -> str:
    """A rotary table (cos or sin) holding torch's values with its last axis laid out the
    other way: interleaved (f0 f0 f1 f1 ...) against halves (f0 f1 ... f0 f1 ...)."""
    r = t.shape[-1]
    if r % 2:
        return ""
    half = t[..., : r // 2]
    inter = np.repeat(half, 2, axis=-1)
    g = fit(inter, f.shape)
    if g is not None and rel_err(f, g) <= 1e-6:
        return ("rotary: the flax port's table holds the frequencies interleaved (f0 f0 f1 f1 ...: GPT-J's and "
                "Meta's layout) where torch's holds them in halves (f0 f1 ... f0 f1 ...: HF's rotate_half)")
    return ""


def _left_out(p: Paired, parent: Call, index: dict[int, Paired]) -> str:
    """The port's input to `p` is torch's less (or plus) the output of a module that ran
    before it in `parent` (one with parameters first: a dropout passes its input on)."""
    ran = [c for c in descendants(parent) if c.end < p.t.start and c.parent is parent]
    for c in sorted(reversed(ran), key=lambda c: not _has_params(c.module)):
        words = _term(p, c, max(p.row.tol_in, index[id(c)].row.tol if id(c) in index else 0.0))
        if words == "leaves out":
            return (f"the flax port leaves out {c.path}'s output ({type(c.module).__name__}), which torch adds in "
                    f"{parent.path or '(root)'}'s code before {p.t.path}")
        if words == "adds":
            return (f"the flax port adds {c.path}'s output ({type(c.module).__name__}) to {p.t.path}'s input, "
                    f"which torch does not (a residual added twice, or a parallel residual x + attn(x) + mlp(x) "
                    f"read as sequential)")
    return ""


def _swapped_axes(p: Paired) -> str:
    """The Flax module was given torch's input with two axes swapped (a transpose missing or
    extra in the parent's code: a square layout fits either way)."""
    for a in p.args.pairs:
        if a.torch is None or a.flax.kind != "float":
            continue
        f, t = a.flax.value, a.torch.value
        for i in range(t.ndim):
            for j in range(i + 1, t.ndim):
                if t.shape[i] == t.shape[j] and f.shape == t.shape and rel_err(f, np.swapaxes(t, i, j)) <= p.row.tol_in:
                    return (f"layout: the flax port gives {p.f.path} torch's input with axes {i} and {j} swapped "
                            f"(a transpose missing or extra before it; the shape is square there, so it ran)")
    return ""


def _weights_of(p: Paired, ctx: Context, own: bool = False) -> str:
    """Words for weights of `p`'s Flax module (its own only, or its whole subtree) that are
    not torch's."""
    path = p.f.path
    def held(k: str) -> bool:
        owner = k.rsplit(".", 1)[0] if "." in k else ""
        return owner == path or (not own and (path == "" or k.startswith(path + ".")))

    mine = {k: v for k, v in ctx.weights.items() if held(k)}
    flipped = [(k, tn) for k, (state, tn) in mine.items() if state == "transposed"]
    if flipped:
        k, tn = flipped[0]
        return (f"kernel: flax {k} holds torch's {tn} transposed (a square kernel: its shape cannot tell; torch's "
                f"nn.Linear stores (out, in), HF's Conv1D (in, out), flax (in, out))")
    differ = [k for k, (state, _) in mine.items() if state == "differs"]
    if differ:
        if not any(state == "same" for state, _ in ctx.weights.values()):
            return (f"weights: none of the port's {len(ctx.weights)} parameters holds torch's values "
                    f"(copy_weights(torch_module, flax_module) not called, or called on another model?)")
        return (f"weights: flax {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''} do not hold torch's "
                f"values (changed after copy_weights?)")
    return ""


def _inside_why(p: Paired, ctx: Context) -> str:
    """Why `p`'s Flax module computes something else than torch's on torch's input: only a
    mistake a replay confirmed (explain.py), else "unexplained" with the measured facts."""
    said = _weights_of(p, ctx) or ctx.explain(p)
    return facts(p, said) if said.startswith("unexplained") else said


def facts(p: Paired, said: str) -> str:
    """`said` ("unexplained ...") with what was measured: where, how large, which of the
    module's arguments differ from torch's (and how)."""
    row = p.row
    local = "-" if row.local is None else f"{row.local:.1e}"
    parts = [f"at {p.f.path or '(root)'} the local error is {local} (tolerance {row.tol_local:.0e}), its input's "
             f"{row.input:.1e}"]
    for a in p.args.pairs:
        if a.torch is None:
            parts.append(f"{a.flax.name} has no counterpart in torch's call")
        elif a.note:
            parts.append(f"{a.flax.name}: {a.note}")
        elif a.err > row.tol_in or a.sense == "inverted":
            parts.append(f"{a.flax.name} differs from torch's {a.torch.name} ({a.differs or f'error {a.err:.1e}'}"
                         f"{', read in the opposite sense' if a.sense == 'inverted' else ''})")
    return f"{said}; measured: " + "; ".join(parts)


def grad_divergence(rows: list[Row]) -> Divergence | None:
    """Forward equal everywhere but a gradient differs: the last module (in execution order)
    whose own parameters' gradients differ, the first the backward pass reaches."""
    bad = [r for r in rows if r.grad is not None and r.grad > (r.grad_tol or r.tol)]
    if not bad:
        return None
    r = bad[-1]
    return Divergence(r.torch_path, r.flax_path, "inherited", r.grad,
                      "the forward pass agrees but the gradients differ from here backward (a stop_gradient, detach or "
                      "custom gradient in one of the two?)")
