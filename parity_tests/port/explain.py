"""Name the porting mistake behind a divergence: replay torch's module on its own recorded
input with one known mistake of the catalogue (catalogue.py) made at a time, and see which
makes torch compute what the Flax port computes on that input; the first that brings torch's
output within the tolerance of the port's names it. nnx.LayerNorm's fast variance, whose
rounding no replay reproduces, is named by its signature instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .behaviour import norm_of
from .catalogue import Mistake, mistakes
from .errors import same_nan_err
from .pairing import fit


def gap(target: list[np.ndarray], outs: list[np.ndarray], dead: list | None = None) -> float:
    """The worst error of torch's outputs (fitted to the port's shapes) against the port's,
    non-finite values required in the same places; rows of queries a mistaken mask leaves no
    key (`dead`, (B, Tq) each) left out where an output is laid out (B, Tq, ...)."""
    n = min(len(target), len(outs))
    if n == 0:
        return float("inf")
    rows = np.logical_or.reduce([np.broadcast_to(d, dead[0].shape) for d in dead]) if dead else None
    errs = []
    for a, b in zip(target[:n], outs[:n], strict=True):
        a = np.asarray(a)
        g = fit(np.asarray(b), a.shape)
        if g is not None and rows is not None and rows.any() and a.shape[:rows.ndim] == rows.shape:
            a, g = a[~rows], g[~rows]
        errs.append(float("inf") if g is None else same_nan_err([a], [g]))
    return max(errs)


def _fast_variance(module, args: tuple, kwargs: dict, target: list[np.ndarray], tol: float) -> str | None:
    """nnx.LayerNorm's use_fast_variance=True (its default) seen in what it does: the port's
    output is torch's with each row's normaliser changed, on rows whose |mean| is many times
    their std (where E[x^2] - E[x]^2 cancels). Its rounding cannot be replayed in torch (the
    two sum in other orders), so its signature is read instead."""
    import torch

    n = norm_of(module)
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if n is None or n.kind != "layer" or len(target) != 1 or not floats:
        return None
    params = dict(module.named_parameters(recurse=False))
    w = next(p for k, p in params.items() if "bias" not in k).detach().double().numpy()
    b = next((p for k, p in params.items() if "bias" in k), None)
    b = 0.0 if b is None else b.detach().double().numpy()
    with torch.no_grad():
        y = module(*args, **kwargs).double().numpy()
    x = floats[0].double().numpy()
    keep = np.abs(w) > 1e-3 * np.abs(w).max()
    z_t, z_p = ((y - b) / np.where(keep, w, 1))[..., keep], ((target[0] - b) / np.where(keep, w, 1))[..., keep]
    r = (z_p * z_t).sum(-1, keepdims=True) / np.maximum((z_t * z_t).sum(-1, keepdims=True), 1e-300)
    spread = float(np.abs(r - 1).max())
    resid = float(np.abs(z_p - r * z_t).max() / max(np.abs(z_t).max(), 1e-300))
    ratio = float((x.mean(-1) ** 2 / np.maximum(x.var(-1), 1e-300)).max())
    if resid > tol or spread <= tol or ratio < 100 or spread > 1e3 * np.finfo(x.dtype).eps * ratio:
        return None
    return (f"norm: the flax port computes the variance as E[x^2] - E[x]^2 (nnx.LayerNorm's use_fast_variance=True, "
            f"its default) where torch computes E[(x - mean)^2]: here |mean| reaches {ratio ** 0.5:.0f} times the "
            f"std, and each row's normaliser is off by up to {spread:.1e} (use_fast_variance=False)")


def explain(torch_module, args: tuple, kwargs: dict, target: list[np.ndarray], tol: float,
            adapt: Callable[[Any], list[np.ndarray]], eps_values: list[float]) -> str | None:
    """The first known mistake that, made while `torch_module` reruns on its recorded input,
    brings its output (through `adapt`) within `tol` of `target` (the Flax module's output on
    that input); None when none does."""
    import torch

    def replay(m: Mistake) -> float:
        a, k = m.args(args, kwargs) if m.args is not None else (args, kwargs)
        with torch.enable_grad():  # as autograd would: nn.MultiheadAttention's no-grad fast path skips F
            return gap(target, adapt(torch_module(*a, **k)), m.dead)

    try:
        if replay(Mistake("")) <= tol:
            return None  # nothing to explain
    except Exception:
        return None
    for m in mistakes(torch_module, eps_values):
        if not (m.patches or m.forwards or m.swaps or m.args):
            continue
        try:
            m.dead.clear()
            with m.made() as count:
                err = replay(m)
        except Exception:
            continue
        if err <= tol:
            return m.sentence()
        for which in range(min(count[0], 4) if count[0] > 1 else 0):  # the mistake in one call only
            m.seen.clear()
            m.dead.clear()
            try:
                with m.made(which):
                    err = replay(m)
            except Exception:
                break
            if err <= tol:
                return m.sentence() + f" (in its call #{which + 1} of that function here)"
        m.seen.clear()
        m.dead.clear()
    try:
        return _fast_variance(torch_module, args, kwargs, target, tol)
    except Exception:
        return None
