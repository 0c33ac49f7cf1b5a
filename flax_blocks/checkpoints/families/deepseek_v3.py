"""DeepSeek-V3 (model_type deepseek_v3: DeepSeek-V3, R1, Kimi K2): DeepSeek-V2's multi-head latent
attention (rotary on adjacent pairs with rope_interleave, rotate-half without; yarn's mscale_all_dim
in the softmax scale) and, after first_k_dense_replace dense layers, experts chosen by sigmoid scores
plus e_score_correction_bias within the topk_group best of n_group groups (ranked by their top-2
sums), weighted by the unbiased scores (renormalised with norm_topk_prob) times
routed_scaling_factor, beside an ungated shared MLP. Its multi-token prediction layers
(num_nextn_predict_layers) are not part of DeepseekV3Model. HF's names: deepseek_v2's dialect."""

from __future__ import annotations

from typing import Any

from ..family import (
    LM_ROTARY,
    Family,
    Read,
    read_causal,
    read_experts,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
)
from .deepseek_v2 import (
    DEEPSEEK_DRAWS,
    DEEPSEEK_INERT,
    DEEPSEEK_OUTSIDE,
    DEEPSEEK_REFERENCE,
    first_dense,
    groups,
    read_latent,
    shared_width,
)


def _deepseek_v3(c: Read) -> dict[str, Any]:
    """DeepseekV3Model: RMSNorm (rms_norm_eps), multi-head latent attention, the dense SwiGLU in the
    first first_k_dense_replace layers, then the experts (DeepSeek V3's routing) and the shared MLP."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    experts = read_experts(c, "n_routed_experts", expert_width="moe_intermediate_size")
    return {**sizes, **silu_only(c, "hidden_act"), "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False,
            "causal": read_causal(c), "mlp_bias": False,
            **read_latent(c, sizes["d_model"], sizes["num_heads"]), "rope_interleave": bool(c["rope_interleave"]),
            **experts, "routing": "deepseek_v3",
            **groups(c, experts["num_experts"], experts.get("num_experts_per_tok", 1), v3=True),
            "routed_scaling_factor": float(c["routed_scaling_factor"]), **shared_width(c),
            **first_dense(c, sizes["num_layers"]), "final_norm": True}


register(Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3Model", "hf-deepseek",
                rotary_defaults(max_position_embeddings=4096, hidden_size=7168, num_attention_heads=128,
                                num_key_value_heads=128, intermediate_size=18432, num_hidden_layers=61,
                                hidden_act="silu", rms_norm_eps=1e-6, vocab_size=129280, attention_bias=False,
                                moe_intermediate_size=2048, n_shared_experts=1, n_routed_experts=256,
                                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                                first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True),
                _deepseek_v3, {**DEEPSEEK_INERT, "num_nextn_predict_layers": "multi-token prediction modules, not "
                                                                           "part of DeepseekV3Model"}, lm=LM_ROTARY,
                aliases={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
                lm_class="DeepseekV3ForCausalLM", outside=DEEPSEEK_OUTSIDE, reference=DEEPSEEK_REFERENCE,
                draws={**DEEPSEEK_DRAWS, "n_group": (2, 4), "topk_group": (1, 2), "rope_interleave": (True, False),
                       "norm_topk_prob": (True, False)}))
