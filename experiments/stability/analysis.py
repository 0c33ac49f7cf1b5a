"""Pure-numpy analysis of finished runs: the failure criterion and the fits the report uses.

Nothing here imports JAX, so the report can be regenerated from the JSON cells alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

PLATEAU_FRACTION = 0.5  # a run fails if it has not covered half of the way from l0 to H


def failure(heldout_loss: Sequence[float], train_loss: Sequence[float], l0: float,
            optimal_loss: float, fraction: float = PLATEAU_FRACTION, start: float | None = None) -> dict:
    """Classify one run as "trained", "plateau" or "diverged".

    heldout_loss: held-out loss after each step (steps,); train_loss: (steps,);
    l0: held-out loss at initialisation; optimal_loss: the task's H (text: its n-gram reference).
    start: where the way to H is measured from (default l0). The text task passes its unigram
    loss: there "trained" means half of the way from a context-free model to the n-gram
    reference, so a run that learned only character frequencies fails.

    diverged: a non-finite loss (or non-finite l0); `step` is the first such step (1-based:
      the loss after `step` updates; a non-finite training loss at index i counts as step i).
    plateau: final held-out loss > s - fraction * (s - H), s = start or l0; `step` is the first step
      from which the held-out loss stays above that threshold to the end (0: it never got below).
    Returns {"status", "step", "final_loss", "threshold"}.
    """
    held = np.asarray(heldout_loss, np.float64)
    train = np.asarray(train_loss, np.float64)
    s = l0 if start is None else start
    threshold = s - fraction * (s - optimal_loss)
    bad_train = np.flatnonzero(~np.isfinite(train))
    bad_held = np.flatnonzero(~np.isfinite(held))
    if not math.isfinite(l0) or bad_train.size or bad_held.size:
        first = [int(i) for i in (bad_train[:1]) ] + [int(i) + 1 for i in bad_held[:1]]
        return {"status": "diverged", "step": min(first) if first else 0,
                "final_loss": None, "threshold": None}
    final = float(held[-1])
    if final <= threshold:
        return {"status": "trained", "step": None, "final_loss": final, "threshold": float(threshold)}
    below = np.flatnonzero(held <= threshold)
    step = int(below[-1]) + 2 if below.size else 0  # held[i] is the loss after step i + 1
    return {"status": "plateau", "step": step, "final_loss": final, "threshold": float(threshold)}


def growth_factor(values: Sequence[float]) -> float:
    """End-to-end factor of a least-squares fit of log(values) against position in [0, 1].

    For per-layer gradient norms g_1..g_L this is the fitted g_L / g_1: > 1 rising toward the
    output, < 1 falling, ~1 level. Less sensitive to one noisy layer than g_L / g_1 itself.
    """
    v = np.asarray(values, np.float64)
    if v.size < 2 or np.any(~np.isfinite(v)) or np.any(v <= 0):
        return float("nan")
    x = np.linspace(0.0, 1.0, v.size)
    slope = np.polyfit(x, np.log(v), 1)[0]
    return float(np.exp(slope))


def power_law_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """p of the least-squares fit y ~ c * x^p in log-log space (needs >= 2 distinct xs)."""
    x = np.log(np.asarray(xs, np.float64))
    y = np.log(np.asarray(ys, np.float64))
    if x.size < 2 or np.unique(x).size < 2 or np.any(~np.isfinite(y)):
        return float("nan")
    return float(np.polyfit(x, y, 1)[0])


def linear_fit(ys: Sequence[float]) -> tuple[float, float, float]:
    """Fit y_l = a + b * l for l = 0..n-1: returns (a, b, R^2)."""
    y = np.asarray(ys, np.float64)
    x = np.arange(y.size, dtype=np.float64)
    if y.size < 3 or np.any(~np.isfinite(y)):
        return float("nan"), float("nan"), float("nan")
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    total = np.sum((y - y.mean()) ** 2)
    r2 = 1.0 - float(np.sum(resid ** 2) / total) if total > 0 else float("nan")
    return float(a), float(b), r2


def clipped_loss(final: float | None, l0: float) -> float:
    """min(final loss, initial loss); a diverged run (None / non-finite) counts as l0.

    Wortsman et al. 2023's clipping: a run that ends worse than where it started (or never
    ends) costs exactly as much as one that did not move."""
    if final is None or not math.isfinite(final):
        return float(l0)
    return float(min(final, l0))


def lr_sensitivity(losses: Sequence[float]) -> float:
    """Wortsman et al. 2023's LR sensitivity from clipped losses, one per learning rate of the
    grid: mean over the grid of [loss(lr) - min over the grid]. 0 = every LR equally good."""
    v = np.asarray(losses, np.float64)
    if v.size == 0 or np.any(~np.isfinite(v)):
        return float("nan")
    return float(np.mean(v - v.min()))


def trajectory_max(values: Sequence) -> float:
    """Largest finite value of a trajectory (e.g. probe points x layers), NaN if none is finite."""
    v = np.asarray(values, np.float64)
    finite = v[np.isfinite(v)]
    return float(finite.max()) if finite.size else float("nan")
