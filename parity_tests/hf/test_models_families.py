"""Whole models of the families beyond LLaMA, GPT-2 and BERT:
fb.from_hf(part="causal-lm") for OPT, Phi-3, Qwen3, Gemma, Gemma 2, Gemma 3 text, OLMo 2,
GPT-NeoX, StableLM, Starcoder2 and the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek
V2 / V3),
part="model" for RoBERTa and DistilBERT, fb.to_hf of the
whole model, fb.generate, and the torch twin on the parts these families add (OPT's position
offset, Gemma's embedding scale, Gemma 2's final logit soft-cap).

Tiny float32 models (d_model 32, 2 layers, vocab 96, matrices at std 0.2, norms and biases
moved off 1 / 0; the
helpers and the left-padded batch are test_models.py's), built once per module. Logits are
compared at real tokens, both sides given HF's positions cumsum(mask) - 1.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
import torch_blocks as tb  # noqa: E402
from flax_blocks.attention import Attention  # noqa: E402
from flax_blocks.checkpoints.checkpoint import describe, hf_state_dict, lm_config  # noqa: E402
from flax_blocks.checkpoints.family import FAMILIES as FAMILY_TABLES  # noqa: E402
from flax_blocks.checkpoints.hf import place  # noqa: E402
from torch_blocks.lm import generate as torch_generate  # noqa: E402

from .test_models import NO_SPECIAL, E, V, _batch, _build, greedy_equals_hf  # noqa: E402

ROTARY = dict(vocab_size=V, hidden_size=E, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
              num_hidden_layers=2, max_position_embeddings=64, **NO_SPECIAL)
GEMMA2 = dict(ROTARY, head_dim=8, sliding_window=4, attn_logit_softcapping=5.0, query_pre_attn_scalar=16,
              final_logit_softcapping=0.5)  # a cap at the logits' scale: a real 30 would change nothing here
OPT = dict(vocab_size=V, hidden_size=E, num_attention_heads=4, ffn_dim=48, num_hidden_layers=2,
           max_position_embeddings=40, word_embed_proj_dim=E, **NO_SPECIAL)
CAUSAL = {
    "opt": ("OPTConfig", "OPTForCausalLM", OPT),
    "opt-350m": ("OPTConfig", "OPTForCausalLM", {**OPT, "word_embed_proj_dim": 16, "do_layer_norm_before": False}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(ROTARY, rope_theta=500.0, partial_rotary_factor=0.75,
                                                     sliding_window=None)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(ROTARY, head_dim=8, rope_theta=500.0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(ROTARY, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(ROTARY, head_dim=8, sliding_window=4,
                                                             query_pre_attn_scalar=16, final_logit_softcapping=0.5,
                                                             layer_types=["sliding_attention", "full_attention"])),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", ROTARY),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(vocab_size=V, hidden_size=E, num_attention_heads=4,
                                                             intermediate_size=48, num_hidden_layers=2,
                                                             max_position_embeddings=64, rotary_pct=0.5,
                                                             **NO_SPECIAL)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(ROTARY, use_qkv_bias=True)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(ROTARY, partial_rotary_factor=0.5)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(ROTARY, rope_theta=500.0, no_rope_layers=[0, 1])),
    # Llama 4's text model: layer 1 dense (intermediate_size_mlp), layer 2 experts (interleave_moe_layer_step 2: top-1
    # of 4, the sigmoid on the expert's input, the ungated shared expert) and NoPE, its queries tempered (floor 2:
    # slots 1, 3, 5 ... step up), layer 1's q and k over their RMS after rotary (use_qk_norm) and in chunks of 2
    # (layer_types' default: the rotary layers chunked; 7 tokens, 3.5 chunks; the padded row's 4 tokens in 2 chunks
    # from its first real token, slot 3)
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    dict(ROTARY, head_dim=8, intermediate_size=16, intermediate_size_mlp=48,
                         interleave_moe_layer_step=2, num_local_experts=4, use_qk_norm=True, attention_chunk_size=2,
                         no_rope_layers=[1, 0], floor_scale=2, attn_scale=0.5, rope_theta=500.0)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(ROTARY, attention_multiplier=0.3, residual_multiplier=0.22,
                                                          embedding_multiplier=6.0, logits_scaling=4.0)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(vocab_size=V, n_embd=E, n_head=4, n_inner=48,
                                                                   n_layer=2, n_positions=64, **NO_SPECIAL)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(ROTARY, sliding_window=4)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(ROTARY, logit_scale=0.5, attention_bias=True)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(ROTARY, logit_scale=0.5, sliding_window=4,
                                                           layer_types=["sliding_attention", "full_attention"])),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=V, n_embd=E, n_head=4, n_inner=48, n_layer=2,
                                                   n_positions=64, rotary_dim=4, **NO_SPECIAL)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=V, hidden_size=E, num_attention_heads=4,
                                                         num_kv_heads=2, ffn_hidden_size=48, num_hidden_layers=2,
                                                         new_decoder_architecture=True, rope_theta=500.0,
                                                         **NO_SPECIAL)),
    "falcon-rw": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=V, hidden_size=E, num_attention_heads=4,
                                                            ffn_hidden_size=48, num_hidden_layers=2, alibi=True,
                                                            multi_query=False, parallel_attn=False, bias=True,
                                                            **NO_SPECIAL)),
}
# Mixtures of experts: 4 experts, top 2; Qwen2-MoE's layers dense, experts (with the shared expert), dense
# (decoder_sparse_step 2, mlp_only_layers [2]), Qwen3-MoE's first dense (mlp_only_layers [0]).
EXPERTS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(ROTARY, num_local_experts=4, intermediate_size=24)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(ROTARY, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[2])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(ROTARY, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       norm_topk_prob=True, mlp_only_layers=[0])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(ROTARY, num_experts=4, num_experts_per_tok=2,
                                                      intermediate_size=16)),
    # DeepSeek: multi-head latent attention (V2 direct queries, V3 low-rank ones and yarn with mscale_all_dim),
    # layer 0 dense (first_k_dense_replace 1), then top-3 of 8 experts in 4 groups, 2 kept (V2 group-limited
    # greedy softmax; V3 sigmoid with a drawn correction bias), scaled, beside ungated shared experts
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(ROTARY, num_key_value_heads=4, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3,
                         moe_intermediate_size=16, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, routed_scaling_factor=1.5, first_k_dense_replace=1, kv_lora_rank=12,
                         q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(ROTARY, num_key_value_heads=4, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3,
                         moe_intermediate_size=16, n_shared_experts=1, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=12, q_lora_rank=10,
                         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                       "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    # GPT-OSS: sinks, local / global layers (window 4 < T), yarn past its original length, q/k/v/o biases, biased
    # experts whose SwiGLU clamp acts at these weights (limit 1), another alpha
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(ROTARY, head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                     sliding_window=4, swiglu_limit=1.0, swiglu_alpha=1.5,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4,
                                      "rope_theta": 500.0})),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(ROTARY, num_local_experts=4, intermediate_size=16, attention_multiplier=0.3,
                        residual_multiplier=0.22, embedding_multiplier=6.0, logits_scaling=4.0)),
}
CAUSAL.update(EXPERTS)
TIED = {"opt", "opt-350m", "gemma", "gemma2", "gemma3", "starcoder2", "cohere", "cohere2", "gpt_bigcode", "falcon",
        "falcon-rw", "smollm3"}
GENERATE = ["opt", "gemma2", "gpt_neox", "gemma", "qwen3", "qwen2_moe", "qwen3_moe",  # (MoE: 9-15 s each)
            "deepseek_v3", "gpt_oss", "gptj", "cohere2",  # (DeepSeek: the latent cache, HF's too)
            "falcon-rw",  # (ALiBi by the keys' ranks in the cache)
            "llama4_text"]  # (Llama 4: the NoPE layer's temperature at the cache's slots; SmolLM3's NoPE layers alike)
PAD = 1  # RoBERTa's padding token (its padding_idx)
ENCODERS = {
    "roberta": ("RobertaConfig", "RobertaModel", dict(vocab_size=V, hidden_size=E, num_attention_heads=4,
                                                      intermediate_size=48, num_hidden_layers=2,
                                                      max_position_embeddings=20, type_vocab_size=1,
                                                      pad_token_id=PAD, bos_token_id=0, eos_token_id=2)),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", dict(vocab_size=V, hidden_size=E, num_attention_heads=4,
                                                                intermediate_size=48, num_hidden_layers=2,
                                                                max_position_embeddings=20, type_vocab_size=1,
                                                                pad_token_id=PAD, bos_token_id=0, eos_token_id=2)),
    "distilbert": ("DistilBertConfig", "DistilBertModel", dict(vocab_size=V, dim=E, n_heads=4, hidden_dim=48,
                                                               n_layers=2, max_position_embeddings=20,
                                                               pad_token_id=PAD)),
    # ModernBERT: global, local, local, global layers (a window |i - j| <= 1 over 7 tokens), layer 0 without attn_norm
    "modernbert": ("ModernBertConfig", "ModernBertModel", dict(vocab_size=V, hidden_size=E, num_attention_heads=4,
                                                               intermediate_size=48, num_hidden_layers=4,
                                                               local_attention=2, pad_token_id=PAD, bos_token_id=0,
                                                               eos_token_id=2, cls_token_id=0, sep_token_id=2)),
}


def _build_varied(cfg_cls, model_cls, kw):
    """test_lm's build with every matrix drawn at std 0.2 (HF's 0.02 makes greedy tokens repeat
    one id), but Gemma's token embeddings (scaled up by sqrt(d) and tied to the head: at 0.2
    each row's argmax is its last token)."""
    model = _build(cfg_cls, model_cls, kw)
    if FAMILY_TABLES[model.config.model_type].reference.sdpa:  # its eager path computes otherwise (Falcon)
        model.config._attn_implementation = "sdpa"  # (Falcon refuses set_attn_implementation; it reads this)
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # the experts' stacked (X, out, in) matrices too
                p.normal_(0.0, 0.02 if gemma and "embed_tokens" in name else 0.2)
        for name, b in model.named_buffers():  # DeepSeek V3's correction bias (zeros at init): one that acts
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


