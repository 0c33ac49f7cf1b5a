"""Phi-3 (model_type phi3): LLaMA's layers with q, k, v fused in qkv_proj and gate, up in
gate_up_proj; rotary on a partial_rotary_factor of each head (Phi-4-mini), longrope (Phi-3.5)
whose generate recomputes every key past the original length; every layer local with a window."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..dialects import WINDOWS, Dialect, Rule, fused, linear, norm, register_dialect
from ..family import (
    DECODER_INERT,
    DROPOUT,
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

# Phi-3: LLaMA's layers with q/k/v fused into qkv_proj (rows [q; k; v], our in_proj layout: a
# rename) and gate/up fused into gate_up_proj (rows [gate; up]: split into linear_gate, linear1).
HF_PHI3 = Dialect(
    "hf-phi3", "Hugging Face Phi-3 (layers.{i}.self_attn.qkv_proj.weight, mlp.gate_up_proj.weight, ...)",
    layer="layers.{i}.", final_norm="norm",
    rules=(
        Rule("self_attn.in_proj_weight", ("self_attn.qkv_proj.weight",)),
        *linear("self_attn.out_proj", "self_attn.o_proj"),
        *fused("mlp.gate_up_proj.weight", "linear_gate.weight", "linear1.weight"),
        *linear("linear2", "mlp.down_proj"),
        *norm("norm1", "input_layernorm"),
        *norm("norm2", "post_attention_layernorm"),
    ),
    settings={"norm": "pre", "norm_type": "rmsnorm", "mlp": "swiglu", "activation": "silu",
              "scaling": "none", "residual": "add", "qk_norm": False, "layernorm_scaling": False, "bias": False,
              "qkv_bias": None, "norm_weight_offset": 0.0, "parallel_residual": "none",
              "attn_logit_softcapping": None, "query_pre_attn_scalar": None, "rope_local_theta": None,
              "mlp_bias": None, "norm_bias": None, "rope_interleaved": False, "rope_local_only": False},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "partial_rotary_factor", "causal",
           *WINDOWS),
    outside="token embeddings (embed_tokens), the rotary inv_freq buffer and the LM head",
)
register_dialect(HF_PHI3)


def _phi3(c: Read) -> dict[str, Any]:
    """Phi3Model: fused qkv and gate_up, no biases, rotary on the first partial_rotary_factor
    of each head (Phi3Config keeps it in rope_parameters), every layer local with a window."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), **silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "causal": read_causal(c),
            **read_rope(c, partial=1.0, partial_key="partial_rotary_factor",
                    head_dim=int(c["head_dim"] or sizes["d_model"] // sizes["num_heads"]), **phi3_rope(c)),
            **every_layer_local(c, c["sliding_window"], sizes["num_layers"]), "final_norm": True}


def phi3_rope(c: Read) -> dict[str, Any]:
    """Phi3Config's own rope reading: the older "su" and "yarn" types are longrope, any type
    but default and longrope is refused by transformers, and the top-level
    original_max_position_embeddings (a field of Phi3Config) replaces the dict's."""
    source = "rope_scaling" if c["rope_scaling"] else "rope_parameters"
    params = dict(c["rope_scaling"] or c["rope_parameters"] or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "longrope":  # standardize_rope_params: Phi3Config's own field replaces the dict's
        params["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    renamed = kind in ("su", "yarn")
    if renamed:  # renamed after standardize_rope_params: the dict's own original length only
        params["rope_type"] = kind = "longrope"
    if kind not in ("default", "longrope"):
        c.refuse(source, f"rope_type {kind!r}: Phi3Config accepts default and longrope only (transformers refuses "
                         "the config)")
        params = {}
    return {"params": params, "source": source, "original_default": not renamed}


register(Family("phi3", "Phi3Config", "Phi3Model", "hf-phi3",
           rotary_defaults(max_position_embeddings=4096, hidden_size=3072, num_attention_heads=32,
                           num_key_value_heads=None, intermediate_size=8192, num_hidden_layers=32, hidden_act="silu",
                           rms_norm_eps=1e-5, partial_rotary_factor=1.0, sliding_window=None, layer_types=None,
                           head_dim=None, vocab_size=32064, original_max_position_embeddings=4096),
           _phi3, {**DECODER_INERT, "resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT,
                   },
           lm=LM_ROTARY,
           lm_class="Phi3ForCausalLM", outside=replace(LLAMA_LIKE, recompute_past_original=True),
           reference=LLAMA_REFERENCE, draws={"sliding_window": (2, 4, 16, None), "layer_types": ("pattern",)}))
