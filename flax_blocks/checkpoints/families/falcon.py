"""Falcon (model_type falcon: falcon-7b, falcon-40b / 180B, falcon-11B, falcon-rw-1b): LayerNorms
with biases, one fused query_key_value whose rows are grouped per key/value head ([the group's
queries; its key; its value]: one group for multi_query, one per head for the old layout,
num_kv_heads for new_decoder_architecture), `dense`, a dense MLP (dense_h_to_4h, dense_4h_to_h),
every linear map with a bias or none (`bias`); a parallel block over one shared input_layernorm
(parallel_attn, or new_decoder_architecture with num_ln_in_parallel_attn=1), over ln_attn and
ln_mlp (new_decoder_architecture), or a sequential pre-LN block (parallel_attn=False: input_ and
post_attention_layernorm); rotary on whole heads, or ALiBi (`alibi`); a final ln_f and a tied head."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, CLASSIC_READS, Dialect, Rule, linear, norm, register_dialect
from ..family import (
    DECODER_INERT,
    DROPOUT,
    Family,
    Outside,
    Read,
    Reference,
    read_activation,
    read_causal,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
)

_TWO = ("parallel_residual", "two_norms")
HF_FALCON = Dialect(
    "hf-falcon", "Hugging Face Falcon (h.{i}.self_attention.query_key_value.weight: rows per key/value head "
    "[its queries; k; v]; self_attention.dense, mlp.dense_h_to_4h / dense_4h_to_h; input_layernorm "
    "(+ post_attention_layernorm) or ln_attn / ln_mlp)",
    layer="h.{i}.", final_norm="ln_f",
    rules=(
        Rule("self_attn.in_proj_weight", ("self_attention.query_key_value.weight",), per_group=True),
        Rule("self_attn.in_proj_bias", ("self_attention.query_key_value.bias",), per_group=True),
        *linear("self_attn.out_proj", "self_attention.dense"),
        *linear("linear1", "mlp.dense_h_to_4h"),
        *linear("linear2", "mlp.dense_4h_to_h"),
        *(Rule(f"{ours}.{p}", (f"{theirs}.{p}",), only=_TWO) for ours, theirs in (("norm1", "ln_attn"),
                                                                                 ("norm2", "ln_mlp"))
          for p in ("weight", "bias")),
        *norm("norm1", "input_layernorm"),
        *norm("norm2", "post_attention_layernorm"),
    ),
    settings={**{k: v for k, v in CLASSIC.items() if k not in ("rope_theta", "rope_scaling", "parallel_residual",
                                                                 "bias", "mlp_bias", "norm_bias")},
              "norm": "pre"},
    reads=(*CLASSIC_READS, "rope_theta", "rope_scaling", "parallel_residual", "bias", "mlp_bias", "norm_bias",
           "causal", "alibi"),
    outside="token embeddings (word_embeddings), the rotary inv_freq buffer and the LM head (lm_head, tied)",
    by_name=False,  # BLOOM's names: only model_type or dialect= chooses it
)
register_dialect(HF_FALCON)


def _block(c: Read) -> str:
    """FalconDecoderLayer's block: which norms it builds and which its forward reads (a
    combination whose forward reads a norm it did not build fails in transformers: refused)."""
    new, parallel, n_ln = c["new_decoder_architecture"], c["parallel_attn"], c["num_ln_in_parallel_attn"]
    if new and n_ln is None:
        n_ln = 2  # FalconDecoderLayer's own default
    if new and not parallel:
        c.refuse("parallel_attn", "new_decoder_architecture with a sequential block: FalconDecoderLayer builds "
                                  "input_layernorm / post_attention_layernorm and its forward reads ln_attn or no "
                                  "MLP norm (transformers fails)")
    elif new and n_ln not in (1, 2):
        c.refuse("num_ln_in_parallel_attn", "1 or 2 norms in the new decoder architecture (transformers fails "
                                            "on another count)")
    elif parallel and not new and n_ln == 2:
        c.refuse("num_ln_in_parallel_attn", "two norms without new_decoder_architecture: FalconDecoderLayer builds "
                                            "ln_attn / ln_mlp and its forward reads input_layernorm (transformers "
                                            "fails)")
    if not parallel and not new:
        return "none"
    return "two_norms" if new and n_ln == 2 else "shared_norm"


def _heads(c: Read, heads: int) -> int | None:
    """FalconAttention's key/value heads: num_kv_heads groups (new_decoder_architecture), one
    (multi_query), else one per query head (num_kv_heads must then equal the heads)."""
    kv = c["num_kv_heads"]
    kv = heads if kv is None else int(kv)
    if c["new_decoder_architecture"]:
        if kv <= 0 or heads % kv:
            c.refuse("num_kv_heads", f"{kv} key/value groups do not divide {heads} query heads (transformers fails)")
            return None
        return None if kv == heads else kv
    if c["multi_query"]:
        return 1 if heads > 1 else None
    if kv != heads:
        c.refuse("num_kv_heads", f"{kv} key/value heads beside multi_query=False in the old layout: its "
                                 f"query_key_value holds {heads} (transformers fails reshaping them)")
    return None


def _falcon(c: Read) -> dict[str, Any]:
    """FalconModel: LayerNorms (eps layer_norm_epsilon) with biases, `bias` on every linear map,
    head_dim hidden_size (or n_embed) // num_attention_heads, ffn_hidden_size (None: 4 * hidden_size), the
    block from new_decoder_architecture / parallel_attn / num_ln_in_parallel_attn, rotary on
    whole heads (rope_parameters), or ALiBi's biases instead (alibi: no rotary at all)."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", None, "num_hidden_layers")
    if c["n_embed"] is not None:  # FalconConfig.__post_init__: the older n_embed wins over hidden_size
        sizes["d_model"] = int(c["n_embed"])
    d, h = sizes["d_model"], sizes["num_heads"]
    if d % h:
        c.refuse("hidden_size", f"{d} is not divisible by num_attention_heads={h} (FalconAttention fails)")
        return {**sizes, "final_norm": True}
    ff = c["ffn_hidden_size"]
    b = bool(c["bias"])
    alibi = bool(c["alibi"])  # FalconConfig.rotary is `not alibi`: one or the other
    return {**sizes, "num_kv_heads": _heads(c, h), "d_ff": int(ff) if ff is not None else 4 * d,
            "activation": read_activation(c, "activation"), "layer_norm_eps": float(c["layer_norm_epsilon"]),
            "parallel_residual": _block(c), "bias": b, "mlp_bias": None, "norm_bias": None if b else True,
            "causal": read_causal(c), "alibi": alibi,
            **({"rope_theta": None} if alibi else read_rope(c, head_dim=d // h)), "final_norm": True}


register(Family("falcon", "FalconConfig", "FalconModel", "hf-falcon",
                {**rotary_defaults(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                                   tie_word_embeddings=True),
                 "num_ln_in_parallel_attn": None, "layer_norm_epsilon": 1e-5, "num_kv_heads": None, "alibi": False,
                 "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True, "bias": False,
                 "ffn_hidden_size": None, "activation": "gelu", "n_embed": None},
                _falcon, {**DECODER_INERT, "hidden_dropout": DROPOUT},
                lm=("vocab_size", "tie_word_embeddings"),
                lm_class="FalconForCausalLM", outside=Outside("transformer.", "word_embeddings.weight"),
                # rotary's cos / sin in float32; the eager path adds ALiBi twice (SDPA, the default, once)
                reference=Reference(float32_inside=True, sdpa=True),
                draws={"new_decoder_architecture": (False, True), "multi_query": (True, False),
                       "parallel_attn": (True, False), "num_ln_in_parallel_attn": (None, 1, 2),
                       "num_kv_heads": (None, 2), "bias": (False, True), "alibi": (False, True),
                       "activation": ("gelu", "gelu_pytorch_tanh", "relu")}))
