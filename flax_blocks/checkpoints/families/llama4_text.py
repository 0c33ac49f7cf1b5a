"""Llama 4's text model (model_type llama4_text: Llama4TextModel, Llama4ForCausalLM): LLaMA's attention
and norms, its MLP under feed_forward; rotary as complex pairs (adjacent dims, rope_interleaved) in the
layers no_rope_layers marks 1, every no_rope_layer_interval-th (4th) layer without (NoPE), whose queries
attn_temperature_tuning tempers by their slot (floor_scale, attn_scale); the rotary layers' q and k over
their RMS after rotary (use_qk_norm); chunked attention (attention_chunk_size) in the layers layer_types
marks "chunked_attention" (by default the rotary ones), the chunks counted from each row's first real
token. Not computed yet, refused by name: its experts (moe_layers, by default every layer); so a published
Scout / Maverick config is refused, a dense one loads."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    LLAMA_ATTENTION_NORMS,
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_SETTINGS,
    Dialect,
    linear,
    register_dialect,
)
from ..family import Family, Outside, Read, Reference, register
from ..readers import (
    DECODER_INERT,
    LM_ROTARY,
    MOE_TRAINING,
    explicit_head_dim,
    read_causal,
    read_nope_layers,
    read_rope,
    read_sizes,
    rotary_defaults,
    silu_only,
)

HF_LLAMA4 = Dialect(
    "hf-llama4", "Hugging Face Llama 4 text (LLaMA's attention and norms, feed_forward.gate_proj / up_proj / "
                 "down_proj)",
    layer="layers.{i}.", final_norm="norm",
    rules=(*LLAMA_ATTENTION_NORMS, *linear("linear_gate", "feed_forward.gate_proj"),
           *linear("linear1", "feed_forward.up_proj"), *linear("linear2", "feed_forward.down_proj")),
    settings={**{k: v for k, v in LLAMA_SETTINGS.items() if k != "mlp_bias"},
              "rope_interleaved": True, "sliding_window": None, "sliding_window_pattern": None, "qkv_bias": None},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal",
           "nope_layers", "query_temperature_floor", "query_temperature_scale", "qk_l2_norm", "attention_chunk_size",
           "unchunked_layers"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_LLAMA4)



def _experts_not_yet(c: Read, n: int) -> None:
    """Llama 4's experts, which the blocks do not compute yet: refused by name."""
    moe = c["moe_layers"]
    if moe is None:
        step = c["interleave_moe_layer_step"]
        moe = list(range(step - 1, n, step)) if isinstance(step, int) and step > 0 else [0]
    if list(moe):
        c.refuse("moe_layers" if c["moe_layers"] is not None else "interleave_moe_layer_step",
                 f"experts in layers {list(moe)}: a top-1 router whose sigmoid score multiplies the expert's input, "
                 "beside an ungated shared expert, which the blocks do not compute yet (moe_layers=[] loads dense "
                 "layers of intermediate_size_mlp)")


def _chunks(c: Read, n: int, nope: tuple[int, ...]) -> dict[str, Any]:
    """Chunked attention: layer_types (Llama4TextConfig's default: "chunked_attention" in the rotary layers when
    attention_chunk_size is set, else "full_attention") -> attention_chunk_size and unchunked_layers (the
    "full_attention" layers, from 0); no chunked layer: none."""
    size, given = c["attention_chunk_size"], c["layer_types"]
    types = list(given) if given else ["chunked_attention" if i not in nope and size is not None else "full_attention"
                                       for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "chunked_attention"}:
        c.refuse("layer_types", f"one of 'full_attention' or 'chunked_attention' for each of the {n} layers "
                                "(Llama4TextModel builds no other mask)")
        return {}
    if "chunked_attention" not in types:
        return {}
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        c.refuse("attention_chunk_size", "a positive int: layer_types names chunked layers (transformers' "
                                         "create_chunked_causal_mask raises without one)")
        return {}
    if not read_causal(c):  # create_chunked_causal_mask never reads is_causal; create_causal_mask does
        c.refuse("is_causal", "True with chunked layers: transformers keeps them causal and makes the full layers "
                              "bidirectional, a mix the blocks do not compute")
        return {}
    return {"attention_chunk_size": size,
            "unchunked_layers": tuple(i for i, t in enumerate(types) if t == "full_attention")}


