"""GPT-BigCode (model_type gpt_bigcode: santacoder, StarCoder 1): GPT-2's pre-LN layers and names
(h.{i}.ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f, wte, wpe) held in
nn.Linear (out, in), not Conv1D, with multi-query attention: c_attn's rows are [q (n_embd); k
(head_dim); v (head_dim)], one key/value head shared by every query head; learned positions and
a tied head."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, CLASSIC_READS, Dialect, Rule, linear, norm, register_dialect
from ..family import DROPOUT, Family, Outside, Read, Reference, read_activation, read_causal, read_sizes, register

# c_attn rows [q; k; v] with one KV head: our in_proj's layout with num_kv_heads=1 (a rename).
HF_GPT_BIGCODE = Dialect(
    "hf-gpt-bigcode", "Hugging Face GPT-BigCode (h.{i}.attn.c_attn.weight (n_embd + 2 head_dim, n_embd): "
    "multi-query [q; k; v])",
    layer="h.{i}.", final_norm="ln_f",
    rules=(
        *norm("norm1", "ln_1"),
        Rule("self_attn.in_proj_weight", ("attn.c_attn.weight",)),
        Rule("self_attn.in_proj_bias", ("attn.c_attn.bias",)),
        *linear("self_attn.out_proj", "attn.c_proj"),
        *norm("norm2", "ln_2"),
        *linear("linear1", "mlp.c_fc"),
        *linear("linear2", "mlp.c_proj"),
    ),
    settings={**CLASSIC, "norm": "pre"},
    reads=(*CLASSIC_READS, "causal"),
    outside="token and position embeddings (wte, wpe) and the LM head",
    by_name=False,  # GPT-2's names, its matrices transposed: only model_type or dialect= chooses it
)
register_dialect(HF_GPT_BIGCODE)


def _gpt_bigcode(c: Read) -> dict[str, Any]:
    """GPTBigCodeModel: pre-LN, nn.Linear weights, multi_query -> one KV head (GPTBigCodeConfig
    sets num_key_value_heads = 1 if multi_query else n_head), n_inner None -> 4 * n_embd."""
    if not c["multi_query"]:
        c.refuse("multi_query", "c_attn viewed as (heads, 3 * head_dim) with q, k, v grouped per head: not read "
                                "(multi_query=True, santacoder's and StarCoder's layout, is)")
    if not c["scale_attn_weights"]:
        c.refuse("scale_attn_weights", "unscaled attention logits: the blocks scale by 1 / sqrt(head_dim)")
    if c["add_cross_attention"]:
        c.refuse("add_cross_attention", "a decoder with cross-attention: only self-attention stacks are read")
    n_inner = c["n_inner"]
    out = read_sizes(c, "n_embd", "n_head", None, "n_layer")
    if out["num_heads"] > 1:
        out["num_kv_heads"] = 1
    return {**out, "d_ff": int(n_inner) if n_inner is not None else 4 * out["d_model"],
            "activation": read_activation(c, "activation_function"), "layer_norm_eps": float(c["layer_norm_epsilon"]),
            "causal": read_causal(c), "final_norm": True}


_SOFTMAX = "the softmax's dtype: transformers 5's attention computes it in float32 whatever it says"
register(Family("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeModel", "hf-gpt-bigcode",
                {"n_embd": 768, "n_head": 12, "n_inner": None, "n_layer": 12,
                 "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
                 "multi_query": True, "add_cross_attention": False, "is_causal": True, "vocab_size": 50257,
                 "n_positions": 1024, "tie_word_embeddings": True},
                _gpt_bigcode,
                {"resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT, "attn_pdrop": DROPOUT,
                 "attention_softmax_in_fp32": _SOFTMAX, "scale_attention_softmax_in_fp32": _SOFTMAX,
                 "num_key_value_heads": "written by GPTBigCodeConfig from multi_query (1 or n_head), which is read",
                 **{k: "a sequence-summary head setting of GPT-2's configs; GPTBigCode has no such head" for k in (
                     "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                     "summary_first_dropout")}},
                lm=("vocab_size", "n_positions", "tie_word_embeddings"),
                aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                         "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
                lm_class="GPTBigCodeForCausalLM",
                outside=Outside("transformer.", "wte.weight", positions="wpe.weight", max_positions=("n_positions",)),
                reference=Reference(float32_inside=True),  # the eager softmax in float32
                draws={"activation_function": ("gelu_pytorch_tanh", "gelu", "gelu_new"), "n_inner": (40, None),
                       "multi_query": (True, False), "scale_attn_weights": (True, False)}))
