"""flax_blocks.experts' dispatch in float64: grouped_mlp (rows sorted into blocks of one expert,
a loop over the experts that have rows, a custom VJP) against a dense reference that runs every
row through every expert and keeps its own expert's output; experts that get no rows, group sizes
that are not multiples of the block, gated and plain MLPs; and the block layout itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_blocks.experts import block_rows, expert_blocks, grouped_mlp

# 6 experts: 0 and 4 get no rows; the others 5, 1, 9 and 8 rows with blocks of 4 (none a multiple but 8)
EXPERTS = np.array([1, 3, 1, 5, 2, 1, 3, 3, 5, 1, 3, 5, 3, 3, 5, 1, 3, 5, 5, 3, 5, 5, 3])
X, E, F, BLOCK = 6, 5, 7, 4


def reference(x, experts, up, gate, down, act):
    """Every row through every expert (einsum over all X), then each row's own expert's output."""
    hu = jnp.einsum("ae,xef->axf", x, up)
    h = act(hu) if gate is None else act(jnp.einsum("ae,xef->axf", x, gate)) * hu
    y = jnp.einsum("axf,xfe->axe", h, down)
    return jnp.take_along_axis(y, experts[:, None, None], axis=1)[:, 0]


@pytest.mark.parametrize("gated", [True, False])
def test_grouped_mlp_matches_dense_reference_float64(gated):
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((len(EXPERTS), E)))
        r = jnp.asarray(rng.standard_normal((len(EXPERTS), E)))
        up, gate, down = (jnp.asarray(rng.standard_normal(s)) for s in ((X, E, F), (X, E, F), (X, F, E)))
        gate = gate if gated else None
        act = jax.nn.silu if gated else jax.nn.gelu
        experts = jnp.asarray(EXPERTS, jnp.int32)

        def value_and_grads(fn):
            def loss(x, up, gate, down):
                y = fn(x, experts, up, gate, down, act)
                return jnp.sum(y * r), y
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

        ((v, y), grads) = value_and_grads(lambda *a: grouped_mlp(*a, block=BLOCK))(x, up, gate, down)
        ((v_ref, y_ref), grads_ref) = value_and_grads(reference)(x, up, gate, down)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(v, v_ref, rtol=1e-13)
        for name, g, g_ref in zip(("x", "up", "gate", "down"), grads, grads_ref, strict=True):
            if g_ref is None:
                assert g is None
                continue
            scale = float(jnp.max(jnp.abs(g_ref)))
            np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-13 * scale, err_msg=name)
        # experts without rows get exactly zero weight gradients
        for g in grads[1:]:
            if g is not None:
                assert not np.any(np.asarray(g)[[0, 4]])


def test_block_layout():
    """Each expert's rows in their order, each expert's blocks its own, padded to a multiple of the
    block; the experts with rows listed first; the static bound holds."""
    experts = jnp.asarray(EXPERTS, jnp.int32)
    slot, block_expert, used = jax.jit(lambda e: block_rows(e, X, BLOCK)[:3])(experts)
    nb = -(-len(EXPERTS) // BLOCK) + X  # the static bound: ceil(A / b) + X blocks
    first, count, order = (np.asarray(a) for a in jax.jit(lambda e: expert_blocks(e, X, BLOCK))(experts))
    slot, block_expert, used = np.asarray(slot), np.asarray(block_expert), np.asarray(used)
    assert len(set(slot.tolist())) == len(EXPERTS) and slot.max() < nb * BLOCK
    np.testing.assert_array_equal(block_expert[slot // BLOCK], EXPERTS)  # every row in a block of its expert
    for e in range(X):
        rows = np.flatnonzero(np.equal(EXPERTS, e))
        assert count[e] == -(-len(rows) // BLOCK)
        np.testing.assert_array_equal(slot[rows], first[e] * BLOCK + np.arange(len(rows)))
    assert len(used) == nb and used.sum() == count.sum() and used[: count.sum()].all()
    assert sorted(order[: (count > 0).sum()].tolist()) == [1, 2, 3, 5] and sorted(order[4:].tolist()) == [0, 4]
