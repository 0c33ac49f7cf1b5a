"""Mixtral (model_type mixtral): Mistral's attention and norms with a mixture of experts in place
of every MLP: a router over num_local_experts SwiGLU experts of width intermediate_size, the top
num_experts_per_tok of its softmax renormalised; on disk block_sparse_moe.gate and
block_sparse_moe.experts.{j}.w1 (gate) / w3 (up) / w2 (down), in transformers 5 fused
(mlp.experts.gate_up_proj, mlp.experts.down_proj): both read."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    LLAMA_ATTENTION_NORMS,
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_SETTINGS,
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

HF_MIXTRAL = Dialect(
    "hf-mixtral", "Hugging Face Mixtral (LLaMA's attention, block_sparse_moe.experts.{j}.w1 / w2 / w3 or the fused "
                  "mlp.experts.gate_up_proj)",
    layer="layers.{i}.", final_norm="norm",
    rules=(*LLAMA_ATTENTION_NORMS, *experts("block_sparse_moe.", ("w1", "w3", "w2"))),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**LLAMA_SETTINGS, "bias": False, "qkv_bias": None, "norm_topk_prob": True,
              "shared_expert_d_ff": 0, "decoder_sparse_step": 1, "mlp_only_layers": ()},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "causal", *WINDOWS, "num_experts",
           "num_experts_per_tok", "expert_d_ff"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_MIXTRAL)


def _mixtral(c: Read) -> dict[str, Any]:
    """MixtralModel: Mistral's layers (no biases; every layer local when sliding_window is set)
    with every MLP a mixture of num_local_experts SwiGLU experts of width intermediate_size, the
    top num_experts_per_tok of the router's softmax always renormalised. router_jitter_noise
    multiplies the input by uniform noise only while training (`self.training and
    jitter_noise > 0`): the loaded model runs for inference and never applies it (listed
    among the keys that change nothing, as the aux-loss keys)."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False, "causal": read_causal(c),
            **read_rope(c, default_theta=1e6), **every_layer_local_key(c, c["sliding_window"]),
            **read_experts(c, "num_local_experts", norm=None), "final_norm": True}


register(Family("mixtral", "MixtralConfig", "MixtralModel", "hf-mixtral",
                rotary_defaults(max_position_embeddings=4096 * 32, hidden_size=4096, num_attention_heads=32,
                                num_key_value_heads=8, intermediate_size=14336, num_hidden_layers=32,
                                hidden_act="silu", rms_norm_eps=1e-5, head_dim=None, sliding_window=None,
                                num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6),
                _mixtral, {**DECODER_INERT, **MOE_TRAINING,
                           "router_jitter_noise": "noise on the router's input while training only "
                                                  "(self.training and router_jitter_noise > 0)"},
                lm=LM_ROTARY, aliases={"num_experts": "num_local_experts"},
                lm_class="MixtralForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
                draws={"sliding_window": (2, 4, 16, None), "num_local_experts": (2, 4, 8),
                       "num_experts_per_tok": (1, 2)}))
