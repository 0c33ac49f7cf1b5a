"""`python -m parity_tests.hf.families [--doc docs/families.md] [--only NAME,...]`: the Hugging Face families beyond
BERT, GPT-2 and LLaMA (RoBERTa, DistilBERT, OPT pre- and post-LN, ViT, Phi-3, Qwen3, Gemma,
OLMo 2, GPT-NeoX parallel and sequential), each a tiny
random model measured against HF itself, as a markdown table; --doc replaces the table between
that page's markers. parity_tests/hf/test_stacks_families.py asserts on the same builds (`measure`).

Each model: 3 layers, d_model 24, 3 heads of 8 (others as FAMILIES says), every weight
scaled up (std 0.1) and every norm and bias perturbed, so unit norms and zero biases hide
nothing; saved with save_pretrained and read back with `fb.from_hf(folder)` (float64), and read
from the model object (float32). Inputs: B 2, T 9, tokens 2-4 of the last element padding
(`parity_tests.hf.reference` moves the embeddings out of the way and, in float64, removes HF's
float32 casts). Errors are max|flax - HF| / max|HF| over real positions, for the output and
the gradient of <output, cotangent> with respect to the input hidden states.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import markers

B, T, LAYERS = 2, 9, 3
WINDOW = 4  # sliding windows shorter than T
PADDED = slice(2, 5)  # tokens of the last batch element that are padding

_TEXT = dict(vocab_size=16, pad_token_id=1, bos_token_id=0, eos_token_id=2)
# name -> (model_type, config, what the build shows); the classes are the family's registration's
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "roberta": ("roberta",
                dict(**_TEXT, hidden_size=24, num_attention_heads=3, intermediate_size=40, num_hidden_layers=LAYERS,
                     max_position_embeddings=20, hidden_act="gelu", layer_norm_eps=1e-12, is_decoder=True),
                "BERT's stack; is_decoder=True (causal)"),
    "distilbert": ("distilbert",
                   dict(**_TEXT, dim=24, n_heads=3, hidden_dim=40, n_layers=LAYERS, max_position_embeddings=20,
                        activation="gelu"), "post-LN, eps 1e-12 in the code"),
    "opt": ("opt",
            dict(**_TEXT, hidden_size=24, num_attention_heads=3, ffn_dim=40, num_hidden_layers=LAYERS,
                 max_position_embeddings=20, word_embed_proj_dim=24, do_layer_norm_before=True,
                 activation_function="relu"), "pre-LN, final_layer_norm"),
    "opt-350m": ("opt",
                 dict(**_TEXT, hidden_size=24, num_attention_heads=3, ffn_dim=40, num_hidden_layers=LAYERS,
                      max_position_embeddings=20, word_embed_proj_dim=16, do_layer_norm_before=False,
                      activation_function="relu"), "post-LN, project_in / project_out (outside the stack)"),
    "vit": ("vit",
            dict(hidden_size=24, num_attention_heads=3, intermediate_size=40, num_hidden_layers=LAYERS, image_size=8,
                 patch_size=4, hidden_act="gelu", layer_norm_eps=1e-6, qkv_bias=True), "pre-LN, final layernorm"),
    "phi3": ("phi3",
             dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                  num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=500.0,
                  sliding_window=None, partial_rotary_factor=0.75),
             "fused qkv_proj and gate_up_proj split and joined; rotary on 4 of 6 dims (Phi-4-mini's 0.75)"),
    "qwen3": ("qwen3",
              dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=40, num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6,
                   rope_theta=1000.0), "QK-norm per head, head_dim 8 (4 heads: 32 != 24), 2 KV heads"),
    "gemma": ("gemma",
              dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=10,
                   intermediate_size=40, num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6,
                   rope_theta=1000.0), "(1 + w) norms, GeGLU, head_dim 10, 1 KV head; sqrt(d) embedding scale "
                                       "outside the stack"),
    "olmo2": ("olmo2",
              dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                   num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=1000.0,
                   attention_bias=True),
              "norms on the sublayer outputs, QK-norm over the whole projections, 2 KV heads; attention_bias "
              "(q, k, v, o biased, the MLP not)"),
    "gpt_neox": ("gpt_neox",
                 dict(**_TEXT, hidden_size=24, num_attention_heads=3, intermediate_size=40, num_hidden_layers=LAYERS,
                      max_position_embeddings=32, rotary_pct=0.5, rotary_emb_base=1000, hidden_act="gelu",
                      use_parallel_residual=True), "parallel residual, rotary on half of each head, per-head "
                                                   "query_key_value"),
    "gpt_neox-sequential": ("gpt_neox",
                            dict(**_TEXT, hidden_size=24, num_attention_heads=3, intermediate_size=40,
                                 num_hidden_layers=LAYERS, max_position_embeddings=32, rotary_pct=0.25,
                                 rotary_emb_base=1000, hidden_act="gelu_new", use_parallel_residual=False,
                                 attention_bias=False),
                            "use_parallel_residual=False: the sequential pre-LN form, rotary_pct 0.25; "
                            "attention_bias=False (MLP and LayerNorm biases kept)"),
    "mistral-window": ("mistral",
                       dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                            num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=1000.0,
                            sliding_window=WINDOW), f"sliding_window {WINDOW} < T {T}, every layer local"),
    "starcoder2": ("starcoder2",
                   dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
                        num_hidden_layers=LAYERS, max_position_embeddings=32, norm_epsilon=1e-5, rope_theta=1000.0,
                        hidden_act="gelu_pytorch_tanh", use_bias=True, sliding_window=WINDOW),
                   f"LayerNorm, biases, dense MLP (c_fc, c_proj), sliding_window {WINDOW}, 1 KV head"),
    "stablelm": ("stablelm",
                 dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
                      num_hidden_layers=LAYERS, max_position_embeddings=32, layer_norm_eps=1e-5, rope_theta=1000.0,
                      partial_rotary_factor=0.25, use_qkv_bias=True, use_parallel_residual=False),
                 "LayerNorms with biases, linear maps without (q/k/v: use_qkv_bias), rotary on 2 of 8 dims"),
    "stablelm-parallel": ("stablelm",
                          dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=3,
                               intermediate_size=40,
                               num_hidden_layers=LAYERS, max_position_embeddings=32, layer_norm_eps=1e-5,
                               rope_theta=1000.0, use_qkv_bias=False, use_parallel_residual=True),
                          "use_parallel_residual: one shared norm, x + Attn(Norm(x)) + MLP(Norm(x))"),
    "phi": ("phi",
            dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
                 num_hidden_layers=LAYERS, max_position_embeddings=32, layer_norm_eps=1e-5, rope_theta=1000.0,
                 partial_rotary_factor=0.5, hidden_act="gelu_new"),
            "one shared input_layernorm (parallel block), biases everywhere, rotary on 4 of 8 dims, 1 KV head"),
    "gptj": ("gptj",
             dict(**_TEXT, n_embd=24, n_head=3, n_inner=40, n_layer=LAYERS, n_positions=32, rotary_dim=4,
                  layer_norm_epsilon=1e-5, activation_function="gelu_new"),
             "one shared ln_1 (parallel block), rotary on adjacent pairs of 4 of 8 dims, q/k/v/out without biases"),
    "cohere": ("cohere",
               dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
                    num_hidden_layers=LAYERS, max_position_embeddings=32, layer_norm_eps=1e-5, rope_theta=1000.0,
                    attention_bias=True),
               "one shared input_layernorm without bias (parallel block), rotary on adjacent pairs, 1 KV head, "
               "attention_bias"),
    "cohere2": ("cohere2",
                dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
                     num_hidden_layers=LAYERS, max_position_embeddings=32, layer_norm_eps=1e-5, rope_theta=1000.0,
                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                f"Cohere's block; layers 1 and 3 local (window {WINDOW}) and rotated, layer 2 without positions"),
    "smollm3": ("smollm3",
                dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                     num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=1000.0,
                     no_rope_layers=[1, 0, 1]),
                "LLaMA's layers, layer 2 without rotary (no_rope_layers [1, 0, 1]), 2 KV heads"),
    "granite": ("granite",
                dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                     num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=1000.0,
                     attention_multiplier=0.3, residual_multiplier=0.22, embedding_multiplier=12.0,
                     logits_scaling=8.0),
                "LLaMA's layers, softmax scale attention_multiplier 0.3, x + 0.22 * F(x), 2 KV heads"),
    "gpt_bigcode": ("gpt_bigcode",
                    dict(**_TEXT, n_embd=24, n_head=3, n_inner=40, n_layer=LAYERS, n_positions=32,
                         activation_function="gelu_pytorch_tanh", multi_query=True),
                    "multi-query attention: c_attn rows [q; k; v] with one KV head, nn.Linear (out, in)"),
    "falcon": ("falcon",
               dict(**_TEXT, hidden_size=24, num_attention_heads=3, ffn_hidden_size=40, num_hidden_layers=LAYERS,
                    max_position_embeddings=32, rope_theta=1000.0, multi_query=True, parallel_attn=True, bias=False),
               "falcon-7b: multi-query (query_key_value rows [q; k; v], one KV head), one shared "
               "input_layernorm (parallel block), no linear biases"),
    "falcon-40b": ("falcon",
                   dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=40,
                        num_hidden_layers=LAYERS, max_position_embeddings=32, rope_theta=1000.0,
                        new_decoder_architecture=True, bias=True),
                   "new_decoder_architecture: query_key_value rows per KV group [q, q; k; v] (2 groups), ln_attn / "
                   "ln_mlp (parallel block, two norms); bias=True"),
    "falcon-rw": ("falcon",
                  dict(**_TEXT, hidden_size=24, num_attention_heads=3, ffn_hidden_size=40, num_hidden_layers=LAYERS,
                       max_position_embeddings=32, alibi=True, multi_query=False, parallel_attn=False, bias=True),
                  "falcon-rw-1b: ALiBi (3 heads: slopes past a power of two; padding mid-row not counted), "
                  "query_key_value per head [q; k; v], the sequential pre-LN block, biases"),
    "whisper": ("whisper",
                dict(vocab_size=16, d_model=24, encoder_attention_heads=3, encoder_ffn_dim=40, encoder_layers=LAYERS,
                     decoder_attention_heads=3, decoder_ffn_dim=40, decoder_layers=LAYERS, num_mel_bins=4,
                     max_source_positions=T, max_target_positions=T, activation_function="gelu", pad_token_id=1,
                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=0),
                "the encoder (no k_proj bias: read as zero); no padding (the encoder takes no mask); its decoder: "
                "test_whisper_decoder_matches_the_hf_decoder"),
    "gemma2": ("gemma2",
               dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=10,
                    intermediate_size=40, num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6,
                    rope_theta=1000.0, sliding_window=WINDOW, attn_logit_softcapping=5.0, query_pre_attn_scalar=16,
                    final_logit_softcapping=30.0),
               f"sandwich norms, logits soft-capped at 5, scaled by 16 ** -0.5, layers 1 and 3 local (window "
               f"{WINDOW}); eager attention only"),
    "gemma3": ("gemma3_text",
               dict(**_TEXT, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=10,
                    intermediate_size=40, num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6,
                    sliding_window=WINDOW, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
               f"QK-norm per head, sandwich norms, layers 1 and 3 local (window {WINDOW}, rotary base 100; "
               f"global 1000)"),
    "gpt_oss": ("gpt_oss",
                dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=16, num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-5,
                     sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.1,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4,
                                      "rope_theta": 1000.0}),
                f"sinks, layers 1 and 3 local (window {WINDOW}), yarn past its original length, q/k/v/o biases, "
                "4 biased experts top 2 with the SwiGLU clamped at 0.1, gate / up interleaved; eager attention"),
    "deepseek_v2": ("deepseek_v2",
                    dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40,
                         num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6,
                         n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=2,
                         topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                         first_k_dense_replace=1, kv_lora_rank=12, q_lora_rank=None, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=6, rope_theta=1000.0),
                    "latent attention with direct queries, layer 1 dense, then top 3 of 8 experts in 4 groups "
                    "(group-limited greedy softmax, 2 groups kept) scaled by 1.5 beside 2 shared experts"),
    "deepseek_v3": ("deepseek_v3",
                    dict(**_TEXT, hidden_size=24, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40,
                         num_hidden_layers=LAYERS, max_position_embeddings=32, rms_norm_eps=1e-6,
                         n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=1,
                         n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                         kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                          "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "rope_theta": 1000.0}),
                    "latent attention with low-rank queries, interleaved rotary, yarn past its original length "
                    "(mscale_all_dim), layer 1 dense, then top 3 of 8 experts in 4 groups (sigmoid, the "
                    "correction bias choosing only, 2 groups kept) scaled by 2.5 beside a shared expert"),
}
FAMILIES["modernbert"] = (
    "modernbert",
    dict(**_TEXT, cls_token_id=0, sep_token_id=2, hidden_size=24, num_attention_heads=3, intermediate_size=40,
         num_hidden_layers=LAYERS, max_position_embeddings=32, local_attention=WINDOW, global_attn_every_n_layers=2,
         attention_bias=True, norm_bias=True,
         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    f"encoder: layers 1 and 3 global (rotary base 1000), layer 2 local (window: distance <= {WINDOW} // 2, base 100); "
    "fused Wqkv, GeGLU from the fused Wi, layer 0 without attn_norm; attention_bias, norm_bias")

# What each family computes that the blocks do not: (config change, the refusal's words). The
# tests assert each; the docs table lists them.
REFUSALS: dict[str, list[tuple[dict[str, Any], str]]] = {
    "roberta": [(dict(add_cross_attention=True), "add_cross_attention=True"),
                (dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'")],
    "distilbert": [(dict(activation="gelu_fast"), "activation='gelu_fast'")],
    "opt": [(dict(enable_bias=False), "enable_bias=False"),
            (dict(layer_norm_elementwise_affine=False), "layer_norm_elementwise_affine=False")],
    "opt-350m": [],
    "vit": [(dict(hidden_act="gelu_fast"), "hidden_act='gelu_fast'")],
    "phi3": [(dict(hidden_act="gelu"), "hidden_act='gelu'")],
    "qwen3": [(dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
               "layer_types=['full_attention', 'sliding_attention', 'sliding_attention']"),
              (dict(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}), "rope_type 'proportional'")],
    "gemma": [(dict(hidden_act="relu"), "hidden_act='relu'")],
    "olmo2": [],
    "gpt_neox": [(dict(hidden_act="gelu_fast"), "hidden_act='gelu_fast'")],
    "gpt_neox-sequential": [],
    "mistral-window": [],
    "starcoder2": [],
    "stablelm": [(dict(qk_layernorm=True), "qk_layernorm=True")],
    "stablelm-parallel": [],
    "phi": [(dict(qk_layernorm=True), "qk_layernorm=True")],
    "gptj": [(dict(rotary_dim=5), "rotary_dim=5"), (dict(rotary_dim=10), "rotary_dim=10")],
    "cohere": [(dict(use_qk_norm=True), "use_qk_norm=True")],
    "cohere2": [(dict(sliding_window=None), "sliding_window=None")],
    "smollm3": [(dict(no_rope_layers=[1, 0], layer_types=["full_attention"] * LAYERS), "no_rope_layers=[1, 0]"),
                (dict(use_sliding_window=True, sliding_window=WINDOW),
                 "layer_types=['full_attention', 'sliding_attention', 'full_attention']")],
    "granite": [(dict(residual_multiplier=-1.0), "residual_multiplier=-1.0")],
    "gpt_bigcode": [(dict(multi_query=False), "multi_query=False"),
                    (dict(scale_attn_weights=False), "scale_attn_weights=False")],
    "falcon": [(dict(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn=2")],
    "falcon-rw": [(dict(num_kv_heads=1), "num_kv_heads=1")],
    "falcon-40b": [(dict(parallel_attn=False), "parallel_attn=False"), (dict(num_kv_heads=3), "num_kv_heads=3")],
    "whisper": [(dict(activation_function="gelu_fast"), "activation_function='gelu_fast'")],
    "gemma2": [(dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
                "layer_types=['full_attention', 'sliding_attention', 'sliding_attention']")],
    "gpt_oss": [(dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
                 "layer_types=['full_attention', 'sliding_attention', 'sliding_attention']")],
    "deepseek_v2": [(dict(num_key_value_heads=2), "num_key_value_heads")],
    "deepseek_v3": [(dict(num_key_value_heads=2), "num_key_value_heads")],
    "gemma3": [(dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
               (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e3},
                                      "sliding_attention": {"rope_type": "linear", "rope_theta": 100.0,
                                                            "factor": 2.0}}),
                "rope_type 'linear' on the sliding layers")],
}
REFUSALS["modernbert"] = [
    (dict(hidden_activation="gelu_fast"), "hidden_activation='gelu_fast'"),
    (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
     "layer_types=['sliding_attention', 'full_attention', 'sliding_attention']"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e3},
                           "sliding_attention": {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}}),
     "rope_type 'linear' on the sliding layers")]

def config(name: str, **changes: Any) -> dict[str, Any]:
    """The family's tiny config (with changes) as a dict, as config.json holds it."""
    import transformers

    model_type, kw, _ = FAMILIES[name]
    return getattr(transformers, registered(model_type).config_class)(**{**kw, **changes}).to_dict()


