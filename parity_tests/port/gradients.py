"""Gradient parity of a port: every copied parameter's gradient under one random cotangent
on the float outputs, torch's (through the copy's transform) against Flax's."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .errors import rel_err
from .pairing import fit
from .record import leaves
from .weights import NO_BIAS, Copied, PortError, flax_variables, plan

FLOOR32 = 1e-6


def torch_grads(tm, t_in: list, t_kw: dict, cots: list[np.ndarray]) -> dict[str, np.ndarray]:
    """d sum(out * cot) / d parameter for every torch parameter (zeros where none flows)."""
    import torch

    with torch.enable_grad():
        tm.zero_grad(set_to_none=True)
        out = [a for a in leaves(tm(*t_in, **t_kw)) if a.is_floating_point()]
        sum((a * torch.from_numpy(c).to(a.dtype)).sum() for a, c in zip(out, cots, strict=True)).backward()
    return {n: (p.grad.detach().numpy() if p.grad is not None else np.zeros(tuple(p.shape)))
            for n, p in tm.named_parameters()}


def grad_err(got: np.ndarray, want: np.ndarray, floor: float) -> float:
    """max|got - want| over the larger of max|want| and `floor`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max()) if want.size else 0.0, floor)
    if got.shape != want.shape or not np.isfinite(got).all() or scale == 0:
        return rel_err(got, want)
    return float(np.abs(got - want).max() / scale)


def _padding_rows(tm) -> dict[str, int]:
    """torch parameter name -> the row nn.Embedding's padding_idx keeps out of the gradient."""
    import torch.nn as nn

    return {f"{name}.weight" if name else "weight": m.padding_idx for name, m in tm.named_modules()
            if isinstance(m, nn.Embedding) and m.padding_idx is not None}


def cotangents(t_out, seed: int) -> list[np.ndarray]:
    """One standard normal cotangent per float output of torch's run (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(a.shape)) for a in leaves(t_out) if a.is_floating_point()]


def flax_loss(out, cots: list[np.ndarray]):
    """sum(out * cot) over the port's float outputs (each cotangent in the output's shape)."""
    import jax.numpy as jnp

    outs = [a for a in leaves(out) if jnp.issubdtype(a.dtype, jnp.floating)]
    total = 0.0
    # strict=False: a wrong port may give more or fewer float outputs than torch, whose shapes made cots
    for a, c in zip(outs, cots, strict=False):
        cot = fit(c, a.shape)
        total = total + (jnp.vdot(a, jnp.asarray(cot, a.dtype)) if cot is not None else 0.0)
    return total


def planned(tm, fm, rules) -> list[Copied] | PortError:
    """copy_weights' pairs of the two models (their copies in a comparison), or the error
    saying why they do not pair."""
    try:
        return plan(tm, fm, rules)
    except PortError as e:
        return e


def gradients(tm, pairs: list[Copied] | PortError, fgrads: dict[str, np.ndarray], t_in: list, t_kw: dict,
              cots: list[np.ndarray], reference: Callable[[list[np.ndarray]], dict[str, np.ndarray]] | None = None
              ) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """Per copied parameter (by Flax path): the error of the port's gradient `fgrads` against
    torch's under the cotangents `cots`, and, given `reference` (torch's gradients for those
    cotangents computed in float64: the float64 model for a float32 run, the float32 islands
    promoted for a float64 one), each gradient's tolerance: ten times torch's own float32
    error on it, at least 1e-6. Also notes: parameters not compared and why (an embedding's
    padding_idx row, which torch gives no gradient, is left out of the comparison and
    named)."""
    if isinstance(pairs, PortError):
        return {}, {}, [f"gradients not compared: the parameters do not pair ({pairs.problems[0]})"]
    tgrads = torch_grads(tm, t_in, t_kw, cots)
    # Each gradient relative to the larger of its own size and a thousandth of the model's
    # largest: a gradient that is zero in exact arithmetic (a key bias's, which softmax
    # cancels) is rounding noise on both sides, not a 100% error.
    floor = 1e-3 * max((float(np.abs(g).max()) for g in tgrads.values() if g.size), default=0.0)
    g64 = reference(cots) if reference is not None else {}
    padded = _padding_rows(tm)
    errs, tols, notes = {}, {}, []
    for t, f, tf in pairs:
        if f is None or t not in tgrads or f not in fgrads or tf is NO_BIAS:
            continue
        want, got = tf(tgrads[t]), fgrads[f]
        if t in padded and got.shape == want.shape and padded[t] < got.shape[0]:
            row = padded[t]
            if np.abs(got[row]).max() > 0:
                notes.append(f"{t} row {row} (padding_idx): torch gives it no gradient, the port's {f} does "
                             f"(the ids hold {row}): that row is not compared")
            want, got = want.copy(), got.copy()
            want[row] = got[row] = 0.0
        errs[f] = grad_err(got, want, floor)
        if t in g64:
            tols[f] = max(10 * grad_err(tf(tgrads[t]), tf(g64[t]), floor), FLOOR32)
    return errs, tols, notes


def weight_states(tm, fm, pairs: list[Copied] | PortError) -> dict[str, tuple[str, str]]:
    """flax path -> ("same" / "constant" (equal, but torch's is one value throughout) /
    "transposed" / "differs", torch name) for every parameter copy_weights pairs ({} when
    they do not pair)."""
    from flax import nnx

    if isinstance(pairs, PortError):
        return {}
    state = tm.state_dict()
    fparams = flax_variables(fm, nnx.Param)
    out: dict[str, tuple[str, str]] = {}
    for t, f, tf in pairs:
        if f is None or f not in fparams:
            continue
        want = np.asarray(tf(state[t].detach().cpu().numpy()), np.float64)
        got = np.asarray(fparams[f].get_value(), np.float64)
        if got.shape == want.shape and np.allclose(got, want, rtol=1e-6, atol=0):
            # a constant (a norm's ones, a bias's zeros) is equal whether copied or not
            out[f] = ("same" if want.size and np.ptp(want) > 0 else "constant", t)
        elif got.ndim == 2 and got.shape == want.T.shape and np.allclose(got, want.T, rtol=1e-6, atol=0):
            out[f] = ("transposed", t)
        else:
            out[f] = ("differs", t)
    return out
