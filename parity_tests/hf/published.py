"""Published config.json files of popular checkpoints (`published_configs/`, copied verbatim;
SOURCES.md says from where), shrunk in their sizes only, for tests that build each in
transformers and read it with `fb.from_hf`.

    python -m parity_tests.hf.published [--doc docs/families.md] [--only NAME,...]

runs every file of the corpus (parity_tests.hf.fuzz.run_case: float32 logits on a left-padded
batch and HF's greedy tokens) and prints (or writes between the page's markers) one row per
checkpoint; the suite (test_config_published.py) runs `SUITE`, one file of each kind.

`shrink` keeps every key and value of the file but the sizes: widths (hidden 32, 4 heads, 2 KV
heads where the file groups them, head_dim 8, or 16 where the file's head_dim differs from
hidden / heads), feed-forward widths 48, 2 layers (6 for Gemma 3, so that one is global; 4 for SmolLM3 and
Llama 4, so that one is without rotary; per-layer lists cut to them), a vocabulary of 64 (special token ids past it
renumbered below it), windows of 4 positions (so they act within a short prompt; ModernBERT's
local_attention 4), a head of 10 where a partial rotary factor of 8 dims is odd (Phi-2's 0.4), GPT-J's
rotary_dim kept at its share of the head (64 of 256: 2 of 8), and longrope's factor lists resampled to the
new rotary width. Rotary lengths (max_position_embeddings,
original_max_position_embeddings) and learned position tables keep theirs: they are what the scaled rotary types read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from .. import markers

FOLDER = os.path.join(os.path.dirname(__file__), "published_configs")
DOC = "docs/families.md"
START = f"<!-- published-configs:start (python -m parity_tests.hf.published --doc {DOC}) -->"
END = "<!-- published-configs:end -->"

# The suite's share of the corpus: each family, each rotary scaling, each legacy key and layout
# once (the files left out repeat one of these: other sizes of one release); every file: the CLI.
SUITE = (
    "bert_base_uncased", "all_minilm_l6_v2", "multilingual_e5_small", "distilbert_base_uncased", "roberta_base",
    "xlm_roberta_base", "bge_m3", "gpt2", "distilgpt2", "gpt_bigcode_santacoder", "opt_125m", "opt_350m",
    "llama2_7b_hf", "llama3_1_8b", "llama3_2_1b", "smollm2_135m", "deepseek_r1_distill_llama_8b", "mistral_7b_v0_1",
    "mistral_7b_instruct_v0_3",
    "qwen2_5_0_5b_instruct", "qwen2_5_7b_instruct__modelcard_yarn", "deepseek_r1_distill_qwen_1_5b", "qwen3_0_6b",
    "gpt_j_6b", "falcon_7b_instruct", "aya_23_8b", "command_r7b_12_2024", "phi_2", "phi3_mini_4k_instruct",
    "phi3_5_mini_instruct",
    "phi4_mini_instruct", "smollm3_3b", "gemma_2b", "gemma2_2b_it", "gemma3_1b_it", "gemma3_4b_it",
    "granite_3_0_2b_instruct",
    "olmo2_1124_7b", "pythia_160m", "stablelm_2_zephyr_1_6b", "starcoder2_3b", "mixtral_8x7b_v0_1",
    "qwen1_5_moe_a2_7b", "qwen3_30b_a3b", "olmoe_1b_7b_0924", "deepseek_v2_lite", "deepseek_v3", "gpt_oss_20b",
    "modernbert_base",
)

HIDDEN, HEADS, FFN, VOCAB = 32, 4, 48, 64
EXPERTS, EXPERT_FFN, PER_TOKEN = 8, 16, 2  # a mixture of experts: 8 experts of width 16 (shared: FFN), top 2
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
    """The language model's config: a multimodal file's text_config (Gemma 3 from 4B up, Llama 4), else itself."""
    return config["text_config"] if config.get("model_type") in ("gemma3", "llama4") else config


def shrink(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a published config.json of a supported family) with its sizes made tiny and
    everything else kept. A size the file leaves to its config class's default is set too
    (Gemma 3 4B's text_config names 6 keys): the defaults are full-size."""
    from flax_blocks.checkpoints.family import FAMILIES

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
    old = value(layers_key)
    layers = {"gemma3_text": 6, "smollm3": 4, "llama4_text": 4}.get(c["model_type"], 2)  # a global / NoPE one
    c[layers_key] = layers
    if c.get("max_window_layers") is not None:  # Qwen2: the first local layer, scaled with the depth
        c["max_window_layers"] = min(layers, round(c["max_window_layers"] * layers / old))
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists (SmolLM3's 1 / 0 rotary flags)
        if isinstance(c.get(key), list):
            c[key] = c[key][:layers]
    for key in ("sliding_window", "attention_chunk_size", "local_attention"):  # (ModernBERT: |i - j| <= 4 // 2)
        if isinstance(c.get(key), int):
            c[key] = 4
    for key in ("num_experts", "num_local_experts"):
        if isinstance(c.get(key), int) and c[key] > EXPERTS:
            c[key] = EXPERTS
    if isinstance(c.get("num_experts_per_tok"), int):
        c["num_experts_per_tok"] = min(c["num_experts_per_tok"], PER_TOKEN)
    if c.get("intermediate_size_mlp") is not None:  # Llama 4's dense layers (its experts: intermediate_size)
        c["intermediate_size_mlp"] = FFN
    if c.get("moe_intermediate_size") is not None:
        c["moe_intermediate_size"] = EXPERT_FFN
    if c.get("shared_expert_intermediate_size"):
        c["shared_expert_intermediate_size"] = FFN
    if c.get("head_dim") is None and _rotary_dim(c) % 2:  # Phi-2's 0.4 of 8 dims: odd, which HF cannot rotate
        c[hidden_key] = HEADS * 10  # a head of 10, 4 rotary dims
    _shrink_deepseek(c)
    if isinstance(c.get("rotary_dim"), int):  # GPT-J: the rotated dims keep their share of the head (64 of 256: 2)
        c["rotary_dim"] = max(2, round(c["rotary_dim"] * heads * HIDDEN / (hidden * HEADS) / 2) * 2)
    c["vocab_size"] = VOCAB
    _renumber_tokens(c)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(c.get(key), dict) and "long_factor" in c[key]:
            c[key] = _resampled(c[key], _rotary_dim(c))
    return c


# DeepSeek's latent attention sizes, shrunk (the file's q_lora_rank None stays None)
_LATENT = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}


