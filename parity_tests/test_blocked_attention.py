"""The memory-efficient (blocked, online-softmax) attention path, forced at small T: the
same parity as the dense path, against the torch twin and against the dense Flax path,
and the memory it saves at T = 8192."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_blocks as fb
from flax_blocks.attention import BLOCKED, blocked_attention_settings

from .cases import BASE, LLAMA
from .harness import TOL, Case, parity

CASES = [
    Case("TransformerBlock", replace(BASE, causal=True), seq=7, key_mask=True),  # T not a multiple of the block
    Case("TransformerBlock", replace(LLAMA, norm="peri"), seq=6, key_mask=True),
    Case("DecoderBlock", LLAMA, seq=6, key_mask=True, memory_key_mask=True),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_blocked_path_keeps_parity(case, dtype):
    with blocked_attention_settings(min_keys=1, block=2):
        err = parity(case, dtype)
    assert err.forward <= TOL["forward", dtype], err.forward
    assert max(err.grad, err.dx) <= TOL["grad", dtype], (err.grad, err.dx)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_path_keeps_float32_parity(case):
    """The accelerator path (jax.nn.dot_product_attention, cuDNN on a GPU) forced on the CPU,
    where XLA runs it: float32 parity (its softmax is float32, so float64 is not its job)."""
    with blocked_attention_settings(min_keys=10**9, fused=True):
        err = parity(case, "float32")
    assert err.forward <= TOL["forward", "float32"] and max(err.grad, err.dx) <= TOL["grad", "float32"]


def test_fused_path_rows_without_keys_are_zero_with_finite_gradients():
    m = fb.TransformerBlock(replace(BASE, causal=True), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, BASE.d_model))
    keys = np.ones((2, 5), bool)
    keys[1, :2] = False  # causal: queries 0 and 1 of sequence 1 see no key
    dense = m(x, key_mask=keys)
    with blocked_attention_settings(min_keys=1, fused=True):
        fused = m(x, key_mask=keys)
        g = jax.grad(lambda x: jnp.sum(m(x, key_mask=keys) ** 2))(x)
    assert float(jnp.abs(fused - dense).max()) < 1e-5 and bool(jnp.isfinite(g).all())


def test_blocked_path_warns_of_a_mask_in_the_other_convention():
    """A key mask with no real key in an element (torch's True = padding handed over as is)
    gets the dense path's warning on the blocked path too."""
    m = fb.TransformerBlock(BASE, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 5, BASE.d_model))
    keys = np.ones((2, 5), bool)
    keys[1] = False
    for settings in ({"min_keys": 10**6}, {"min_keys": 1, "block": 2}):  # dense, blocked
        with blocked_attention_settings(**settings), pytest.warns(UserWarning, match=r"batch element\(s\) \[1\]"):
            m(x, key_mask=keys)


def test_blocked_equals_dense_and_is_taken_only_without_weights():
    with jax.enable_x64(True):
        m = fb.Encoder(replace(LLAMA, param_dtype="float64"), num_layers=2, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(0), (2, 9, LLAMA.d_model), jnp.float64)
        keys = np.ones((2, 9), bool)
        keys[1, 6:] = False
        dense = m(x, key_mask=keys)
        with blocked_attention_settings(min_keys=1, block=4):
            blocked = m(x, key_mask=keys)
            _, inter = m(x, key_mask=keys, return_intermediates=True)  # weights asked for: dense path
        assert float(jnp.abs(blocked - dense).max() / jnp.abs(dense).max()) <= 1e-12
        assert inter["attention_weights"].shape == (2, 2, LLAMA.num_heads, 9, 9)
        with blocked_attention_settings(min_keys=1, block=4):  # a wrong causal mask would show
            wrong = fb.Encoder(replace(LLAMA, param_dtype="float64", causal=False), num_layers=2, rngs=nnx.Rngs(0))
            assert float(jnp.abs(wrong(x, key_mask=keys) - dense).max()) > 1e-3


@pytest.mark.slow
def test_long_sequence_train_step_memory():
    """A block forward + backward at T = 8192, B = 1 (d256, 8 heads): XLA temp memory under
    256 MiB with the blocked path (measured 240 MiB), where the dense logits alone are 2 GiB
    (measured 8.3 GiB in all). Compiled only, never run."""
    cfg = fb.BlockConfig(d_model=256, num_heads=8, d_ff=1024, norm="pre", dropout=0.0)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: fb.TransformerBlock(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    x = jax.ShapeDtypeStruct((1, 8192, 256), jnp.float32)

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2)

    assert BLOCKED["min_keys"] <= 8192
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * 2**20
