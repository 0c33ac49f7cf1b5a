"""Published config.json files of popular checkpoints (`published_configs/`, copied verbatim;
SOURCES.md says from where), shrunk in their sizes only, for tests that build each in
transformers and read it with `fb.from_hf`.

`shrink` keeps every key and value of the file but the sizes: widths (hidden 32, 4 heads, 2 KV
heads where the file groups them, head_dim 8, or 16 where the file's head_dim differs from
hidden / heads), feed-forward widths 48, 2 layers (6 for Gemma 3, so that one is global), a
vocabulary of 64 (special token ids past it renumbered below it), windows of 4 positions
(so they act within a short prompt) and longrope's factor lists resampled to the new rotary
width. Rotary lengths (max_position_embeddings, original_max_position_embeddings) and learned
position tables keep theirs: they are what the scaled rotary types read.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

FOLDER = os.path.join(os.path.dirname(__file__), "published_configs")

HIDDEN, HEADS, FFN, VOCAB = 32, 4, 48, 64
_HIDDEN = ("hidden_size", "n_embd", "dim", "d_model")
_HEADS = ("num_attention_heads", "n_head", "n_heads")
_FFN = ("intermediate_size", "ffn_dim", "n_inner", "hidden_dim")
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers")
_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")


def names() -> list[str]:
    """The corpus's file names, without .json, sorted."""
    return sorted(f[:-5] for f in os.listdir(FOLDER) if f.endswith(".json"))


def load(name: str) -> dict[str, Any]:
    with open(os.path.join(FOLDER, name + ".json")) as f:
        return json.load(f)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a multimodal file's text_config (Gemma 3 from 4B up), else itself."""
    return config["text_config"] if config.get("model_type") == "gemma3" else config


def shrink(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a published config.json of a supported family) with its sizes made tiny and
    everything else kept. A size the file leaves to its config class's default is set too
    (Gemma 3 4B's text_config names 6 keys): the defaults are full-size."""
    from flax_blocks.checkpoints.hf_families import FAMILIES

    c = dict(config)
    reads = FAMILIES[c["model_type"]].reads
    first = lambda keys: next((k for k in keys if k in reads), None)  # noqa: E731
    value = lambda key: c.get(key, reads.get(key))  # noqa: E731 - the file's, else the class default
    hidden_key, heads_key, ffn_key, layers_key = first(_HIDDEN), first(_HEADS), first(_FFN), first(_LAYERS)
    hidden, heads = value(hidden_key), value(heads_key)
    c[hidden_key], c[heads_key] = HIDDEN, HEADS
    kv = value("num_key_value_heads")
    if kv is not None:
        c["num_key_value_heads"] = 2 if kv < heads else HEADS
    if value("head_dim") is not None:  # explicit: as hidden / heads, or (Gemma, Qwen3) not
        c["head_dim"] = 8 if value("head_dim") * heads == hidden else 16
    if value(ffn_key) is not None:
        c[ffn_key] = FFN
    if c.get("word_embed_proj_dim") is not None:  # OPT: equal to the width, or a projection of its own
        c["word_embed_proj_dim"] = HIDDEN if c["word_embed_proj_dim"] == hidden else 16
    old, layers = value(layers_key), 6 if c["model_type"] == "gemma3_text" else 2
    c[layers_key] = layers
    if c.get("max_window_layers") is not None:  # Qwen2: the first local layer, scaled with the depth
        c["max_window_layers"] = min(layers, round(c["max_window_layers"] * layers / old))
    if isinstance(c.get("layer_types"), list):
        c["layer_types"] = c["layer_types"][:layers]
    for key in ("sliding_window", "attention_chunk_size"):
        if isinstance(c.get(key), int):
            c[key] = 4
    c["vocab_size"] = VOCAB
    _renumber_tokens(c)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(c.get(key), dict) and "long_factor" in c[key]:
            c[key] = _resampled(c[key], _rotary_dim(c))
    return c


def _renumber_tokens(c: dict[str, Any]) -> None:
    """Special token ids at or past the shrunk vocabulary renumbered into its top rows (ids
    that were equal stay equal)."""
    ids = sorted({i for k in _TOKENS for i in _as_list(c.get(k)) if isinstance(i, int) and i >= VOCAB})
    new = {i: VOCAB - 1 - n for n, i in enumerate(ids)}
    for k in _TOKENS:
        v = c.get(k)
        if isinstance(v, list):
            c[k] = [new.get(i, i) for i in v]
        elif isinstance(v, int):
            c[k] = new.get(v, v)


def _as_list(v: Any) -> list:
    return v if isinstance(v, list) else [v]


def _rotary_dim(c: dict[str, Any]) -> int:
    """HF's rotary dim of a shrunk config: its head width times its partial rotary factor."""
    head = c.get("head_dim") or HIDDEN // HEADS
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    return int(head * params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))


def _resampled(params: dict[str, Any], dim: int) -> dict[str, Any]:
    """longrope's short / long factor lists resampled to ceil(dim / 2) entries, evenly over the
    published ones (so the curve keeps its shape)."""
    n = (dim + 1) // 2
    out = dict(params)
    for key in ("short_factor", "long_factor"):
        values = params[key]
        out[key] = [values[round(i * (len(values) - 1) / max(n - 1, 1))] for i in range(n)]
    assert all(math.isfinite(v) for key in ("short_factor", "long_factor") for v in out[key])
    return out
