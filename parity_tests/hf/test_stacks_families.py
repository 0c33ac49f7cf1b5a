"""Parity against the real Hugging Face implementations of the families beyond BERT, GPT-2 and
LLaMA: RoBERTa (BERT's stack, here as a decoder: is_decoder=True makes it causal), DistilBERT,
OPT (pre-LN, and post-LN with project_in / project_out as OPT-350m), ViT, Phi-3 (fused
qkv_proj and gate_up_proj), Qwen3 (per-head QK-norm, explicit head_dim), Gemma ((1 + w)
norms, GeGLU), OLMo 2 (norms on the sublayer outputs, full-width QK-norm) and GPT-NeoX (per-head
fused query_key_value, partial rotary; parallel and sequential residual), Mistral with a sliding
window shorter than the sequence, Starcoder2, Gemma 2 (sandwich norms, soft-capping, alternating
windows) and Gemma 3 text (QK-norm, a local rotary base). The builds, inputs and measurements
are parity_tests.hf.families' (which also writes docs/families.md); each family is built and measured ONCE per module.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
from flax_blocks.checkpoints import dialects  # noqa: E402
from flax_blocks.checkpoints.checkpoint import NOT_COMPUTED, hf_config, read_folder  # noqa: E402
from parity_tests.hf import families  # noqa: E402
from parity_tests.hf.families import FAMILIES, REFUSALS, config, forward, measure  # noqa: E402
from parity_tests.hf.reference import rel_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# One worker runs the module (pytest-xdist --dist loadgroup, as `make test` runs): its module fixture
# builds every family once, not once per worker.
pytestmark = pytest.mark.xdist_group("hf_stacks_families")

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> parity_tests.hf.families.Measured, built and measured on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = measure(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_hf_matches_the_hf_stack(family, built):
    m = built(family)
    print(f"{family}: float64 (fwd, grad) {m.float64}, float32 {m.float32}")
    assert m.num_layers == 3
    if family not in families.NO_PADDING:
        assert m.mask_matters > 1e-3  # the padding mask changes real positions' outputs
    assert max(m.float64) <= 1e-12, m.float64
    assert m.float32 is None if family in families.FLOAT64_ONLY else max(m.float32) <= 2e-6, m.float32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_to_hf_writes_the_folders_stack_back_bit_for_bit(family, built):
    m = built(family)
    with jax.enable_x64(True):
        sd = fb.to_hf(m.flax)  # the dialect from_hf read it in
    _, files = read_folder(str(m.folder))
    assert set(sd) == set(files) - set(dialects.translate(files, m.dialect, num_heads=m.flax.cfg.num_heads,
                                                          num_kv_heads=m.flax.cfg.kv_heads).dropped)
    for k, v in sd.items():
        assert v.dtype == files[k].dtype == np.float64 and np.array_equal(v, files[k]), k


def _swap_gate_up(theirs):
    return {k: np.concatenate(np.split(v, 2)[::-1]) if k.endswith("gate_up_proj.weight") else v
            for k, v in theirs.items()}


def _without_qk_norm(theirs):
    return {k: v for k, v in theirs.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}


def _gemma_norm_names(theirs):
    """Gemma 2's post_attention_layernorm (the attention's output norm) read as Gemma's (the MLP's input norm)."""
    swap = {"post_attention_layernorm": "pre_feedforward_layernorm",
            "pre_feedforward_layernorm": "post_attention_layernorm"}
    return {next((k.replace(a, b) for a, b in swap.items() if f".{a}." in k), k): v for k, v in theirs.items()}


def _qkv_as_blocks(theirs):
    """What a reader taking query_key_value's rows as [q; k; v] blocks (not per head) loads."""
    return {k: dialects._regroup(v, 3, 3, to_ours=False) if ".query_key_value." in k else v for k, v in theirs.items()}


