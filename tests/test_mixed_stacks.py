"""Stacks mixing dense and experts layers (Qwen2-MoE's decoder_sparse_step / mlp_only_layers): each
layer holds its own MLP only, as HF's; Flax runs them as scanned segments (`stacks.segments`), the
two MLP kinds stacked apart; cached decoding and intermediates keep a stack of like layers' forms."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

import flax_blocks as fb
import torch_blocks as tb
from flax_blocks import caches, stacks

MOE = fb.BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, d_ff=24, dropout=0.0, norm="pre", norm_type="rmsnorm",
                     mlp="swiglu", activation="silu", rope_theta=1e4, bias=False, causal=True, num_experts=4,
                     num_experts_per_tok=2, expert_d_ff=8, shared_expert_d_ff=6, dtype="float64",
                     param_dtype="float64")
D, X = "dense", "experts"


def _count(shapes) -> int:
    return sum(int(np.prod(s)) for s in shapes)


@pytest.mark.parametrize("mixing", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 2])])
def test_a_mixed_stack_holds_exactly_hfs_parameters_in_both_twins_and_under_adamw(mixing):
    """Qwen2MoeModel's parameter count, equal in the Flax model read from it, in the torch twin's
    stack and in AdamW's moments (nothing idle); a stack holding both MLPs per layer would not be."""
    config = transformers.Qwen2MoeConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=24, num_hidden_layers=4, vocab_size=32, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=6, max_position_embeddings=32, **mixing)
    torch.manual_seed(0)
    hf = transformers.Qwen2MoeModel(config)
    lm = fb.from_hf(hf, part="model")
    n_hf = _count(p.shape for p in hf.parameters())
    ours = nnx.state(lm, nnx.Param)
    assert _count(a.shape for a in jax.tree.leaves(ours)) == n_hf
    stack = lm.encoder
    assert stack.mlp_kinds == tuple(X if hf.layers[i].mlp.__class__.__name__ == "Qwen2MoeSparseMoeBlock" else D
                                    for i in range(4))
    n_layers = sum(_count(p.shape for p in layer.parameters()) for layer in hf.layers)
    twin = tb.Encoder(stack.cfg, num_layers=4, final_norm=False)
    assert _count(p.shape for p in twin.parameters()) == n_layers
    assert set(fb.torch_state_dict(stack)) == set(twin.state_dict()) | {"norm.weight"}  # the twins' names
    opt = nnx.Optimizer(lm, optax.adamw(1e-3, weight_decay=0.0), wrt=nnx.Param)
    moments = [a for a in jax.tree.leaves(nnx.state(opt, nnx.optimizer.OptState)) if a.ndim]
    assert _count(a.shape for a in moments) == 2 * n_hf
    both = stacks.declarations.block(stack.cfg, "TransformerBlock", D).children  # the dense MLP every layer would add
    idle = sum(_count(p.shape for p in c.params) for n, c in both if n.startswith("linear")) * stack.mlp_kinds.count(X)
    assert idle > 0  # the former layout's excess, which the counts above leave no room for


def test_segments_scan_a_repeating_period_once_else_each_run():
    assert stacks.segments((D, X, D, X)) == [((D, X), 2)]
    assert stacks.segments((D, D, X, X, X)) == [((D,), 2), ((X,), 3)]  # first_k_dense_replace's shape
    assert stacks.segments((X, D, X, X)) == [((X,), 1), ((D,), 1), ((X,), 2)]
    scans = lambda m, x: [e.primitive.name for e in jax.make_jaxpr(m)(x).jaxpr.eqns].count("scan")  # noqa: E731
    x = jnp.zeros((1, 3, 16))
    with jax.enable_x64(True):
        like = fb.Encoder(replace(MOE, decoder_sparse_step=1), num_layers=4, rngs=nnx.Rngs(0))
        period = fb.Encoder(replace(MOE, decoder_sparse_step=2), num_layers=4, rngs=nnx.Rngs(0))
        runs = fb.Encoder(replace(MOE, mlp_only_layers=(1,)), num_layers=4, rngs=nnx.Rngs(0))
        assert like.mlp_kinds is None and like.dense_mlps is None and like.experts_mlps is None
        assert {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(like, nnx.Param))} == {"layers", "norm"}
        assert (scans(like, x), scans(period, x), scans(runs, x)) == (1, 1, 3)


@pytest.mark.parametrize("mixing", [dict(decoder_sparse_step=2), dict(mlp_only_layers=(1,))])
def test_a_mixed_stack_decodes_and_reports_as_a_stack_of_like_layers(mixing):
    """Chunked decoding (stacked cache and `decoding_cache`) equal to the whole call in float64;
    intermediates (L, B, T, E) and router logits (L, B, T, X), zeros on the dense layers; the same
    stack with two dense layers' MLPs swapped is far outside that bound."""
    with jax.enable_x64(True):
        m = fb.Encoder(replace(MOE, **mixing), num_layers=4, rngs=nnx.Rngs(0))
        x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 16)))
        y, found = _call(m, x, return_intermediates=True)
        assert found["residual"].shape == (4, 2, 6, 16) and found["router_logits"].shape == (4, 2, 6, 4)
        dense = [i for i, k in enumerate(m.mlp_kinds) if k == D]
        assert not np.asarray(found["router_logits"][np.array(dense)]).any()
        assert np.abs(np.asarray(found["router_logits"][np.array([i for i in range(4) if i not in dense])])).min() > 0
        stacked, split = m.init_cache(2, 6), caches.decoding_cache(m, m.init_cache(2, 6))
        for t0, t1 in ((0, 3), (3, 6)):  # one chunk shape: one program per cache form
            a, stacked = _call(m, x[:, t0:t1], cache=stacked)
            b, split = _call(m, x[:, t0:t1], cache=split)
            for got in (a, b):
                assert float(jnp.max(jnp.abs(got - y[:, t0:t1]))) <= 1e-13 * float(jnp.max(jnp.abs(y))), (t0, t1)
        assert stacked["layers"]["self"]["k"].shape[0] == 4
        w = nnx.state(m.experts_mlps, nnx.Param)
        nnx.update(m.experts_mlps, jax.tree.map(lambda a: a[::-1], w))  # experts layers given each other's MLPs
        assert float(jnp.max(jnp.abs(_call(m, x) - y))) > 1e-3 * float(jnp.max(jnp.abs(y)))


@nnx.jit(static_argnames="return_intermediates")
def _call(m, x, cache=None, return_intermediates=False):
    return m(x, cache=cache, return_intermediates=return_intermediates)