def _temperature(c: Read, nope: tuple[int, ...]) -> dict[str, Any]:
    """attn_temperature_tuning in the NoPE layers: floor_scale, attn_scale (none without a NoPE layer)."""
    if not c["attn_temperature_tuning"] or not nope:
        return {}
    floor, scale = c["floor_scale"], c["attn_scale"]
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0:
        c.refuse("floor_scale", "a positive number (the slots are divided by it)")
        return {}
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        c.refuse("attn_scale", "a number")
        return {}
    return {"query_temperature_floor": float(floor), "query_temperature_scale": float(scale)}


def _llama4_text(c: Read) -> dict[str, Any]:
    """Llama4TextModel with dense layers only: LLaMA's attention (attention_bias on q, k, v and o) and
    RMSNorms (rms_norm_eps), a SwiGLU of intermediate_size_mlp under feed_forward, rotary on adjacent
    pairs outside the NoPE layers (there the L2 QK-norm, eps rms_norm_eps), the NoPE layers' query
    temperature."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size_mlp", "num_hidden_layers",
                       "num_key_value_heads")
    n = sizes["num_layers"]
    nope = read_nope_layers(c, n, config_class="Llama4TextConfig", empty_is_default=True)
    _experts_not_yet(c, n)
    head = explicit_head_dim(c, sizes["d_model"], sizes["num_heads"])
    width = head.get("head_dim", sizes["d_model"] // sizes["num_heads"])
    attn = bool(c["attention_bias"])
    return {**sizes, **head, **silu_only(c, "hidden_act"), "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn,
            "mlp_bias": False if attn else None, "causal": read_causal(c),
            "qk_l2_norm": bool(c["use_qk_norm"]) and len(nope) < n,  # Llama4TextL2Norm: the rotary layers alone
            **read_rope(c, default_theta=500000.0, head_dim=width), "nope_layers": nope, **_temperature(c, nope),
            **_chunks(c, n, nope), "final_norm": True}


register(Family("llama4_text", "Llama4TextConfig", "Llama4TextModel", "hf-llama4",
                rotary_defaults(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                                intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                                num_key_value_heads=8, head_dim=128, hidden_act="silu",
                                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                                moe_layers=None, interleave_moe_layer_step=1, use_qk_norm=True,
                                no_rope_layers=None, no_rope_layer_interval=4, attention_chunk_size=8192,
                                layer_types=None, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                                attention_bias=False),
                _llama4_text, {**DECODER_INERT, **MOE_TRAINING,
                               "router_jitter_noise": "a training-time jitter of the router (unused in eval)",
                               **{k: "read by the experts (moe_layers), refused until computed: nothing without them"
                                  for k in ("num_local_experts", "num_experts_per_tok")}},
                lm=LM_ROTARY, lm_class="Llama4ForCausalLM", outside=Outside("model.", "embed_tokens.weight"),
                reference=Reference(float32_inside=True),  # RMSNorm, rotary and the temperature in float32
                draws={"moe_layers": ([],), "intermediate_size_mlp": (24, 40), "use_qk_norm": (False, True),
                       "attention_chunk_size": (None, 2, 4, 8192),
                       "no_rope_layers": ([1, 0, 1], [0, 1, 1]), "no_rope_layer_interval": (2, 4),
                       "attn_temperature_tuning": (True, False), "floor_scale": (2, 8192), "attn_scale": (0.5, 0.1),
                       "attention_bias": (False, True)}))