def registered(model_type: str):
    """The family's registration (flax_blocks.checkpoints.family): its config and model classes."""
    from flax_blocks.checkpoints.family import FAMILIES as REGISTERED

    return REGISTERED[model_type]


def model_class(name: str) -> str:
    """The HF class a build makes: the family's base model (Whisper: its whole model, whose
    encoder the stack is)."""
    model_type = FAMILIES[name][0]
    return "WhisperModel" if model_type == "whisper" else registered(model_type).model_class


def build(name: str, dtype: str):
    """The family's tiny HF base model in `dtype` (eval mode), weights made to count. float64
    models of families computing in float32 inside run with SDPA (reference.reference)."""
    import torch
    import transformers

    from .reference import attention_for

    model_type, kw, _ = FAMILIES[name]
    config_cls, model_cls = getattr(transformers, registered(model_type).config_class), model_class(name)
    attn = attention_for(config_cls.model_type, dtype)
    cfg = config_cls(**kw, attn_implementation=attn, experts_implementation="eager")  # (grouped_mm: no float64)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.mul_(5.0)
    return model


# Settings of a family measured both ways in another entry (or, Mistral, in parity_tests/hf/test_stacks.py),
# and families whose whole model is measured in float32 against HF (test_models_families.py: GPT-OSS,
# DeepSeek, SmolLM3, ModernBERT): float64 from the folder only, to keep the suite's time (each float32 run
# compiles anew).
FLOAT64_ONLY = ("gpt_neox-sequential", "stablelm-parallel", "mistral-window", "falcon", "falcon-40b",
                "gpt_oss", "deepseek_v2", "deepseek_v3", "smollm3", "modernbert")

