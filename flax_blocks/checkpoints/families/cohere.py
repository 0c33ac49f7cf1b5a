"""Cohere (model_type cohere: Command R, Aya 23): a parallel block reading one shared LayerNorm
without bias, x + Attn(Norm(x)) + MLP(Norm(x)); LLaMA's names and SwiGLU, grouped-query
attention with biases by attention_bias; rotary on interleaved (adjacent) pairs of every head
dim (the frequencies repeat-interleaved); a final LayerNorm without bias; the logits times
logit_scale; the head tied to the embeddings by default."""

from __future__ import annotations

from typing import Any

from ..dialects import LLAMA_RULES, LLAMA_SETTINGS, Dialect, register_dialect
from ..family import (
    DECODER_INERT,
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

HF_COHERE = Dialect(
    "hf-cohere", "Hugging Face Cohere (layers.{i}.self_attn.q_proj ... o_proj, mlp.gate_proj / up_proj / down_proj, "
                 "one input_layernorm without bias)",
    layer="layers.{i}.", final_norm="norm",
    rules=tuple(r for r in LLAMA_RULES if not r.ours.startswith("norm2.")),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**{k: v for k, v in LLAMA_SETTINGS.items() if k not in ("norm_type", "parallel_residual", "mlp_bias",
                                                                       "norm_bias", "rope_interleaved")},
              "norm_type": "layernorm", "parallel_residual": "shared_norm", "mlp_bias": False, "norm_bias": False,
              "rope_interleaved": True, "qkv_bias": None, "sliding_window": None, "sliding_window_pattern": None},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "causal"),
    outside="token embeddings (embed_tokens), the rotary inv_freq buffer and the LM head (tied by default)",
)
register_dialect(HF_COHERE)


def _cohere(c: Read) -> dict[str, Any]:
    """CohereModel: CohereDecoderLayer's parallel block over input_layernorm (a LayerNorm without
    bias), SwiGLU (hidden_act), attention_bias on q, k, v and o, rotary on adjacent pairs;
    use_qk_norm (a LayerNorm with weights per head over q and k) refused."""
    if c["use_qk_norm"]:
        c.refuse("use_qk_norm", "a mean-subtracted LayerNorm with its own weight per head over q and k; the blocks' "
                                "QK-norm is a scale-only norm shared by the heads")
    if c["layer_norm_eps"] is None:
        c.refuse("layer_norm_eps", "CohereLayerNorm adds it to the variance (transformers fails on None)")
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    head = explicit_head_dim(c, sizes["d_model"], sizes["num_heads"])
    width = head.get("head_dim", sizes["d_model"] // sizes["num_heads"])
    return {**sizes, **head, **silu_only(c, "hidden_act"), "bias": bool(c["attention_bias"]),
            "layer_norm_eps": float(c["layer_norm_eps"] or 0.0), "causal": read_causal(c),
            **read_rope(c, default_theta=500000.0, head_dim=width), "final_norm": True}


register(Family("cohere", "CohereConfig", "CohereModel", "hf-cohere",
                 rotary_defaults(vocab_size=256000, hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                                 num_attention_heads=64, num_key_value_heads=None, hidden_act="silu",
                                 max_position_embeddings=8192, layer_norm_eps=1e-5, rope_theta=500000.0,
                                 tie_word_embeddings=True,
                                 attention_bias=False, use_qk_norm=False, logit_scale=0.0625, head_dim=None),
                 _cohere, DECODER_INERT, lm=("vocab_size", "tie_word_embeddings", "logit_scale"),
                 lm_class="CohereForCausalLM",
                 outside=Outside("model.", "embed_tokens.weight", logit_scale="logit_scale"),
                 reference=Reference(float32_inside=True),  # its LayerNorm, rotary and q, k rotated in float32
                 draws={"attention_bias": (True, False), "logit_scale": (0.5, 0.0625, 2.0),
                        "use_qk_norm": (False, True), "num_key_value_heads": (None, 1)}))
