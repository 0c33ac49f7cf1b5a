"""Granite (model_type granite: IBM Granite 3.x): LLaMA's layers and names with four scalar
multipliers (muP): the token embeddings times embedding_multiplier, the softmax scale
attention_multiplier (in place of 1 / sqrt(head_dim)), each sublayer's output times
residual_multiplier before the skip adds it, and the logits divided by logits_scaling."""

from __future__ import annotations

from typing import Any

from ..dialects import LLAMA_NAMED, LLAMA_OUTSIDE, LLAMA_RULES, LLAMA_SETTINGS, Dialect, register_dialect
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    Family,
    Outside,
    Read,
    Reference,
    explicit_head_dim,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
)

HF_GRANITE = Dialect(
    "hf-granite", "Hugging Face Granite (LLaMA's names; scalar multipliers in its config)",
    layer="layers.{i}.", final_norm="norm", rules=LLAMA_RULES,
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**{k: v for k, v in LLAMA_SETTINGS.items() if k not in ("mlp_bias", "query_pre_attn_scalar")},
              "qkv_bias": None},  # attention_bias: q, k, v and o alike
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal",
           "query_pre_attn_scalar", "residual_multiplier", "sliding_window", "sliding_window_pattern"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_GRANITE)


def positive_multiplier(c: Read, key: str) -> float:
    """A Granite multiplier's value, refused by name unless a positive number."""
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        c.refuse(key, "a multiplier the blocks take as a positive number")
        return 1.0
    return float(value)


def _granite(c: Read) -> dict[str, Any]:
    """GraniteModel: LlamaModel's layers, the softmax scale attention_multiplier (read as
    query_pre_attn_scalar = attention_multiplier ** -2, so that its ** -0.5 is the scale) and
    x + residual_multiplier * F(x); GraniteAttention reads head_dim when the config has one."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    attn, mlp = bool(c["attention_bias"]), bool(c["mlp_bias"])
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": None if mlp == attn else mlp,
            "causal": read_causal(c), "query_pre_attn_scalar": positive_multiplier(c, "attention_multiplier") ** -2,
            "residual_multiplier": positive_multiplier(c, "residual_multiplier"),
            "sliding_window": None, "sliding_window_pattern": None, **read_rope(c), "final_norm": True}


register(Family("granite", "GraniteConfig", "GraniteModel", "hf-granite",
                rotary_defaults(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", rms_norm_eps=1e-6,
                                attention_bias=False, mlp_bias=False, head_dim=None, embedding_multiplier=1.0,
                                logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0),
                _granite, DECODER_INERT, lm=(*LM_ROTARY, "embedding_multiplier", "logits_scaling"),
                lm_class="GraniteForCausalLM",
                outside=Outside("model.", "embed_tokens.weight", embed_multiplier="embedding_multiplier",
                                logits_divisor="logits_scaling"),
                reference=Reference(float32_inside=True, scales_inputs=True),  # inputs_embeds * multiplier
                draws={"attention_bias": (True, False), "mlp_bias": (True, False),
                       "embedding_multiplier": (12.0, 1.0), "logits_scaling": (8.0, 1.0),
                       "residual_multiplier": (0.22, 1.0), "attention_multiplier": (0.015625, 0.125)}))
