"""A model built from scratch written as a Hugging Face family's config.json (`config_for`),
for `fb.save_hf(model, folder, family=...)`.

The config is the family's class defaults with the model's sizes and settings put in the keys
the family reads (`flax_blocks.checkpoints.families`); `fb.save_hf` then reads it back as
`fb.from_hf` would and refuses the save, naming the fields, where the family cannot hold what
the model computes (a LayerNorm model written as LLaMA, a Gemma's (1 + w) norms as anything
but Gemma).
"""

from __future__ import annotations

from typing import Any

from .family import FAMILIES

# BlockConfig field -> the keys that carry it, in the families that read them (the first the
# family reads is written).
_KEYS: dict[str, tuple[str, ...]] = {
    "d_model": ("hidden_size", "n_embd", "dim", "d_model"),
    "num_heads": ("num_attention_heads", "n_head", "n_heads"),
    "num_kv_heads": ("num_key_value_heads",),
    "d_ff": ("intermediate_size", "ffn_dim", "n_inner", "hidden_dim"),
    "head_dim": ("head_dim",),
    "layer_norm_eps": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"),
    "rope_theta": ("rope_theta", "rotary_emb_base"),
    "partial_rotary_factor": ("partial_rotary_factor", "rotary_pct"),
    "query_pre_attn_scalar": ("query_pre_attn_scalar",),
    "attn_logit_softcapping": ("attn_logit_softcapping",),
    "sliding_window": ("sliding_window",),
    "causal": ("is_causal",),
    "residual_multiplier": ("residual_multiplier",),
}
_ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function", "activation")
_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}
_BIAS_KEYS = ("attention_bias", "use_bias", "enable_bias", "use_qkv_bias", "qkv_bias", "mlp_bias")


def config_for(family: str, model: Any) -> dict[str, Any]:
    """config.json's dict of `model` (a LanguageModel) written as `family` (a model_type)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(sorted(FAMILIES))}, got {family!r}")
    if type(model).__name__ != "LanguageModel":
        raise TypeError(f"a {type(model).__name__} built from scratch has no embeddings or head to write: save_hf "
                        "writes a LanguageModel with family=, or a stack loaded by fb.from_hf")
    table, cfg, lm = FAMILIES[family], model.cfg, model.lm
    config: dict[str, Any] = {"model_type": family}
    for field, keys in _KEYS.items():
        key = next((k for k in keys if k in table.reads), None)
        value = getattr(cfg, field)
        if key is None or value is None:
            continue
        config[key] = value
    layers = next(k for k in ("num_hidden_layers", "n_layer", "n_layers") if k in table.reads)
    config[layers] = lm.num_layers
    if "num_key_value_heads" in table.reads:
        config["num_key_value_heads"] = cfg.kv_heads
    if "head_dim" in table.reads:
        config["head_dim"] = cfg.head_width
    if "rotary_dim" in table.reads and cfg.rope_theta is not None:  # GPT-J: the rotated dims themselves
        config["rotary_dim"] = cfg.rotary_dim
    act = next((k for k in _ACTIVATION_KEYS if k in table.reads), None)
    if act is not None:
        config[act] = _HF_ACTIVATION[cfg.activation]
    for key in _BIAS_KEYS:
        if key in table.reads:
            config[key] = cfg.has_mlp_bias if key == "mlp_bias" else \
                cfg.has_qkv_bias if key in ("use_qkv_bias", "qkv_bias") else cfg.bias
    if cfg.rope_scaling is not None and "rope_scaling" in table.reads:
        config["rope_scaling"] = {k: v for k, v in cfg.rope_scaling.as_dict().items()
                                  if k != "max_position_embeddings"}
        if cfg.rope_scaling.max_position_embeddings is not None:
            config["max_position_embeddings"] = cfg.rope_scaling.max_position_embeddings
    config["vocab_size"] = lm.vocab_size
    if "tie_word_embeddings" in table.reads:
        config["tie_word_embeddings"] = lm.head == "tied"
    if lm.max_positions is not None:
        key = next(k for k in ("max_position_embeddings", "n_positions") if k in table.reads)
        config[key] = lm.max_positions + (lm.position_offset if lm.default_positions == "ids" else 0)  # RoBERTa's
    if lm.pad_token_id is not None:
        config["pad_token_id"] = lm.pad_token_id
    if lm.final_logit_softcap is not None and "final_logit_softcapping" in table.reads:
        config["final_logit_softcapping"] = lm.final_logit_softcap
    if "logit_scale" in table.reads:  # Cohere: 0.0625 when left out; an unscaled model writes 1.0
        config["logit_scale"] = lm.logit_scale if lm.logit_scale is not None else 1.0
    if "attention_multiplier" in table.reads:  # Granite: the softmax scale itself
        config["attention_multiplier"] = cfg.attention_scale
    if table.outside is not None and table.outside.embed_multiplier is not None:
        config[table.outside.embed_multiplier] = 1.0 if lm.embed_scale is None else lm.embed_scale
    if table.outside is not None and table.outside.logits_divisor is not None:
        config[table.outside.logits_divisor] = 1.0 if lm.logits_divisor is None else lm.logits_divisor
    return config
