"""Pair a torch call's arguments and outputs with its port's by value, not by structure.

A porter hands a layer what the layer needs in the port's own shapes: positions of shape (T,)
where HF looks them up with (1, T); a (B, 1, 1, T) padding mask, boolean or additive, where HF
gives its layers a (B, 1, T, T) one holding the causal part too; (cos, sin) of (T, D) where
HF's rotary module gives (1, T, D). Two arrays that hold the same values up to broadcasting
(leading ones, a dimension the smaller one repeats) are the same argument; two masks are
compared as what they let attend. What cannot be reconciled is said once, and the local run
then takes the port's own value.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import rel_err
from .record import to_numpy

MASKED = -1e3  # an additive mask's entry at or below this masks its key


@dataclass
class Leaf:
    """One array of a call: its name ("hidden_states", "position_embeddings[1]", "argument 2"),
    its values (numpy, in the flax layout for a torch leaf), the object itself (to swap in a
    local run) and its kind: "float" (data), "mask" (bool, or additive 0 / very negative) or
    "int" (ids, positions)."""

    name: str
    value: np.ndarray
    ref: Any
    kind: str


@dataclass
class ArgPair:
    """A flax leaf and the torch leaf holding the same argument (None: no counterpart). err:
    the relative error of a float pair; for masks and ints 0 (equal) or 1 (they differ).
    sense: a mask pair's reading ("keep": True = may attend on both sides after
    canonicalising; "inverted": the port's holds the opposite). note: why a pair could not be
    reconciled (the local run then keeps the port's own value)."""

    flax: Leaf
    torch: Leaf | None
    err: float = 0.0
    sense: str = "keep"
    note: str = ""
    fitted: np.ndarray | None = None  # torch's value in the flax leaf's shape and representation
    differs: str = ""  # how two masks differ, in words


@dataclass
class Pairing:
    """How a call's arguments pair: one ArgPair per flax leaf, and all of torch's leaves."""

    pairs: list[ArgPair] = field(default_factory=list)
    torch_leaves: list[Leaf] = field(default_factory=list)

    @property
    def error(self) -> float:
        """The worst error over the reconciled pairs (0.0 when there are none)."""
        return max((p.err for p in self.pairs if p.torch is not None and not p.note), default=0.0)

    def notes(self) -> list[str]:
        return [p.note for p in self.pairs if p.note]


# ----------------------------------------------------------------------------------------
# Leaves with names
# ----------------------------------------------------------------------------------------


def kind_of(a: np.ndarray) -> str:
    if a.dtype == np.bool_:
        return "mask"
    if np.issubdtype(a.dtype, np.integer):
        return "int"
    if np.issubdtype(a.dtype, np.floating) and a.ndim >= 2 and a.size:
        masked = a <= MASKED
        if masked.any() and np.all(masked | (a == 0)):
            return "mask"
    return "float" if np.issubdtype(a.dtype, np.floating) else "other"


def _bound(fn, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) of each argument, named by `fn`'s signature where it binds."""
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    out: list[tuple[str, Any]] = []
    for name, value in bound.arguments.items():
        kind = inspect.signature(fn).parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            out += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif kind == inspect.Parameter.VAR_KEYWORD:
            out += list(value.items())
        else:
            out.append((name, value))
    return out


def _walk(name: str, obj: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            _walk(f"{name}[{i}]", o, out)
    elif isinstance(obj, dict):
        for k, o in obj.items():
            _walk(f"{name}.{k}", o, out)
    elif hasattr(obj, "shape") and hasattr(obj, "dtype"):
        out.append((name, obj))


def named_leaves(fn, args: tuple, kwargs: dict, adapt=None) -> list[Leaf]:
    """The array leaves of a call, named by `fn`'s signature; `adapt` puts a torch array in
    the flax layout."""
    flat: list[tuple[str, Any]] = []
    for name, value in _bound(fn, args, kwargs):
        _walk(name, value, flat)
    out = []
    for name, ref in flat:
        a = to_numpy(ref)
        if adapt is not None and np.issubdtype(a.dtype, np.floating):
            a = adapt(a)
        kind = kind_of(a)
        if kind != "other":
            out.append(Leaf(name, a, ref, kind))
    return out


# ----------------------------------------------------------------------------------------
# Shapes: the same values up to broadcasting
# ----------------------------------------------------------------------------------------


def _strip(shape: tuple) -> tuple:
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


def fit(a: np.ndarray, shape: tuple) -> np.ndarray | None:
    """`a` in `shape` when it holds the same values: equal but for leading ones; broadcast
    where `a` has ones; reduced where `a` repeats itself along an axis `shape` has as one
    (or lacks); a batch-first array of fewer axes read with ones after its first ((B, T)
    as (B, 1, 1, T), a padding mask). None when it cannot."""
    shape = tuple(shape)
    if a.shape == shape:
        return a
    if _strip(a.shape) == _strip(shape):
        return a.reshape(shape)
    out = _fit(a, shape)
    if out is None and 1 < a.ndim < len(shape):
        out = _fit(a.reshape(a.shape[0], *(1,) * (len(shape) - a.ndim), *a.shape[1:]), shape)
    if out is None and 1 < len(shape) < a.ndim:
        wide = _fit(a, (shape[0], *(1,) * (a.ndim - len(shape)), *shape[1:]))
        out = None if wide is None else wide.reshape(shape)
    return out


def _fit(a: np.ndarray, shape: tuple) -> np.ndarray | None:
    try:
        common = np.broadcast_shapes(a.shape, shape)
    except ValueError:
        return None
    x = np.broadcast_to(a, common)
    target = (1,) * (len(common) - len(shape)) + shape
    for axis, (n, m) in enumerate(zip(common, target, strict=True)):
        if m == 1 and n != 1:
            first = np.take(x, [0], axis=axis)
            if not np.array_equal(x, np.broadcast_to(first, x.shape), equal_nan=True):
                return None
            x = first
    return np.broadcast_to(x, target).reshape(shape)


def compare_values(f: np.ndarray, t: np.ndarray) -> float | None:
    """rel_err of a flax array against a torch one holding the same values up to
    broadcasting; None when their shapes cannot be reconciled."""
    g = fit(t, f.shape)
    if g is not None:
        return rel_err(f, g)
    g = fit(f, t.shape)
    return rel_err(g, t) if g is not None else None


def paired_outputs(f_leaves: list[np.ndarray], t_leaves: list[np.ndarray]) -> float:
    """The worst error of a call's float outputs, paired in order, up to broadcasting (inf
    when there is nothing to pair or a pair cannot be reconciled)."""
    n = min(len(f_leaves), len(t_leaves))
    if n == 0:
        return float("inf")
    errs = [compare_values(f_leaves[i], t_leaves[i]) for i in range(n)]
    return max(float("inf") if e is None else e for e in errs)


# ----------------------------------------------------------------------------------------
# Masks: what each lets attend
# ----------------------------------------------------------------------------------------


def keep_of(leaf: Leaf) -> np.ndarray:
    """True where the mask lets a query attend a key, read as "True / 0 = may attend" (the
    sense is settled by comparing with the other side)."""
    a = leaf.value
    if a.dtype == np.bool_:
        return a
    if np.issubdtype(a.dtype, np.integer):
        return a != 0
    return a > MASKED


def _mask_diff(f_keep: np.ndarray, t_keep: np.ndarray) -> tuple[str, str]:
    """(sense, what differs) between two masks already in one shape: sense "keep" or
    "inverted" (whichever disagrees less), what differs "" when they agree."""
    bad_keep, bad_inv = int((f_keep != t_keep).sum()), int((f_keep == t_keep).sum())
    sense = "keep" if bad_keep <= bad_inv else "inverted"
    f = f_keep if sense == "keep" else ~f_keep
    if bad_keep == 0 or bad_inv == 0:
        return sense, ""
    return sense, describe_mask_difference(f, t_keep)


def describe_mask_difference(f: np.ndarray, t: np.ndarray) -> str:
    """Words for how a port's mask `f` differs from torch's `t` (both True = may attend, one
    shape, (..., Tq, Tk))."""
    if f.ndim >= 2 and f.shape[-1] == f.shape[-2]:
        n = f.shape[-1]
        upper = np.triu(np.ones((n, n), bool), 1)
        diag = np.eye(n, dtype=bool)
        superdiag = np.eye(n, k=1, dtype=bool)
        torch_causal = not (t & upper).any()
        extra, missing = f & ~t, t & ~f
        if torch_causal and not missing.any() and extra.any() and not (extra & ~superdiag).any():
            return ("a causal mask shifted by one: each query may also see the next key (tril(k=1) where torch uses "
                    "tril)")
        if torch_causal and not extra.any() and missing.any() and not (missing & ~diag).any():
            return ("a causal mask shifted by one: no query may see its own key (tril(k=-1), or triu(k=0) as the "
                    "masked part, where torch uses tril)")
        if torch_causal and not missing.any() and extra.any() and not (extra & ~upper).any():
            return "no causal part: queries may see future keys, which torch masks"
    extra, missing = f & ~t, t & ~f
    if extra.any() and not missing.any():
        return f"it lets {int(extra.sum())} query-key pairs attend that torch masks (padding not applied?)"
    if missing.any() and not extra.any():
        return f"it masks {int(missing.sum())} query-key pairs that torch lets attend"
    return f"they differ in {int((f != t).sum())} of {f.size} entries"


def _pair_masks(f: Leaf, t: Leaf) -> ArgPair | None:
    fk, tk = keep_of(f), keep_of(t)
    g = fit(tk, fk.shape)
    if g is not None:
        sense, diff = _mask_diff(fk, g)
        return ArgPair(f, t, err=1.0 if diff else 0.0, sense=sense, differs=diff,
                       fitted=_represent(g if sense == "keep" else ~g, f))
    g = fit(fk, tk.shape)
    if g is None:
        big = np.broadcast_shapes(fk.shape, tk.shape) if _broadcastable(fk.shape, tk.shape) else None
        if big is None:
            return None
        fb, tb = np.broadcast_to(fk, big), np.broadcast_to(tk, big)
    else:
        fb, tb = g, tk
    sense, diff = _mask_diff(fb, tb)
    f_read = fb if sense == "keep" else ~fb
    n = tb.shape[-1]
    upper = np.triu(np.ones((n, n), bool), 1) if tb.ndim >= 2 and tb.shape[-2] == n else None
    if diff and upper is not None and not (f_read & ~tb & ~upper).any() and not (tb & ~f_read).any():
        # torch's holds a causal part the port's does not: the port applies it inside
        return ArgPair(f, t, sense=sense, note=f"torch's mask {tuple(t.value.shape)} holds the causal part, the "
                                              f"port's {tuple(f.value.shape)} does not (it applies it inside)")
    return ArgPair(f, t, err=1.0 if diff else 0.0, sense=sense, differs=diff)


def _broadcastable(a: tuple, b: tuple) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def _represent(keep: np.ndarray, like: Leaf) -> np.ndarray:
    """A True = may-attend mask in the representation of the port's mask `like`."""
    a = like.value
    if a.dtype == np.bool_:
        return keep
    if np.issubdtype(a.dtype, np.integer):
        return keep.astype(a.dtype)
    low = a.min() if a.size and a.min() <= MASKED else np.finfo(a.dtype).min
    return np.where(keep, 0.0, low).astype(a.dtype)


# ----------------------------------------------------------------------------------------
# A call's arguments
# ----------------------------------------------------------------------------------------


def pair_arguments(f_leaves: list[Leaf], t_leaves: list[Leaf]) -> Pairing:
    """Each flax leaf with the torch leaf holding the same argument: floats with floats (the
    nearest by value among those whose shapes reconcile, in order on ties), masks with masks
    (or an int 0 / 1 mask), ints with ints (equal values first)."""
    used: set[int] = set()
    out = Pairing(torch_leaves=list(t_leaves))
    for f in f_leaves:
        best: ArgPair | None = None
        for i, t in enumerate(t_leaves):
            if i in used:
                continue
            cand = _candidate(f, t)
            if cand is not None and (best is None or cand.err < best.err):
                best, best_i = cand, i
                if cand.err == 0.0:
                    break
        if best is None:
            trivial = (f.value.dtype == np.bool_ and f.value.all()) or (f.kind != "int" and not f.value.any())
            out.pairs.append(ArgPair(f, None, note="" if trivial else  # a mask that masks nothing: torch's None
                                     f"{f.name}: no torch argument holds its values up to broadcasting "
                                     f"({tuple(f.value.shape)} {f.value.dtype})"))
            continue
        used.add(best_i)
        out.pairs.append(best)
    return out


def _candidate(f: Leaf, t: Leaf) -> ArgPair | None:
    if f.kind == "float" and t.kind == "float":
        err = compare_values(f.value, t.value)
        if err is None:
            return None
        g = fit(t.value, f.value.shape)
        return ArgPair(f, t, err=err, fitted=g)
    if f.kind == "mask" and (t.kind == "mask" or (t.kind == "int" and _binary(t.value))):
        return _pair_masks(f, t)
    if f.kind == "int" and t.kind == "mask" and _binary(f.value):
        return _pair_masks(f, t)
    if f.kind == "int" and t.kind == "int":
        g = fit(t.value, f.value.shape)
        if g is None:
            h = fit(f.value, t.value.shape)
            if h is None:
                return None
            return ArgPair(f, t, err=0.0 if np.array_equal(h, t.value) else 1.0)
        return ArgPair(f, t, err=0.0 if np.array_equal(g, f.value) else 1.0, fitted=g)
    return None


def _binary(a: np.ndarray) -> bool:
    return a.size > 0 and bool(np.isin(a, (0, 1)).all())
