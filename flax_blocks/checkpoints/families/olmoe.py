"""OLMoE (model_type olmoe): pre-norm layers with QK-norm over the whole q and k projections (as
OLMo 2's, before the split into heads) and a mixture of num_experts SwiGLU experts of width
intermediate_size in every layer, the top num_experts_per_tok of the router's softmax
(renormalised with norm_topk_prob); clip_qkv (clamping q, k, v) refused."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    ATTENTION_BIAS,
    LLAMA_ATTENTION_NORMS,
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
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
    read_causal,
    read_experts,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE

HF_OLMOE = Dialect(
    "hf-olmoe", "Hugging Face OLMoE (LLaMA's attention and norms with q_norm / k_norm over the whole projections, "
                "mlp.experts.{j}.gate_proj ... or the fused mlp.experts.gate_up_proj)",
    layer="layers.{i}.", final_norm="norm", rules=(*LLAMA_ATTENTION_NORMS, *experts("mlp.")),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**ATTENTION_BIAS, "qk_norm": True, "qk_norm_over": "projection", "qkv_bias": None,
              "sliding_window": None, "sliding_window_pattern": None, "shared_expert_d_ff": 0,
              "decoder_sparse_step": 1, "mlp_only_layers": ()},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal",
           "num_experts", "num_experts_per_tok", "expert_d_ff", "norm_topk_prob"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_OLMOE)


def _olmoe(c: Read) -> dict[str, Any]:
    """OlmoeModel: pre-norm, QK-norm over the whole projections (sized from hidden_size: head_dim
    must be hidden_size / heads), attention_bias on q, k, v and o, every MLP the experts of width
    intermediate_size; clip_qkv clamps q, k, v after the norms, which the blocks do not compute."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    if c["head_dim"] is not None and c["head_dim"] * sizes["num_heads"] != sizes["d_model"]:
        c.refuse("head_dim", "OlmoeAttention sizes q_norm / k_norm from hidden_size / heads (transformers fails on "
                             "another head_dim)")
    if c["clip_qkv"] is not None:
        c.refuse("clip_qkv", "q, k and v clamped to [-clip_qkv, clip_qkv] after the QK-norm, which the blocks do "
                             "not compute")
    attn = bool(c["attention_bias"])
    return {**sizes, **silu_only(c, "hidden_act"), "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn,
            "mlp_bias": False if attn else None, "causal": read_causal(c), **read_rope(c),
            **read_experts(c, "num_experts"), "final_norm": True}


register(Family("olmoe", "OlmoeConfig", "OlmoeModel", "hf-olmoe",
                rotary_defaults(max_position_embeddings=4096, hidden_size=2048, intermediate_size=2048,
                                num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=None,
                                hidden_act="silu", rms_norm_eps=1e-5, head_dim=None, attention_bias=False,
                                clip_qkv=None, num_experts_per_tok=8, num_experts=64, norm_topk_prob=False,
                                vocab_size=50304),
                _olmoe, {**DECODER_INERT, **MOE_TRAINING}, lm=LM_ROTARY,
                aliases={"num_local_experts": "num_experts"},
                lm_class="OlmoeForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
                draws={"num_experts": (2, 4, 8), "num_experts_per_tok": (1, 2), "norm_topk_prob": (True, False),
                       "attention_bias": (True, False), "clip_qkv": (None,)}))
