"""BERT (model_type bert): BertModel's post-LN layers under encoder.layer.{i}, its embeddings (word,
position, token type, LayerNorm) around them; the pooler is not read. RoBERTa and
XLM-RoBERTa reuse its layers (`HF_BERT`, `read_bert`)."""

from __future__ import annotations

from typing import Any

from ..dialects import CLASSIC, CLASSIC_READS, Dialect, linear, norm, qkv, register_dialect
from ..family import COMMON, DROPOUT, Family, Outside, Read, read_activation, read_sizes, register

# RoBERTa's stack IS BERT's: the same layer code and key names in transformers (RobertaLayer is
# generated from BertLayer), so "roberta" is read with this one table. What differs lies outside
# the stack: RoBERTa's position ids start at padding_idx + 1 and skip padding, in its embeddings.
# BERT with is_decoder=True (no cross-attention) is causal under the same names: causal is read
# from the config, not fixed.
HF_BERT = Dialect(
    "hf-bert", "Hugging Face BERT / RoBERTa (encoder.layer.{i}.attention.self.query.weight, ...)",
    layer="encoder.layer.{i}.", final_norm=None,
    rules=(
        *qkv("attention.self.query", "attention.self.key", "attention.self.value"),
        *linear("self_attn.out_proj", "attention.output.dense"),
        *norm("norm1", "attention.output.LayerNorm"),
        *linear("linear1", "intermediate.dense"),
        *linear("linear2", "output.dense"),
        *norm("norm2", "output.LayerNorm"),
    ),
    settings={**CLASSIC, "norm": "post"},
    reads=(*CLASSIC_READS, "causal"),
    outside="embeddings (word, position, token type, their LayerNorm) and pooler",
)
register_dialect(HF_BERT)


def read_bert(c: Read) -> dict[str, Any]:
    """BertModel / RobertaModel / XLMRobertaModel: post-LN; is_decoder makes the self-attention causal
    (BertSelfAttention.is_causal = config.is_decoder); cross-attention refused."""
    if c["add_cross_attention"]:
        c.refuse("add_cross_attention", "a decoder with cross-attention: only self-attention stacks are read")
    if c["position_embedding_type"] not in ("absolute", None):
        c.refuse("position_embedding_type", "a checkpoint trained with relative positions holds distance "
                                            "embeddings inside attention, which the Flax blocks do not compute and "
                                            "transformers 5 no longer does either (its BERT ignores the setting): "
                                            "refused rather than silently dropped")
    act = read_activation(c, "hidden_act")
    causal = bool(c["is_decoder"]) and c["is_causal"] is not False  # create_causal_mask reads is_causal
    if not c["is_decoder"] and c["is_causal"]:
        c.refuse("is_causal", "an encoder (is_decoder false) that transformers makes causal under SDPA without "
                              "padding only; refused")
    return {**read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers"),
            "activation": act, "layer_norm_eps": float(c["layer_norm_eps"]), "causal": causal,
            "final_norm": False}


BERT_READS = {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "num_hidden_layers": 12,
               "hidden_act": "gelu", "layer_norm_eps": 1e-12, "is_decoder": False, "add_cross_attention": False,
               "position_embedding_type": "absolute", "vocab_size": 30522, "max_position_embeddings": 512,
               "type_vocab_size": 2, "is_causal": None}
BERT_INERT = {"hidden_dropout_prob": DROPOUT, "attention_probs_dropout_prob": DROPOUT,
               "classifier_dropout": DROPOUT, "use_cache": COMMON["use_cache"],
               "tie_word_embeddings": "ties the masked-LM head, which is not loaded"}
ENCODER_IGNORE = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")
BERT_DRAWS: dict[str, tuple[Any, ...]] = {"hidden_act": ("gelu_new", "gelu", "relu"), "is_decoder": (True, False),
                                          "is_causal": (False, True), "type_vocab_size": (1, 2),
                                          "position_embedding_type": ("absolute", "relative_key")}

register(Family("bert", "BertConfig", "BertModel", "hf-bert", BERT_READS, read_bert, BERT_INERT,
           lm=("vocab_size", "max_position_embeddings", "type_vocab_size"),
           outside=Outside("bert.", "embeddings.word_embeddings.weight",
                           positions="embeddings.position_embeddings.weight",
                               max_positions=("max_position_embeddings",),
                           token_type="embeddings.token_type_embeddings.weight", embed_norm="embeddings.LayerNorm.",
                           head=None, ignore=ENCODER_IGNORE),
           draws=BERT_DRAWS))
