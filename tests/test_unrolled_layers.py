"""Stacks with scan_layers=False (a Python loop over the stacked layers): same outputs,
gradients and caches as the scan, forward-mode autodiff through the layer boundary's custom
rule, and the unrolled backward linear in depth."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_blocks as fb
from flax_blocks import blocks as fbb

BASE = fb.BlockConfig(d_model=16, num_heads=4, d_ff=24, dropout=0.0, norm="pre", dtype="float64", param_dtype="float64")
LLAMA = fb.BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, d_ff=24, dropout=0.0, norm="pre", norm_type="rmsnorm",
                       mlp="swiglu", activation="silu", rope_theta=1e4, qk_norm=True, bias=False, causal=True,
                       dtype="float64", param_dtype="float64")


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))


def _pair(cls, cfg, **kw):
    """The same stack (same parameters) scanned and unrolled."""
    scanned = cls(cfg, num_layers=3, rngs=nnx.Rngs(0), **kw)
    unrolled = cls(cfg, num_layers=3, rngs=nnx.Rngs(0), scan_layers=False, **kw)
    return scanned, unrolled


@pytest.mark.parametrize("cls,cfg", [(fb.Encoder, BASE), (fb.Encoder, LLAMA), (fb.Decoder, BASE)])
def test_unrolled_equals_scan_forward_and_gradients(x64, cls, cfg):
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.normal(size=(2, 6, 16))) for _ in range(2))
    memory = (jnp.asarray(rng.normal(size=(2, 5, 16))),) if cls is fb.Decoder else ()
    results = []
    for m in _pair(cls, cfg):
        g, p, rest = nnx.split(m, nnx.Param, ...)

        def loss(p, x, g=g, rest=rest):
            return jnp.sum(nnx.merge(g, p, rest)(x, *memory) * r)

        results.append(jax.value_and_grad(loss, argnums=(0, 1))(p, x))
    (v0, g0), (v1, g1) = results
    assert abs(float(v0 - v1)) <= 1e-12 * abs(float(v0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert a.shape == b.shape
        assert _rel(a, b) < 1e-13


def test_the_equality_measure_catches_layers_run_in_the_wrong_order(x64):
    """The negative twin of the 1e-13 bound above: the same stack with its layers 0 and 1
    swapped (a loop that cut the stacked parameters wrongly) is far outside it."""
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 6, 16)))
    scanned, unrolled = _pair(fb.Encoder, BASE)
    swap = lambda a: a.at[jnp.array([0, 1])].set(a[jnp.array([1, 0])]) if a.ndim and a.shape[0] == 3 else a  # noqa: E731
    layers = nnx.state(unrolled.layers, nnx.Param)
    nnx.update(unrolled.layers, jax.tree.map(swap, layers))
    assert _rel(scanned(x), unrolled(x)) > 1e-3


def test_unrolled_intermediates_and_cached_decoding_match_scan(x64):
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 16)))
    scanned, unrolled = _pair(fb.Encoder, LLAMA)
    y0, e0 = scanned(x, return_intermediates=True)
    y1, e1 = unrolled(x, return_intermediates=True)
    assert set(e0) == set(e1)
    for k in e0:
        assert e0[k].shape == e1[k].shape and _rel(e0[k], e1[k]) < 1e-13, k
    cache = unrolled.init_cache(2, 6)
    chunks = []
    for t0, t1 in ((0, 1), (1, 4), (4, 6)):
        y, cache = unrolled(x[:, t0:t1], cache=cache)
        chunks.append(y)
    assert _rel(y0, jnp.concatenate(chunks, axis=1)) < 1e-13
    assert cache["layers"]["self"]["k"].shape[0] == 3  # still stacked on the layer axis


def test_forward_mode_through_the_unrolled_stack(x64):
    """The layer boundary carries a custom forward rule (its transpose is a matmul): the
    unrolled stack's jax.jvp equals the scanned stack's, and its own gradient."""
    rng = np.random.default_rng(2)
    x, v, r = (jnp.asarray(rng.normal(size=(2, 6, 16))) for _ in range(3))
    dp = None
    tangents = []
    for m in _pair(fb.Encoder, BASE):
        g, p, rest = nnx.split(m, nnx.Param, ...)

        def loss(p, x, g=g, rest=rest):
            return jnp.sum(nnx.merge(g, p, rest)(x) * r)

        dp = dp or jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), p)
        _, tangent = jax.jvp(loss, (p, x), (dp, v))
        gp, gx = jax.grad(loss, argnums=(0, 1))(p, x)
        expected = jnp.sum(gx * v) + sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(dp)))
        assert abs(float(tangent - expected)) <= 1e-12 * abs(float(expected))
        tangents.append(float(tangent))
    assert abs(tangents[0] - tangents[1]) <= 1e-12 * abs(tangents[0])


def test_unrolled_dropout_draws_the_scans_masks(x64):
    """Training with dropout: one key per layer from the stack's stream, as in the scan, so
    the same seed gives the same masks; the next call draws new ones."""
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 6, 16)))
    cfg = replace(BASE, dropout=0.2)
    scanned, unrolled = _pair(fb.Encoder, cfg)
    first = unrolled(x, deterministic=False)
    assert _rel(scanned(x, deterministic=False), first) < 1e-13
    assert _rel(first, unrolled(x, deterministic=False)) > 1e-3  # fresh masks
    assert _rel(unrolled(x, deterministic=True), scanned(x, deterministic=True)) < 1e-13


def _bytes_accessed(layers: int) -> float:
    with jax.enable_x64(False):  # defined whatever an earlier test left: under x64 it measures other work
        return _compiled_bytes(layers)


def _compiled_bytes(layers: int) -> float:
    m = fb.Encoder(fb.BlockConfig(d_model=16, num_heads=2, d_ff=32, dropout=0.0, norm="pre"), num_layers=layers,
                   rngs=nnx.Rngs(0), scan_layers=False)
    g, p, rest = nnx.split(m, nnx.Param, ...)
    x = jnp.ones((2, 8, 16))
    compiled = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(g, p, rest)(x) ** 2))).lower(p).compile()
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def _growth() -> float:
    """The compiled work added by layers 9-12 over that added by layers 5-8."""
    b4, b8, b12 = (_bytes_accessed(n) for n in (4, 8, 12))
    return (b12 - b8) / (b8 - b4)


def test_unrolled_backward_is_linear_in_depth(monkeypatch):
    """XLA fuses the stream's cotangent into every earlier layer's gradient fusions unless
    the layers are separated: each added layer then costs more than the last (measured: the
    four layers 9-12 add 1.41 x what layers 5-8 add). With the boundary, 1.01."""
    assert _growth() < 1.1
    monkeypatch.setattr(fbb, "_layer_boundary", lambda h: h)  # the mistake: no boundary
    assert _growth() > 1.2


def test_unrolled_refuses_remat():
    with pytest.raises(ValueError, match="remat='full' needs scan_layers=True"):
        fb.Decoder(BASE, num_layers=2, rngs=nnx.Rngs(0), remat="full", scan_layers=False)


def test_scan_layers_must_be_a_bool():
    with pytest.raises(TypeError, match="scan_layers must be True or False, got 'no'"):
        fb.Encoder(BASE, num_layers=2, rngs=nnx.Rngs(0), scan_layers="no")
