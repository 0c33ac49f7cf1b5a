"""The experts MLP beyond the parity matrix (parity_tests/twins/cases.py runs its forward and
gradients in both twins and the numpy reference): top-k ties, the router logits a stack returns,
and the load-balancing loss against transformers' own `load_balancing_loss_func`."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_blocks as fb
import torch_blocks as tb
from flax_blocks import experts as fx
from torch_blocks import experts as tx

from . import reference as ref
from .harness import Case, flax_twin, precision, torch_twin

MOE = fb.BlockConfig(d_model=16, num_heads=4, d_ff=20, dropout=0.0, norm="pre", norm_type="rmsnorm", mlp="swiglu",
                     activation="silu", bias=False, causal=True, num_experts=8, expert_d_ff=6)


def test_ties_go_to_the_lowest_index_in_both_twins_and_the_reference():
    """Equal probabilities (a zero router, as HF's Qwen2-MoE initialises it): experts 0..k-1 on every
    side. (torch.topk's order among equal values is implementation-defined: on CPU, top-2 of 8 equal
    values gave [6, 5]; the torch twin sorts stably instead.)"""
    cfg = replace(MOE, num_experts_per_tok=3, norm_topk_prob=False)
    logits = np.zeros((4, 8))
    logits[1, 5] = logits[1, 7] = 1.0  # a tie between two larger ones: 5 before 7, then 0
    want = [[0, 1, 2], [5, 7, 0], [0, 1, 2], [0, 1, 2]]
    assert np.asarray(fx.route(cfg, jnp.asarray(logits))[1]).tolist() == want
    assert tx.route(cfg, torch.from_numpy(logits))[1].tolist() == want
    assert [ref.route(cfg, row)[1].tolist() for row in logits] == want
    w = np.asarray(fx.route(cfg, jnp.asarray(logits))[0])
    np.testing.assert_allclose(w[0], np.full(3, 1 / 8), rtol=1e-6)


def _hf_loss(logits: np.ndarray, cfg: fb.BlockConfig, mask: np.ndarray | None) -> float:
    """transformers' load_balancing_loss_func on a stack's logits (L, B, T, X), one (B*T, X) per layer."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = tuple(torch.from_numpy(a.reshape(-1, a.shape[-1])) for a in logits)
    return float(load_balancing_loss_func(layers, cfg.num_experts, cfg.num_experts_per_tok,
                                          None if mask is None else torch.from_numpy(mask.astype(np.int64))))


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_is_transformers(masked):
    """Both twins' loss equals HF's (1e-6: HF counts the picks in float32, `expert_mask.float()`; the twins
    agree with each other to 1e-12 in float64), padding masked as HF masks it; a dense layer of a mixed
    stack is left out (HF returns no logits for it); a mistake (the padding counted) is caught."""
    rng = np.random.default_rng(0)
    cfg = replace(MOE, num_experts_per_tok=2, decoder_sparse_step=2)  # layers 2 and 4 of 4 run experts
    logits = rng.normal(size=(4, 3, 5, 8)) * 2
    mask = np.ones((3, 5), bool)
    mask[0, :2] = mask[2, 3:] = False
    m = mask if masked else None
    want = _hf_loss(logits[1::2], cfg, m)
    with precision("float64"):
        got = float(fx.load_balancing_loss(cfg, jnp.asarray(logits), None if m is None else jnp.asarray(m)))
    got_t = float(tx.load_balancing_loss(cfg, torch.from_numpy(logits), None if m is None else torch.from_numpy(m)))
    assert abs(got - want) <= 1e-6 * want and abs(got_t - got) <= 1e-12 * want, (got, got_t, want)
    if masked:
        wrong = _hf_loss(logits[1::2], cfg, None)  # the padded tokens counted
        assert abs(wrong - want) > 1e-3 * want
    balanced = np.zeros((1, 1, 8, 8))  # every expert picked equally, equal mean probabilities: k
    balanced[0, 0, np.arange(8), np.arange(8)] = balanced[0, 0, np.arange(8), (np.arange(8) + 1) % 8] = 5.0
    assert float(fx.load_balancing_loss(replace(cfg, decoder_sparse_step=1), jnp.asarray(balanced))) == \
        pytest.approx(2.0, rel=1e-6)


def test_a_stack_returns_each_layers_router_logits_in_both_twins():
    """(L, B, T, X) from both Encoders, equal in float64; zeros in the dense layers of a mixed stack (layer 1
    by mlp_only_layers, layer 3 by the step), the experts' layers' equal to the router applied to the
    stream the layer's MLP reads."""
    case = Case("Encoder", replace(MOE, decoder_sparse_step=2, mlp_only_layers=(1,), shared_expert_d_ff=4),
                num_layers=4, seq=6)
    with precision("float64"):
        tmod = torch_twin(case, "float64")
        fmod = flax_twin(case, tmod, "float64")
        x = np.random.default_rng(1).normal(size=(2, 6, 16))
        _, fi = fmod(jnp.asarray(x), return_intermediates=True)
        with torch.no_grad():
            _, ti = tmod(torch.from_numpy(x), return_intermediates=True)
    f, t = np.asarray(fi["router_logits"]), ti["router_logits"].numpy()
    assert f.shape == t.shape == (4, 2, 6, 8)
    assert not f[[0, 1, 2]].any() and np.abs(f[3]).min() > 0  # layers 1..4: dense (idx 0), dense (in
    np.testing.assert_allclose(f, t, rtol=0, atol=1e-12 * np.abs(t).max())  # mlp_only_layers), dense, experts
    assert isinstance(tmod, tb.Encoder)


def test_router_logits_of_another_config_are_refused_naming_the_shapes():
    """A dense config, or one of another expert count, with a stack's router logits: one error in both twins."""
    logits = np.zeros((2, 1, 3, 4))
    for cfg in (replace(MOE, num_experts=0), MOE):  # MOE has 8 experts, the logits 4
        with pytest.raises(ValueError, match=rf"num_experts={cfg.num_experts} must have shape .*got \(2, 1, 3, 4\)"):
            fx.load_balancing_loss(cfg, jnp.asarray(logits))
        with pytest.raises(ValueError, match=rf"num_experts={cfg.num_experts} must have shape"):
            tx.load_balancing_loss(cfg, torch.from_numpy(logits))
