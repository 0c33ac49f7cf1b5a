"""LLaMA (model_type llama): RMSNorm, SwiGLU, grouped-query attention and rotary (every scaling
transformers ships: LLaMA 3.1's llama3 ...) under layers.{i}; Mistral and Qwen2 write the same
names (`HF_LLAMA`), and many families a superset of them (`LLAMA_NAMED`)."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_RULES,
    LLAMA_SETTINGS,
    WINDOWS,
    Dialect,
    register_dialect,
)
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

HF_LLAMA = Dialect(
    "hf-llama", "Hugging Face LLaMA / Mistral / Qwen2 (layers.{i}.self_attn.q_proj.weight, ...)",
    layer="layers.{i}.", final_norm="norm",
    rules=LLAMA_RULES,
    ignore=("self_attn.rotary_emb.inv_freq",),  # older checkpoints keep it per layer
    settings={k: v for k, v in LLAMA_SETTINGS.items() if k != "mlp_bias"},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "qkv_bias", "mlp_bias", "causal",
           *WINDOWS),
    outside=LLAMA_OUTSIDE,
    shared_by=LLAMA_NAMED,
)
register_dialect(HF_LLAMA)

LLAMA_LIKE = Outside("model.", "embed_tokens.weight")  # embed_tokens, the layers, norm; lm_head beside the model
LLAMA_REFERENCE = Reference(float32_inside=True)  # RMSNorm and rotary cast to float32 in HF


def _llama(c: Read) -> dict[str, Any]:
    """LlamaModel: RMSNorm (rms_norm_eps), SwiGLU (hidden_act), biases on the attention's maps
    (attention_bias) and the MLP's (mlp_bias), head_dim, rotary; never a window."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    attn, mlp = bool(c["attention_bias"]), bool(c["mlp_bias"])
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": None if mlp == attn else mlp,
            "causal": read_causal(c),
            "sliding_window": None, "sliding_window_pattern": None, **read_rope(c), "final_norm": True}


LLAMA_INERT = {**DECODER_INERT, "pretraining_tp": "a training-time sharding hint transformers 5's LLaMA no longer "
                                                    "reads"}

register(Family("llama", "LlamaConfig", "LlamaModel", "hf-llama",
           rotary_defaults(hidden_size=4096, num_attention_heads=32, num_key_value_heads=None,
                           intermediate_size=11008, num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-6,
                           attention_bias=False, mlp_bias=False, head_dim=None),
           _llama, LLAMA_INERT, lm=LM_ROTARY,
           lm_class="LlamaForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
           draws={"hidden_act": ("silu", "gelu"), "attention_bias": (True, False), "mlp_bias": (True, False)}))
