"""XLM-RoBERTa (model_type xlm-roberta): RoBERTa's code (XLMRobertaModel is generated from it) and
names, its config class's own vocabulary default."""

from __future__ import annotations

from ..family import Family, register
from .bert import BERT_DRAWS, BERT_INERT, BERT_READS, read_bert
from .roberta import ROBERTA_OUTSIDE

register(Family("xlm-roberta", "XLMRobertaConfig", "XLMRobertaModel", "hf-bert",
           {**BERT_READS, "vocab_size": 30522, "pad_token_id": 1}, read_bert, BERT_INERT,
           lm=("vocab_size", "max_position_embeddings", "type_vocab_size", "pad_token_id"),
           outside=ROBERTA_OUTSIDE, draws=BERT_DRAWS))
