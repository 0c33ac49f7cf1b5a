"""Every scaled rotary transformers ships, against transformers, where it acts.

float32, through `fb.from_hf` of a saved folder (parity_tests.hf.fuzz.run_case): logits on a
left-padded batch and HF's greedy tokens, with original lengths short enough that the prompt
already passes them (dynamic's larger base, longrope's long factors), and long enough that
only the generated tokens do (the switch during HF's generate, whose cached keys keep their
rotation). float64: the Flax model, its torch twin and HF (its rope functions recompiled in
float64: `parity_tests.hf.reference.rope_functions64`) at positions past the original length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
import torch_blocks as tb  # noqa: E402
from flax_blocks.checkpoints.checkpoint import read_config  # noqa: E402
from parity_tests.hf.fuzz import run_case  # noqa: E402
from parity_tests.hf.reference import float64_faithful  # noqa: E402

ROTARY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
              num_hidden_layers=2, vocab_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 8.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0], "long_factor": [1.0, 3.0, 6.0, 9.0],
                 "original_max_position_embeddings": 4},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4},
}


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("length", [4, 9])  # the prompt (7 tokens) past it, or only the generated tokens
def test_each_rope_type_loads_equal_to_transformers(kind, length, monkeypatch):
    monkeypatch.setenv("FUZZ_HF_EAGER", "1")
    scaling = {**SCALINGS[kind]}
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = length
    config = {"model_type": "llama", **ROTARY, "rope_theta": 100.0, "max_position_embeddings": length,
              "rope_scaling": scaling}
    out = run_case("llama", config)
    assert out.kind == "equal", out


def test_phi35_longrope_with_its_older_spelling_and_partial_rotary(monkeypatch):
    """Phi-3.5 / Phi-4-mini: "type" "su" or "longrope", factors of the partial rotary width,
    the top-level original_max_position_embeddings, factor from max / original."""
    monkeypatch.setenv("FUZZ_HF_EAGER", "1")
    factors = {"short_factor": [1.0, 1.5, 2.0], "long_factor": [1.0, 4.0, 8.0]}
    for spelling in ({"type": "longrope"}, {"type": "su", "original_max_position_embeddings": 4}):
        config = {"model_type": "phi3", **ROTARY, "partial_rotary_factor": 0.75, "max_position_embeddings": 32,
                  "original_max_position_embeddings": 4, "rope_theta": 100.0,
                  "rope_scaling": {**spelling, **factors}}
        out = run_case("phi3", config)
        assert out.kind == "equal", out
    # "su" renamed after transformers fills in the original length: without its own, refused by both
    su = {"model_type": "phi3", **ROTARY, "original_max_position_embeddings": 4,
          "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}
    out = run_case("phi3", su)
    assert out.kind == "hf-refused" and "original_max_position_embeddings" in out.detail, out
    with pytest.raises(fb.ConversionError, match="transformers requires them too"):
        read_config(su)


def test_gemma3_scales_its_global_layers_only(monkeypatch):
    """Gemma 3 4B's text config: a flat rope_scaling (linear x8) on the full-attention layers, the
    sliding ones plain at rope_local_base_freq."""
    monkeypatch.setenv("FUZZ_HF_EAGER", "1")
    config = {"model_type": "gemma3_text", **ROTARY, "head_dim": 8, "num_hidden_layers": 3, "sliding_window": 4,
              "sliding_window_pattern": 3, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    out = run_case("gemma3_text", config)
    assert out.kind == "equal", out
    cfg = read_config(config).cfg
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_local_theta == 10_000.0 and cfg.rope_theta == 1e6


def _float64_case(kind: str):
    scaling = SCALINGS[kind]
    hf_cfg = transformers.LlamaConfig(**ROTARY, rope_theta=100.0, max_position_embeddings=4, rope_scaling=scaling)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_float64_twins_and_hf_agree_past_the_original_length(kind):
    hf = _float64_case(kind)
    ids = np.arange(3, 15)[None] % 64  # 12 positions, past the original 4
    with jax.enable_x64(True):
        lm = fb.from_hf(hf, part="causal-lm")
        ours = np.asarray(lm(jnp.asarray(ids)))
        twin = tb.LanguageModel(lm.cfg, lm.lm).to(torch.float64)
        twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
        plain = tb.LanguageModel(dataclasses.replace(lm.cfg, rope_scaling=None), lm.lm).to(torch.float64)
        plain.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)  # the same weights, plain rotary
    hf_model = float64_faithful(hf)
    hf_model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        theirs = hf_model(torch.tensor(ids)).logits.numpy()
        torch_twin = twin.eval()(torch.tensor(ids)).detach().numpy()
        unscaled = plain.eval()(torch.tensor(ids)).detach().numpy()
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() / scale <= 1e-12
    assert np.abs(torch_twin - theirs).max() / scale <= 1e-12
    assert np.abs(unscaled - theirs).max() / scale > 1e-6  # the scaling acts at these positions: a check that can fail


def test_yarn_over_a_rotary_dim_of_three_broadcasts_its_ramp_as_transformers_does(monkeypatch):
    """int(8 * 0.375) = 3 dims: two frequencies share the ramp's one entry in HF; equal here."""
    monkeypatch.setenv("FUZZ_HF_EAGER", "1")
    config = {"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 40,
              "num_hidden_layers": 2, "vocab_size": 64, "rotary_pct": 0.375, "bos_token_id": None,
              "eos_token_id": None, "pad_token_id": None,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    out = run_case("gpt_neox", config)
    assert out.kind == "equal", out


def test_gemma3_rope_scaling_spelled_with_type_changes_nothing_as_in_transformers(monkeypatch):
    """Gemma3TextConfig updates its default full-layer parameters, which already say rope_type
    "default", with a flat rope_scaling: an older "type" key there is never read (found by the
    fuzzer: read as linear, 1e-1 off)."""
    monkeypatch.setenv("FUZZ_HF_EAGER", "1")
    config = {"model_type": "gemma3_text", **ROTARY, "head_dim": 8, "num_hidden_layers": 3,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert read_config(config).cfg.rope_scaling is None
    out = run_case("gemma3_text", config)
    assert out.kind == "equal", out


def test_phi3_generate_recomputes_every_key_where_the_sequence_passes_the_original_length(tmp_path):
    """Phi3ForCausalLM's generate drops its cache when the sequence first reaches
    original_max_position_embeddings + 1 tokens and recomputes every key with the long factors
    (found by the fuzzer: a decode that kept the short-rotated keys drifted, 0.3 in the logits);
    fb.generate and the torch twin's do the same, token for token."""
    import torch_blocks.lm as tlm

    config = transformers.Phi3Config(**ROTARY, max_position_embeddings=32, original_max_position_embeddings=8,
                                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5, 1.75],
                                                   "long_factor": [1.0, 2.0, 3.0, 4.0]})
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    lm = fb.from_hf(tmp_path, part="causal-lm")
    assert lm.lm.recompute_length == 8
    ids = np.array([[5, 6, 7, 8, 9, 10, 11], [1, 1, 1, 4, 9, 16, 25]])
    mask = np.array([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    theirs = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=8, do_sample=False,
                         pad_token_id=0, eos_token_id=None).numpy()
    ours = np.asarray(fb.generate(lm, ids, mask, max_new_tokens=8))
    assert (ours == theirs).all(), (ours, theirs)
    twin = tb.LanguageModel(lm.cfg, lm.lm).eval()
    twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
    with torch.no_grad():
        assert (tlm.generate(twin, torch.tensor(ids), torch.tensor(mask), max_new_tokens=8).numpy() == ours).all()
    lm.lm = dataclasses.replace(lm.lm, recompute_length=None)  # the cache kept throughout: another token stream
    assert not (np.asarray(fb.generate(lm, ids, mask, max_new_tokens=8)) == theirs).all()
