"""Qwen3-MoE (model_type qwen3_moe): Qwen3's attention (QK-norm per head, attention_bias on q, k,
v and o) with a mixture of num_experts SwiGLU experts of width moe_intermediate_size, no shared
expert; dense layers (intermediate_size) where decoder_sparse_step or mlp_only_layers say."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    ATTENTION_BIAS,
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_RULES,
    WINDOWS,
    Dialect,
    experts,
    register_dialect,
)
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    MOE_TRAINING,
    Family,
    Read,
    every_layer_local_key,
    explicit_head_dim,
    read_causal,
    read_experts,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE
from .qwen2_moe import QWEN_MOE_DRAWS

HF_QWEN3_MOE = Dialect(
    "hf-qwen3-moe", "Hugging Face Qwen3-MoE (Qwen3's names, mlp.experts.{j}.gate_proj ... or the fused "
                    "mlp.experts.gate_up_proj)",
    layer="layers.{i}.", final_norm="norm", rules=(*LLAMA_RULES, *experts("mlp.")),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**ATTENTION_BIAS, "qk_norm": True, "qk_norm_over": "head", "qkv_bias": None, "shared_expert_d_ff": 0},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal", *WINDOWS,
           "num_experts", "num_experts_per_tok", "expert_d_ff", "norm_topk_prob", "decoder_sparse_step",
           "mlp_only_layers"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_QWEN3_MOE)


def _qwen3_moe(c: Read) -> dict[str, Any]:
    """Qwen3MoeModel: Qwen3's attention; every layer local when use_sliding_window and a window
    (Qwen3MoeConfig has no layer_types: create_sliding_window_causal_mask for the whole stack);
    the experts MLP as Qwen2-MoE's without a shared expert."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    attn = bool(c["attention_bias"])
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "causal": read_causal(c), **read_rope(c),
            **every_layer_local_key(c, c["sliding_window"] if c["use_sliding_window"] else None),
            **read_experts(c, "num_local_experts", expert_width="moe_intermediate_size", layers=True),
            "final_norm": True}


register(Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeModel", "hf-qwen3-moe",
                rotary_defaults(max_position_embeddings=32768, hidden_size=2048, num_attention_heads=32,
                                num_key_value_heads=4, intermediate_size=6144, num_hidden_layers=24,
                                hidden_act="silu", rms_norm_eps=1e-6, head_dim=None, attention_bias=False,
                                use_sliding_window=False, sliding_window=4096, vocab_size=151936,
                                decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                                num_local_experts=128, norm_topk_prob=False, mlp_only_layers=None),
                _qwen3_moe, {**DECODER_INERT, **MOE_TRAINING}, lm=LM_ROTARY,
                aliases={"num_experts": "num_local_experts"},
                # transformers 5.24: Qwen3MoeConfig(num_experts=2, num_local_experts=4) has 4 experts,
                # where MixtralConfig's alias wins (found by the fuzzer: a file holding both)
                keeps_key=("num_local_experts",),
                lm_class="Qwen3MoeForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
                draws={**QWEN_MOE_DRAWS, "num_local_experts": (2, 4, 8), "attention_bias": (True, False),
                       "use_sliding_window": (True, False), "sliding_window": (2, 4, 16, None)}))
