"""Gemma 3 (model_type gemma3_text, and the language model of a multimodal gemma3 folder): Gemma 2's
layers plus a QK-norm per head and a rotary of their own for the local layers (per-layer-type
rope parameters: the global layers scaled, Gemma 3 4B's linear x8); its attention never applies
attn_logit_softcapping."""

from __future__ import annotations

from typing import Any

from ..dialects import LLAMA_NAMED, LLAMA_OUTSIDE, Dialect, register_dialect, same
from ..family import (
    DECODER_INERT,
    GENERATION,
    LM_ROTARY,
    Family,
    Read,
    Reference,
    read_rope,
    register,
    register_language_model,
    rotary_defaults,
    window_pattern,
)
from .gemma2 import GEMMA2_DRAWS, GEMMA2_LIKE, GEMMA2_RULES, GEMMA2_SETTINGS, HF_GEMMA2, read_gemma2_common

# Gemma 3 (text): Gemma 2's layers plus a QK-norm per head ((1 + w) RMSNorm over head_dim) and a
# rotary base of its own for the local layers; soft-capping off by default (read).
HF_GEMMA3 = Dialect(
    "hf-gemma3", "Hugging Face Gemma 3 text (Gemma 2's names plus self_attn.q_norm / k_norm)",
    layer="layers.{i}.", final_norm="norm",
    rules=(*GEMMA2_RULES, *same("self_attn.q_norm.weight", "self_attn.k_norm.weight")),
    settings={**{k: v for k, v in GEMMA2_SETTINGS.items() if k != "rope_local_theta"}, "qk_norm": True,
              "qk_norm_over": "head"},
    reads=(*HF_GEMMA2.reads, "rope_local_theta"),
    outside=LLAMA_OUTSIDE + " (Gemma 3 scales the embeddings by sqrt(hidden_size) in its embedding module)",
    shared_by=LLAMA_NAMED,
)
register_dialect(HF_GEMMA3)


def _gemma3(c: Read) -> dict[str, Any]:
    """Gemma3TextModel: Gemma 2's layers with QK-norm and two rotary bases (full and sliding
    layers); its attention never applies attn_logit_softcapping (the key is inert)."""
    out = read_gemma2_common(c, "hidden_activation")
    n = out["num_layers"]
    every = c["sliding_window_pattern"] if c["sliding_window_pattern"] is not None else 6
    types = c["layer_types"] or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    # Gemma3TextConfig.convert_rope_params_to_dict: per-layer-type parameters (defaults when absent), a flat
    # rope_scaling updating the full layers' (over the default's rope_type: an older "type" key then changes nothing)
    params = c["rope_parameters"]
    if params is None:
        params = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
    if c["rope_scaling"] and "full_attention" not in params:
        c.refuse("rope_parameters", "no full_attention entry for rope_scaling to update (transformers fails on it too)")
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    if c["rope_scaling"]:
        full.update(c["rope_scaling"])
    full.setdefault("rope_theta", c["rope_theta"] if c.given("rope_theta") else 1_000_000.0)
    local.setdefault("rope_theta", c["rope_local_base_freq"] if c.given("rope_local_base_freq") else 10_000.0)
    rotary = read_rope(c, params=full, source="rope_scaling" if c["rope_scaling"] else "rope_parameters.full_attention")
    window = window_pattern(c, list(types), c["sliding_window"], n)
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default" and window.get("sliding_window") is not None:
        c.problems.append(f"rope_parameters.sliding_attention={local!r}: rope_type {kind!r} on the sliding layers; "
                          "the blocks' local layers take plain rotary at their own base")
    local_theta = float(local["rope_theta"]) if window.get("sliding_window") is not None else None
    return {**out, **rotary, "rope_local_theta": local_theta, **window}


register(Family("gemma3_text", "Gemma3TextConfig", "Gemma3TextModel", "hf-gemma3",
           rotary_defaults(max_position_embeddings=131072, hidden_size=2304, num_attention_heads=8,
                           num_key_value_heads=4, intermediate_size=9216, num_hidden_layers=26,
                           hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, head_dim=256,
                           attention_bias=False, use_bidirectional_attention=False, query_pre_attn_scalar=256,
                           sliding_window=4096, layer_types=None, sliding_window_pattern=None,
                           rope_local_base_freq=10000.0, final_logit_softcapping=None, vocab_size=262208,
                           tie_word_embeddings=True),
           _gemma3, {**DECODER_INERT, "attn_logit_softcapping": "Gemma 3's attention never applies it (transformers "
                                                                 "5.24's Gemma3Attention passes softcap=None)",
                     "_sliding_window_pattern": "derived from sliding_window_pattern (layer_types is read)",
                     "hidden_act": "Gemma3TextConfig reads hidden_activation; hidden_act is never read",
                     "cache_implementation": GENERATION},
           lm=(*LM_ROTARY, "hidden_size", "final_logit_softcapping"),
           lm_class="Gemma3ForCausalLM", outside=GEMMA2_LIKE, reference=Reference(float32_inside=True),
           draws={**GEMMA2_DRAWS, "sliding_window_pattern": (2, 3, 6), "rope_theta": (1000.0, 1e6),
                  "rope_local_base_freq": (100.0,),
                  "rope_parameters": ({"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},)}))
# Gemma 3 from 4B up: Gemma3ForConditionalGeneration, its text model nested, its language model's weights
# under language_model. (the checkpoints) or model.language_model. (transformers 5), a vision tower beside.
register_language_model("gemma3", "text_config", (("language_model.model.", "model."),
                                                   ("language_model.lm_head.", "lm_head."),
                                                   ("model.language_model.", "model.")))
