"""Stacks with scan_layers=False (a Python loop over the stacked layers): same outputs,
gradients and caches as the scan, forward-mode autodiff through the layer boundary's custom
rule, and the unrolled backward linear in depth.

The stacks these tests only read are built once per module (`pairs`), and the functions
they run are jitted at module level (`_value_and_grad`, `_forward`, ...) with the graphdef
static, so a test that runs the same stack at the same shapes as another reuses its
compiled program. Run eagerly, each of the unrolled loop's primitives compiled on its own
(about a thousand small programs for this module)."""

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_blocks as fb
from flax_blocks import caches, stacks

BASE = fb.BlockConfig(d_model=16, num_heads=4, d_ff=24, dropout=0.0, norm="pre", dtype="float64", param_dtype="float64")
LLAMA = fb.BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, d_ff=24, dropout=0.0, norm="pre", norm_type="rmsnorm",
                       mlp="swiglu", activation="silu", rope_theta=1e4, qk_norm=True, bias=False, causal=True,
                       dtype="float64", param_dtype="float64")
# a mixed stack: dense, experts, dense (3 segments)
MIXED = replace(LLAMA, num_experts=4, num_experts_per_tok=2, expert_d_ff=8, decoder_sparse_step=2)


pytestmark = pytest.mark.xdist_group("unrolled_layers")  # its module fixtures built by one worker (--dist loadgroup)

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


@pytest.fixture(scope="module")
def pairs():
    """_pair(cls, cfg), built once per (cls, cfg) for this module's tests, which only read
    them (dropout 0: no call advances an RNG stream). Each entry: the two stacks, each as
    (module, graphdef, params, rest)."""
    built = {}

    def get(cls, cfg):
        if (cls, cfg) not in built:
            with jax.enable_x64(True):
                built[cls, cfg] = tuple((m, *nnx.split(m, nnx.Param, ...)) for m in _pair(cls, cfg))
        return built[cls, cfg]

    return get


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grad(graphdef, params, rest, x, r, memory=()):
    """sum(stack(x, *memory) * r) and its gradient w.r.t. (params, x)."""

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p, rest)(x, *memory) * r)

    return jax.value_and_grad(loss, argnums=(0, 1))(params, x)


@functools.partial(jax.jit, static_argnums=0)
def _loss_jvp(graphdef, params, rest, x, r, dp, v):
    """The tangent of sum(stack(x) * r) along (dp, v)."""
    return jax.jvp(lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x) * r), (params, x), (dp, v))[1]


@functools.partial(jax.jit, static_argnums=0, static_argnames="return_intermediates")
def _forward(graphdef, params, rest, x, *, return_intermediates=False):
    return nnx.merge(graphdef, params, rest)(x, return_intermediates=return_intermediates)


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, params, rest, x, cache):
    """One cached call: (y, cache)."""
    return nnx.merge(graphdef, params, rest)(x, cache=cache)


@pytest.mark.parametrize("cls,cfg", [(fb.Encoder, BASE), (fb.Encoder, LLAMA), (fb.Decoder, BASE), (fb.Encoder, MIXED)])
def test_unrolled_equals_scan_forward_and_gradients(x64, pairs, cls, cfg):
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.normal(size=(2, 6, 16))) for _ in range(2))
    memory = (jnp.asarray(rng.normal(size=(2, 5, 16))),) if cls is fb.Decoder else ()
    (v0, g0), (v1, g1) = (_value_and_grad(g, p, rest, x, r, memory) for _, g, p, rest in pairs(cls, cfg))
    assert abs(float(v0 - v1)) <= 1e-12 * abs(float(v0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        assert a.shape == b.shape
        assert _rel(a, b) < 1e-13


def test_the_equality_measure_catches_layers_run_in_the_wrong_order(x64, pairs):
    """The negative twin of the 1e-13 bound above: the same stack with its layers 0 and 1
    swapped (a loop that cut the stacked parameters wrongly) is far outside it."""
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 6, 16)))
    (_, g0, p0, rest0), (shared, g1, _, rest1) = pairs(fb.Encoder, BASE)
    unrolled = nnx.clone(shared)  # swapped below; the shared stack keeps its order
    swap = lambda a: a.at[jnp.array([0, 1])].set(a[jnp.array([1, 0])]) if a.ndim and a.shape[0] == 3 else a  # noqa: E731
    layers = nnx.state(unrolled.layers, nnx.Param)
    nnx.update(unrolled.layers, jax.tree.map(swap, layers))
    _, swapped, _ = nnx.split(unrolled, nnx.Param, ...)
    assert _rel(_forward(g0, p0, rest0, x), _forward(g1, swapped, rest1, x)) > 1e-3


def test_unrolled_intermediates_and_cached_decoding_match_scan(x64, pairs):
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 16)))
    (_, g0, p0, rest0), (unrolled, g1, p1, rest1) = pairs(fb.Encoder, LLAMA)
    y0, e0 = _forward(g0, p0, rest0, x, return_intermediates=True)
    y1, e1 = _forward(g1, p1, rest1, x, return_intermediates=True)
    assert set(e0) == set(e1)
    for k in e0:
        assert e0[k].shape == e1[k].shape and _rel(e0[k], e1[k]) < 1e-13, k
    cache = unrolled.init_cache(2, 6)
    chunks = []
    for t0, t1 in ((0, 1), (1, 4), (4, 6)):
        y, cache = _decode(g1, p1, rest1, x[:, t0:t1], cache)
        chunks.append(y)
    assert _rel(y0, jnp.concatenate(chunks, axis=1)) < 1e-13
    assert cache["layers"]["self"]["k"].shape[0] == 3  # still stacked on the layer axis


