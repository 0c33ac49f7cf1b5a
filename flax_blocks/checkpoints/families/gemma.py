"""Gemma (model_type gemma): LLaMA's names; norms that scale by 1 + w, GeGLU (its config turns
"gelu" into tanh GELU), head_dim explicit, embeddings scaled by sqrt(hidden_size)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..dialects import ATTENTION_BIAS, LLAMA_NAMED, LLAMA_OUTSIDE, LLAMA_RULES, Dialect, register_dialect
from ..family import (
    DECODER_INERT,
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
)
from .llama import LLAMA_LIKE

# Gemma: LLaMA's names; RMSNorm scaling by (1 + w) (every norm, the final one too), GeGLU with
# tanh GELU, head_dim explicit, no biases. Its embedding scale sqrt(d_model) lies outside the stack.
HF_GEMMA = Dialect(
    "hf-gemma", "Hugging Face Gemma (LLaMA's names; norms scale by 1 + w, GeGLU)",
    layer="layers.{i}.", final_norm="norm", rules=LLAMA_RULES,
    settings={**{k: v for k, v in ATTENTION_BIAS.items() if k not in ("mlp", "activation")},
              "norm_weight_offset": 1.0, "qkv_bias": None, "sliding_window": None, "sliding_window_pattern": None},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal", "mlp",
           "activation"),
    outside=LLAMA_OUTSIDE + " (Gemma multiplies the embeddings by sqrt(hidden_size) before the layers)",
    shared_by=LLAMA_NAMED,
)
register_dialect(HF_GEMMA)

GEMMA_LIKE = replace(LLAMA_LIKE, embed_scale=True)  # token embeddings times sqrt(hidden_size)


def _gemma(c: Read) -> dict[str, Any]:
    """GemmaModel: (1 + w) RMSNorm, GeGLU (GemmaConfig rewrites hidden_act 'gelu' to tanh
    GELU), explicit head_dim, attention_bias on q, k, v, o."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    if c["use_bidirectional_attention"]:
        c.refuse("use_bidirectional_attention", "Gemma with bidirectional attention (EmbeddingGemma): read as causal "
                                                "here; refused")
    attn = bool(c["attention_bias"])
    act = read_activation(c, "hidden_act", gated=True, tanh_gelu=True)
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **gated_mlp(act),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "causal": read_causal(c), **read_rope(c), "final_norm": True}


register(Family("gemma", "GemmaConfig", "GemmaModel", "hf-gemma",
           rotary_defaults(max_position_embeddings=8192, hidden_size=3072, num_attention_heads=16,
                           num_key_value_heads=16, intermediate_size=24576, num_hidden_layers=28,
                           hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, head_dim=256, attention_bias=False,
                           use_bidirectional_attention=None, vocab_size=256000, tie_word_embeddings=True),
           _gemma, DECODER_INERT, lm=(*LM_ROTARY, "hidden_size"),
           lm_class="GemmaForCausalLM", outside=GEMMA_LIKE,
           reference=Reference(float32_inside=True, scales_inputs=True),
           draws={"hidden_act": ("gelu", "gelu_pytorch_tanh", "gelu_new", "silu"), "attention_bias": (True, False),
                  "use_bidirectional_attention": (False, None, True)}))
