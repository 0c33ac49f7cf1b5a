"""DistilBERT (model_type distilbert): post-LN layers under transformer.layer.{i}, LayerNorms with
eps 1e-12 fixed in the code, learned positions and an embedding LayerNorm around them."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, Dialect, linear, norm, qkv, register_dialect
from ..family import DROPOUT, Family, Outside, Read, read_activation, read_sizes, register

HF_DISTILBERT = Dialect(
    "hf-distilbert", "Hugging Face DistilBERT (transformer.layer.{i}.attention.q_lin.weight, ...)",
    layer="transformer.layer.{i}.", final_norm=None,
    rules=(
        *qkv("attention.q_lin", "attention.k_lin", "attention.v_lin"),
        *linear("self_attn.out_proj", "attention.out_lin"),
        *norm("norm1", "sa_layer_norm"),
        *linear("linear1", "ffn.lin1"),
        *linear("linear2", "ffn.lin2"),
        *norm("norm2", "output_layer_norm"),
    ),
    # post-LN, its LayerNorms' eps fixed to 1e-12 in the code (not in the config)
    settings={**CLASSIC, "norm": "post", "causal": False, "layer_norm_eps": 1e-12},
    reads=("activation", "num_kv_heads"),
    outside="embeddings (word, position, their LayerNorm); DistilBERT has no pooler",
)
register_dialect(HF_DISTILBERT)


def _distilbert(c: Read) -> dict[str, Any]:
    """DistilBertModel: post-LN, eps 1e-12 in the code (nn.LayerNorm(eps=1e-12))."""
    if c["is_causal"]:
        c.refuse("is_causal", "DistilBERT is read as bidirectional; transformers makes it causal under SDPA only")
    act = read_activation(c, "activation")
    return {**read_sizes(c, "dim", "n_heads", "hidden_dim", "n_layers"), "activation": act, "final_norm": False}


register(Family("distilbert", "DistilBertConfig", "DistilBertModel", "hf-distilbert",
           {"dim": 768, "n_heads": 12, "hidden_dim": 3072, "n_layers": 6, "activation": "gelu", "vocab_size": 30522,
            "max_position_embeddings": 512, "is_causal": None},
           _distilbert,
           {"dropout": DROPOUT, "attention_dropout": DROPOUT, "qa_dropout": DROPOUT, "seq_classif_dropout": DROPOUT,
            "tie_word_embeddings": "ties the masked-LM head, which is not loaded",
            "sinusoidal_pos_embds": "initialises the position table with sinusoids; the checkpoint's table is read"},
           lm=("vocab_size", "max_position_embeddings"),
           aliases={"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"},
           outside=Outside("distilbert.", "embeddings.word_embeddings.weight",
                           positions="embeddings.position_embeddings.weight",
                               max_positions=("max_position_embeddings",),
                           embed_norm="embeddings.LayerNorm.", head=None, ignore=("embeddings.position_ids",)),
           draws={"activation": ("relu", "gelu"), "sinusoidal_pos_embds": (True, False), "is_causal": (False, True)}))
