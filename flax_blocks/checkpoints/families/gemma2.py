"""Gemma 2 (model_type gemma2): Gemma's norms as sandwiches around each sublayer, attention logits
soft-capped and scaled by query_pre_attn_scalar ** -0.5, local and global layers alternating, a
final logit soft-cap; HF serves it with the eager attention only."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..dialects import ATTENTION_BIAS, LLAMA_NAMED, LLAMA_OUTSIDE, WINDOWS, Dialect, linear, norm, qkv, register_dialect
from ..family import (
    DECODER_INERT,
    GENERATION,
    LM_ROTARY,
    Family,
    Read,
    Reference,
    explicit_head_dim,
    gated_mlp,
    read_activation,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    window_pattern,
)
from .gemma import GEMMA_LIKE

# Gemma 2: Gemma's norms as sandwiches (norm="peri": x + Norm_out(F(Norm(x))), input_layernorm /
# post_attention_layernorm around the attention, pre_feedforward_layernorm /
# post_feedforward_layernorm around the MLP), attention logits soft-capped, scaled by
# query_pre_attn_scalar ** -0.5, local (sliding-window) and global layers alternating. The final
# logit soft-cap lies in the LM head, outside the stack.
GEMMA2_RULES = (
    *qkv("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    *linear("self_attn.out_proj", "self_attn.o_proj"),
    *linear("linear_gate", "mlp.gate_proj"),
    *linear("linear1", "mlp.up_proj"),
    *linear("linear2", "mlp.down_proj"),
    *norm("norm1", "input_layernorm"),
    *norm("norm1_out", "post_attention_layernorm"),
    *norm("norm2", "pre_feedforward_layernorm"),
    *norm("norm2_out", "post_feedforward_layernorm"),
)
GEMMA2_SETTINGS = {**ATTENTION_BIAS, "norm": "peri", "norm_weight_offset": 1.0, "qkv_bias": None}
for _k in ("attn_logit_softcapping", "query_pre_attn_scalar", "activation", "mlp"):
    del GEMMA2_SETTINGS[_k]
HF_GEMMA2 = Dialect(
    "hf-gemma2", "Hugging Face Gemma 2 (sandwich norms: pre_feedforward_layernorm, post_feedforward_layernorm)",
    layer="layers.{i}.", final_norm="norm", rules=GEMMA2_RULES,
    settings=GEMMA2_SETTINGS,
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "attn_logit_softcapping",
           "query_pre_attn_scalar",
           "bias", "mlp_bias", "causal", "activation", "mlp", *WINDOWS),
    outside=LLAMA_OUTSIDE + " (Gemma 2 multiplies the embeddings by sqrt(hidden_size) before the layers; its "
                             "final logit soft-cap is the LM head's)",
    shared_by=LLAMA_NAMED,
)
register_dialect(HF_GEMMA2)

GEMMA2_LIKE = replace(GEMMA_LIKE, final_logit_softcap="final_logit_softcapping")
GEMMA2_DRAWS: dict[str, tuple[Any, ...]] = {"hidden_activation": ("gelu", "gelu_pytorch_tanh"),
                                            "query_pre_attn_scalar": (4, 8, 16),
                "attn_logit_softcapping": (0.5, 2.0, None, 50.0), "final_logit_softcapping": (0.5, None, 30.0),
                "sliding_window": (2, 4, 16), "attention_bias": (True, False), "layer_types": ("pattern",)}


def read_gemma2_common(c: Read, act_key: str) -> dict[str, Any]:
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    if c["use_bidirectional_attention"]:
        c.refuse("use_bidirectional_attention", "bidirectional attention (EmbeddingGemma): refused")
    attn = bool(c["attention_bias"])
    act = read_activation(c, act_key, gated=True)  # Gemma 2 / 3: "gelu" stays exact GELU
    scalar = c["query_pre_attn_scalar"]
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **gated_mlp(act),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "query_pre_attn_scalar": None if scalar is None else float(scalar), "causal": read_causal(c),
            "final_norm": True}


def _gemma2(c: Read) -> dict[str, Any]:
    """Gemma2Model: sandwich norms, soft-capped logits, query_pre_attn_scalar, layer_types
    (Gemma2Config: every second layer global when not given)."""
    out = read_gemma2_common(c, "hidden_activation")
    n = out["num_layers"]
    types = c["layer_types"] or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    cap = c["attn_logit_softcapping"]
    return {**out, **read_rope(c), "attn_logit_softcapping": None if cap is None else float(cap),
            **window_pattern(c, list(types), c["sliding_window"], n)}


register(Family("gemma2", "Gemma2Config", "Gemma2Model", "hf-gemma2",
           rotary_defaults(max_position_embeddings=8192, hidden_size=2304, num_attention_heads=8,
                           num_key_value_heads=4, intermediate_size=9216, num_hidden_layers=26,
                           hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, head_dim=256,
                           attention_bias=False, use_bidirectional_attention=None, query_pre_attn_scalar=256,
                           sliding_window=4096, layer_types=None, final_logit_softcapping=30.0,
                           attn_logit_softcapping=50.0, vocab_size=256000, tie_word_embeddings=True),
           _gemma2, {**DECODER_INERT, "hidden_act": "Gemma2Config reads hidden_activation; hidden_act is never "
                                                      "read", "cache_implementation": GENERATION,
                     "sliding_window_size": "an older name for sliding_window that transformers no longer reads"},
           lm=(*LM_ROTARY, "hidden_size", "final_logit_softcapping"),
           lm_class="Gemma2ForCausalLM", outside=GEMMA2_LIKE,
           reference=Reference(eager_only=True, scales_inputs=True), draws=GEMMA2_DRAWS))
