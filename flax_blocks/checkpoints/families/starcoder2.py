"""Starcoder2 (model_type starcoder2): LLaMA's attention names with biases, a dense MLP (c_fc,
c_proj), LayerNorms, every layer local with a window."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, CLASSIC_READS, WINDOWS, Dialect, linear, norm, qkv, register_dialect
from ..family import (
    DECODER_INERT,
    DROPOUT,
    LM_ROTARY,
    Family,
    Read,
    every_layer_local,
    explicit_head_dim,
    read_activation,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE

# Starcoder2: LLaMA's attention names with biases, a dense MLP (c_fc, c_proj), LayerNorms, every
# layer local when sliding_window is set.
HF_STARCODER2 = Dialect(
    "hf-starcoder2", "Hugging Face Starcoder2 (layers.{i}.mlp.c_fc.weight, LayerNorms with biases)",
    layer="layers.{i}.", final_norm="norm",
    rules=(
        *qkv("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        *linear("self_attn.out_proj", "self_attn.o_proj"),
        *linear("linear1", "mlp.c_fc"),
        *linear("linear2", "mlp.c_proj"),
        *norm("norm1", "input_layernorm"),
        *norm("norm2", "post_attention_layernorm"),
    ),
    settings={**{k: v for k, v in CLASSIC.items() if k not in ("rope_theta", "rope_scaling", "sliding_window",
                                                                 "sliding_window_pattern", "bias", "norm_bias")},
              "norm": "pre"},
    reads=(*CLASSIC_READS, "rope_theta", "rope_scaling", "bias", "norm_bias", "causal", *WINDOWS),
    outside="token embeddings (embed_tokens), the rotary inv_freq buffer and the LM head",
)
register_dialect(HF_STARCODER2)


def _starcoder2(c: Read) -> dict[str, Any]:
    """Starcoder2Model: LayerNorms (norm_epsilon), a dense MLP, biases with use_bias (the
    LayerNorms keep theirs), every layer local with a window."""
    use_bias = bool(c["use_bias"])
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]),
            "activation": read_activation(c, "hidden_act"), "layer_norm_eps": float(c["norm_epsilon"]),
            "bias": use_bias, "norm_bias": None if use_bias else True, "causal": read_causal(c), **read_rope(c),
            **every_layer_local(c, c["sliding_window"], sizes["num_layers"]), "final_norm": True}


register(Family("starcoder2", "Starcoder2Config", "Starcoder2Model", "hf-starcoder2",
           rotary_defaults(max_position_embeddings=4096, hidden_size=3072, num_attention_heads=24,
                           num_key_value_heads=2, intermediate_size=12288, num_hidden_layers=30,
                           hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, use_bias=True, sliding_window=None,
                           layer_types=None, head_dim=None, vocab_size=49152, tie_word_embeddings=True),
           _starcoder2, {**DECODER_INERT, "residual_dropout": DROPOUT, "embedding_dropout": DROPOUT},
           lm=LM_ROTARY,
           lm_class="Starcoder2ForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
           draws={"sliding_window": (2, 4, 16, None), "layer_types": ("pattern",),
                  "hidden_act": ("gelu", "gelu_pytorch_tanh", "relu"), "use_bias": (False, True)}))
