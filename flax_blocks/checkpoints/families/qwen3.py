"""Qwen3 (model_type qwen3): LLaMA's names plus a QK-norm per head (q_norm / k_norm over head_dim),
Qwen2's windows, head_dim explicit."""

from __future__ import annotations

from typing import Any

from ..dialects import ATTENTION_BIAS, LLAMA_NAMED, LLAMA_OUTSIDE, LLAMA_RULES, WINDOWS, Dialect, register_dialect
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    Family,
    Read,
    explicit_head_dim,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
    window_pattern,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE
from .qwen2 import QWEN_DRAWS, qwen2_layer_types, qwen2_source

# Qwen3: LLaMA's layers and names plus a QK-norm over each head (q_norm / k_norm of width
# head_dim, RMSNorm, before rotary), head_dim explicit; no biases (attention_bias puts them on
# q, k, v and o alike, refused).
HF_QWEN3 = Dialect(
    "hf-qwen3", "Hugging Face Qwen3 (LLaMA's names with self_attn.q_norm / k_norm over head_dim)",
    layer="layers.{i}.", final_norm="norm", rules=LLAMA_RULES,
    settings={**ATTENTION_BIAS, "qk_norm": True, "qk_norm_over": "head", "qkv_bias": None},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal", *WINDOWS),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_QWEN3)


def _qwen3(c: Read) -> dict[str, Any]:
    """Qwen3Model: Qwen2's windows, QK-norm per head, explicit head_dim, attention_bias on q, k,
    v and o (never the MLP)."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    window = c["sliding_window"] if c["use_sliding_window"] else None
    attn = bool(c["attention_bias"])
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "causal": read_causal(c), **read_rope(c),
            **window_pattern(c, qwen2_layer_types(c, sizes["num_layers"]), window, sizes["num_layers"],
                             qwen2_source(c)),
            "final_norm": True}


register(Family("qwen3", "Qwen3Config", "Qwen3Model", "hf-qwen3",
           rotary_defaults(max_position_embeddings=32768, hidden_size=4096, num_attention_heads=32,
                           num_key_value_heads=32, intermediate_size=22016, num_hidden_layers=32, hidden_act="silu",
                           rms_norm_eps=1e-6, head_dim=128, attention_bias=False, use_sliding_window=False,
                           sliding_window=4096, max_window_layers=28, layer_types=None, vocab_size=151936),
           _qwen3, DECODER_INERT, lm=LM_ROTARY,
           lm_class="Qwen3ForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
           draws={**QWEN_DRAWS, "attention_bias": (True, False)}))
