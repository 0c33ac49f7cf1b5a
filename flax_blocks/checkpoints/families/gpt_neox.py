"""GPT-NeoX (model_type gpt_neox: Pythia): q, k, v fused per head in query_key_value, rotary on
the first rotary_pct of each head, a parallel residual unless use_parallel_residual=False."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, CLASSIC_READS, Dialect, Rule, linear, norm, register_dialect
from ..family import (
    DECODER_INERT,
    DROPOUT,
    LM_ROTARY,
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
    rotary_head_dim,
)

# GPT-NeoX (Pythia): LayerNorm, a dense MLP, biases everywhere; q, k, v fused per head in
# query_key_value (per_head=3), rotary on the first rotary_pct of each head, and a parallel
# residual x + Attn(Norm1(x)) + MLP(Norm2(x)) unless use_parallel_residual=False.
HF_GPT_NEOX = Dialect(
    "hf-gpt-neox", "Hugging Face GPT-NeoX (layers.{i}.attention.query_key_value.weight, per head [q; k; v])",
    layer="layers.{i}.", final_norm="final_layer_norm",
    rules=(
        Rule("self_attn.in_proj_weight", ("attention.query_key_value.weight",), per_head=3),
        Rule("self_attn.in_proj_bias", ("attention.query_key_value.bias",), per_head=3),
        *linear("self_attn.out_proj", "attention.dense"),
        *linear("linear1", "mlp.dense_h_to_4h"),
        *linear("linear2", "mlp.dense_4h_to_h"),
        *norm("norm1", "input_layernorm"),
        *norm("norm2", "post_attention_layernorm"),
    ),
    ignore=("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"),  # old checkpoints' buffers
    settings={**{k: v for k, v in CLASSIC.items() if k not in ("rope_theta", "rope_scaling", "partial_rotary_factor",
                                                                 "parallel_residual", "bias", "mlp_bias", "norm_bias")},
              "norm": "pre"},
    reads=(*CLASSIC_READS, "rope_theta", "rope_scaling", "partial_rotary_factor", "parallel_residual", "bias",
           "mlp_bias",
           "norm_bias", "causal"),
    outside="token embeddings (embed_in), the rotary inv_freq buffer and the LM head (embed_out)",
)
register_dialect(HF_GPT_NEOX)


def _gpt_neox(c: Read) -> dict[str, Any]:
    """GPTNeoXModel: parallel residual (use_parallel_residual), partial rotary (GPTNeoXConfig
    reads the older rotary_pct / rotary_emb_base into rope_parameters), attention_bias on the
    attention's maps only."""
    attn = bool(c["attention_bias"])
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    rotary_head_dim(c, sizes["d_model"], sizes["num_heads"])
    return {**sizes, "activation": read_activation(c, "hidden_act"), "layer_norm_eps": float(c["layer_norm_eps"]),
            "parallel_residual": "two_norms" if c["use_parallel_residual"] else "none",
            "bias": attn, "mlp_bias": None if attn else True, "norm_bias": None if attn else True,
            "causal": read_causal(c),
            **read_rope(c, partial=c["rotary_pct"] if c.given("rotary_pct") else 0.25, theta_key="rotary_emb_base",
                    partial_key="rotary_pct", head_dim=sizes["d_model"] // sizes["num_heads"]),
            "final_norm": True}


register(Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXModel", "hf-gpt-neox",
           {k: v for k, v in rotary_defaults(hidden_size=6144, num_attention_heads=64, intermediate_size=24576,
                                             num_hidden_layers=44, hidden_act="gelu", layer_norm_eps=1e-5,
                                             use_parallel_residual=True, attention_bias=True, rotary_pct=0.25,
                                             rotary_emb_base=10000.0, head_dim=None, vocab_size=50432).items()
            if k != "rope_theta"},
           _gpt_neox, {**DECODER_INERT, "hidden_dropout": DROPOUT, "classifier_dropout": DROPOUT,
                       **{k: "GPTNeoXConfig reads rotary_emb_base / rotary_pct (or rope_parameters); a top-level "
                             f"{k} is never read" for k in ("rope_theta", "partial_rotary_factor")}},
           lm=LM_ROTARY,
           lm_class="GPTNeoXForCausalLM",
           outside=Outside("gpt_neox.", "embed_in.weight", head="embed_out."),  # the checkpoints' names
           reference=Reference(float32_inside=True),
           draws={"hidden_act": ("gelu_new", "gelu", "relu"), "use_parallel_residual": (False, True),
                  "attention_bias": (False, True)}))
