"""The benchmarks' timer and statistics: every contender of a configuration timed in the same
repeats, in a shuffled order each repeat, so the contenders of a ratio share the machine's
state; medians and interquartile ranges, ratios as medians of per-repeat ratios."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any


def _q(v: list[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(p * len(s)))]


def interleaved(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1, max_s: float = 1e9,
                seed: int = 0) -> dict[str, list[float]]:
    """Time every fn `reps` times, interleaved in a shuffled order per repeat; seconds."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    rng = random.Random(seed)
    t0 = time.perf_counter()
    for i in range(reps):
        order = list(fns)
        rng.shuffle(order)
        for k in order:
            s = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - s)
        if i >= 2 and time.perf_counter() - t0 > max_s:
            break
    return times


def summary(v: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(v), "p25_ms": 1e3 * _q(v, 0.25), "p75_ms": 1e3 * _q(v, 0.75),
            "n": len(v)}


def paired_ratio(a: list[float], b: list[float]) -> dict[str, float]:
    r = [x / y for x, y in zip(a, b, strict=True)]
    return {"median": statistics.median(r), "p25": _q(r, 0.25), "p75": _q(r, 0.75)}
