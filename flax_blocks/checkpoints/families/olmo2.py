"""OLMo 2 (model_type olmo2): norms on the sublayers' outputs (x + Norm(F(x))) and QK-norm over the
whole q and k projections before the split into heads."""

from __future__ import annotations

from typing import Any

from ..dialects import ATTENTION_BIAS, LLAMA_NAMED, LLAMA_OUTSIDE, Dialect, linear, norm, qkv, register_dialect, same
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
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE

# OLMo 2: norms on the sublayers' outputs, x + Norm(F(x)) (post_attention_layernorm after the
# attention, post_feedforward_layernorm after the MLP; no input norm), a final norm, and QK-norm
# over the whole q (heads * head_dim) and k (kv_heads * head_dim) projections before the split.
HF_OLMO2 = Dialect(
    "hf-olmo2", "Hugging Face OLMo 2 (post_attention_layernorm / post_feedforward_layernorm on the outputs)",
    layer="layers.{i}.", final_norm="norm",
    rules=(
        *qkv("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        *linear("self_attn.out_proj", "self_attn.o_proj"),
        *same("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
        *linear("linear_gate", "mlp.gate_proj"),
        *linear("linear1", "mlp.up_proj"),
        *linear("linear2", "mlp.down_proj"),
        *norm("norm1", "post_attention_layernorm"),
        *norm("norm2", "post_feedforward_layernorm"),
    ),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**ATTENTION_BIAS, "norm": "out", "qk_norm": True, "qk_norm_over": "projection",
              "qkv_bias": None, "sliding_window": None, "sliding_window_pattern": None},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_OLMO2)


def _olmo2(c: Read) -> dict[str, Any]:
    """Olmo2Model: norms on the sublayer outputs, QK-norm over the whole projections,
    attention_bias on q, k, v, o."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    attn = bool(c["attention_bias"])
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "causal": read_causal(c), **read_rope(c), "final_norm": True}


register(Family("olmo2", "Olmo2Config", "Olmo2Model", "hf-olmo2",
           rotary_defaults(hidden_size=4096, num_attention_heads=32, num_key_value_heads=None,
                           intermediate_size=11008, num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-5,
                           attention_bias=False, head_dim=None, vocab_size=50304),
           _olmo2, DECODER_INERT, lm=LM_ROTARY,
           lm_class="Olmo2ForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
           draws={"attention_bias": (True, False)}))
