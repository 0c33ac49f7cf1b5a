"""The Flax blocks used as an experienced JAX user uses Flax: jax.export with symbolic
batch and sequence dimensions (forward and cached decode step; no host callback, a cache
overflow under jit sets the cache's flag), Linen through nnx.bridge.to_linen with one key
at dropout 0 (no RNG state; parameter counts equal the torch twin's), Flax's own mask
helpers (nnx.make_attention_mask / make_causal_mask, (B, 1 | H, T, S), 0/1 floats), the
fully-masked warning (once per cause, worded by what was seen, FullyMaskedWarning to
filter), and construction drawing each block's parameters in one jitted draw.

The modules are small and built once per module (construction and compiles dominate)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from flax.nnx import bridge

import flax_blocks as fb
from flax_blocks.core import config
from flax_blocks.core.config import BlockConfig, FullyMaskedWarning

E, H, FF, B, T, L = 12, 3, 20, 3, 5, 8
CFG = BlockConfig(d_model=E, num_heads=H, num_kv_heads=1, d_ff=FF, dropout=0.0, norm="pre", causal=True,
                  rope_theta=1e4)


@functools.cache
def encoder() -> fb.Encoder:
    return fb.Encoder(CFG, num_layers=2, rngs=nnx.Rngs(0))


@functools.cache
def block() -> fb.TransformerBlock:
    return fb.TransformerBlock(CFG, rngs=nnx.Rngs(0))


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# ----------------------------------------------------------------------------------------
# jax.export
# ----------------------------------------------------------------------------------------


def test_forward_exports_with_symbolic_batch_and_length():
    graphdef, state = nnx.split(block())

    def forward(state, x, key_mask):
        return nnx.merge(graphdef, state)(x, key_mask=key_mask)

    b, t = jax.export.symbolic_shape("b, t")
    exported = jax.export.export(jax.jit(forward))(
        state, jax.ShapeDtypeStruct((b, t, E), jnp.float32), jax.ShapeDtypeStruct((b, t), jnp.bool_))
    for batch, length in ((2, 4), (3, 7)):
        x, key_mask = rand(batch, length, E, seed=length), np.ones((batch, length), bool)
        key_mask[0, -1] = False
        assert diff(exported.call(state, x, key_mask), jax.jit(forward)(state, x, key_mask)) <= 1e-6


def test_cached_step_exports_with_symbolic_batch_and_overflow_sets_the_flag():
    """The cache length is concrete, the batch symbolic. A chunk past max_length: eagerly
    the ValueError; jitted or exported (no host callback) the cache's "overflow" flag."""
    enc = encoder()
    graphdef, state = nnx.split(enc)

    def step(state, cache, x):
        return nnx.merge(graphdef, state)(x, cache=cache)

    (b,) = jax.export.symbolic_shape("b")
    cache = enc.init_cache(B, L)  # B = 3: no other dimension of the cache is 3
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(b if d == B else d for d in a.shape), a.dtype), cache)
    exported = jax.export.export(jax.jit(step))(state, spec, jax.ShapeDtypeStruct((b, 1, E), jnp.float32))
    assert "callback" not in exported.mlir_module()
    jitted = jax.jit(step)
    x = rand(B, 2, E)
    y1, c1 = exported.call(state, cache, x[:, :1])
    y2, c2 = exported.call(state, c1, x[:, 1:])
    j1, k1 = jitted(state, cache, x[:, :1])
    assert diff(y1, j1) <= 1e-6 and diff(y2, jitted(state, k1, x[:, 1:])[0]) <= 1e-6
    assert int(c2["index"]) == 2 and not bool(c2["overflow"])
    full = {**cache, "index": jnp.asarray(L, jnp.int32)}
    assert bool(exported.call(state, full, x[:, :1])[1]["overflow"])
    assert bool(jitted(state, full, x[:, :1])[1]["overflow"])
    with pytest.raises(ValueError, match=f"cache overflow: a chunk of 1 position.*at position {L}"):
        enc(x[:, :1], cache=full)  # eager: the clear error


