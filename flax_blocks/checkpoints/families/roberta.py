"""RoBERTa (model_type roberta): BERT's layers (`HF_BERT`); its positions are numbered from its ids
and start at padding_idx + 1 (HF's create_position_ids_from_input_ids)."""

from __future__ import annotations

from ..family import Family, Outside, register
from .bert import BERT_DRAWS, BERT_INERT, BERT_READS, ENCODER_IGNORE, read_bert

ROBERTA_OUTSIDE = Outside("roberta.", "embeddings.word_embeddings.weight",
                          positions="embeddings.position_embeddings.weight", max_positions=("max_position_embeddings",),
                          token_type="embeddings.token_type_embeddings.weight", embed_norm="embeddings.LayerNorm.",
                          head=None, ignore=ENCODER_IGNORE, position_offset="pad", default_positions="ids")

register(Family("roberta", "RobertaConfig", "RobertaModel", "hf-bert",
           {**BERT_READS, "vocab_size": 50265, "pad_token_id": 1}, read_bert, BERT_INERT,
           lm=("vocab_size", "max_position_embeddings", "type_vocab_size", "pad_token_id"),
           outside=ROBERTA_OUTSIDE, draws=BERT_DRAWS))
