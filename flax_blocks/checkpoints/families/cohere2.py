"""Cohere 2 (model_type cohere2: Command R7B, Command A): Cohere's parallel block, names and logit
scale, with sliding-window layers by layer_types (or the older sliding_window_pattern, 4 by
default: three local layers, then a global one); rotary (on adjacent pairs) in the local layers
alone, the global layers attending without positions; head_dim always hidden / heads."""

from __future__ import annotations

from typing import Any

from ..dialects import WINDOWS, Dialect, register_dialect
from ..family import (
    DECODER_INERT,
    Family,
    Outside,
    Read,
    Reference,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
    window_pattern,
)
from .cohere import HF_COHERE

HF_COHERE2 = Dialect(
    "hf-cohere2", "Hugging Face Cohere 2 (Cohere's names; local and global layers)",
    layer=HF_COHERE.layer, final_norm=HF_COHERE.final_norm, rules=HF_COHERE.rules, ignore=HF_COHERE.ignore,
    settings={k: v for k, v in HF_COHERE.settings.items() if k not in (*WINDOWS, "rope_local_only")},
    reads=(*HF_COHERE.reads, *WINDOWS, "rope_local_only"),
    outside=HF_COHERE.outside,
)
register_dialect(HF_COHERE2)


def _cohere2(c: Read) -> dict[str, Any]:
    """Cohere2Model: Cohere2Attention rotates q and k only where its layer is sliding; layer_types
    from sliding_window_pattern when not given (Cohere2Config.__post_init__)."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    n, every = sizes["num_layers"], c["sliding_window_pattern"]
    types = c["layer_types"] or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if c["sliding_window"] is None and "sliding_attention" in types:
        c.refuse("sliding_window", "sliding layers without a window: transformers rotates none of them and masks "
                                   "them as full layers, which the blocks do not compute")
    window = window_pattern(c, list(types), c["sliding_window"], n)
    rope = read_rope(c, head_dim=max(1, sizes["d_model"] // sizes["num_heads"]))  # head_dim: hidden / heads
    if window.get("sliding_window") is None:  # no local layer: no positions anywhere
        rope = {"rope_theta": None}
    return {**sizes, **silu_only(c, "hidden_act"), "bias": bool(c["attention_bias"]),
            "layer_norm_eps": float(c["layer_norm_eps"]), "causal": read_causal(c), **window, **rope,
            "rope_local_only": rope["rope_theta"] is not None, "final_norm": True}


register(Family("cohere2", "Cohere2Config", "Cohere2Model", "hf-cohere2",
                rotary_defaults(vocab_size=256000, hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                                num_attention_heads=64, num_key_value_heads=None, hidden_act="silu",
                                max_position_embeddings=8192, layer_norm_eps=1e-5, tie_word_embeddings=True,
                                attention_bias=False, logit_scale=0.0625, sliding_window=4096, layer_types=None,
                                sliding_window_pattern=4),
                _cohere2, {**DECODER_INERT, "head_dim": "Cohere2Config sets it to hidden_size / num_attention_heads"},
                lm=("vocab_size", "tie_word_embeddings", "logit_scale"), lm_class="Cohere2ForCausalLM",
                outside=Outside("model.", "embed_tokens.weight", logit_scale="logit_scale"),
                reference=Reference(float32_inside=True),  # its LayerNorm, rotary and q, k rotated in float32
                draws={"attention_bias": (True, False), "logit_scale": (0.5, 0.0625), "sliding_window_pattern": (2, 4),
                       "layer_types": ("pattern",), "num_key_value_heads": (None, 1)}))
