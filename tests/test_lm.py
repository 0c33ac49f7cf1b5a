"""The LanguageModel twins and fb.generate's compiled loop: a model made in Flax generates the
same tokens in torch, the lab's model is the library's, and a decoding step writes its cache
in place. (Whole models against Hugging Face: parity_tests/hf/test_models.py.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

import flax_blocks as fb  # noqa: E402
import torch_blocks as tb  # noqa: E402
from torch_blocks.lm import generate as torch_generate  # noqa: E402

V, E = 96, 32


def _batch(t=7, pad=3, seed=0):
    ids = np.random.default_rng(seed).integers(0, V, (2, t))
    mask = np.ones((2, t), np.int64)
    mask[1, :pad] = 0
    positions = np.maximum(mask.cumsum(1) - 1, 0)
    return ids, mask, positions


GPT2_LIKE = (dict(activation="gelu_tanh"), dict(max_positions=32, head="tied"))
LLAMA_LIKE = (dict(norm_type="rmsnorm", mlp="swiglu", activation="silu", rope_theta=100.0, num_kv_heads=2, bias=False),
              dict(head="untied"))


@pytest.mark.parametrize("kind", [GPT2_LIKE, LLAMA_LIKE], ids=["learned-tied", "rotary-untied"])
def test_twins_generate_the_same_tokens_both_ways(kind):
    """A model made in Flax generates the same greedy tokens in torch (left-padded rows:
    per-row positions, learned or rotary), and its weights come back unchanged."""
    cfg = fb.BlockConfig(d_model=E, num_heads=4, d_ff=64, norm="pre", causal=True, dropout=0.0, **kind[0])
    lm = fb.LanguageModel(cfg, fb.LMConfig(vocab_size=V, num_layers=2, init_std=0.5, **kind[1]), rngs=nnx.Rngs(0))
    twin = tb.LanguageModel(cfg, lm.lm)
    twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
    ids, mask, _ = _batch(t=5, pad=2, seed=2)
    ours = np.asarray(fb.generate(lm, ids, mask, max_new_tokens=8))
    theirs = torch_generate(twin, torch.tensor(ids), torch.tensor(mask), max_new_tokens=8).numpy()
    np.testing.assert_array_equal(ours, theirs)
    back = fb.LanguageModel(cfg, lm.lm, rngs=nnx.Rngs(1))
    fb.load_torch_state_dict(back, twin.state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(fb.torch_state_dict(back).values(),
                                                     fb.torch_state_dict(lm).values(), strict=True))


def test_the_labs_model_is_the_library_model_and_generates_the_same_in_torch():
    """experiments.stability.model builds a fb.LanguageModel (the lab's init declared in LMConfig: the
    embeddings N(0, 1/2), a xavier-uniform head with a zero bias), which the torch twin loads
    by name: the same logits and intermediates, the same greedy tokens."""
    from experiments.stability.model import ModelConfig, create_params

    mc = ModelConfig("pre", 2, vocab=V, seq_len=16, d_model=E, num_heads=4, d_ff=64)
    graphdef, params, rest = create_params(mc, jax.random.key(0))
    lm = nnx.merge(graphdef, params, rest)
    assert type(lm) is fb.LanguageModel and lm.lm == mc.lm_config()
    embed, pos = np.asarray(lm.embed.embedding[...]), np.asarray(lm.pos.embedding[...])
    kernel, bias = np.asarray(lm.head.kernel[...]), np.asarray(lm.head.bias[...])
    bound = math.sqrt(6 / (E + V))
    assert abs(embed.std() - math.sqrt(0.5)) < 0.03 and abs(pos.std() - math.sqrt(0.5)) < 0.06
    assert kernel.shape == (E, V) and 0.95 * bound < np.abs(kernel).max() <= bound and not bias.any()
    twin = tb.LanguageModel(lm.cfg, lm.lm)
    twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
    assert float(twin.head.weight.detach().abs().max()) <= bound  # the torch twin's own draw follows the same spec
    ids = np.random.default_rng(1).integers(0, V, (2, 10))
    logits, inter = lm(jnp.asarray(ids), return_intermediates=True)
    t_logits, t_inter = twin(torch.tensor(ids), return_intermediates=True)
    np.testing.assert_allclose(np.asarray(logits), t_logits.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert set(inter) == set(t_inter) >= {"embedded", "output", "residual", "attention_weights"}
    np.testing.assert_allclose(np.asarray(inter["residual"]), t_inter["residual"].detach().numpy(), atol=1e-5)
    ours = np.asarray(fb.generate(lm, ids[:, :4], max_new_tokens=8))
    np.testing.assert_array_equal(ours, torch_generate(twin, torch.tensor(ids[:, :4]), max_new_tokens=8).numpy())
    with pytest.raises(ValueError, match="without a cache"):
        lm(jnp.asarray(ids), cache=lm.init_cache(2, 12), return_intermediates=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_decoding_step_writes_the_cache_in_place(batch):
    """fb.generate's compiled loop copies no layer's cache (B, K, L, hd): each step writes its
    key and value into the cache in place (XLA:CPU copied every cache at every step when the
    step's products read the written cache, or its writes were not ordered after the reads)."""
    import re

    from flax_blocks.generation import _generate, _layer_weights

    cfg = fb.BlockConfig(d_model=E, num_heads=4, d_ff=64, norm="pre", causal=True, dropout=0.0, **LLAMA_LIKE[0])
    lm = fb.LanguageModel(cfg, fb.LMConfig(vocab_size=V, num_layers=2, **LLAMA_LIKE[1]), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(lm)
    ids = jnp.zeros((batch, 5), jnp.int32)
    hlo = _generate.lower(graphdef, state, _layer_weights(graphdef, state), ids, jnp.ones((batch, 5), bool),
                          jax.random.key(0), max_new_tokens=11, temperature=0.0, top_k=None, top_p=None, eos=None,
                          pad=None).compile().as_text()
    cache = rf"f32\[{batch},2,16,8\]"  # (B, K, L = 5 + 11, hd)
    assert re.search(rf"= {cache}\S* dynamic-update-slice\(|= {cache}\S* fusion\(", hlo)  # the pattern sees caches
    copies = re.findall(rf"= {cache}\S* copy\(", hlo)
    assert not copies, f"{len(copies)} copies of a layer's cache in the decoding loop"


def test_a_cache_window_is_refused_beside_chunked_attention():
    """Chunks count from each row's first cached key: a cache_window hiding the old keys would move them, so
    either twin's init_cache refuses the pair by name (a model with chunks and no window makes its cache)."""
    cfg = fb.BlockConfig(d_model=E, num_heads=4, d_ff=64, norm="pre", causal=True, dropout=0.0, rope_theta=100.0,
                         attention_chunk_size=4)
    lm = fb.LanguageModel(cfg, fb.LMConfig(vocab_size=V, num_layers=1, cache_window=8), rngs=nnx.Rngs(0))
    twin = tb.LanguageModel(cfg, lm.lm)
    for model in (lm, twin):
        with pytest.raises(ValueError, match="cache_window=8 with attention_chunk_size=4"):
            model.init_cache(2, 16)
    assert "window" not in fb.LanguageModel(cfg, fb.LMConfig(vocab_size=V, num_layers=1),
                                            rngs=nnx.Rngs(0)).init_cache(2, 16)
