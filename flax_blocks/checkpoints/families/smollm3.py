"""SmolLM3 (model_type smollm3): LLaMA's layers and names with layers that attend without rotary
positions (NoPE): no_rope_layers holds 1 (rotary) or 0 (none) per layer, by default every
no_rope_layer_interval-th (4th) layer without; sliding windows only where layer_types (by default
the NoPE layers, with use_sliding_window and a sliding_window) says; a tied LM head by default."""

from __future__ import annotations

from typing import Any

from ..dialects import LLAMA_NAMED, LLAMA_OUTSIDE, LLAMA_RULES, LLAMA_SETTINGS, WINDOWS, Dialect, register_dialect
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    Family,
    Outside,
    Read,
    Reference,
    explicit_head_dim,
    read_causal,
    read_nope_layers,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
    window_pattern,
)

HF_SMOLLM3 = Dialect(
    "hf-smollm3", "Hugging Face SmolLM3 (LLaMA's names; layers without rotary in its config)",
    layer="layers.{i}.", final_norm="norm", rules=LLAMA_RULES,
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={k: v for k, v in LLAMA_SETTINGS.items() if k != "mlp_bias"},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "qkv_bias", "mlp_bias", "causal",
           "nope_layers", *WINDOWS),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_SMOLLM3)



def _windows(c: Read, nope: tuple[int, ...], n: int) -> dict[str, Any]:
    """layer_types as SmolLM3Config builds them (sliding where a NoPE layer meets use_sliding_window and a
    sliding_window) and as the model masks them: a 'sliding_attention' layer by sliding_window."""
    window, on = c["sliding_window"], bool(c["use_sliding_window"])
    types = c["layer_types"] or ["sliding_attention" if on and window is not None and i in nope else "full_attention"
                                 for i in range(n)]
    if "sliding_attention" in list(types) and not on:
        c.refuse("use_sliding_window", "sliding layers by layer_types with use_sliding_window off: transformers' "
                                       "eager and SDPA masks window them, its flash attention does not")
        return {}
    if "sliding_attention" in list(types) and window is None:
        c.refuse("sliding_window", "sliding layers without a window (transformers fails on it)")
        return {}
    return window_pattern(c, list(types), window, n)


def _smollm3(c: Read) -> dict[str, Any]:
    """SmolLM3Model: LlamaModel's layers (rms_norm_eps, SwiGLU, attention_bias on q, k, v and o,
    mlp_bias), rotary in the layers no_rope_layers marks 1, sliding windows by layer_types."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    attn, mlp = bool(c["attention_bias"]), bool(c["mlp_bias"])
    nope = read_nope_layers(c, sizes["num_layers"], config_class="SmolLM3Config")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": None if mlp == attn else mlp,
            "causal": read_causal(c), **_windows(c, nope, sizes["num_layers"]),
            **read_rope(c, default_theta=2000000.0), "nope_layers": nope, "final_norm": True}


register(Family("smollm3", "SmolLM3Config", "SmolLM3Model", "hf-smollm3",
                rotary_defaults(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                num_attention_heads=16, num_key_value_heads=4, hidden_act="silu",
                                max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=2000000.0,
                                use_sliding_window=False, sliding_window=None, no_rope_layers=None,
                                no_rope_layer_interval=4, layer_types=None, attention_bias=False, mlp_bias=False,
                                tie_word_embeddings=True, head_dim=None),
                _smollm3, DECODER_INERT, lm=LM_ROTARY, lm_class="SmolLM3ForCausalLM",
                outside=Outside("model.", "embed_tokens.weight"),
                reference=Reference(float32_inside=True),  # RMSNorm and rotary in float32
                draws={"no_rope_layer_interval": (4, 2, 1), "no_rope_layers": (None, [1, 0, 1], [0, 1, 1]),
                       "use_sliding_window": (True, False), "sliding_window": (2, None), "layer_types": ("pattern",),
                       "attention_bias": (False, True), "mlp_bias": (False, True)}))
