"""Mistral (model_type mistral): LLaMA's layers and names without biases; with sliding_window every
layer is local."""

from __future__ import annotations

from typing import Any

from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    Family,
    Read,
    every_layer_local,
    explicit_head_dim,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE


def _mistral(c: Read) -> dict[str, Any]:
    """MistralModel: LLaMA's layers without biases; every layer local when sliding_window is set."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False, "causal": read_causal(c), **read_rope(c),
            **every_layer_local(c, c["sliding_window"], sizes["num_layers"]), "final_norm": True}


register(Family("mistral", "MistralConfig", "MistralModel", "hf-llama",
           rotary_defaults(max_position_embeddings=131072, hidden_size=4096, num_attention_heads=32,
                           num_key_value_heads=8, intermediate_size=14336, num_hidden_layers=32, hidden_act="silu",
                           rms_norm_eps=1e-6, head_dim=None, sliding_window=4096, layer_types=None),
           _mistral, DECODER_INERT, lm=LM_ROTARY,
           lm_class="MistralForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
           draws={"sliding_window": (2, 4, 16, None), "layer_types": ("pattern",)}))