# One worker runs the module (pytest-xdist --dist loadgroup, as `make test` runs): its module fixture
# builds every family once, not once per worker.
pytestmark = pytest.mark.xdist_group("hf_models_families")

@pytest.fixture(scope="module")
def hf_models():
    return {name: _build_varied(*spec) for name, spec in {**CAUSAL, **ENCODERS}.items()}


@pytest.fixture(scope="module")
def flax_models(hf_models):
    return {name: fb.from_hf(m, part="causal-lm" if name in CAUSAL else "model") for name, m in hf_models.items()}


def _rel(ours, ref, live):
    return float(np.abs(np.asarray(ours) - ref)[live].max() / np.abs(ref[live]).max())


def _logits(lm, ids, mask, positions):
    return np.asarray(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask), positions=jnp.asarray(positions)))


@pytest.fixture(scope="module")
def reference(hf_models):
    """family -> HF's logits on the left-padded batch, given position_ids = cumsum(mask) - 1."""
    ids, mask, positions = _batch()
    out = {}
    with torch.no_grad():
        for name in CAUSAL:
            out[name] = hf_models[name](torch.tensor(ids), attention_mask=torch.tensor(mask),
                                        position_ids=torch.tensor(positions)).logits.numpy()
    return out


def _strict_round_trip(hf, sd):
    """Load `sd` (checkpoint names) into a fresh HF model with strict=True; its state dict is
    then the original's, bit for bit. The checkpoint names are what save_pretrained writes
    (GPT-NeoX's embed_out; the experts one tensor each); transformers 5 names that module lm_head
    and fuses the experts in the library: its own conversion (as from_pretrained's) reads them."""
    fresh = type(hf)(hf.config).eval()
    names = {"embed_out.weight": "lm_head.weight"} if hf.config.model_type == "gpt_neox" else {}
    tensors = tb.to_tensors({names.get(k, k): v for k, v in sd.items()})
    if hf.config.model_type in EXPERTS:
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as folder:  # from_pretrained converts the per-expert names
            save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
            hf.config.save_pretrained(folder)
            fresh, info = type(hf).from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info
    else:
        fresh.load_state_dict(tensors, strict=True)
    original = hf.state_dict()
    assert set(fresh.state_dict()) == set(original)
    assert all(torch.equal(v, original[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("family", list(CAUSAL))
def test_causal_lm_matches_hf_and_writes_back_bit_for_bit(family, hf_models, flax_models, reference):
    hf, lm = hf_models[family], flax_models[family]
    assert lm.lm.head == ("tied" if family in TIED else "untied")
    ids, mask, positions = _batch()
    err = _rel(_logits(lm, ids, mask, positions), reference[family], mask.astype(bool))
    print(f"{family}: max relative logit error {err:.1e}")
    assert err < 1e-5, err

    sd = fb.to_hf(lm)  # the checkpoint's names and values
    files = {k: v.numpy() for k, v in hf_state_dict(hf).items()}
    assert set(sd) == set(files)
    assert all(np.array_equal(v, files[k]) for k, v in sd.items())
    _strict_round_trip(hf, sd)


def test_what_each_family_adds_is_read(flax_models):
    opt, gemma, gemma2, gemma3, roberta = (flax_models[n].lm for n in ("opt", "gemma", "gemma2", "gemma3", "roberta"))
    assert (opt.max_positions, opt.position_offset, opt.default_positions, opt.position_rows) == (40, 2, "mask", 42)
    assert gemma.embed_scale == gemma2.embed_scale == gemma3.embed_scale == E ** 0.5
    assert (gemma.final_logit_softcap, gemma2.final_logit_softcap, gemma3.final_logit_softcap) == (None, 0.5, 0.5)
    assert (roberta.position_offset, roberta.max_positions, roberta.default_positions, roberta.pad_token_id) == \
        (PAD + 1, 20 - PAD - 1, "ids", PAD)
    assert all(flax_models[n].lm.embed_scale is None and flax_models[n].lm.final_logit_softcap is None
               for n in ("opt", "phi3", "qwen3", "olmo2", "gpt_neox", "stablelm", "starcoder2"))
    ids, mask, _ = _batch()  # OPT's 40 positions (rows 2..41): 7 + 34 tokens pass them
    with pytest.raises(ValueError, match="40 learned positions"):
        fb.generate(flax_models["opt"], ids, mask, max_new_tokens=34)


def test_gemma_embedding_scale_rounds_as_hf_in_bfloat16(hf_models):
    """sqrt(32) rounded to float32 (HF's buffer), then to bfloat16, times the bfloat16
    embeddings: the same bits as HF's scaled embedding."""
    hf = copy.deepcopy(hf_models["gemma2"]).to(torch.bfloat16)
    lm = fb.from_hf(hf, part="causal-lm")
    ids, _, _ = _batch()
    ours = np.asarray(lm.embed_tokens(jnp.asarray(ids)).astype(jnp.float32))
    with torch.no_grad():
        ref = hf.model.embed_tokens(torch.tensor(ids)).float().numpy()
    np.testing.assert_array_equal(ours, ref)


def test_opt_default_positions_are_hfs_from_the_mask(hf_models, flax_models):
    """Without position_ids HF's OPT numbers the real tokens from the mask (padding: -1, row
    1); so does the model without positions= (0..T-1 there would be wrong for the padded row)."""
    ids, mask, _ = _batch()
    with torch.no_grad():
        ref = hf_models["opt"](torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    lm, live = flax_models["opt"], mask.astype(bool)
    assert _rel(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask)), ref, live) < 1e-5
    arange = _wrong(lm, default_positions="arange")
    assert _rel(arange(jnp.asarray(ids), attention_mask=jnp.asarray(mask)), ref, live) > 1e-3


@pytest.mark.parametrize("family", GENERATE)
def test_greedy_generation_equals_hf_generate(family, hf_models, flax_models):
    ref, _, _ = greedy_equals_hf(hf_models[family], flax_models[family])
    assert len(np.unique(ref[:, 6:])) > 2  # the tokens vary: a stuck argmax would pass too easily


@pytest.mark.parametrize("family", ["opt", "gemma2", "deepseek_v3", "gpt_oss", "cohere", "granite", "falcon-rw",
                                    "llama4_text"])
def test_the_torch_twin_computes_the_new_parts_alike(family, flax_models, reference):
    """OPT's offset positions and mask-derived default positions, Gemma 2's embedding scale
    and final soft-cap, DeepSeek's latent attention and routing, GPT-OSS's sinks and clamped experts
    (cached decoding with sinks on local and global layers), Cohere's logit scale and interleaved
    rotary, Granite's four multipliers, Falcon-RW's ALiBi (by the keys' ranks in a left-padded cache),
    Llama 4's NoPE layer and its query temperature (at the cache's slots when decoding) in the torch
    twin: HF's logits, and the same greedy tokens."""
    lm = flax_models[family]
    twin = tb.LanguageModel(lm.cfg, lm.lm).eval()
    twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
    ids, mask, positions = _batch()
    with torch.no_grad():
        theirs = twin(torch.tensor(ids), torch.tensor(mask), torch.tensor(positions)).numpy()
        default = twin(torch.tensor(ids), torch.tensor(mask)).numpy()
    assert _rel(theirs, reference[family], mask.astype(bool)) < 1e-5
    ours_default = np.asarray(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert _rel(default, ours_default, mask.astype(bool)) < 1e-5
    ids, mask, _ = _batch(t=6, pad=2, seed=1)
    np.testing.assert_array_equal(torch_generate(twin, torch.tensor(ids), torch.tensor(mask), max_new_tokens=8).numpy(),
                                  np.asarray(fb.generate(lm, ids, mask, max_new_tokens=8)))


def _wrong(lm, **fields):
    """The same weights in a model computing something else (LMConfig fields changed)."""
    from flax_blocks.checkpoints.convert.load import from_torch_state_dict

    return from_torch_state_dict(lm.cfg, replace(lm.lm, **fields), fb.torch_state_dict(lm))


def test_the_experts_are_read_with_their_routing_and_in_the_right_halves(hf_models, flax_models, reference):
    """Each MoE family's routing read from its config (Mixtral always renormalises, Qwen and OLMoE
    only with norm_topk_prob; the shared expert and the dense layers Qwen2-MoE's rule picks), and
    two wrong readings a porter could make, each caught: norm_topk_prob flipped, and the fused
    gate_up_proj's halves swapped (up first)."""
    got = {n: flax_models[n].cfg for n in EXPERTS}
    assert (got["mixtral"].norm_topk_prob, got["qwen3_moe"].norm_topk_prob, got["olmoe"].norm_topk_prob) == \
        (True, True, False)
    q2 = got["qwen2_moe"]
    assert (q2.num_experts, q2.expert_d_ff, q2.shared_expert_d_ff, q2.d_ff, q2.mixed_mlp) == (4, 16, 24, 48, True)
    ids, mask, positions = _batch()
    live = mask.astype(bool)
    for name in ("mixtral", "olmoe"):
        lm = flax_models[name]
        flipped = replace(lm.cfg, norm_topk_prob=not lm.cfg.norm_topk_prob)
        from flax_blocks.checkpoints.convert.load import from_torch_state_dict

        wrong = from_torch_state_dict(flipped, lm.lm, fb.torch_state_dict(lm))
        err = _rel(_logits(wrong, ids, mask, positions), reference[name], live)
        print(f"{name}: norm_topk_prob flipped: rel error {err:.1e}")
        assert err > 1e-3  # a hundred times the test's tolerance
    hf = hf_models["olmoe"]  # the fused layout transformers 5 holds, its gate and up halves swapped
    fused = {k: v.numpy() for k, v in hf.state_dict().items()}
    for k in [k for k in fused if k.endswith("experts.gate_up_proj")]:
        gate, up = np.split(fused[k], 2, axis=1)
        fused[k] = np.concatenate([up, gate], axis=1)
    swapped = place(describe(hf.config.to_dict(), fused, "causal-lm"))
    err = _rel(_logits(swapped, ids, mask, positions), reference["olmoe"], live)
    print(f"olmoe: gate_up_proj halves swapped: rel error {err:.1e}")
    assert err > 1e-3
    # the router logits of a whole model (dense layers of the mixed stack included, as zeros) make HF's
    # auxiliary loss over the real tokens of the left-padded batch, as output_router_logits does
    from flax_blocks.experts import load_balancing_loss

    lm = flax_models["qwen2_moe"]
    _, found = lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask), positions=jnp.asarray(positions),
                  return_intermediates=True)
    ours = float(load_balancing_loss(lm.cfg, found["router_logits"], jnp.asarray(live)))
    with torch.no_grad():
        want = float(hf_models["qwen2_moe"](torch.tensor(ids), attention_mask=torch.tensor(mask),
                                            position_ids=torch.tensor(positions), output_router_logits=True).aux_loss)
    assert abs(ours - want) <= 1e-5 * want, (ours, want)


def test_gpt_oss_is_read_with_its_sinks_clamp_and_interleaved_experts(hf_models, flax_models, reference, tmp_path):
    """GPT-OSS read as GptOssModel computes it (sinks, biased experts clamped at swiglu_limit with its alpha,
    layers alternating local and global, the softmax over the top k = the renormalised top k), and three
    wrong readings a porter could make, each caught: gate_up_proj split in halves where gate and up
    interleave column by column, the sinks left out of the softmax, the SwiGLU's clamp missing. fb.save_hf
    writes a folder from_pretrained reads with nothing missing or unexpected, every tensor identical."""
    from flax_blocks.checkpoints.convert.load import from_torch_state_dict

    lm = flax_models["gpt_oss"]
    c = lm.cfg
    assert (c.attn_sinks, c.experts_bias, c.swiglu_limit, c.swiglu_alpha, c.norm_topk_prob) == (True, True, 1.0, 1.5,
                                                                                                 True)
    assert (c.sliding_window, c.sliding_window_pattern, c.rope_scaling.rope_type) == (4, 2, "yarn")
    ids, mask, positions = _batch()
    live = mask.astype(bool)
    hf = hf_models["gpt_oss"]
    halves = {k: v.numpy() for k, v in hf.state_dict().items()}
    for k in [k for k in halves if "gate_up_proj" in k]:  # read as [gate | up]: gate = the first half
        a = halves[k]
        halves[k] = np.stack([a[..., : a.shape[-1] // 2], a[..., a.shape[-1] // 2:]], axis=-1).reshape(a.shape)
    sd = fb.torch_state_dict(lm)
    wrong = {"gate_up_proj read in halves": place(describe(hf.config.to_dict(), halves, "causal-lm")),
             "sinks left out": from_torch_state_dict(replace(c, attn_sinks=False), lm.lm,
                                                     {k: v for k, v in sd.items() if not k.endswith(".sinks")}),
             "SwiGLU clamp missing": from_torch_state_dict(replace(c, swiglu_limit=1e30), lm.lm, sd)}
    for what, model in wrong.items():
        err = _rel(_logits(model, ids, mask, positions), reference["gpt_oss"], live)
        print(f"gpt_oss: {what}: rel error {err:.1e}")
        assert err > 1e-3, what  # a hundred times the test's tolerance
    fb.save_hf(lm, tmp_path)
    back, info = type(hf).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    original = hf.state_dict()
    assert set(back.state_dict()) == set(original)
    assert all(torch.equal(v, original[k]) for k, v in back.state_dict().items())


class _ChunksFromSlotZero(Attention):
    """Chunks counted from slot 0 in every row (HF: from a row's first real token)."""

    def chunked(self, mask, rows, index, t, s, chunked):
        inside, _ = super().chunked(None, None, index, t, s, chunked)  # no padding seen: chunks from slot 0
        m = mask & inside
        has = jnp.any(m, axis=-1, keepdims=True)
        return m | ~has, (has if rows is None else rows & has)


@pytest.mark.parametrize("what, fields", [
    ("the NoPE layer's queries not tempered (attn_temperature_tuning ignored)", dict(query_temperature_floor=None)),
    ("rotary on halves (LLaMA's) for Llama 4's complex pairs", dict(rope_interleaved=False)),
    ("rotary in every layer (no_rope_layers ignored)", dict(nope_layers=(), query_temperature_floor=None)),
    ("the rotary layer's L2 QK-norm left out (use_qk_norm ignored)", dict(qk_l2_norm=False)),
    ("chunks one token longer (attention_chunk_size off by one)", dict(attention_chunk_size=3)),
    ("the NoPE layer chunked too (layer_types' full layer ignored)", dict(unchunked_layers=())),
    ("chunks counted from slot 0, not from the padded row's first real token", None),
    ("the router's sigmoid on the expert's output, not its input", dict(routing_weights_on="output")),
    ("the shared expert gated (Qwen2-MoE's sigmoid gate, a zero weight as a porter would fill it)",
     dict(shared_expert_gate=True))])
def test_llama4_text_mistakes_are_caught(what, fields, flax_models, reference):
    """Llama 4's text model read otherwise than Llama4TextModel computes it: each caught (the chunks from slot 0:
    an attention whose chunk_start is 0)."""
    from flax_blocks.checkpoints.convert.load import from_torch_state_dict

    lm = flax_models["llama4_text"]
    c = lm.cfg
    assert (c.nope_layers, c.query_temperature_floor, c.rope_interleaved, c.qk_l2_norm, c.attention_chunk_size,
            c.unchunked_layers) == ((1,), 2.0, True, True, 2, (1,))
    assert (c.num_experts, c.num_experts_per_tok, c.expert_d_ff, c.shared_expert_d_ff, c.d_ff, c.mlp_only_layers,
            c.routing, c.routing_weights_on, c.shared_expert_gate, c.norm_topk_prob) == \
        (4, 1, 16, 16, 48, (0,), "llama4", "input", False, False)
    slot_zero, fields = fields is None, fields or {}
    sd = fb.torch_state_dict(lm)
    if fields.get("shared_expert_gate"):
        sd = {**sd, **{k.replace("shared_up.weight", "shared_expert_gate"): np.zeros((1, E), np.float32)
                       for k in sd if k.endswith("experts.shared_up.weight")}}
    wrong = from_torch_state_dict(replace(c, **fields), lm.lm, sd)
    if slot_zero:
        wrong.encoder.layers.self_attn.__class__ = _ChunksFromSlotZero
    ids, mask, positions = _batch()
    err = _rel(_logits(wrong, ids, mask, positions), reference["llama4_text"], mask.astype(bool))
    print(f"llama4_text: {what}: rel error {err:.1e}")
    assert err > 1e-3


def test_llama4_text_save_hf_is_read_back_by_from_pretrained(hf_models, flax_models, tmp_path):
    """fb.save_hf writes the experts layer's fused gate_up_proj / down_proj, router and shared expert and the
    dense layer's MLP in save_pretrained's names: from_pretrained reads the folder with nothing missing or
    unexpected, every tensor identical."""
    hf = hf_models["llama4_text"]
    fb.save_hf(flax_models["llama4_text"], tmp_path)
    back, info = type(hf).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    original = hf.state_dict()
    assert set(back.state_dict()) == set(original)
    assert all(torch.equal(v, original[k]) for k, v in back.state_dict().items())


def test_llama4_multimodal_folder_loads_its_language_model(tmp_path):
    """Scout and Maverick are published as Llama4ForConditionalGeneration (model_type llama4, the text model's
    config nested in text_config, its weights under language_model.model. / language_model.lm_head.): fb.from_hf
    reads the language model (the llama4_text row's, experts included) equal to transformers' language model of
    the folder, and leaves the vision model and projector unread, named in the load report. (transformers
    5.24's Llama4ForConditionalGeneration.forward fails on any input, reading an image_outputs its language
    model's output lacks: its language_model is the reference.)"""
    _, _, kw = CAUSAL["llama4_text"]
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, image_size=28,
                  patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
    config = transformers.Llama4Config(text_config={"model_type": "llama4_text", **kw}, vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    lm = fb.from_hf(tmp_path, part="causal-lm", dtype="float32")
    assert (lm.cfg.num_experts, lm.cfg.routing, lm.cfg.nope_layers) == (4, "llama4", (1,))
    ids, mask, positions = _batch()
    with torch.no_grad():
        theirs = hf.language_model(torch.tensor(ids), attention_mask=torch.tensor(mask),
                                   position_ids=torch.tensor(positions)).logits.numpy()
    err = _rel(_logits(lm, ids, mask, positions), theirs, mask.astype(bool))
    print(f"llama4 (multimodal folder): max relative logit error {err:.1e}")
    assert err < 1e-5, err
    note = fb.load_report(lm).notes[0]
    assert "llama4_text" in note and "vision_model" in note and "multi_modal_projector" in note


@pytest.mark.parametrize("changes", [dict(), dict(interleave_moe_layer_step=2), dict(interleave_moe_layer_step=3),
                                     dict(num_hidden_layers=4, interleave_moe_layer_step=2), dict(moe_layers=[0, 5]),
                                     dict(moe_layers=[]), dict(moe_layers=[1], interleave_moe_layer_step=2)])
def test_llama4_text_experts_layers_are_transformers(changes):
    """The layers that run the experts are the ones Llama4TextDecoderLayer gives experts (layer_idx in
    Llama4TextConfig's moe_layers, derived from interleave_moe_layer_step when not given), the others dense."""
    from flax_blocks.checkpoints.checkpoint import hf_config
    from flax_blocks.core.config import is_moe_layer

    kw = {**ROTARY, "head_dim": 8, "attention_chunk_size": None, **changes}
    _, cfg, n, _ = hf_config({"model_type": "llama4_text", **kw})
    theirs = transformers.Llama4TextConfig(**kw).moe_layers
    assert [bool(is_moe_layer(cfg, i + 1)) for i in range(n)] == [i in theirs for i in range(n)]


@pytest.mark.parametrize("changes, key", [
    (dict(interleave_moe_layer_step=0, attention_chunk_size=None), "interleave_moe_layer_step"),
    (dict(moe_layers=[1], num_local_experts=0, attention_chunk_size=None), "num_local_experts"),
    (dict(moe_layers=[], attention_chunk_size=None, layer_types=["chunked_attention", "full_attention"]),
     "attention_chunk_size"),
    (dict(moe_layers=[], layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(moe_layers=[], attention_chunk_size=4, is_causal=False), "is_causal")])
def test_llama4_text_refuses_by_name_what_it_does_not_compute_yet(changes, key):
    """Experts layers without experts (or a step below 1), chunked layers without a chunk size (transformers
    raises), masks it does not build, and chunked layers beside bidirectional full ones (is_causal=False opens
    create_causal_mask's, not the chunked one): refused, each by its key (a config.json as written by hand:
    moe_layers and layer_types derived as Llama4TextConfig derives them)."""
    from flax_blocks.checkpoints.checkpoint import hf_config

    with pytest.raises(fb.ConversionError, match=f"{key}="):
        hf_config({"model_type": "llama4_text", **ROTARY, "head_dim": 8, **changes})


# A real mistake per new part: (family, what, the LMConfig fields of the mistake).
MISTAKES = [
    ("opt", "positions read without OPT's offset of 2 (row p, not p + 2)",
     dict(position_offset=0, max_positions=42, default_positions="arange")),
    ("gemma", "embeddings not multiplied by sqrt(hidden_size)", dict(embed_scale=None)),
    ("gemma2", "no final logit soft-cap", dict(final_logit_softcap=None)),
    ("cohere", "logits not multiplied by logit_scale", dict(logit_scale=None)),
    ("gemma3", "embeddings not multiplied by sqrt(hidden_size)", dict(embed_scale=None)),
    ("granite", "embeddings not multiplied by embedding_multiplier", dict(embed_scale=None)),
    ("granite", "logits not divided by logits_scaling", dict(logits_divisor=None)),
    ("granitemoe", "embeddings not multiplied by embedding_multiplier", dict(embed_scale=None)),
]


@pytest.mark.parametrize("family, what, fields", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_real_mistake_is_caught(family, what, fields, flax_models, reference):
    ids, mask, positions = _batch()
    err = _rel(_logits(_wrong(flax_models[family], **fields), ids, mask, positions), reference[family],
               mask.astype(bool))
    print(f"{family}: {what}: rel error {err:.1e}")
    assert err > 1e-3  # a hundred times the test's tolerance


def _encoder_batch():
    """Right- and left-padded rows whose padding is RoBERTa's pad token (real tokens never are)."""
    ids = np.random.default_rng(3).integers(PAD + 2, V, (2, 7))
    mask = np.ones((2, 7), np.int64)
    mask[0, 5:] = 0
    mask[1, :2] = 0
    return np.where(mask > 0, ids, PAD), mask


@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoder_model_matches_last_hidden_state(family, hf_models, flax_models):
    """part="model" without positions: RoBERTa numbers positions from its ids (real tokens from
    padding_idx + 1, padding at padding_idx), DistilBERT 0..T-1; HF's last_hidden_state."""
    hf, lm = hf_models[family], flax_models[family]
    ids, mask = _encoder_batch()
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    ours = np.asarray(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    live = mask.astype(bool)
    err = _rel(ours, ref, live)
    print(f"{family}: max relative error of last_hidden_state {err:.1e}")
    assert err < 1e-5, err
    if family == "roberta":  # positions from 0 at row 0 (no offset, not numbered from the ids): caught
        wrong = _wrong(lm, position_offset=0, max_positions=20, default_positions="arange", pad_token_id=None)
        assert _rel(wrong(jnp.asarray(ids), attention_mask=jnp.asarray(mask)), ref, live) > 1e-3
    twin = tb.LanguageModel(lm.cfg, lm.lm).eval()  # the torch twin numbers them from the ids too
    twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
    with torch.no_grad():
        assert _rel(twin(torch.tensor(ids), torch.tensor(mask)).numpy(), ref, live) < 1e-5

    sd = fb.to_hf(lm)
    files = {k: v.numpy() for k, v in hf_state_dict(hf).items()}
    assert set(sd) == {k for k in files if not k.startswith("pooler.")}  # the pooler is not read
    assert all(np.array_equal(v, files[k]) for k, v in sd.items())
    fresh = type(hf)(hf.config)
    missing, unexpected = fresh.load_state_dict(tb.to_tensors(sd), strict=family not in ("roberta", "xlm-roberta"))
    assert unexpected == [] and all(k.startswith("pooler.") for k in missing)
    with pytest.raises(fb.ConversionError, match="not a causal language model"):
        fb.from_hf(hf, part="causal-lm")
    extra = {**files, "extra.weight": next(iter(files.values()))}  # an encoder has no head to
    with pytest.raises(fb.ConversionError, match="unexpected key extra.weight"):  # hide unread keys behind
        describe(hf.config.to_dict(), extra, "model")


def test_what_the_blocks_do_not_compute_is_refused_by_name():
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=E, num_hidden_layers=1, num_attention_heads=4,
                                                       intermediate_size=48, image_size=8, patch_size=4))
    for part in ("causal-lm", "model"):
        with pytest.raises(fb.ConversionError, match=r"(?s)cannot load a whole vit model.*images.*part='stack'"):
            fb.from_hf(vit, part=part)
    whisper = dict(model_type="whisper", vocab_size=V, d_model=E, encoder_attention_heads=4, encoder_ffn_dim=48,
                   encoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=48, decoder_layers=1,
                   activation_function="gelu")
    with pytest.raises(fb.ConversionError, match=r"(?s)cannot load a whole whisper model.*encoder-decoder on audio"):
        lm_config(whisper, "causal-lm")
    qwen3 = transformers.Qwen3Config(**CAUSAL["qwen3"][2], rope_parameters={"rope_type": "proportional",
                                                                           "rope_theta": 1e4}).to_dict()
    with pytest.raises(fb.ConversionError, match="rope_type 'proportional'"):
        lm_config(qwen3, "causal-lm")
    roberta = transformers.RobertaConfig(**{**ENCODERS["roberta"][2], "pad_token_id": None}).to_dict()
    with pytest.raises(fb.ConversionError, match="pad_token_id None"):
        lm_config(roberta, "model")


def test_to_hf_refuses_a_family_that_computes_otherwise(flax_models):
    """A Gemma model written as a LLaMA (same names) would lose its embedding scale: refused."""
    with pytest.raises(fb.ConversionError, match=r"embed_scale=5.65.*llama has no embedding scale"):
        fb.to_hf(flax_models["gemma"], dialect="hf-llama")
    with pytest.raises(fb.ConversionError, match="final_logit_softcap=0.5: gemma has no final logit soft-cap"):
        fb.to_hf(flax_models["gemma2"], dialect="hf-gemma")


@pytest.mark.parametrize("fields, words", [
    (dict(position_offset=2), "needs learned positions"),
    (dict(max_positions=8, default_positions="mask"), "needs position_offset >= 1"),
    (dict(max_positions=8, position_offset=2, default_positions="ids"), "pad_token_id goes with"),
    (dict(embed_scale=0.0), "embed_scale must be a positive number"),
    (dict(final_logit_softcap=30.0, head="none"), "final_logit_softcap needs a head"),
    (dict(logits_divisor=8.0, head="none"), "logits_divisor needs a head"),
    (dict(logits_divisor=0.0), "logits_divisor must be a positive number"),
    (dict(head="tied", head_init="xavier"), "head_init='xavier' needs head='untied'"),
    (dict(head_init="glorot"), "head_init must be one of"),
    (dict(init_std=0), "init_std must be a positive number"),
])
def test_lm_config_refuses_inconsistent_fields(fields, words):
    with pytest.raises(ValueError, match=words):
        fb.LMConfig(vocab_size=V, num_layers=1, **fields)