def _shrink_deepseek(c: dict[str, Any]) -> None:
    """DeepSeek V2 / V3: the latent attention's sizes; 16 routed experts (V3's 8 groups keep two
    each, its top-2 group scores need them); first_k_dense_replace 1 of the 2 layers (so one runs
    the experts); and no quantization_config: the model built here holds float tensors, what a
    dequantized checkpoint holds (reading the quantized files is flax_blocks' quantized reading's)."""
    if c.get("model_type") not in ("deepseek_v2", "deepseek_v3"):
        return
    for key, small in _LATENT.items():
        if isinstance(c.get(key), int):
            c[key] = small
    if isinstance(c.get("n_routed_experts"), int) and c["n_routed_experts"] > 2 * EXPERTS:
        c["n_routed_experts"] = 2 * EXPERTS
    if isinstance(c.get("first_k_dense_replace"), int) and c["first_k_dense_replace"] > 1:
        c["first_k_dense_replace"] = 1
    c.pop("quantization_config", None)


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


def check(name: str):
    """One published config, shrunk, built, saved in its own dtype and compared
    (parity_tests.hf.fuzz.run_case)."""
    from .fuzz import run_case

    config = text_config(load(name))
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return run_case(config["model_type"], unquantized(shrink(config)), saved_as=dtype)


def unquantized(config: dict[str, Any]) -> dict[str, Any]:
    """`config` without its quantization_config (GPT-OSS's mxfp4): the check builds and saves float
    weights, which such a key would misdescribe (the quantized files' own reading is the quantized
    reader's, tested with quantized tensors); every other key as published."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def table(names: list[str]) -> str:
    """One row per checkpoint: its family, what it carries, the outcome and the error."""
    from flax_blocks.checkpoints.checkpoint import read_config

    rows = ["| checkpoint (file) | model_type | dtype | rotary scaling | keys ignored | outcome | float32 error |",
            "|---|---|---|---|---|---|---|"]
    for name in names:
        config = text_config(load(name))
        out = check(name)
        shrunk = unquantized(shrink(config))
        read = read_config(shrunk)
        scaling = read.cfg.rope_scaling.rope_type if read.cfg.rope_scaling is not None else ""
        unread = ", ".join(f"`{k}`" for k in sorted(read.ignored) if read.family.classify(k) == "unread")
        error = f"{out.error:.1e}" if out.error is not None else ""
        rows.append(f"| {name} | {config['model_type']} | {config.get('torch_dtype') or config.get('dtype') or ''} "
                    f"| {scaling} | {unread} | {out.kind} | {error} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.hf.published", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", metavar="FILE", help=f"replace the table between this file's markers ({DOC})")
    ap.add_argument("--only", metavar="NAMES", type=lambda s: s.split(","),
                    help="check these files only (comma list of names without .json, e.g. llama3_2_1b); with "
                         "--doc their rows are replaced and the table's other rows kept")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(names()))
    if unknown:
        ap.error(f"--only {','.join(unknown)}: no such file in {FOLDER}")
    checked = args.only or names()
    if len(checked) > 3:  # tiny models of alike sizes: eager ops' compiles are shared; a few: each compiled
        os.environ.setdefault("FUZZ_HF_EAGER", "1")
    text = table(checked)
    if args.doc and args.only:
        markers.replace_rows(args.doc, text, START, END, "published-configs")
    elif args.doc:
        markers.rewrite(args.doc, text, START, END, "published-configs")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
