"""Qwen2 (model_type qwen2): LLaMA's names with biases on q, k, v only; local layers from
max_window_layers on when use_sliding_window (Qwen2Config builds layer_types from them)."""

from __future__ import annotations

from typing import Any

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
    window_pattern,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE


def qwen2_layer_types(c: Read, n_layers: int) -> list[str]:
    """Qwen2Config / Qwen3Config.__post_init__: layer_types as given, else local from
    max_window_layers on when use_sliding_window (and a window) is set."""
    if c["layer_types"] is not None:
        types = list(c["layer_types"])
        if "sliding_attention" in types and not (c["use_sliding_window"] and c["sliding_window"] is not None):
            c.refuse("layer_types", "local layers without a window (use_sliding_window false or sliding_window "
                                    "None): transformers refuses this config when it builds the model")
        return types
    first = c["max_window_layers"]
    return ["sliding_attention" if c["sliding_window"] is not None and c["use_sliding_window"] and i >= first
            else "full_attention" for i in range(n_layers)]


def qwen2_source(c: Read) -> str:
    """The keys a Qwen layout came from, for messages: layer_types when given, else the keys
    Qwen2Config builds it from."""
    if c["layer_types"] is not None:
        return ""
    return f"use_sliding_window={c['use_sliding_window']!r}, max_window_layers={c['max_window_layers']!r}"


def _qwen2(c: Read) -> dict[str, Any]:
    """Qwen2Model: LLaMA's layers with biases on q, k, v only; the window from layer_types
    (Qwen2Config: sliding_window kept only with use_sliding_window)."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    window = c["sliding_window"] if c["use_sliding_window"] else None
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False,
            "qkv_bias": True, "causal": read_causal(c), **read_rope(c),
            **window_pattern(c, qwen2_layer_types(c, sizes["num_layers"]), window, sizes["num_layers"],
                             qwen2_source(c)),
            "final_norm": True}


QWEN_DRAWS: dict[str, tuple[Any, ...]] = {"use_sliding_window": (True, False), "sliding_window": (2, 4, 16, None),
                                          "max_window_layers": (0, 1, 2, 28), "layer_types": ("pattern",)}

register(Family("qwen2", "Qwen2Config", "Qwen2Model", "hf-llama",
           rotary_defaults(max_position_embeddings=32768, hidden_size=4096, num_attention_heads=32,
                           num_key_value_heads=32, intermediate_size=22016, num_hidden_layers=32, hidden_act="silu",
                           rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                           layer_types=None, head_dim=None, vocab_size=151936),
           _qwen2, DECODER_INERT, lm=LM_ROTARY,
           lm_class="Qwen2ForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE, draws=QWEN_DRAWS))
