"""Qwen2-MoE (model_type qwen2_moe, Qwen1.5-MoE): Qwen2's attention (biases on q, k, v: qkv_bias)
with a mixture of num_experts SwiGLU experts of width moe_intermediate_size, the top
num_experts_per_tok of the router's softmax (renormalised with norm_topk_prob), plus a shared
expert (shared_expert_intermediate_size) scaled by a sigmoid gate; layers run a dense MLP
(intermediate_size) instead where decoder_sparse_step or mlp_only_layers say (a mixed stack: each
layer of ours holds its own MLP only, as HF's)."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_RULES,
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
    explicit_head_dim,
    read_causal,
    read_experts,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
    window_pattern,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE
from .qwen2 import QWEN_DRAWS

HF_QWEN2_MOE = Dialect(
    "hf-qwen2-moe", "Hugging Face Qwen2-MoE (Qwen2's names, mlp.experts.{j}.gate_proj ... or the fused "
                    "mlp.experts.gate_up_proj, mlp.shared_expert, mlp.shared_expert_gate)",
    layer="layers.{i}.", final_norm="norm",
    rules=(*LLAMA_RULES, *experts("mlp.", shared="mlp.shared_expert")),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**LLAMA_SETTINGS, "bias": False},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "qkv_bias", "causal", *WINDOWS,
           "num_experts", "num_experts_per_tok", "expert_d_ff", "norm_topk_prob", "shared_expert_d_ff",
           "decoder_sparse_step", "mlp_only_layers"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_QWEN2_MOE)


def _layer_types(c: Read, n_layers: int) -> tuple[list[str], int | None]:
    """Qwen2MoeConfig.__post_init__: sliding_window kept only with use_sliding_window (else 0);
    layer_types as given, else local on the odd layers (from 1) below max_window_layers when
    use_sliding_window."""
    window = c["sliding_window"] if c["use_sliding_window"] else 0
    if c["layer_types"] is not None:
        types = list(c["layer_types"])
    else:
        types = ["sliding_attention" if (i + 1) % 2 and i < c["max_window_layers"] and c["use_sliding_window"]
                 else "full_attention" for i in range(n_layers)]
    if "sliding_attention" in types and not window:
        c.refuse("layer_types", f"local layers with a window of {window!r} (use_sliding_window="
                                f"{c['use_sliding_window']!r}, sliding_window={c['sliding_window']!r})")
        window = None
    return types, window or None


def _qwen2_moe(c: Read) -> dict[str, Any]:
    """Qwen2MoeModel: Qwen2's attention (qkv_bias on q, k, v), the experts MLP with a gated shared
    expert in the layers (layer_idx + 1) % decoder_sparse_step == 0 not in mlp_only_layers, a dense
    SwiGLU of intermediate_size in the others."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    types, window = _layer_types(c, sizes["num_layers"])
    source = "" if c["layer_types"] is not None else \
        f"use_sliding_window={c['use_sliding_window']!r}, max_window_layers={c['max_window_layers']!r}"
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False, "qkv_bias": bool(c["qkv_bias"]),
            "causal": read_causal(c), **read_rope(c),
            **window_pattern(c, types, window, sizes["num_layers"], source),
            **read_experts(c, "num_experts", expert_width="moe_intermediate_size",
                           shared="shared_expert_intermediate_size", layers=True),
            "final_norm": True}


QWEN_MOE_DRAWS: dict[str, tuple[Any, ...]] = {"num_experts": (2, 4, 8), "num_experts_per_tok": (1, 2),
                                              "norm_topk_prob": (True, False), "decoder_sparse_step": (1, 2),
                                              "mlp_only_layers": ([], [0])}

register(Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeModel", "hf-qwen2-moe",
                rotary_defaults(max_position_embeddings=32768, hidden_size=2048, num_attention_heads=16,
                                num_key_value_heads=16, intermediate_size=5632, num_hidden_layers=24,
                                hidden_act="silu", rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=4096,
                                max_window_layers=28, layer_types=None, head_dim=None, vocab_size=151936,
                                qkv_bias=True, decoder_sparse_step=1, moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                                norm_topk_prob=False, mlp_only_layers=None),
                _qwen2_moe, {**DECODER_INERT, **MOE_TRAINING}, lm=LM_ROTARY,
                lm_class="Qwen2MoeForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
                draws={**QWEN_DRAWS, **QWEN_MOE_DRAWS, "qkv_bias": (True, False)}))