# Families whose stack takes no padding mask (Whisper's encoder): measured without padding.
NO_PADDING = ("whisper",)


def inputs(dtype: str, d_model: int, padded: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hidden states, cotangent, keys) with padding mid-sequence in the last element (padded)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, T, d_model))
    keys = np.ones((B, T), bool)
    if padded:
        keys[-1, PADDED] = False
    ct = rng.normal(size=(B, T, d_model)) * keys[..., None]
    return x.astype(dtype), ct.astype(dtype), keys


def forward(module, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The Flax stack's output with key_mask=keys."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(module)
    return np.asarray(jax.jit(lambda s, h, k: nnx.merge(graphdef, s)(h, key_mask=k))(state, x, keys))


@dataclass
class Measured:
    name: str
    folder: Any  # the save_pretrained folder (float64)
    dialect: str
    flax: Any  # fb.from_hf(folder), float64 (use under jax.enable_x64)
    model32: Any  # the float32 HF model, embeddings out of the way
    x: np.ndarray
    keys: np.ndarray
    hf_y: np.ndarray  # HF's float64 output, masked
    float64: tuple[float, float]  # (forward, gradient) rel errors
    float32: tuple[float, float] | None  # None: FLOAT64_ONLY
    mask_matters: float  # how much the padding changes HF's real positions
    num_layers: int


def measure(name: str, folder) -> Measured:
    """Build, save, read and compare one family (float64 from the folder, float32 from the object)."""
    import jax

    import flax_blocks as fb

    from .reference import embeddings_out_of_the_way, flax_runs, float64_faithful, hf_run, rel_at

    model = build(name, "float64")
    model.save_pretrained(folder)
    with jax.enable_x64(True):
        flax = fb.from_hf(folder)
        d = flax.cfg.d_model
        ref = float64_faithful(embeddings_out_of_the_way(model))
        x, ct, keys = inputs("float64", d, name not in NO_PADDING)
        yf, gf = flax_runs(flax, x, ct, keys, (True,))[True]
    yh, gh = hf_run(ref, x, ct, keys)
    y_open, _ = hf_run(ref, x, ct, None)
    f64 = (rel_at(yf, yh, keys), rel_at(gf, gh, keys))
    if name in FLOAT64_ONLY:
        return Measured(name, folder, flax.hf_dialect, flax, None, x, keys, yh, f64, None,
                        rel_at(y_open, yh, keys), flax.num_layers)
    model32 = embeddings_out_of_the_way(build(name, "float32"))
    flax32 = fb.from_hf(model32)
    x32, ct32, _ = inputs("float32", d, name not in NO_PADDING)
    yf, gf = flax_runs(flax32, x32, ct32, keys, (True,))[True]
    yh32, gh32 = hf_run(model32, x32, ct32, keys)
    f32 = (rel_at(yf, yh32, keys), rel_at(gf, gh32, keys))
    return Measured(name, folder, flax.hf_dialect, flax, model32, x, keys, yh, f64, f32, rel_at(y_open, yh, keys),
                    flax.num_layers)


@dataclass
class MeasuredDecoder:
    flax: Any  # fb.from_hf(folder, part="decoder"), float64
    x: np.ndarray
    memory: np.ndarray
    keys: np.ndarray
    hf_y: np.ndarray
    float64: tuple[float, float, float]  # (forward, gradient w.r.t. x, gradient w.r.t. the memory)
    float32: tuple[float, float, float]
    mask_matters: float


def _decoder_runs(module, x, memory, ct, keys):
    import jax
    from flax import nnx

    graphdef, state = nnx.split(module)

    @jax.jit
    def run(state, x, memory, ct, keys):
        model = nnx.merge(graphdef, state)
        y, vjp = jax.vjp(lambda h, m: model(h, m, key_mask=keys), x, memory)
        return y, *vjp(ct)

    return [np.asarray(a) for a in run(state, x, memory, ct, keys)]


def _hf_decoder_runs(model, x, memory, ct, keys):
    """Whisper's decoder on inputs_embeds x (its positions zeroed), cross-attending to memory."""
    import torch

    decoder = model.get_decoder()
    with torch.no_grad():
        decoder.embed_positions.weight.zero_()
    xt, mt = torch.tensor(x, requires_grad=True), torch.tensor(memory, requires_grad=True)
    mask = None if keys is None else torch.tensor(keys.astype(np.int64))
    y = decoder(inputs_embeds=xt, encoder_hidden_states=mt, attention_mask=mask).last_hidden_state
    y.backward(torch.tensor(ct))
    return y.detach().numpy(), xt.grad.numpy(), mt.grad.numpy()


def measure_whisper_decoder(folder) -> MeasuredDecoder:
    """Whisper's decoder from the family's folder (float64; written by measure("whisper", folder))
    and from the float32 model object, against HF's decoder on the same inputs: padding inside
    the last sequence, a random memory of T positions."""
    import jax
    import torch
    import transformers

    import flax_blocks as fb

    from .reference import rel_at

    rng = np.random.default_rng(2)
    model = transformers.WhisperModel.from_pretrained(folder, dtype=torch.float64).eval()
    d = model.config.d_model
    x, ct, keys = inputs("float64", d)
    memory = rng.normal(size=(B, T, d))
    with jax.enable_x64(True):
        flax = fb.from_hf(folder, part="decoder")
        yf, gf, mf = _decoder_runs(flax, x, memory, ct, keys)
    yh, gh, mh = _hf_decoder_runs(model, x, memory, ct, keys)
    y_open = _hf_decoder_runs(model, x, memory, ct, None)[0]
    everywhere = np.ones((B, T), bool)
    f64 = (rel_at(yf, yh, keys), rel_at(gf, gh, keys), rel_at(mf, mh, everywhere))
    model32 = build("whisper", "float32")
    flax32 = fb.from_hf(model32, part="decoder")
    x32, ct32, m32 = x.astype("float32"), ct.astype("float32"), memory.astype("float32")
    yf, gf, mf = _decoder_runs(flax32, x32, m32, ct32, keys)
    yh32, gh32, mh32 = _hf_decoder_runs(model32, x32, m32, ct32, keys)
    f32 = (rel_at(yf, yh32, keys), rel_at(gf, gh32, keys), rel_at(mf, mh32, everywhere))
    return MeasuredDecoder(flax, x, memory, keys, yh, f64, f32, rel_at(y_open, yh, keys))


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------

DOC = "docs/families.md"
START = f"<!-- families-table:start (python -m parity_tests.hf.families --doc {DOC}) -->"
END = "<!-- families-table:end -->"


# Fixed settings the table shows where a family sets them otherwise than the blocks' default.
SHOWN_IF_SET = ("norm_weight_offset", "qk_norm", "qk_norm_over", "parallel_residual", "attn_logit_softcapping",
                "query_pre_attn_scalar", "sliding_window_pattern")


def describe(name: str) -> dict[str, str]:
    """The table's words for one family, from the dialect table, the config reader and REFUSALS."""
    import dataclasses

    from flax_blocks.checkpoints import dialects
    from flax_blocks.checkpoints.family import FAMILIES as TABLES
    from flax_blocks.core.config import BlockConfig

    cfg = config(name)
    model_type = cfg["model_type"]
    dialect = TABLES[model_type].dialect
    lay = dialects.DIALECTS[dialect]
    family = TABLES[model_type]
    reads = [k for k in family.reads if k in cfg and k not in family.lm]  # the keys this build sets
    defaults = {f.name: f.default for f in dataclasses.fields(BlockConfig)}
    fixed = ", ".join(f"{k}={v!r}" for k, v in lay.settings.items()
                      if k in ("norm", "norm_type", "mlp", "activation", "causal", "bias", "layer_norm_eps")
                      or (k in SHOWN_IF_SET and v != defaults[k]))
    refused = "; ".join(words for _, words in REFUSALS[name])
    return {"family": f"{name} ({model_type} -> {dialect})", "model": model_class(name) + ": " + FAMILIES[name][2],
            "reads": ", ".join(reads),
            "fixed": fixed, "refused": refused or "-"}


def table(measured: dict[str, Measured]) -> str:
    lines = ["| family | built | read from the config | fixed by the family | refused by name | "
             "float64 fwd / grad | float32 fwd / grad |", "|---|---|---|---|---|---|---|"]
    for name in measured:  # FAMILIES' order (or the --only selection's)
        d, m = describe(name), measured[name]
        lines.append(f"| {d['family']} | {d['model']} | {d['reads']} | {d['fixed']} | {d['refused']} | "
                     f"{m.float64[0]:.0e} / {m.float64[1]:.0e} | "
                     + (f"{m.float32[0]:.0e} / {m.float32[1]:.0e} |" if m.float32 else "- (float64 only) |"))
    return "\n".join(lines) + "\n"


def splice(document: str, text: str) -> str:
    """`document` with the text between the families-table markers replaced by `text`."""
    return markers.splice(document, text, START, END, "families-table")


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m parity_tests.hf.families", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", metavar="FILE", help=f"replace the table between this file's markers (the committed "
                                                  f"one: {DOC})")
    ap.add_argument("--only", metavar="NAMES", type=lambda s: s.split(","),
                    help="measure these families only (comma list of FAMILIES' names, e.g. llama,gemma); with "
                         "--doc their rows are replaced and the table's other rows kept")
    args = ap.parse_args(argv)
    chosen = args.only or list(FAMILIES)
    unknown = sorted(set(chosen) - set(FAMILIES))
    if unknown:
        ap.error(f"--only {','.join(unknown)}: not in FAMILIES ({', '.join(FAMILIES)})")
    if args.doc:
        with open(args.doc) as f:
            splice(f.read(), "")
    with tempfile.TemporaryDirectory() as tmp:
        text = table({n: measure(n, os.path.join(tmp, n)) for n in FAMILIES if n in chosen})
    print(text)
    if args.doc and args.only:
        markers.replace_rows(args.doc, text, START, END, "families-table")
    elif args.doc:
        markers.rewrite(args.doc, text, START, END, "families-table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