def _kv_swapped(theirs):
    """GPT-BigCode's c_attn rows read as [q; v; k] (one KV head of 8 rows each)."""
    def swap(v):
        q, k, val = np.split(v, [len(v) - 16, len(v) - 8])
        return np.concatenate([q, val, k])
    return {k: swap(v) if ".attn.c_attn." in k else v for k, v in theirs.items()}


def _falcon_kv_swapped(theirs):
    """Falcon-7B's query_key_value rows read as [q; v; k] (one KV head of 8 rows each)."""
    fused = ".self_attention.query_key_value."
    swapped = _kv_swapped({k.replace(fused, ".attn.c_attn."): v for k, v in theirs.items() if fused in k})
    return {**theirs, **{k.replace(".attn.c_attn.", fused): v for k, v in swapped.items()}}


def _falcon_groups_as_blocks(theirs):
    """What a reader taking Falcon-40B's query_key_value rows as [q; k; v] blocks (not per KV group) loads."""
    return {k: dialects._ungroup(v, 4, 2, to_ours=False) if ".query_key_value." in k else v
            for k, v in theirs.items()}


# A real mistake per family: (what, fields changed, the HF tensors mangled as the mistake reads them).
MISTAKES = {
    "roberta": ("is_decoder ignored: read as BERT's bidirectional encoder", dict(causal=False), None),
    "distilbert": ("torch's LayerNorm eps 1e-5 for DistilBERT's hard-coded 1e-12", dict(layer_norm_eps=1e-5), None),
    "opt": ("post-LN assumed (OPT's names do not say the placement)", dict(norm="post"), None),
    "opt-350m": ("pre-LN assumed for a post-LN OPT", dict(norm="pre"), None),
    "vit": ("tanh GELU (jax.nn.gelu's default) for ViT's exact GELU", dict(activation="gelu_tanh"), None),
    "phi3": ("gate_up_proj split in the wrong order (up first)", {}, _swap_gate_up),
    "qwen3": ("read as a LLaMA (its names): QK-norm dropped", dict(qk_norm=False), _without_qk_norm),
    "gemma": ("norms scale by w, not 1 + w", dict(norm_weight_offset=0.0), None),
    "olmo2": ("norms before the sublayers (pre) for OLMo 2's after (out)", dict(norm="pre"), None),
    "gpt_neox": ("query_key_value rows split as [q; k; v] blocks, not per head", {}, _qkv_as_blocks),
    "gpt_neox-sequential": ("parallel residual (GPT-NeoX's default) for use_parallel_residual=False",
                            dict(parallel_residual="two_norms"), None),
    "mistral-window": ("window off by one (i - W <= j <= i)", dict(sliding_window=families.WINDOW + 1), None),
    "starcoder2": ("no window (every earlier key)", dict(sliding_window=None), None),
    "stablelm": ("rotary on every dim (partial_rotary_factor ignored)", dict(partial_rotary_factor=1.0), None),
    "stablelm-parallel": ("rotary on half of each head for StableLM's quarter", dict(partial_rotary_factor=0.5), None),
    "phi": ("rotary on every dim (partial_rotary_factor ignored)", dict(partial_rotary_factor=1.0), None),
    "gptj": ("rotary on halves (rotate_half, LLaMA's) for GPT-J's adjacent pairs", dict(rope_interleaved=False), None),
    "cohere": ("rotary on halves (LLaMA's names, LLaMA's rotary) for Cohere's adjacent pairs",
               dict(rope_interleaved=False), None),
    "cohere2": ("rotary on the global layers too (Cohere's every layer)", dict(rope_local_only=False), None),
    "smollm3": ("rotary in every layer (read as a LLaMA: its names; no_rope_layers ignored)", dict(nope_layers=()),
                None),
    "granite": ("residual_multiplier ignored (read as a LLaMA: its names)", dict(residual_multiplier=1.0), None),
    "gpt_bigcode": ("c_attn's key and value rows swapped ([q; v; k])", {}, _kv_swapped),
    "falcon": ("query_key_value's key and value rows swapped ([q; v; k])", {}, _falcon_kv_swapped),
    "falcon-rw": ("ALiBi ignored (no position at all)", dict(alibi=False), None),
    "falcon-40b": ("query_key_value rows read as [q; k; v] blocks, not per KV group", {}, _falcon_groups_as_blocks),
    "whisper": ("causal attention (its decoder's) for the encoder", dict(causal=True), None),
    "gemma2": ("post_attention_layernorm read as Gemma's MLP input norm", {}, _gemma_norm_names),
    "gemma3": ("one rotary base for every layer (rope_local_base_freq ignored)", dict(rope_local_theta=None), None),
    "gpt_oss": ("the SwiGLU's clamp missing", dict(swiglu_limit=1e30), None),
    "deepseek_v2": ("routed_scaling_factor ignored (the routed experts' sum unscaled)",
                    dict(routed_scaling_factor=1.0), None),
    "deepseek_v3": ("rotary on halves (rotate_half, LLaMA's) for V3's interleaved pairs",
                    dict(rope_interleave=False), None),
}
MISTAKES["modernbert"] = ("the window one key short on each side (|i - j| <= local_attention // 2 read as <)",
                          dict(sliding_window=families.WINDOW // 2), None)
# More mistakes where one family carries several new settings.
MORE_MISTAKES = [
    ("modernbert", "the global layer last in each period (Gemma's phase)", dict(pattern_global_first=False)),
    ("modernbert", "layer 0's attn_norm applied (the identity ignored)", dict(first_attn_norm=True)),
    ("gemma2", "attention logits not soft-capped", dict(attn_logit_softcapping=None)),
    ("gemma2", "every layer local (the alternation ignored)", dict(sliding_window_pattern=None)),
    ("granite", "1 / sqrt(head_dim) for the softmax scale attention_multiplier", dict(query_pre_attn_scalar=None)),
]


@pytest.mark.parametrize("family, what, fields, mangle", [(f, *MISTAKES[f]) for f in FAMILIES] +
                         [(f, what, fields, None) for f, what, fields in MORE_MISTAKES])
def test_a_real_mistake_is_caught(family, what, fields, mangle, built):
    m = built(family)
    with jax.enable_x64(True):
        theirs = fb.to_hf(m.flax)
        if mangle is not None:
            theirs = mangle(theirs)
        cfg = replace(m.flax.cfg, **fields)
        wrong = fb.from_torch(fb.Encoder, cfg, theirs, dialect=m.dialect, num_layers=3,
                              final_norm=m.flax.final_norm is not None)
        err = rel_at(forward(wrong, m.x, m.keys), m.hf_y, m.keys)
    print(f"{family}: {what}: rel error {err:.1e}")
    assert err > 1e-6  # a million times the float64 tolerance


# ----------------------------------------------------------------------------------------
# What each config says and what is refused (configs only: no model is built)
# ----------------------------------------------------------------------------------------


def test_settings_read_from_each_family_config():
    dialect, cfg, layers, final = hf_config(config("roberta"))
    assert (dialect, cfg.norm, cfg.causal, final) == ("hf-bert", "post", True, False)
    assert hf_config(config("roberta", is_decoder=False))[1].causal is False
    dialect, cfg, layers, final = hf_config(config("distilbert"))
    assert (dialect, cfg.norm, cfg.layer_norm_eps, cfg.d_model, cfg.num_heads, cfg.d_ff, layers) == \
        ("hf-distilbert", "post", 1e-12, 24, 3, 40, 3)
    _, cfg, _, final = hf_config(config("opt"))
    assert (cfg.norm, cfg.layer_norm_eps, final) == ("pre", 1e-5, True)
    _, cfg, _, final = hf_config(config("opt-350m"))
    assert (cfg.norm, final) == ("post", False)  # post-LN OPT has no final norm
    assert hf_config(config("opt", _remove_final_layer_norm=True))[3] is False
    vit = hf_config(config("vit", qkv_bias=False))[1]
    assert (vit.norm, vit.activation, vit.has_qkv_bias, vit.bias, vit.layer_norm_eps) == \
        ("pre", "gelu", False, True, 1e-6)
    phi = hf_config(config("phi3"))[1]
    assert (phi.num_kv_heads, phi.rope_theta, phi.bias, phi.mlp, phi.layer_norm_eps, phi.partial_rotary_factor) == \
        (2, 500.0, False, "swiglu", 1e-5, 0.75)
    qwen3 = hf_config(config("qwen3"))[1]
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qk_norm_over, qwen3.num_kv_heads, qwen3.bias, qwen3.rope_theta) == \
        (8, True, "head", 2, False, 1000.0)
    gemma = hf_config(config("gemma"))[1]
    assert (gemma.head_dim, gemma.norm_weight_offset, gemma.mlp, gemma.activation, gemma.num_kv_heads) == \
        (10, 1.0, "geglu", "gelu_tanh", 1)
    legacy = {**config("gemma"), "hidden_act": "gelu"}  # GemmaConfig reads the legacy "gelu" as tanh GELU
    assert hf_config(legacy)[1].activation == "gelu_tanh"
    olmo = hf_config(config("olmo2"))
    assert (olmo[1].norm, olmo[1].qk_norm_over, olmo[3], olmo[1].bias, olmo[1].mlp_bias) == \
        ("out", "projection", True, True, False)
    for name in ("qwen3", "gemma", "gemma2", "gemma3"):  # attention_bias: q, k, v, o biased, the MLP not
        biased = hf_config(config(name, attention_bias=True))[1]
        assert (biased.bias, biased.mlp_bias, hf_config(config(name))[1].bias) == (True, False, False), name
    neox = hf_config(config("gpt_neox"))[1]
    assert (neox.parallel_residual, neox.partial_rotary_factor, neox.rope_theta, neox.bias, neox.norm) == \
        ("two_norms", 0.5, 1000.0, True, "pre")
    seq = hf_config(config("gpt_neox-sequential"))[1]
    assert (seq.parallel_residual, seq.bias, seq.mlp_bias, seq.norm_bias) == ("none", False, True, True)
    st = hf_config(config("stablelm"))[1]
    assert (st.norm_type, st.bias, st.has_qkv_bias, st.norm_bias, st.partial_rotary_factor, st.parallel_residual,
            st.mlp) == ("layernorm", False, True, True, 0.25, "none", "swiglu")
    assert hf_config(config("stablelm-parallel"))[1].parallel_residual == "shared_norm"
    sc_nobias = hf_config(config("starcoder2", use_bias=False))[1]
    assert (sc_nobias.bias, sc_nobias.norm_bias) == (False, True)
    old = {k: v for k, v in config("gpt_neox").items() if k != "rope_parameters"}  # an old config.json's keys
    old_cfg = hf_config({**old, "rotary_pct": 0.5, "rotary_emb_base": 500})[1]
    assert (old_cfg.partial_rotary_factor, old_cfg.rope_theta) == (0.5, 500.0)
    assert hf_config(old)[1].partial_rotary_factor == 0.25  # GPTNeoXConfig's default rotary_pct
    mistral = hf_config(config("mistral-window"))[1]
    assert (mistral.sliding_window, mistral.sliding_window_pattern) == (4, None)
    qwen2 = dict(model_type="qwen2", hidden_size=24, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=40, num_hidden_layers=3,
                 rms_norm_eps=1e-6, hidden_act="silu", sliding_window=4)
    assert hf_config(qwen2)[1].sliding_window is None  # use_sliding_window False: HF drops the window
    assert hf_config({**qwen2, "use_sliding_window": True, "max_window_layers": 0})[1].sliding_window == 4
    with pytest.raises(fb.ConversionError, match=r"use_sliding_window=True, max_window_layers=1 \(sliding_window=4\)"
                                                 r".* \['full_attention', 'sliding_attention', 'sliding_attention'\]"):
        hf_config({**qwen2, "use_sliding_window": True, "max_window_layers": 1})  # local from layer 2 on
    assert hf_config(config("phi3", sliding_window=4))[1].sliding_window == 4
    g2 = hf_config(config("gemma2"))[1]
    assert (g2.norm, g2.sliding_window, g2.sliding_window_pattern, g2.attn_logit_softcapping,
            g2.query_pre_attn_scalar, g2.activation, g2.head_dim) == ("peri", 4, 2, 5.0, 16, "gelu_tanh", 10)
    g3 = hf_config(config("gemma3"))[1]
    assert (g3.qk_norm, g3.rope_theta, g3.rope_local_theta, g3.sliding_window_pattern, g3.attn_logit_softcapping) == \
        (True, 1000.0, 100.0, 2, None)
    sc = hf_config(config("starcoder2"))[1]
    assert (sc.norm_type, sc.bias, sc.mlp, sc.layer_norm_eps, sc.sliding_window, sc.num_kv_heads) == \
        ("layernorm", True, "dense", 1e-5, 4, 1)
    assert not {"phi3", "roberta", "distilbert", "opt", "vit", "qwen3", "gemma", "olmo2", "gpt_neox", "gemma2",
                "gemma3_text", "starcoder2", "stablelm"} & set(NOT_COMPUTED)


@pytest.mark.parametrize("name, changes, words", [(n, c, w) for n, rs in REFUSALS.items() for c, w in rs])
def test_what_a_family_computes_otherwise_is_refused_by_name(name, changes, words):
    with pytest.raises(fb.ConversionError, match=re.escape(words)):
        hf_config(config(name, **changes))


def test_bert_position_embedding_type_is_ignored_by_transformers_and_refused_here():
    """transformers 5.24's BERT computes absolute positions whatever position_embedding_type
    says (no distance_embedding is even built): a checkpoint trained with relative_key would
    load into it silently wrong, so hf_config refuses it, saying so."""
    kw = dict(vocab_size=16, hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1)
    model = transformers.BertModel(transformers.BertConfig(**kw, position_embedding_type="relative_key"))
    assert not any("distance_embedding" in k for k in model.state_dict())
    with pytest.raises(fb.ConversionError, match="transformers 5 no longer does either"):
        hf_config(model.config.to_dict())


# ----------------------------------------------------------------------------------------
# Rule 3: a model object or folder says what it is; names alone pick no family they share
# ----------------------------------------------------------------------------------------


def test_names_alone(built):
    files = {n: read_folder(str(built(n).folder))[1] for n in ("roberta", "distilbert", "vit", "phi3", "opt")}
    assert fb.detect_dialect(files["roberta"]) == "hf-bert"  # RoBERTa's stack is BERT's: one table
    assert fb.detect_dialect(files["distilbert"]) == "hf-distilbert"
    assert fb.detect_dialect(files["vit"]) == "hf-vit"
    assert fb.detect_dialect(files["phi3"]) == "hf-phi3"  # not hf-llama: the fused names are Phi-3's
    neox = read_folder(str(built("gpt_neox").folder))[1]
    assert fb.detect_dialect(neox) == "hf-gpt-neox"
    with pytest.raises(fb.ConversionError, match=r"(?s)grouped per head.*num_heads"):
        dialects.translate(neox, "hf-gpt-neox")  # query_key_value's per-head rows need the head count
    assert fb.detect_dialect(read_folder(str(built("starcoder2").folder))[1]) == "hf-starcoder2"
    bigcode = read_folder(str(built("gpt_bigcode").folder))[1]  # GPT-2's names, nn.Linear (out, in) matrices
    assert fb.detect_dialect(bigcode) == "hf-gpt2"  # names alone never say GPT-BigCode ...
    with pytest.raises(fb.ConversionError, match=r"shape mismatch for layers.0.self_attn.in_proj_weight"):  # loud
        fb.from_torch(fb.Encoder, built("gpt_bigcode").flax.cfg, bigcode, dialect="hf-gpt2", num_layers=3,
                      final_norm=True)
    for name, dialect in (("qwen3", "hf-qwen3"), ("gemma", "hf-gemma"), ("olmo2", "hf-olmo2"), ("gemma2", "hf-gemma2"),
                          ("gemma3", "hf-gemma3"), ("stablelm", "hf-stablelm")):
        with pytest.raises(fb.ConversionError, match=rf"(?s)cannot tell the checkpoint's family.*pass "
                                                     rf"dialect='{dialect}' \(--dialect {dialect}\) if the "
                                                     rf"checkpoint is one of {config(name)['model_type']}"):
            fb.detect_dialect(read_folder(str(built(name).folder))[1])
    with pytest.raises(fb.ConversionError, match=r"(?s)OPT itself in both norm placements.*pass dialect='hf-opt'"):
        fb.detect_dialect(files["opt"])
    with pytest.raises(fb.ConversionError, match=r"several Hugging Face dialects hold this config \(hf-bert, "
                                                 r"hf-distilbert\)"):
        # a stack not read by from_hf does not know its family: a post-LN, eps 1e-12 one is BERT's or DistilBERT's
        cfg = replace(hf_config(config("distilbert"))[1], param_dtype="float32")
        fb.to_hf(fb.from_torch(fb.Encoder, cfg, files["distilbert"], num_layers=3, dtype="float32"))


def test_an_hf_module_says_what_it_is(built):
    """from_torch given the HF model object reads its family (ViT: its transformers-5 module
    names read as the checkpoint's) and refuses a config contradicting it, naming the field."""
    model = built("opt").model32
    cfg = hf_config(model.config.to_dict())[1]
    fb.from_torch(fb.Encoder, cfg, model, num_layers=3)
    with pytest.raises(fb.ConversionError, match="norm='post' given, but the opt model has norm='pre'"):
        fb.from_torch(fb.Encoder, replace(cfg, norm="post"), model, num_layers=3)
    vit = built("vit").model32
    enc = fb.from_torch(fb.Encoder, hf_config(vit.config.to_dict())[1], vit, num_layers=3)
    assert enc.final_norm is not None


def test_whisper_k_proj_has_no_bias_and_a_nonzero_one_is_not_written(built):
    """Whisper's k_proj has no bias: read as zeros (softmax ignores a key bias), written back
    only when zero."""
    m = built("whisper")
    with jax.enable_x64(True):
        ours = fb.torch_state_dict(m.flax)
    e = m.flax.cfg.d_model
    assert not ours["layers.0.self_attn.in_proj_bias"][e:2 * e].any()
    ours["layers.0.self_attn.in_proj_bias"] = ours["layers.0.self_attn.in_proj_bias"].copy()
    ours["layers.0.self_attn.in_proj_bias"][e] = 0.5
    with pytest.raises(fb.ConversionError, match=r"rows for self_attn.k_proj.bias are not zero"):
        dialects.to_dialect(ours, "hf-whisper", m.flax.cfg)


@pytest.fixture(scope="module")
def whisper_decoder(built):
    return families.measure_whisper_decoder(str(built("whisper").folder))


def test_whisper_decoder_matches_the_hf_decoder(whisper_decoder, built):
    """Whisper's decoder read as our Decoder (causal self-attention, cross-attention to the
    memory, MLP; no k_proj biases): output and gradients w.r.t. the input and the memory."""
    m = whisper_decoder
    print(f"whisper decoder: float64 (fwd, grad x, grad memory) {m.float64}, float32 {m.float32}")
    assert type(m.flax).__name__ == "Decoder" and m.flax.num_layers == 3 and m.flax.cfg.causal
    assert m.mask_matters > 1e-3
    assert max(m.float64) <= 1e-12, m.float64
    assert max(m.float32) <= 2e-6, m.float32
    with jax.enable_x64(True):
        sd = fb.to_hf(m.flax)
    _, files = read_folder(str(built("whisper").folder))
    assert set(sd) == {k for k in files if k.startswith(("decoder.layers.", "decoder.layer_norm."))}
    assert all(np.array_equal(v, files[k]) for k, v in sd.items())
    # a real mistake: the cross-attention's norm and the self-attention's swapped
    swap = {"self_attn_layer_norm": "encoder_attn_layer_norm", "encoder_attn_layer_norm": "self_attn_layer_norm"}
    wrong = {next((k.replace(a, b) for a, b in swap.items() if f".{a}." in k), k): v for k, v in sd.items()}
    with jax.enable_x64(True):
        module = fb.from_torch(fb.Decoder, m.flax.cfg, wrong, dialect="hf-whisper-decoder", num_layers=3,
                               final_norm=True)
        y = families._decoder_runs(module, m.x, m.memory, np.zeros_like(m.x), m.keys)[0]
    assert rel_at(y, m.hf_y, m.keys) > 1e-6
    with pytest.raises(fb.ConversionError, match="part='decoder': a qwen3 model has one stack"):
        hf_config(config("qwen3"), part="decoder")
    with pytest.raises(fb.ConversionError, match=r"(?s)cannot tell.*Whisper's (en|de)coder \(hf-whisper.*pass "
                                                 r"dialect='hf-whisper"):
        fb.detect_dialect(files)  # both stacks in one checkpoint: names alone choose neither


def test_cli_and_parity_check_on_family_folders(built, tmp_path, capsys):
    from safetensors.numpy import load_file

    from flax_blocks.checkpoints.convert.cli import main as convert_main
    from parity_tests.check import main as check_main

    m = built("phi3")
    assert convert_main([str(m.folder), str(tmp_path / "flax.safetensors")]) == 0
    assert "Hugging Face phi3 (dialect hf-phi3)" in capsys.readouterr().out
    assert convert_main([str(tmp_path / "flax.safetensors"), str(tmp_path / "back.safetensors"),
                         "--dialect", "hf-phi3"]) == 0
    back, (_, files) = load_file(str(tmp_path / "back.safetensors")), read_folder(str(m.folder))
    assert back and all(np.array_equal(v, files[k]) for k, v in back.items())
    assert check_main([str(built("vit").folder), "--dtype", "float64"]) == 0
    assert "PASS" in capsys.readouterr().out
    neox = built("gpt_neox")  # the per-head query_key_value through the CLI, both ways
    assert convert_main([str(neox.folder), str(tmp_path / "neox.safetensors")]) == 0
    assert convert_main([str(tmp_path / "neox.safetensors"), str(tmp_path / "neox_back.safetensors"),
                         "--dialect", "hf-gpt-neox"]) == 0
    back, (_, files) = load_file(str(tmp_path / "neox_back.safetensors")), read_folder(str(neox.folder))
    assert any(".query_key_value." in k for k in back) and all(np.array_equal(v, files[k]) for k, v in back.items())
    capsys.readouterr()
    assert check_main([str(built("gemma").folder), "--dtype", "float64"]) == 0  # layer 0 fed past sqrt(d)
    assert "PASS" in capsys.readouterr().out


def test_docs_table_is_what_the_writer_writes(built):
    """docs/families.md's table: its words are what `describe` derives from the code now, and
    its errors are this run's to within a factor of 10 (rewrite it with python -m
    parity_tests.hf.families --doc docs/families.md)."""
    text = (ROOT / families.DOC).read_text()
    assert text.count(families.START) == 1 and text.count(families.END) == 1
    committed = text[text.index(families.START) + len(families.START):text.index(families.END)].strip().splitlines()
    fresh = families.table({n: built(n) for n in FAMILIES}).strip().splitlines()
    assert len(committed) == len(fresh)
    number = re.compile(r"\d(?:\.\d+)?e[-+]\d\d")
    for old, new in zip(committed, fresh, strict=True):
        assert number.sub("#", old) == number.sub("#", new), (old, new)
        for a, b in zip(map(float, number.findall(old)), map(float, number.findall(new)), strict=True):
            assert a == b or (a > 0 and b > 0 and 0.1 <= a / b <= 10), (old, new)
