"""OPT (model_type opt): layers under decoder.layers.{i}, pre-LN or post-LN by do_layer_norm_before
(OPT-350m: post-LN, and embeddings narrower than the stack projected in and out), learned
positions offset by 2."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, Dialect, linear, norm, qkv, register_dialect
from ..family import DROPOUT, INIT, Family, Outside, Read, Reference, read_activation, read_causal, read_sizes, register

HF_OPT = Dialect(
    "hf-opt", "Hugging Face OPT (decoder.layers.{i}.self_attn.q_proj.weight, fc1, final_layer_norm, ...)",
    layer="decoder.layers.{i}.", final_norm="decoder.final_layer_norm",
    rules=(
        *qkv("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        *linear("self_attn.out_proj", "self_attn.out_proj"),
        *norm("norm1", "self_attn_layer_norm"),
        *linear("linear1", "fc1"),
        *linear("linear2", "fc2"),
        *norm("norm2", "final_layer_norm"),
    ),
    # causal; torch's LayerNorm default eps 1e-5 (not in the config); the norm placement is read
    # (do_layer_norm_before: OPT-350m is post-LN, the others pre-LN)
    settings={**CLASSIC, "layer_norm_eps": 1e-5},
    reads=("activation", "num_kv_heads", "norm", "causal"),
    outside=("token and position embeddings (embed_tokens; embed_positions, offset by 2), project_in / "
             "project_out (word_embed_proj_dim != hidden_size: applied to the token embeddings before the "
             "positions are added, and after the final norm) and the LM head"),
    shared_by=("OPT itself in both norm placements (OPT-350m is post-LN, the other sizes pre-LN: the names do "
               "not say which)"),
)
register_dialect(HF_OPT)


def _opt(c: Read) -> dict[str, Any]:
    """OPTDecoder: do_layer_norm_before (post-LN: OPT-350m), LayerNorms with torch's eps 1e-5
    (nn.LayerNorm default), the final norm unless post-LN or _remove_final_layer_norm."""
    pre = bool(c["do_layer_norm_before"])
    if not c["enable_bias"]:
        c.refuse("enable_bias", "OPT's linear maps lose their biases but its LayerNorms keep theirs; the blocks "
                                "have biases in both or in neither")
    if not c["layer_norm_elementwise_affine"]:
        c.refuse("layer_norm_elementwise_affine", "LayerNorms without weight and bias")
    return {**read_sizes(c, "hidden_size", "num_attention_heads", "ffn_dim", "num_hidden_layers"),
            "activation": read_activation(c, "activation_function"), "norm": "pre" if pre else "post",
            "causal": read_causal(c), "final_norm": pre and not c["_remove_final_layer_norm"]}


register(Family("opt", "OPTConfig", "OPTModel", "hf-opt",
           {"hidden_size": 768, "num_attention_heads": 12, "ffn_dim": 3072, "num_hidden_layers": 12,
            "activation_function": "relu", "do_layer_norm_before": True, "_remove_final_layer_norm": False,
            "enable_bias": True, "layer_norm_elementwise_affine": True, "is_causal": True, "vocab_size": 50272,
            "max_position_embeddings": 2048, "word_embed_proj_dim": None, "tie_word_embeddings": True},
           _opt, {"dropout": DROPOUT, "attention_dropout": DROPOUT, "layerdrop": "skips layers in training only",
                  "init_std": INIT},
           lm=("vocab_size", "max_position_embeddings", "word_embed_proj_dim", "tie_word_embeddings"),
           lm_class="OPTForCausalLM",
           outside=Outside("model.", "decoder.embed_tokens.weight", positions="decoder.embed_positions.weight",
                           max_positions=("max_position_embeddings",), position_offset="two",
                           default_positions="mask",
                           projections=("word_embed_proj_dim", "decoder.project_in.", "decoder.project_out.")),
           reference=Reference(float32_inside=True),
           draws={"activation_function": ("gelu", "relu"), "do_layer_norm_before": (False, True),
                  "_remove_final_layer_norm": (True, False), "enable_bias": (True, False),
                  "word_embed_proj_dim": ("hidden", None, 16)}))
