"""ALiBi (Press et al. 2022, "Train Short, Test Long") as transformers' Falcon computes it
(`build_alibi_tensor`): head h adds slope_h * p_j to its logit for key j, p_j the key's position
counted over the real keys of its row (cumsum(mask) - 1: padding is not counted), before the
1 / sqrt(head_dim) scale; the slopes and each bias rounded to bfloat16 as transformers rounds
them, whatever the model's dtype. The slopes and the rounding here; each twin's attention adds
the bias (flax_blocks.attention, torch_blocks.attention). Framework-free."""

from __future__ import annotations

import math

import numpy as np


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """x (any shape) as float32, each value rounded to the nearest bfloat16 (ties to even, as
    torch's .bfloat16() and jnp's astype round); returned as float32 holding those values."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000)
    return rounded.astype(np.uint32).view(np.float32)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """(num_heads,) float32: the geometric slopes 2 ** (-8 (h + 1) / n) of the largest power
    of two n <= num_heads, then (for a head count not a power of two) every other slope of 2n,
    2 ** (-4 (2 i + 1) / n), for the remaining heads; rounded to bfloat16 (Falcon's
    `slopes.bfloat16()`)."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be a positive int, got {num_heads!r}")
    n = 2 ** math.floor(math.log2(num_heads))
    base = np.float32(2.0 ** (-(2.0 ** -(math.log2(n) - 3))))  # float32, as HF's torch.full
    slopes = [base ** np.float32(p) for p in range(1, n + 1)]
    if n != num_heads:
        extra = np.float32(2.0 ** (-(2.0 ** -(math.log2(2 * n) - 3))))
        slopes += [extra ** np.float32(p) for p in range(1, 1 + 2 * min(n, num_heads - n), 2)]
    return round_bfloat16(np.asarray(slopes, np.float32))
