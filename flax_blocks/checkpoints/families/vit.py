"""ViT (model_type vit): pre-LN encoder layers under encoder.layer.{i} (the checkpoint files' names), a
stack only: its inputs are image patches."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, CLASSIC_READS, Dialect, linear, norm, qkv, register_dialect
from ..family import (
    DROPOUT,
    OUTSIDE_PART,
    Family,
    Read,
    Reference,
    explicit_head_dim,
    read_activation,
    read_sizes,
    register,
)

# ViT: the names of the checkpoint files (save_pretrained writes them still); transformers 5's
# own ViTModel names its modules layers.{i}.attention.q_proj, ... and converts when loading. A
# model object is read as save_pretrained writes it (flax_blocks.checkpoints.checkpoint.hf_state_dict).
HF_VIT = Dialect(
    "hf-vit", "Hugging Face ViT checkpoints (encoder.layer.{i}.attention.attention.query.weight, ...)",
    layer="encoder.layer.{i}.", final_norm="layernorm",
    rules=(
        *qkv("attention.attention.query", "attention.attention.key", "attention.attention.value"),
        *linear("self_attn.out_proj", "attention.output.dense"),
        *norm("norm1", "layernorm_before"),
        *linear("linear1", "intermediate.dense"),
        *linear("linear2", "output.dense"),
        *norm("norm2", "layernorm_after"),
    ),
    settings={**{k: v for k, v in CLASSIC.items() if k != "qkv_bias"}, "norm": "pre", "causal": False},
    reads=(*CLASSIC_READS, "qkv_bias"),
    outside="patch and position embeddings, the CLS token and the pooler",
)
register_dialect(HF_VIT)


def _vit(c: Read) -> dict[str, Any]:
    """ViTModel's encoder: pre-LN, qkv_bias, head_dim read when set (getattr in ViTSelfAttention)."""
    if c["is_causal"]:
        c.refuse("is_causal", "ViT is read as bidirectional; transformers makes it causal under SDPA only")
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]),
            "activation": read_activation(c, "hidden_act"), "layer_norm_eps": float(c["layer_norm_eps"]),
            "qkv_bias": bool(c["qkv_bias"]), "final_norm": True}


register(Family("vit", "ViTConfig", "ViTModel", "hf-vit",
           {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "num_hidden_layers": 12,
            "hidden_act": "gelu", "layer_norm_eps": 1e-12, "qkv_bias": True, "head_dim": None, "is_causal": None},
           _vit, {"hidden_dropout_prob": DROPOUT, "attention_probs_dropout_prob": DROPOUT,
                  **{k: OUTSIDE_PART + " (patch embeddings, pooler)" for k in (
                      "image_size", "patch_size", "num_channels", "encoder_stride", "pooler_output_size",
                      "pooler_act")}},
           stack_only="its inputs are images: patch embeddings (a convolution), a CLS token and a pooler, not "
                      "token ids",
           reference=Reference(float32_inside=True)))
