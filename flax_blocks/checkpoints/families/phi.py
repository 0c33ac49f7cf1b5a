"""Phi-1 / 1.5 / 2 (model_type phi): a parallel block reading one shared LayerNorm, x + Attn(Norm(x))
+ MLP(Norm(x)); separate q, k, v projections and the output `dense`, biases everywhere; rotary on
the first partial_rotary_factor (0.5) of each head; a dense MLP (fc1, fc2) of gelu_new; a final
LayerNorm and an LM head with a bias."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, Dialect, linear, norm, qkv, register_dialect
from ..family import (
    DECODER_INERT,
    DROPOUT,
    LM_ROTARY,
    Family,
    Outside,
    Read,
    Reference,
    explicit_head_dim,
    read_activation,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
)

HF_PHI = Dialect(
    "hf-phi", "Hugging Face Phi-1/2 (layers.{i}.self_attn.q_proj ... dense, mlp.fc1 / fc2, one input_layernorm)",
    layer="layers.{i}.", final_norm="final_layernorm",
    rules=(
        *qkv("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        *linear("self_attn.out_proj", "self_attn.dense"),
        *linear("linear1", "mlp.fc1"),
        *linear("linear2", "mlp.fc2"),
        *norm("norm1", "input_layernorm"),
    ),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**{k: v for k, v in CLASSIC.items() if k not in ("rope_theta", "rope_scaling", "partial_rotary_factor",
                                                                 "parallel_residual")},
              "norm": "pre", "parallel_residual": "shared_norm"},
    reads=("activation", "layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "partial_rotary_factor",
           "causal"),
    outside="token embeddings (embed_tokens), the rotary inv_freq buffer and the LM head with its bias (lm_head)",
)
register_dialect(HF_PHI)


def _phi(c: Read) -> dict[str, Any]:
    """PhiModel: PhiDecoderLayer's parallel block over one input_layernorm, partial rotary
    (PhiConfig sets partial_rotary_factor 0.5 unless given), GQA by num_key_value_heads;
    qk_layernorm (a LayerNorm with weight and bias per head of q and k) refused."""
    if c["qk_layernorm"]:
        c.refuse("qk_layernorm", "a LayerNorm with its own weight and bias over each head of q and k; the blocks' "
                                 "QK-norm is a scale-only norm")
    if not c["is_causal"]:
        c.refuse("is_causal", "PhiAttention keeps is_causal=True: transformers computes it bidirectional under eager "
                              "attention and causal under SDPA without padding")
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    head = explicit_head_dim(c, sizes["d_model"], sizes["num_heads"])
    return {**sizes, **head, "activation": read_activation(c, "hidden_act"),
            "layer_norm_eps": float(c["layer_norm_eps"]), "causal": read_causal(c),
            **read_rope(c, partial=0.5, partial_key="partial_rotary_factor",
                        head_dim=head.get("head_dim", sizes["d_model"] // sizes["num_heads"])),
            "final_norm": True}


register(Family("phi", "PhiConfig", "PhiModel", "hf-phi",
                rotary_defaults(vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                num_attention_heads=32, num_key_value_heads=None, hidden_act="gelu_new",
                                max_position_embeddings=2048, layer_norm_eps=1e-5, qk_layernorm=False,
                                partial_rotary_factor=0.5, head_dim=None),
                _phi, {**DECODER_INERT, "resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT}, lm=LM_ROTARY,
                lm_class="PhiForCausalLM", outside=Outside("model.", "embed_tokens.weight", head_bias=True),
                reference=Reference(float32_inside=True),  # rotary's cos / sin in float32
                draws={"hidden_act": ("gelu_new", "gelu"), "partial_rotary_factor": (0.5, 0.4, 1.0),
                       "num_key_value_heads": (None, 2), "qk_layernorm": (False, True)}))