# ----------------------------------------------------------------------------------------
# No RNG state without dropout: Linen's bridge, parameter counts, from_torch
# ----------------------------------------------------------------------------------------


def n_params(module) -> int:
    return sum(a.size for a in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_dropout_free_modules_hold_no_rng_state_and_count_torch_parameters():
    import torch_blocks as tb

    enc = encoder()
    assert not jax.tree.leaves(nnx.state(enc, nnx.RngState)) and not jax.tree.leaves(nnx.state(block(), nnx.RngState))
    assert n_params(enc) == sum(p.numel() for p in tb.Encoder(CFG, num_layers=2).parameters())
    torch_count = sum(p.numel() for p in tb.TransformerBlock(CFG).parameters())
    assert f"Total Parameters: {torch_count:,}" in nnx.tabulate(block(), rand(1, 2, E), depth=1)
    # with dropout, the RNG streams are there (and the parameters the same)
    with_dropout = fb.TransformerBlock(replace(CFG, dropout=0.1), rngs=nnx.Rngs(0))
    assert jax.tree.leaves(nnx.state(with_dropout, nnx.RngState)) and n_params(with_dropout) == torch_count


def test_to_linen_inits_with_one_key_at_dropout_0():
    x = rand(2, T, E)
    linen_block = bridge.to_linen(fb.TransformerBlock, CFG)
    variables = linen_block.init(jax.random.key(0), x)
    assert set(variables) == {"params"}
    y = linen_block.apply(variables, x)
    assert y.shape == (2, T, E) and np.isfinite(np.asarray(y)).all()
    # the same parameters in the NNX block give the same output
    graphdef, params, rest = nnx.split(block(), nnx.Param, ...)
    params = nnx.clone(params)
    nnx.replace_by_pure_dict(params, linen.meta.unbox(variables["params"]))
    assert diff(nnx.merge(graphdef, params, rest)(x), y) <= 1e-6


# ----------------------------------------------------------------------------------------
# Flax's own masks
# ----------------------------------------------------------------------------------------


def test_flax_mask_helpers_are_taken_as_they_come():
    """nnx.make_attention_mask(query_ok, key_ok): (B, 1, T, S) of 0 / 1 floats; on the
    queries that are real it equals the key mask alone (the padded queries have no key:
    zero attention output, the residual passes them through)."""
    m = block()
    x = rand(2, T, E, seed=1)
    key_ok = np.ones((2, T), bool)
    key_ok[1, 3:] = False
    query_ok = key_ok
    flax_mask = nnx.make_attention_mask(query_ok, key_ok)
    assert flax_mask.shape == (2, 1, T, T) and flax_mask.dtype == jnp.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every element keeps a key: no warning
        y = m(x, attention_mask=flax_mask)
        y_keys = m(x, key_mask=key_ok)
    assert diff(np.asarray(y)[query_ok], np.asarray(y_keys)[query_ok]) <= 1e-6
    # make_causal_mask on a causal block: the causal mask again; combined with the padding
    causal = nnx.make_causal_mask(jnp.ones((2, T)))
    assert diff(m(x, attention_mask=causal), m(x)) <= 1e-6
    both = nnx.combine_masks(causal, flax_mask)
    assert diff(np.asarray(m(x, attention_mask=both))[query_ok], np.asarray(y_keys)[query_ok]) <= 1e-6
    # a per-head mask: the same mask for every head is the broadcast one
    per_head = jnp.broadcast_to(flax_mask, (2, H, T, T)) > 0
    assert diff(m(x, attention_mask=per_head), y) <= 1e-6
    shape = rf"attention_mask must have shape .*\(2, {H}, {T}, {T}\).*got \(2, 2, {T}, {T}\)"
    with pytest.raises(ValueError, match=shape):
        m(x, attention_mask=per_head[:, :2])


# ----------------------------------------------------------------------------------------
# The fully-masked warning
# ----------------------------------------------------------------------------------------


@pytest.fixture
def shown():
    """The FullyMaskedWarnings shown in the test, the library's memory of shown causes
    cleared first (it is per process), the session's warnings filters as they are."""
    config._SHOWN.clear()
    with warnings.catch_warnings(record=True) as seen:
        yield seen
    config._SHOWN.clear()


def _keys(*empty):
    k = np.ones((2, T), bool)
    k[list(empty)] = False
    return k


def test_fully_masked_warning_once_per_cause_worded_by_what_was_seen(shown):
    m, x = block(), rand(2, T, E)
    for empty in (1, 0, 1):  # a padded element (another one each call): one warning
        m(x, key_mask=_keys(empty))
    for _ in range(2):  # every element empty: the other cause, one more
        m(x, key_mask=_keys(0, 1))
    texts = [str(w.message) for w in shown]
    assert [w.category for w in shown] == [FullyMaskedWarning] * 2, texts
    assert "some batch elements have no key" in texts[0] and "Expected for a padded element" in texts[0]
    assert "no batch element has any key" in texts[1] and "other framework's convention" in texts[1]
    assert all(w.filename == __file__ for w in shown)  # pointing at the caller


def test_fully_masked_warning_under_transforms_and_switched_off(shown):
    m, x = block(), rand(2, T, E)
    graphdef, state = nnx.split(m)
    keys = _keys(1)
    grad = jax.grad(lambda x: jnp.sum(nnx.merge(graphdef, state)(x, key_mask=keys)))
    for _ in range(2):  # constant masks inside grad: checked, shown once
        grad(x)
    assert len(shown) == 1
    traced = jax.jit(lambda state, x, k: nnx.merge(graphdef, state)(x, key_mask=k))
    traced(state, x, _keys(0, 1))  # traced masks: not read (no host callback), no warning
    assert len(shown) == 1
    warnings.simplefilter("always", FullyMaskedWarning)  # a filter of the user's rules: every time ...
    m(x, key_mask=_keys(1))
    m(x, key_mask=_keys(1))
    assert len(shown) == 3
    warnings.filterwarnings("ignore", category=FullyMaskedWarning)  # ... or never: the off switch
    config._SHOWN.clear()
    m(x, key_mask=_keys(0, 1))
    assert len(shown) == 3


def test_torch_twin_warns_alike(shown):
    import torch

    import torch_blocks as tb

    m = tb.TransformerBlock(CFG).eval()
    x = torch.zeros(2, T, E)
    with torch.no_grad():
        m(x, src_key_padding_mask=torch.from_numpy(~_keys(1)))
        m(x, src_key_padding_mask=torch.from_numpy(~_keys(0)))
        m(x, src_key_padding_mask=torch.from_numpy(~_keys(0, 1)))
    texts = [str(w.message) for w in shown]
    assert len(texts) == 2 and texts[0].startswith("torch: some batch elements") and "True = may NOT attend" in texts[1]


# ----------------------------------------------------------------------------------------
# Construction: one random draw per block tree (experiments/bench/construction.py times it)
# ----------------------------------------------------------------------------------------


def _primitives(jaxpr, counts: dict) -> dict:
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives(inner, counts)
    return counts


@pytest.mark.parametrize("scheme", [{"norm": "pre"}, {"norm": "post", "scaling": "deepnorm"}])
def test_a_stack_draws_its_parameters_in_one_random_draw(scheme):
    """Every parameter of every layer comes from one random_bits (a block's tree is drawn in
    one jitted function, vmapped over the layers): first construction compiles one random
    kernel, not one per parameter shape (5.8-7.3 s -> ~3.4 s for a d64 2-layer LM here)."""
    cfg = BlockConfig(d_model=10, num_heads=2, d_ff=14, dropout=0.0, **scheme)
    for build in (lambda: fb.Encoder(cfg, num_layers=3, rngs=nnx.Rngs(0)),
                  lambda: fb.Decoder(cfg, num_layers=2, rngs=nnx.Rngs(0))):
        counts = _primitives(jax.make_jaxpr(lambda build=build: nnx.state(build()))().jaxpr, {})
        assert counts.get("random_bits") == 1, counts
