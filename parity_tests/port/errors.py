"""Relative errors, as the port checker measures them."""

from __future__ import annotations

from typing import Any

import numpy as np


def rel_err(a: Any, b: Any) -> float:
    """max|a - b| / max|b| (inf for other shapes or non-finite values)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    scale = np.abs(b).max() if b.size else 0.0
    return float(np.abs(a - b).max() / scale) if scale > 0 else float(np.abs(a - b).max())


def rel_err_leaves(flax: list, torch: list) -> float:
    """The worst rel_err over paired leaves (inf when there is nothing to pair)."""
    n = min(len(flax), len(torch))
    return max((rel_err(flax[i], torch[i]) for i in range(n)), default=float("inf"))


def same_nan_err(flax: list, torch: list) -> float:
    """rel_err_leaves where both sides may hold non-finite values in the same places (a fully
    masked row): those places must agree, the rest is compared."""
    errs = []
    # strict=False: a wrong port may give more or fewer leaves than torch; compare the ones both give
    for a, b in zip(flax, torch, strict=False):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not np.array_equal(~np.isfinite(a), ~np.isfinite(b)):
            return float("inf")
        ok = np.isfinite(b)
        errs.append(rel_err(a[ok], b[ok]) if ok.any() else 0.0)
    return max(errs, default=float("inf"))
