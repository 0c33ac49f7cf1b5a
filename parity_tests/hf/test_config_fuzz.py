"""fb.from_hf against transformers on configs people hold.

Each case is a save_pretrained folder whose config.json is written as given, read back by
transformers' from_pretrained (the reference) and by fb.from_hf: equal (float32 logits within
1e-5 relative on a left-padded batch with HF's position_ids, and HF's greedy tokens), or one
refusal naming a key (parity_tests.hf.fuzz.run_case). First the seven kinds of config that
once loaded silently wrong, each on two or more families, and folders of shapes people hold; then a
fixed-seed hypothesis budget over every family's keys.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
from flax_blocks.checkpoints.checkpoint import hf_config  # noqa: E402
from parity_tests.hf.fuzz import MODELS, Outcome, fuzz, run_case  # noqa: E402

ROTARY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
              num_hidden_layers=3, vocab_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
GPT2 = dict(n_embd=32, n_head=4, n_layer=2, n_inner=40, n_positions=24, vocab_size=64, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
GEMMA = dict(ROTARY, head_dim=8)


def case(family: str, **config) -> Outcome:
    base = GPT2 if family == "gpt2" else GEMMA if family.startswith("gemma") else ROTARY
    window = {"sliding_window": 4} if family in ("gemma2", "gemma3_text") else {}
    return run_case(family, {"model_type": family, **base, **window, **config})


def equal(outcome: Outcome) -> None:
    assert outcome.kind == "equal", outcome


def refused(outcome: Outcome, key: str) -> None:
    assert outcome.kind == "refused" and f"{key}=" in outcome.detail, outcome


# The seven kinds ----------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2", "olmo2"])
def test_is_causal_false_is_bidirectional_as_in_transformers(family):
    out = case(family, is_causal=False)  # causal-lm refused by name, then the base model compared
    assert out.kind == "equal" and out.detail == "model", out


def test_gemma3_never_soft_caps_its_attention_and_gemma2_does():
    equal(case("gemma3_text", attn_logit_softcapping=0.5))
    equal(case("gemma2", attn_logit_softcapping=0.5))


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "gemma"])
def test_gelu_is_exact_in_gemma_2_and_3_and_tanh_in_gemma(family):
    equal(case(family, **({"hidden_act": "gelu"} if family == "gemma" else {"hidden_activation": "gelu"})))


def test_llama_never_reads_sliding_window():
    equal(case("llama", sliding_window=2))  # a Mistral's key relabelled llama: ignored, as LlamaModel ignores it
    llama = {"model_type": "llama", **ROTARY, "sliding_window": 2}
    assert hf_config(llama)[1].sliding_window is None


@pytest.mark.parametrize("family", ["mistral", "phi3", "starcoder2"])
def test_layer_types_are_not_read_where_every_layer_is_local(family):
    refused(case(family, sliding_window=2, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            "layer_types")
    equal(case(family, sliding_window=2, layer_types=["sliding_attention"] * 3))  # what the model computes anyway


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_stored_head_is_kept_under_tie_word_embeddings(family):
    equal(case(family, tie_word_embeddings=True, _stored_head=True))


@pytest.mark.parametrize("family,stray", [("llama", "layer_norm_eps"), ("gpt2", "layer_norm_eps"),
                                          ("starcoder2", "rms_norm_eps")])
def test_a_stray_eps_key_is_ignored_as_in_transformers(family, stray):
    equal(case(family, **{stray: 0.5}))  # a large eps would show if it were read


# Folders of shapes people hold --------------------------------------------------------------

def test_gemma3_with_every_layer_full_computes():
    equal(case("gemma3_text", layer_types=["full_attention"] * 3))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_is_decoder_without_cross_attention_computes(family):
    neox = {"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 40,
            "num_hidden_layers": 2, "vocab_size": 64, "rotary_pct": 0.5}
    equal(case("llama", is_decoder=True) if family == "llama" else run_case(family, {**neox, "is_decoder": True}))


def test_the_whisper_encoder_saved_alone_loads(tmp_path):
    import numpy as np
    import torch
    import transformers

    config = transformers.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=40,
                                        decoder_attention_heads=4, decoder_ffn_dim=40, num_mel_bins=8,
                                        max_source_positions=16)
    torch.manual_seed(0)
    whole = transformers.WhisperModel(config).eval()
    whole.encoder.save_pretrained(tmp_path)
    assert not any(k.startswith("encoder.") for k in whole.encoder.state_dict())
    alone, from_whole = fb.from_hf(str(tmp_path)), fb.from_hf(whole)
    x = np.random.default_rng(0).normal(size=(2, 5, 32)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(alone(x)), np.asarray(from_whole(x)))


@pytest.mark.parametrize("model_type,words", [
    ("falcon_mamba", "state-space"), ("bloom", "ALiBi position biases"), ("gpt_neo", "local attention"),
    ("codegen", "interleaved rotary"),
    ("dbrx", "p-norm.*clip_qkv"), ("llama4", "vision tower.*llama4_text"),
    ("frobnet", "no table reads it; supported: bert")])
def test_model_types_the_blocks_do_not_compute_are_refused_with_the_reason(model_type, words):
    with pytest.raises(fb.ConversionError, match=words):
        hf_config({"model_type": model_type, "num_local_experts": 4, "num_experts_per_tok": 2})


# The budget ---------------------------------------------------------------------------------

# Two per family in the suite (the committed fuzz run, parity_tests/results/fuzz_hf, holds 3610);
# FUZZ_HF_EXAMPLES=N draws more.
EXAMPLES = int(os.environ.get("FUZZ_HF_EXAMPLES", "2"))


@pytest.mark.parametrize("family", list(MODELS))
def test_fuzz_budget(family):
    """EXAMPLES drawn configs per family (fixed seed): none loads silently wrong or crashes."""
    outcomes: list[Outcome] = []
    fuzz(family, EXAMPLES, seed=33, record=outcomes.append)
    bad = [o for o in outcomes if o.kind in ("wrong", "crash")]
    assert len(outcomes) == EXAMPLES and not bad, bad


# The fuzzer's own tolerances catch real mistakes --------------------------------------------

def test_a_wrong_eps_is_a_wrong_load_for_the_fuzzer(monkeypatch):
    """The 1e-5 rule (and its float64 fallback) fails an eps read ten times too large."""
    import dataclasses

    from flax_blocks.checkpoints import family as hf_families

    llama = hf_families.FAMILIES["llama"]
    wrong = dataclasses.replace(llama, reader=lambda c: {**llama.reader(c), "layer_norm_eps": 10 * c["rms_norm_eps"]})
    monkeypatch.setitem(hf_families.FAMILIES, "llama", wrong)
    out = case("llama", rms_norm_eps=0.01)
    assert out.kind == "wrong" and "float64" in out.detail, out


def test_greedy_agreement_fails_on_another_token():
    import numpy as np

    from parity_tests.hf.fuzz import NEW, T, _greedy_agrees

    rng = np.random.default_rng(0)
    forced = rng.normal(size=(2, T + NEW, 64))
    tokens = np.concatenate([rng.integers(0, 64, (2, T)), forced[:, T - 1:T - 1 + NEW].argmax(-1)], axis=1)
    assert _greedy_agrees(forced, tokens)
    tokens[1, T + 3] = (tokens[1, T + 3] + 1) % 64
    assert not _greedy_agrees(forced, tokens)


def test_a_scaled_rope_draw_reads_a_rope_parameters_key_left_out():
    """The generator sizes longrope's factors from the drawn config, whose rope_parameters may be drawn
    absent (the long run's gemma3_text draws crashed on it: the generator's bug, not the loader's)."""
    from parity_tests.hf.fuzz import ABSENT, _rotary_dim

    c = {"hidden_size": 32, "num_attention_heads": 4, "head_dim": ABSENT, "rope_parameters": ABSENT}
    assert _rotary_dim("gemma3_text", c) == 8
    assert _rotary_dim("gemma3_text", {**c, "rope_parameters": {"partial_rotary_factor": 0.5}}) == 4


@pytest.mark.parametrize("model_type, count", [("qwen3_moe", 4), ("mixtral", 2)])
def test_an_experts_count_given_twice_is_read_as_each_config_class_keeps_it(model_type, count):
    """A file holding both num_experts=2 and num_local_experts=4: transformers 5.24's Qwen3MoeConfig
    keeps num_local_experts, MixtralConfig takes the alias (found by the fuzzer: Qwen3-MoE folders
    refused for their expert tensors' shapes)."""
    import transformers

    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[model_type]
    both = {"num_experts": 2, "num_local_experts": 4}
    assert cls.from_dict(both).num_local_experts == count
    config = {"model_type": model_type, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 16, "num_hidden_layers": 2, "num_experts_per_tok": 2, **both}
    assert hf_config(config)[1].num_experts == count


def test_a_qwen3_moe_window_without_use_sliding_window_is_no_generation_window():
    """Qwen3MoeConfig keeps sliding_window only with use_sliding_window, so HF's generate decodes
    without a window there (found by the fuzzer: 7 Qwen3-MoE configs with sliding_window 2 whose
    greedy tokens differed, our cache windowed as for a family that never reads the key)."""
    config = {"model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 40, "num_hidden_layers": 1, "vocab_size": 64, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 24, "sliding_window": 2, "use_sliding_window": False}
    outcome = run_case("qwen3_moe", config)
    assert outcome.kind == "equal", outcome