def test_decoding_cache_decodes_as_the_stacked_cache(x64, pairs):
    """`decoding_cache` (each layer's cache and weights cut out once, as fb.generate decodes)
    gives the scanned stack's chunks to float64 rounding, keeps its per-layer form, and
    refuses what it cannot give (intermediates, another depth)."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 6, 16)))
    (scanned, g0, p0, rest0), _ = pairs(fb.Encoder, LLAMA)
    stacked, split = scanned.init_cache(2, 6), caches.decoding_cache(scanned, scanned.init_cache(2, 6))
    assert isinstance(split["layers"], tuple) and len(split["layers"]) == 3
    for t0, t1 in ((0, 2), (2, 3), (3, 6)):
        want, stacked = _decode(g0, p0, rest0, x[:, t0:t1], stacked)
        got, split = _decode(g0, p0, rest0, x[:, t0:t1], split)
        assert _rel(want, got) < 1e-13, (t0, t1)
    np.testing.assert_allclose(np.stack([e["cache"]["self"]["k"] for e in split["layers"]]),
                               stacked["layers"]["self"]["k"], rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="return_intermediates"):
        scanned(x[:, :1], cache=caches.decoding_cache(scanned, scanned.init_cache(2, 6)), return_intermediates=True)
    short = caches.decoding_cache(scanned, scanned.init_cache(2, 6))
    with pytest.raises(ValueError, match="of 2 layers for a stack of 3"):
        scanned(x[:, :1], cache={**short, "layers": short["layers"][:2]})
    given = caches.decoding_cache(scanned, scanned.init_cache(2, 6), caches.layer_weights(scanned))  # cut beforehand
    assert _rel(_decode(g0, p0, rest0, x[:, :2], given)[0], _decode(g0, p0, rest0, x[:, :2], short)[0]) == 0
    with pytest.raises(ValueError, match="weights for 2 layers, but the stack has 3"):
        caches.decoding_cache(scanned, scanned.init_cache(2, 6), caches.layer_weights(scanned)[:2])


def test_forward_mode_through_the_unrolled_stack(x64, pairs):
    """The layer boundary carries a custom forward rule (its transpose is a matmul): the
    unrolled stack's jax.jvp equals the scanned stack's, and its own gradient."""
    rng = np.random.default_rng(2)
    x, v, r = (jnp.asarray(rng.normal(size=(2, 6, 16))) for _ in range(3))
    dp = None
    tangents = []
    for _, g, p, rest in pairs(fb.Encoder, BASE):
        dp = dp or jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), p)
        tangent = _loss_jvp(g, p, rest, x, r, dp, v)
        _, (gp, gx) = _value_and_grad(g, p, rest, x, r)
        expected = jnp.sum(gx * v) + sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(dp),
                                                                        strict=True))
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


@functools.cache
def _abstract_stack(layers: int):
    """The unrolled Encoder as shapes and dtypes only (nnx.eval_shape: no parameter drawn,
    no random-number program compiled), built once for both measurements: the compiled
    program, and so its cost, depends on nothing else (the same bytes as a built stack's)."""
    m = nnx.eval_shape(lambda: fb.Encoder(fb.BlockConfig(d_model=16, num_heads=2, d_ff=32, dropout=0.0, norm="pre"),
                                          num_layers=layers, rngs=nnx.Rngs(0), scan_layers=False))
    return nnx.split(m, nnx.Param, ...)


def _compiled_bytes(layers: int) -> float:
    g, p, rest = _abstract_stack(layers)
    x = jnp.ones((2, 8, 16))
    compiled = jax.jit(jax.grad(lambda p, rest: jnp.sum(nnx.merge(g, p, rest)(x) ** 2))).lower(p, rest).compile()
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def _growth() -> float:
    """The compiled work added by layers 7-9 over that added by layers 4-6 (depths 3, 6, 9:
    the same separation as 4, 8, 12 in three quarters of the compile time)."""
    b3, b6, b9 = (_bytes_accessed(n) for n in (3, 6, 9))
    return (b9 - b6) / (b6 - b3)


def test_unrolled_backward_is_linear_in_depth(monkeypatch):
    """XLA fuses the stream's cotangent into every earlier layer's gradient fusions unless
    the layers are separated: each added layer then costs more than the last (measured: the
    three layers 7-9 add 1.50 x what layers 4-6 add; at depths 4, 8, 12: 1.41). With the
    boundary, 1.02 (1.01)."""
    assert _growth() < 1.1
    monkeypatch.setattr(stacks, "_layer_boundary", lambda h: h)  # the mistake: no boundary
    assert _growth() > 1.2


def test_unrolled_refuses_remat():
    with pytest.raises(ValueError, match="remat='full' needs scan_layers=True"):
        fb.Decoder(BASE, num_layers=2, rngs=nnx.Rngs(0), remat="full", scan_layers=False)


def test_scan_layers_must_be_a_bool():
    with pytest.raises(ValueError, match="scan_layers must be True or False, got 'no'"):
        fb.Encoder(BASE, num_layers=2, rngs=nnx.Rngs(0), scan_layers="no")
