"""StableLM (model_type stablelm): LLaMA's names with LayerNorms (their biases kept), q/k/v biases
with use_qkv_bias, rotary on a quarter of each head by default, one shared norm with
use_parallel_residual."""

from __future__ import annotations

from typing import Any

from ..dialects import LLAMA_NAMED, LLAMA_OUTSIDE, LLAMA_RULES, LLAMA_SETTINGS, Dialect, register_dialect
from ..family import (
    DECODER_INERT,
    DROPOUT,
    LM_ROTARY,
    Family,
    Read,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    rotary_head_dim,
    silu_only,
)
from .llama import LLAMA_LIKE, LLAMA_REFERENCE

# StableLM: LLaMA's names with LayerNorms (biases kept while the linear maps have none: norm_bias),
# q/k/v biases with use_qkv_bias, rotary on the first partial_rotary_factor (0.25) of each head, and
# with use_parallel_residual one shared norm, x + Attn(Norm(x)) + MLP(Norm(x)), no
# post_attention_layernorm. qk_layernorm (a LayerNorm of its own per head) is refused.
HF_STABLELM = Dialect(
    "hf-stablelm", "Hugging Face StableLM (LLaMA's names, LayerNorms with biases)",
    layer="layers.{i}.", final_norm="norm", rules=LLAMA_RULES,
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**{k: v for k, v in LLAMA_SETTINGS.items() if k not in ("partial_rotary_factor", "parallel_residual")},
              "norm_type": "layernorm", "bias": False, "mlp_bias": None, "norm_bias": True,
              "sliding_window": None, "sliding_window_pattern": None},
    reads=("layer_norm_eps", "num_kv_heads", "rope_theta", "rope_scaling", "partial_rotary_factor",
           "parallel_residual", "qkv_bias",
           "causal"),
    outside=LLAMA_OUTSIDE, shared_by=LLAMA_NAMED,
)
register_dialect(HF_STABLELM)


def _stablelm(c: Read) -> dict[str, Any]:
    """StableLmModel: LayerNorms, q/k/v biases (use_qkv_bias), partial rotary, one shared norm
    with use_parallel_residual; qk_layernorm refused."""
    if c["qk_layernorm"]:
        c.refuse("qk_layernorm", "a LayerNorm of its own for each head of q and k; the blocks' QK-norm is one "
                                 "scale-only norm shared by the heads")
    if not c["is_causal"]:
        c.refuse("is_causal", "StableLM's layers do not pass is_causal on: transformers computes it "
                              "bidirectional under eager attention and causal under SDPA without padding")
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    rotary_head_dim(c, sizes["d_model"], sizes["num_heads"])
    return {**sizes, **silu_only(c, "hidden_act"), "layer_norm_eps": float(c["layer_norm_eps"]),
            "qkv_bias": bool(c["use_qkv_bias"]),
            "parallel_residual": "shared_norm" if c["use_parallel_residual"] else "none", "causal": read_causal(c),
            **read_rope(c, partial=0.25, partial_key="partial_rotary_factor",
                    head_dim=sizes["d_model"] // sizes["num_heads"]), "final_norm": True}


register(Family("stablelm", "StableLmConfig", "StableLmModel", "hf-stablelm",
           rotary_defaults(max_position_embeddings=4096, hidden_size=2560, num_attention_heads=32,
                           num_key_value_heads=32, intermediate_size=6912, num_hidden_layers=32, hidden_act="silu",
                           layer_norm_eps=1e-5, use_qkv_bias=False, qk_layernorm=False, use_parallel_residual=False,
                           partial_rotary_factor=0.25, head_dim=None, vocab_size=50304),
           _stablelm, {**DECODER_INERT, "hidden_dropout": DROPOUT}, lm=LM_ROTARY,
           lm_class="StableLmForCausalLM", outside=LLAMA_LIKE, reference=LLAMA_REFERENCE,
           draws={"use_qkv_bias": (True, False), "use_parallel_residual": (True, False),
                  "qk_layernorm": (False, True)}))
