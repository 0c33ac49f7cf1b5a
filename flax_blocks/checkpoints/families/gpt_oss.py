"""GPT-OSS (model_type gpt_oss, openai/gpt-oss-20b and -120b): LLaMA's layer names with biases on q, k,
v and o (attention_bias), a learned sink logit per head in every softmax (self_attn.sinks), local and
global layers alternating by layer_types (sliding_window), yarn rotary by default, and every MLP a
mixture of num_local_experts experts: a router with a bias (mlp.router), the top num_experts_per_tok
of its logits then a softmax over those k (= the top k of the softmax, renormalised), each expert a
clamped SwiGLU with biases whose fused gate_up_proj (X, E, 2F) interleaves gate and up column by
column (gate = [..., ::2], up = [..., 1::2]); the experts keep (X, in, out), not nn.Linear's (out, in)."""

from __future__ import annotations

from typing import Any

from ..dialects import (
    LLAMA_ATTENTION_NORMS,
    LLAMA_NAMED,
    LLAMA_OUTSIDE,
    LLAMA_SETTINGS,
    WINDOWS,
    Dialect,
    Rule,
    register_dialect,
)
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    MOE_TRAINING,
    Family,
    Read,
    Reference,
    explicit_head_dim,
    read_causal,
    read_experts,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    window_pattern,
)
from .llama import LLAMA_LIKE


def _interleaved(ours: tuple[str, str], theirs: str, transpose: bool) -> tuple[Rule, ...]:
    """Our gate and up from their fused tensor whose last axis alternates gate, up, gate, up ..."""
    axis = 1  # (X, 2F, E) once transposed; the biases (X, 2F)
    return tuple(Rule(o, (theirs,), transpose, chunk=(i, 2), axis=axis, interleave=True) for i, o in enumerate(ours))


GPT_OSS_EXPERTS = (
    Rule("experts.router", ("mlp.router.weight",)),
    Rule("experts.router_bias", ("mlp.router.bias",)),
    *_interleaved(("experts.gate", "experts.up"), "mlp.experts.gate_up_proj", transpose=True),
    *_interleaved(("experts.gate_bias", "experts.up_bias"), "mlp.experts.gate_up_proj_bias", transpose=False),
    Rule("experts.down", ("mlp.experts.down_proj",), transpose=True),
    Rule("experts.down_bias", ("mlp.experts.down_proj_bias",)),
)

HF_GPT_OSS = Dialect(
    "hf-gpt-oss", "Hugging Face GPT-OSS (LLaMA's attention names with self_attn.sinks, mlp.router, the fused "
                  "mlp.experts.gate_up_proj (X, E, 2F) gate and up interleaved, mlp.experts.down_proj (X, F, E))",
    layer="layers.{i}.", final_norm="norm",
    rules=(*LLAMA_ATTENTION_NORMS, Rule("self_attn.sinks", ("self_attn.sinks",)), *GPT_OSS_EXPERTS),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**LLAMA_SETTINGS, "qkv_bias": None, "attn_sinks": True, "experts_bias": True, "norm_topk_prob": True,
              "shared_expert_d_ff": 0, "decoder_sparse_step": 1, "mlp_only_layers": ()},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "bias", "causal", *WINDOWS, "num_experts",
           "num_experts_per_tok", "expert_d_ff", "swiglu_limit", "swiglu_alpha"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_GPT_OSS)

# GptOssConfig.__post_init__'s rotary when the file gives none (rope_theta: its default_theta, 150000)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def _gpt_oss(c: Read) -> dict[str, Any]:
    """GptOssModel: RMSNorm (rms_norm_eps), q/k/v/o biases (attention_bias), sinks on every layer, layer
    i local iff layer_types[i] is "sliding_attention" (default: the even i, from 0) with the window
    sliding_window, rotary as GptOssConfig standardises it (rope_scaling, else rope_parameters, else its
    yarn x32), and the experts: num_local_experts (alias num_experts) of width intermediate_size, the top
    num_experts_per_tok, each a SwiGLU clamped at swiglu_limit with gain swiglu_alpha. hidden_act is never
    read (the experts compute their own activation)."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                       "num_key_value_heads")
    n = sizes["num_layers"]
    types = c["layer_types"] or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    given = c["rope_scaling"] or c["rope_parameters"]
    rope = read_rope(c, default_theta=150000.0, params=given or GPT_OSS_ROPE,
                     source=("rope_scaling" if c["rope_scaling"] else "rope_parameters") if given else
                     "rope_parameters (GptOssConfig's default)")
    experts = read_experts(c, "num_local_experts", norm=None)
    if not experts.get("num_experts"):
        c.refuse("num_local_experts", "no experts: GPT-OSS's every MLP is its router and experts (transformers' "
                                      "top-k over zero experts fails)")
        return {}
    limit = float(c["swiglu_limit"])
    if not limit > 0:
        c.refuse("swiglu_limit", "a clamp at or below 0 leaves the gate no positive value (the blocks take a "
                                 "limit > 0)")
    return {**sizes, **explicit_head_dim(c, sizes["d_model"], sizes["num_heads"]), "mlp": "swiglu",
            "activation": "silu", "layer_norm_eps": float(c["rms_norm_eps"]), "bias": bool(c["attention_bias"]),
            "causal": read_causal(c), **rope, **window_pattern(c, list(types), c["sliding_window"], n),
            **experts, "norm_topk_prob": True, "attn_sinks": True, "experts_bias": True, "swiglu_limit": limit,
            "swiglu_alpha": float(c["swiglu_alpha"]), "final_norm": True}


register(Family("gpt_oss", "GptOssConfig", "GptOssModel", "hf-gpt-oss",
                rotary_defaults(max_position_embeddings=131072, hidden_size=2880, num_attention_heads=64,
                                num_key_value_heads=8, intermediate_size=2880, num_hidden_layers=36, head_dim=64,
                                rms_norm_eps=1e-5, sliding_window=128, layer_types=None, num_local_experts=128,
                                num_experts_per_tok=4, swiglu_limit=7.0, swiglu_alpha=1.702, attention_bias=True,
                                rope_theta=150000.0, vocab_size=201088),
                _gpt_oss, {**DECODER_INERT, **MOE_TRAINING,
                           "hidden_act": "GptOssModel never reads it (its experts compute the clamped SwiGLU)",
                           "experts_per_token": "an alias of num_experts_per_tok in OpenAI's files that "
                                                "GptOssConfig does not read"},
                lm=LM_ROTARY, aliases={"num_experts": "num_local_experts"},
                lm_class="GptOssForCausalLM", outside=LLAMA_LIKE, reference=Reference(float32_inside=True),
                draws={"sliding_window": (2, 4, 128), "num_local_experts": (2, 4, 8),
                       "num_experts_per_tok": (1, 2), "swiglu_limit": (0.5, 1.0, 7.0), "swiglu_alpha": (1.0, 1.702),
                       "attention_bias": (True, False), "layer_types": ("pattern",)}))
