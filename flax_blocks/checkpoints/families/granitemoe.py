"""GraniteMoE (model_type granitemoe: IBM Granite 3.0 1B-A400M / 3B-A800M): Granite's four scalar
multipliers around Mixtral's layers: every MLP a mixture of num_local_experts SwiGLU experts of
width intermediate_size, a softmax over the top num_experts_per_tok router logits (Mixtral's
renormalised top-k of the softmax, the same weights). On disk block_sparse_moe.input_linear
(X, 2F, E: rows [gate; up]), output_linear (X, E, F) and router.layer (X, E); in transformers 5
block_sparse_moe.experts.gate_up_proj / down_proj and router.weight: both read."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    LLAMA_ATTENTION_NORMS,
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_SETTINGS,
    Dialect,
    Rule,
    register_dialect,
)
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    MOE_TRAINING,
    Family,
    Outside,
    Read,
    Reference,
    explicit_head_dim,
    read_causal,
    read_experts,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
)
from .granite import positive_multiplier


def _experts(moe: str, gate_up: str, down: str, router: str) -> tuple[Rule, ...]:
    return (Rule("experts.router", (f"{moe}{router}",)),
            Rule("experts.gate", (f"{moe}{gate_up}",), chunk=(0, 2), axis=1),
            Rule("experts.up", (f"{moe}{gate_up}",), chunk=(1, 2), axis=1),
            Rule("experts.down", (f"{moe}{down}",)))


HF_GRANITEMOE = Dialect(
    "hf-granitemoe", "Hugging Face GraniteMoE (LLaMA's attention, block_sparse_moe.input_linear / output_linear / "
                     "router.layer, or transformers 5's block_sparse_moe.experts.gate_up_proj)",
    layer="layers.{i}.", final_norm="norm",
    rules=(*LLAMA_ATTENTION_NORMS,
           *_experts("block_sparse_moe.", "input_linear.weight", "output_linear.weight", "router.layer.weight"),
           *_experts("block_sparse_moe.", "experts.gate_up_proj", "experts.down_proj", "router.weight")),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**{k: v for k, v in LLAMA_SETTINGS.items() if k != "query_pre_attn_scalar"}, "bias": False,
              "qkv_bias": None, "norm_topk_prob": True, "shared_expert_d_ff": 0, "decoder_sparse_step": 1,
              "mlp_only_layers": (), "sliding_window": None, "sliding_window_pattern": None},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "causal", "num_experts",
           "num_experts_per_tok", "expert_d_ff", "query_pre_attn_scalar", "residual_multiplier"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_GRANITEMOE)


def _granitemoe(c: Read) -> dict[str, Any]:
    """GraniteMoeModel: Granite's softmax scale and residual multiplier, every MLP experts
    (top-k logits, then their softmax: Mixtral's renormalised weights)."""
    if c["attention_bias"]:
        c.refuse("attention_bias", "biases on q, k, v and o beside bias-free experts (not read)")
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False, "causal": read_causal(c),
            "query_pre_attn_scalar": positive_multiplier(c, "attention_multiplier") ** -2,
            "residual_multiplier": positive_multiplier(c, "residual_multiplier"), **read_rope(c),
            **read_experts(c, "num_local_experts", norm=None), "final_norm": True}


register(Family("granitemoe", "GraniteMoeConfig", "GraniteMoeModel", "hf-granitemoe",
                rotary_defaults(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", rms_norm_eps=1e-6,
                                attention_bias=False, head_dim=None, embedding_multiplier=1.0, logits_scaling=1.0,
                                residual_multiplier=1.0, attention_multiplier=1.0, num_local_experts=8,
                                num_experts_per_tok=2),
                _granitemoe, {**DECODER_INERT, **MOE_TRAINING},
                lm=(*LM_ROTARY, "embedding_multiplier", "logits_scaling"),
                lm_class="GraniteMoeForCausalLM",
                outside=Outside("model.", "embed_tokens.weight", embed_multiplier="embedding_multiplier",
                                logits_divisor="logits_scaling"),
                reference=Reference(float32_inside=True, scales_inputs=True),
                draws={"embedding_multiplier": (12.0, 1.0), "logits_scaling": (6.0, 1.0),
                       "residual_multiplier": (0.22, 1.0), "attention_multiplier": (0.015625, 0.125),
                       "num_local_experts": (2, 4), "num_experts_per_tok": (1, 2)}))
