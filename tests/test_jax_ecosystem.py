"""The Flax blocks inside the JAX ecosystem: jax.jit (nnx.split / merge), jax.grad, jax.vmap
(over inputs, over stacked parameters), nnx.jit, nnx.grad, Linen through nnx.bridge.to_linen,
and an Encoder's compile time that does not grow with depth (layers applied with a scan).

Every XLA compile costs a noticeable fraction of a second on a small CPU, so the models and
the jitted apply function of each kind are built once per module and shared."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from flax.nnx import bridge

import flax_blocks as fb
from flax_blocks.core.config import BlockConfig

E, H, FF, B, T = 12, 3, 20, 2, 6
CFG = BlockConfig(d_model=E, num_heads=H, d_ff=FF, dropout=0.0, norm="pre", causal=True)
KINDS = ["TransformerBlock", "Encoder"]


def rngs(seed: int) -> nnx.Rngs:
    # "rbg" keys compile far faster than threefry on CPU; the blocks do not care which
    return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def build(kind: str, seed: int = 0, cfg: BlockConfig = CFG):
    if kind == "Encoder":
        return fb.Encoder(cfg, num_layers=2, rngs=rngs(seed))
    return getattr(fb, kind)(cfg, rngs=rngs(seed))


@functools.cache
def models(kind: str) -> tuple:
    """Three independently initialised models of one kind (same graphdef); do not mutate."""
    return tuple(build(kind, seed) for seed in range(3))


@functools.cache
def apply_fn(kind: str):
    """graphdef and the jitted pure apply (params, rest, x, attention_mask, key_mask) -> y."""
    graphdef, _, _ = nnx.split(models(kind)[0], nnx.Param, ...)

    def apply(params, rest, x, attention_mask, key_mask):
        return nnx.merge(graphdef, params, rest)(x, attention_mask=attention_mask, key_mask=key_mask)

    return graphdef, apply, jax.jit(apply)


def parts(m):
    _, params, rest = nnx.split(m, nnx.Param, ...)
    return params, rest


def stack(*arrays):
    if jax.dtypes.issubdtype(arrays[0].dtype, jax.dtypes.prng_key):
        return jnp.stack(arrays)  # (the dropout RNG keys)
    return np.stack([np.asarray(a) for a in arrays])


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def close(a, b, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


def diff(a, b) -> float:  # in numpy: an eager jnp operation would compile
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


X = rand(B, T, E)
ATTN = np.ones((B, T, T), bool)
ATTN[1, :, 0] = False  # batch 1 may not attend to key 0
KEY_MASK = np.array([[True] * 5 + [False], [True] * 6])
NO_ATTN, NO_KEY = np.ones_like(ATTN), np.ones_like(KEY_MASK)


@pytest.mark.parametrize("kind", KINDS)
def test_jax_jit_via_split_merge_and_nnx_jit(kind):
    m = models(kind)[0]
    _, _, f = apply_fn(kind)
    y = f(*parts(m), X, ATTN, KEY_MASK)
    assert y.shape == (B, T, E) and np.isfinite(np.asarray(y)).all()
    cache = f._cache_size()
    y2 = f(*parts(models(kind)[1]), rand(B, T, E, seed=1), ~ATTN, KEY_MASK)  # new values: no retrace
    assert f._cache_size() == cache and diff(y2, y) > 0
    # nnx.jit on the module object agrees with jax.jit on its split state
    g = nnx.jit(lambda m, x, a, k: m(x, attention_mask=a, key_mask=k))
    close(g(m, X, ATTN, KEY_MASK), y, atol=1e-6)
    # the masks mattered: without them, another result
    assert diff(f(*parts(m), X, NO_ATTN, NO_KEY), y) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_jax_grad_and_nnx_grad(kind):
    m = models(kind)[0]
    _, apply, f = apply_fn(kind)
    params, rest = parts(m)
    r = rand(B, T, E, seed=2)

    def loss(params):
        return jnp.sum(apply(params, rest, X, ATTN, KEY_MASK) * r)

    g = jax.jit(jax.grad(loss))(params)
    flat = dict(nnx.to_flat_state(g))
    assert set(flat) == set(dict(nnx.to_flat_state(params)))
    for path, v in flat.items():
        a = np.asarray(v[...])
        assert np.isfinite(a).all() and np.abs(a).max() > 0, path
    # directional derivative against a central difference (through the shared jitted apply)
    leaves, treedef = jax.tree.flatten(params)
    leaves = [np.asarray(a) for a in leaves]
    rng = np.random.default_rng(3)
    direction = [rng.standard_normal(a.shape).astype(np.float32) for a in leaves]
    dot = sum(float(np.vdot(np.asarray(a), d)) for a, d in zip(jax.tree.leaves(g), direction, strict=True))
    eps = 1e-4  # (curvature makes 1e-3 too coarse; float32 rounding is still far below 1%)

    def at(s):
        p = jax.tree.unflatten(treedef, [a + np.float32(s) * d for a, d in zip(leaves, direction, strict=True)])
        return float(np.sum(np.asarray(f(p, rest, X, ATTN, KEY_MASK), np.float64) * r))

    assert (at(eps) - at(-eps)) / (2 * eps) == pytest.approx(dot, rel=1e-2)
    if kind == "Encoder":
        return  # (nnx.grad of the Encoder: one more large compile; its blocks are covered)
    # nnx.grad on the module itself (under nnx.jit) gives the same gradients
    g_nnx = nnx.jit(nnx.grad(lambda m: jnp.sum(m(X, attention_mask=ATTN, key_mask=KEY_MASK) * r)))(m)
    for (_path, a), (_, b) in zip(nnx.to_flat_state(g), nnx.to_flat_state(g_nnx), strict=True):
        close(a[...], b[...], atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_jax_vmap_over_inputs_and_over_stacked_params(kind):
    _, apply, f = apply_fn(kind)
    params, rest = parts(models(kind)[0])
    batched = f(params, rest, X, ATTN, KEY_MASK)
    # vmap over examples: each call is unbatched, x (T, E) with its own (T, T) mask
    one = lambda x, a: apply(params, rest, x, a, None)  # noqa: E731
    per_example = jax.jit(jax.vmap(one))(X, ATTN)
    close(per_example, f(params, rest, X, ATTN, NO_KEY))
    assert diff(per_example, batched) > 1e-3  # (the key mask did matter above)
    # vmap over a stack of independently initialised parameter sets
    states = [parts(m) for m in models(kind)]
    stacked = jax.tree.map(stack, *states)
    ys = jax.jit(jax.vmap(apply, in_axes=(0, 0, None, None, None)))(*stacked, X, ATTN, KEY_MASK)
    assert ys.shape == (3, B, T, E)
    for i, state in enumerate(states):
        close(ys[i], f(*state, X, ATTN, KEY_MASK))
    assert diff(ys[0], ys[1]) > 1e-3


@pytest.mark.parametrize("kind", ["Encoder"])  # (the blocks' dropout: test_flax_blocks)
def test_nnx_jit_carries_dropout_state(kind):
    m = build(kind, seed=0, cfg=dataclasses.replace(CFG, dropout=0.3))
    _, _, f = apply_fn(kind)
    ref = f(*parts(models(kind)[0]), X, ATTN, KEY_MASK)  # same seed, no dropout: same parameters
    g = nnx.jit(lambda m, x, a, k: m(x, attention_mask=a, key_mask=k))
    y1, y2 = g(m, X, ATTN, KEY_MASK), g(m, X, ATTN, KEY_MASK)  # the dropout RNG advanced between calls
    assert diff(y1, y2) > 1e-3 and diff(y1, ref) > 1e-3
    m.eval()
    close(g(m, X, ATTN, KEY_MASK), ref, atol=1e-6)


class LinenModel(linen.Module):
    """A Linen model holding an NNX TransformerBlock and an NNX Encoder."""

    @linen.compact
    def __call__(self, x):
        x = linen.Dense(E, name="dense")(x)
        x = bridge.to_linen(fb.TransformerBlock, CFG, name="block")(x)
        return bridge.to_linen(fb.Encoder, CFG, num_layers=2, name="encoder")(x)


def test_to_linen():
    # at dropout 0 the blocks hold no RNG state: one key is all Linen's init needs
    variables = LinenModel().init(jax.random.key(0, impl="rbg"), X)
    assert set(variables) == {"params"}
    p = linen.meta.unbox(variables["params"])
    assert p["block"]["self_attn"]["in_kernel"].shape == (E, 3, H, E // H)
    assert p["encoder"]["layers"]["linear1"]["kernel"].shape == (2, E, FF)

    def loss(v):
        out = LinenModel().apply(v, X)
        return jnp.sum(out ** 2), out

    (_, out), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables)
    assert out.shape == (B, T, E)
    # Linen's jax.grad reaches the NNX parameters
    g = linen.meta.unbox(g["params"])
    for sub in ("block", "encoder", "dense"):
        leaves = [np.asarray(a) for a in jax.tree.leaves(g[sub])]
        assert leaves and all(np.isfinite(a).all() and np.abs(a).max() > 0 for a in leaves), sub
    # the same parameters in the NNX modules give the same output
    h = np.asarray(X) @ np.asarray(p["dense"]["kernel"]) + np.asarray(p["dense"]["bias"])
    for kind, name in (("TransformerBlock", "block"), ("Encoder", "encoder")):
        params, rest = parts(nnx.clone(models(kind)[0]))
        nnx.replace_by_pure_dict(params, p[name])
        h = apply_fn(kind)[2](params, rest, h.astype(np.float32), NO_ATTN, NO_KEY)
    close(out, h)


def _compiled_program(num_layers: int) -> str:
    cfg = BlockConfig(d_model=8, num_heads=2, d_ff=16, dropout=0.0, norm="pre")
    # abstract construction: shapes only, nothing is computed
    enc = nnx.eval_shape(lambda: fb.Encoder(cfg, num_layers=num_layers, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(enc)
    assert state["layers"]["linear1"]["kernel"].get_value().shape == (num_layers, 8, 16)
    f = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    x = jax.ShapeDtypeStruct((2, 8, 8), jnp.float32)
    return f.lower(state, x).compile().as_text()


def test_the_compiled_program_does_not_grow_with_depth():
    """The layers run under one scan: the program XLA compiles for 48 layers is the one for 6
    but for its numbers (the trip count, the stacked parameters' leading dimension), so compile
    time cannot grow with depth. Measured on the program, not on the clock (a busy machine
    cannot fail it); an unrolled stack would hold 8x the ops."""
    h6, h48 = _compiled_program(6), _compiled_program(48)
    assert "while" in h48
    assert re.sub(r"\d+", "N", h48) == re.sub(r"\d+", "N", h6)
