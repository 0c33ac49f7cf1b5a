"""Masks across the twins beyond the matrix's (B, T, T) and key masks: a per-head mask
((B, H, T, S) in Flax, nn.MultiheadAttention's (B * H, T, S) in torch) gives the same
outputs and gradients in float64, with grouped-query heads (a wrong head order cannot
pass) and rows that lose every key in one head or in all of them; the other forms of one
mask (Flax's 0 / 1 floats, torch's additive float mask) give the same result as booleans."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import torch

from .cases import WIDE
from .harness import TOL, Case, Inputs, compare, flax_twin, precision, run_flax, run_torch, torch_twin

CASE = Case("TransformerBlock", replace(WIDE, num_kv_heads=2), seq=6, batch=2)  # 4 heads over 2 KV heads


def _inputs() -> Inputs:
    rng = np.random.default_rng(3)
    b, t, e, h = CASE.batch, CASE.seq, CASE.cfg.d_model, CASE.cfg.num_heads
    heads = rng.random((b, h, t, t)) < 0.6
    heads[..., 0] = True  # most rows keep a key ...
    heads[0, 1, 2] = False  # ... query 2 of element 0 has none in head 1 (the others have keys)
    heads[1, :, 4] = False  # ... query 4 of element 1 has none in any head: no attention output
    keys = np.ones((b, t), bool)
    keys[1, -1] = False
    return Inputs(rng.normal(size=(b, t, e)), rng.normal(size=(b, t, e)), heads, keys)


def test_per_head_masks_match_between_the_twins_in_float64():
    inp = _inputs()
    with precision("float64"):
        tmod = torch_twin(CASE, "float64")
        fmod = flax_twin(CASE, tmod, "float64")
        flax, torch_ = run_flax(CASE, fmod, inp, "float64"), run_torch(CASE, tmod, inp, "float64")
        err = compare(flax, torch_)
        assert err.forward <= TOL["forward", "float64"], err
        assert max(err.grad, err.dx) <= TOL["grad", "float64"], err
        # the head axis mattered: one mask for every head gives another output
        shared = run_flax(CASE, fmod, replace(inp, attention_mask=inp.attention_mask[:, 0]), "float64")
        assert np.abs(shared.y - flax.y).max() > 1e-3
        # the same mask as Flax's 0 / 1 floats, and as torch's additive float mask
        x = jnp.asarray(inp.x)
        as_bool = fmod(x, attention_mask=inp.attention_mask, key_mask=inp.key_mask)
        as_float = fmod(x, attention_mask=inp.attention_mask.astype(np.float64), key_mask=inp.key_mask)
        assert np.array_equal(np.asarray(as_bool), np.asarray(as_float))
        np.testing.assert_allclose(np.asarray(as_bool), flax.y, rtol=0, atol=1e-12)
        b, h, t, s = inp.attention_mask.shape
        allowed = torch.from_numpy(inp.attention_mask).reshape(b * h, t, s)
        additive = torch.zeros(b * h, t, s, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        kpm = torch.from_numpy(~inp.key_mask)
        xt = torch.from_numpy(inp.x)
        with torch.no_grad():
            y_bool, y_add = tmod(xt, ~allowed, kpm), tmod(xt, additive, kpm)
        assert torch.equal(y_bool, y_add)
        np.testing.assert_allclose(y_bool.numpy(), torch_.y, rtol=0, atol=1e-12)
