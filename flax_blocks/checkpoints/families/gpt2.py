"""GPT-2 (model_type gpt2): pre-LN layers under h.{i} with Conv1D weights stored (in, out), a fused
c_attn, learned positions (wpe) and a tied head."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, CLASSIC_READS, Dialect, Rule, linear, norm, register_dialect
from ..family import DROPOUT, Family, Outside, Read, read_activation, read_causal, read_sizes, register

HF_GPT2 = Dialect(
    "hf-gpt2", "Hugging Face GPT-2 (h.{i}.attn.c_attn.weight stored (in, out), ...)",
    layer="h.{i}.", final_norm="ln_f",
    rules=(
        *norm("norm1", "ln_1"),
        Rule("self_attn.in_proj_weight", ("attn.c_attn.weight",), transpose=True),
        Rule("self_attn.in_proj_bias", ("attn.c_attn.bias",)),
        *linear("self_attn.out_proj", "attn.c_proj", transpose=True),
        *norm("norm2", "ln_2"),
        *linear("linear1", "mlp.c_fc", transpose=True),
        *linear("linear2", "mlp.c_proj", transpose=True),
    ),
    ignore=("attn.bias", "attn.masked_bias"),  # the causal-mask buffers of old GPT-2 checkpoints
    settings={**CLASSIC, "norm": "pre"},
    reads=(*CLASSIC_READS, "causal"),
    outside="token and position embeddings (wte, wpe) and the LM head",
)
register_dialect(HF_GPT2)


def _gpt2(c: Read) -> dict[str, Any]:
    """GPT2Model: pre-LN, Conv1D weights, n_inner None -> 4 * n_embd."""
    if not c["scale_attn_weights"]:
        c.refuse("scale_attn_weights", "unscaled attention logits: the blocks scale by 1 / sqrt(head_dim)")
    if c["scale_attn_by_inverse_layer_idx"]:
        c.refuse("scale_attn_by_inverse_layer_idx", "a per-layer logit scale 1 / (layer + 1) the blocks lack")
    if c["add_cross_attention"]:
        c.refuse("add_cross_attention", "a decoder with cross-attention: only self-attention stacks are read")
    n_inner = c["n_inner"]
    out = read_sizes(c, "n_embd", "n_head", None, "n_layer")
    return {**out, "d_ff": int(n_inner) if n_inner is not None else 4 * out["d_model"],
            "activation": read_activation(c, "activation_function"), "layer_norm_eps": float(c["layer_norm_epsilon"]),
            "causal": read_causal(c), "final_norm": True}


register(Family("gpt2", "GPT2Config", "GPT2Model", "hf-gpt2",
           {"n_embd": 768, "n_head": 12, "n_inner": None, "n_layer": 12, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False, "is_causal": True, "vocab_size": 50257, "n_positions": 1024,
            "tie_word_embeddings": True},
           _gpt2,
           {"resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT, "attn_pdrop": DROPOUT,
            "reorder_and_upcast_attn": "computes the attention products in float32: the same function",
            **{k: "the sequence-summary head of GPT2DoubleHeadsModel, not loaded" for k in (
                "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                "summary_first_dropout")},
            "n_ctx": "an old name for n_positions that transformers no longer reads"},
           lm=("vocab_size", "n_positions", "tie_word_embeddings"),
           aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
                    "num_hidden_layers": "n_layer"},
           lm_class="GPT2LMHeadModel",
           outside=Outside("transformer.", "wte.weight", positions="wpe.weight", max_positions=("n_positions",)),
           draws={"activation_function": ("gelu", "gelu_pytorch_tanh", "relu", "gelu_new"), "n_inner": (40, None),
                  "scale_attn_weights": (True, False), "scale_attn_by_inverse_layer_idx": (False, True),
                  "reorder_and_upcast_attn": (True, False)}))
