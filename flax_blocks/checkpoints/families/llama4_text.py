"""Llama 4's text model (model_type llama4_text: Llama4TextModel, Llama4ForCausalLM; the language model of
model_type llama4, Llama4ForConditionalGeneration: Scout, Maverick): LLaMA's attention and norms; rotary as
complex pairs (adjacent dims, rope_interleaved) in the layers no_rope_layers marks 1, every
no_rope_layer_interval-th (4th) layer without (NoPE), whose queries attn_temperature_tuning tempers by their
slot (floor_scale, attn_scale); the rotary layers' q and k over their RMS after rotary (use_qk_norm); chunked
attention (attention_chunk_size) in the layers layer_types marks "chunked_attention" (by default the rotary
ones), the chunks counted from each row's first real token. The layers
of moe_layers (by default every interleave_moe_layer_step-th) run Llama4TextMoe: a router Linear(hidden,
num_local_experts), the top num_experts_per_tok logits, each expert's input times its logit's sigmoid
(routing "llama4", routing_weights_on "input"), experts as fused gate_up_proj (X, hidden, 2 intermediate_size:
gate then up) and down_proj (X, intermediate_size, hidden), plus an ungated shared SwiGLU of intermediate_size;
the other layers a SwiGLU of intermediate_size_mlp (feed_forward.gate_proj ...)."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    EXPERTS_READS,
    LLAMA_ATTENTION_NORMS,
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_SETTINGS,
    Dialect,
    Rule,
    linear,
    register_dialect,
)
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    MOE_TRAINING,
    Family,
    Outside,
    Read,
    Reference,
    explicit_head_dim,
    read_causal,
    read_experts,
    read_nope_layers,
    read_rope,
    read_sizes,
    register,
    register_language_model,
    rotary_defaults,
    silu_only,
)

# Llama4TextMoe: feed_forward.router (X, E); the experts' fused tensors stored (X, in, out), gate_up_proj's last
# axis [gate | up] (ours (X, F, E) each, once transposed: halves along axis 1); the shared expert as nn.Linear.
LLAMA4_EXPERTS = (
    Rule("experts.router", ("feed_forward.router.weight",)),
    Rule("experts.gate", ("feed_forward.experts.gate_up_proj",), transpose=True, chunk=(0, 2), axis=1),
    Rule("experts.up", ("feed_forward.experts.gate_up_proj",), transpose=True, chunk=(1, 2), axis=1),
    Rule("experts.down", ("feed_forward.experts.down_proj",), transpose=True),
    *linear("experts.shared_gate", "feed_forward.shared_expert.gate_proj"),
    *linear("experts.shared_up", "feed_forward.shared_expert.up_proj"),
    *linear("experts.shared_down", "feed_forward.shared_expert.down_proj"),
)

HF_LLAMA4 = Dialect(
    "hf-llama4", "Hugging Face Llama 4 text (LLaMA's attention and norms, feed_forward.gate_proj / up_proj / "
                 "down_proj in the dense layers; feed_forward.router, the fused feed_forward.experts.gate_up_proj "
                 "(X, E, 2F) and down_proj (X, F, E), feed_forward.shared_expert in the experts layers)",
    layer="layers.{i}.", final_norm="norm",
    rules=(*LLAMA_ATTENTION_NORMS, *linear("linear_gate", "feed_forward.gate_proj"),
           *linear("linear1", "feed_forward.up_proj"), *linear("linear2", "feed_forward.down_proj"),
           *LLAMA4_EXPERTS),
    settings={**{k: v for k, v in LLAMA_SETTINGS.items() if k != "mlp_bias"},
              "rope_interleaved": True, "sliding_window": None, "sliding_window_pattern": None, "qkv_bias": None,
              "routing": "llama4", "routing_weights_on": "input", "norm_topk_prob": False,
              "shared_expert_gate": False},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "mlp_bias", "causal",
           "nope_layers", "query_temperature_floor", "query_temperature_scale", "qk_l2_norm", "attention_chunk_size",
           "unchunked_layers", *(k for k in EXPERTS_READS if k != "norm_topk_prob")),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_LLAMA4)


def _experts(c: Read, n: int) -> dict[str, Any]:
    """Llama4TextConfig.__post_init__'s moe_layers (given, else range(step - 1, n, step) of
    interleave_moe_layer_step): those layers run Llama4TextMoe (num_local_experts experts of width
    intermediate_size, the top num_experts_per_tok, an ungated shared expert of intermediate_size), the
    others a SwiGLU of intermediate_size_mlp (d_ff). A layer is one of them iff layer_idx in moe_layers."""
    given = c["moe_layers"]
    if given is None:
        step = c["interleave_moe_layer_step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            c.refuse("interleave_moe_layer_step", "a step of 1 or more (the experts layers are range(step - 1, "
                                                  "num_hidden_layers, step))")
            return {}
        moe, pattern = set(range(step - 1, n, step)), {"decoder_sparse_step": step, "mlp_only_layers": ()}
    else:
        if not isinstance(given, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in given):
            c.refuse("moe_layers", "a list of layer indices (from 0)")
            return {}
        moe = {i for i in given if 0 <= i < n}  # other entries name no layer
        pattern = {"decoder_sparse_step": 1, "mlp_only_layers": tuple(i for i in range(n) if i not in moe)}
    if not moe:
        return {"num_experts": 0}
    experts = read_experts(c, "num_local_experts", expert_width="intermediate_size", shared="intermediate_size",
                           norm=None)
    if not experts.get("num_experts"):
        c.refuse("num_local_experts", f"no experts in the experts layers {sorted(moe)} (transformers' router "
                                      "takes the top k of zero logits and fails)")
        return {}
    return {**experts, **pattern}


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
    """Llama4TextModel: LLaMA's attention (attention_bias on q, k, v and o) and RMSNorms (rms_norm_eps),
    under feed_forward the experts (`_experts`) or a SwiGLU of intermediate_size_mlp, rotary on adjacent
    pairs outside the NoPE layers (there the L2 QK-norm, eps rms_norm_eps), the NoPE layers' query
    temperature, chunked attention (`_chunks`)."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size_mlp", "num_hidden_layers",
                       "num_key_value_heads")
    n = sizes["num_layers"]
    nope = read_nope_layers(c, n, config_class="Llama4TextConfig", empty_is_default=True)
    head = explicit_head_dim(c, sizes["d_model"], sizes["num_heads"])
    width = head.get("head_dim", sizes["d_model"] // sizes["num_heads"])
    attn = bool(c["attention_bias"])
    return {**sizes, **head, **silu_only(c, "hidden_act"), "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn,
            "mlp_bias": False if attn else None, "causal": read_causal(c),
            "qk_l2_norm": bool(c["use_qk_norm"]) and len(nope) < n,  # Llama4TextL2Norm: the rotary layers alone
            **read_rope(c, default_theta=500000.0, head_dim=width), "nope_layers": nope, **_temperature(c, nope),
            **_experts(c, n), **_chunks(c, n, nope), "final_norm": True}


register(Family("llama4_text", "Llama4TextConfig", "Llama4TextModel", "hf-llama4",
                rotary_defaults(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                                intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                                num_key_value_heads=8, head_dim=128, hidden_act="silu",
                                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                                moe_layers=None, interleave_moe_layer_step=1, use_qk_norm=True,
                                no_rope_layers=None, no_rope_layer_interval=4, attention_chunk_size=8192,
                                layer_types=None, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                                attention_bias=False, num_local_experts=16, num_experts_per_tok=1),
                _llama4_text, {**DECODER_INERT, **MOE_TRAINING,
                               "router_jitter_noise": "never read by Llama4TextModel (its router adds no jitter)"},
                lm=LM_ROTARY, lm_class="Llama4ForCausalLM", outside=Outside("model.", "embed_tokens.weight"),
                reference=Reference(float32_inside=True),  # RMSNorm, rotary and the temperature in float32
                draws={"moe_layers": ([], [1], [0, 1]), "interleave_moe_layer_step": (1, 2),
                       "num_local_experts": (2, 4), "num_experts_per_tok": (1, 2), "intermediate_size": (16, 24),
                       "intermediate_size_mlp": (24, 40), "use_qk_norm": (False, True),
                       "attention_chunk_size": (None, 2, 4, 8192),
                       "no_rope_layers": ([1, 0, 1], [0, 1, 1]), "no_rope_layer_interval": (2, 4),
                       "attn_temperature_tuning": (True, False), "floor_scale": (2, 8192), "attn_scale": (0.5, 0.1),
                       "attention_bias": (False, True)}))
# Scout and Maverick as published: Llama4ForConditionalGeneration (model_type llama4), the text model's config
# nested (text_config), its language model's weights under language_model., a vision tower and projector beside
# (left unread, noted in the load report).
register_language_model("llama4", "text_config", (("language_model.model.", "model."),
                                                  ("language_model.lm_head.", "lm_head.")))
