"""`python -m parity_tests.hf.family_keys [--doc docs/families.md] [--dialects-doc docs/dialects.md]`:
per Hugging Face family, the config keys `fb.from_hf` reads (with the config class's defaults),
the values it refuses by name, the keys it knows change nothing, and the model_types it refuses
by name (NOT_COMPUTED); and docs/dialects.md's table of the dialects (DIALECTS); as markdown
generated from the tables in
the family modules (`flax_blocks/checkpoints/families/`). The refused values are found by probing: each read key is set
to a few values people use (the other boolean, other activations, a scaled rotary type, a
mixed layer_types) on a small valid config, and a value is listed when `hf_config` refuses it
naming that key. parity_tests/hf/test_config_keys.py checks the committed page against this writer.
"""

from __future__ import annotations

import argparse
from typing import Any

from flax_blocks.checkpoints import dialects
from flax_blocks.checkpoints.checkpoint import hf_config
from flax_blocks.checkpoints.family import COMMON, FAMILIES, MODULES, NOT_COMPUTED, PARTS, REFUSED_ANYWHERE, Family
from flax_blocks.checkpoints.io import ConversionError

from .. import markers

DOC = "docs/families.md"
START = f"<!-- family-keys:start (python -m parity_tests.hf.family_keys --doc {DOC}) -->"
END = "<!-- family-keys:end -->"
DIALECTS_DOC = "docs/dialects.md"
DIALECTS_START = f"<!-- dialect-table:start (python -m parity_tests.hf.family_keys --dialects-doc {DIALECTS_DOC}) -->"
DIALECTS_END = "<!-- dialect-table:end -->"

_SIZES = {"gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_inner=40),
          "distilbert": dict(dim=32, n_heads=4, n_layers=2, hidden_dim=40),
          "whisper": dict(d_model=32, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
                          decoder_ffn_dim=40, encoder_layers=2, decoder_layers=2),
          **{t: dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40,
                     num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                     kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                     **({"n_group": 2, "topk_group": 1} if t == "deepseek_v3" else {}))
             for t in ("deepseek_v2", "deepseek_v3")}}
_LLAMA_SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                    num_hidden_layers=2, head_dim=8)
_ACTIVATIONS = ["relu", "gelu", "gelu_pytorch_tanh", "silu", "gelu_fast"]


def probes(key: str, default: Any) -> list[Any]:
    """Values people set for a key, other than its default."""
    if key in ("rope_parameters", "rope_scaling"):
        return [{"rope_type": "proportional", "rope_theta": 10000.0}, {"rope_type": "su", "factor": 2.0}]
    if key == "layer_types":
        return [["sliding_attention", "full_attention"]]
    if key in ("is_causal", "is_decoder") or isinstance(default, bool):
        return [v for v in (True, False) if v != default]
    if key == "position_embedding_type":
        return ["relative_key"]
    if key in ("hidden_act", "hidden_activation", "activation", "activation_function"):
        return [v for v in _ACTIVATIONS if v != default]
    return []


def base(family: Family) -> dict[str, Any]:
    """A small config of the family that loads."""
    sizes = _SIZES.get(family.model_type, {k: v for k, v in _LLAMA_SIZES.items() if k in family.reads})
    if family.model_type == "opt":
        sizes = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=40)
    if family.model_type in ("gemma2", "gemma3_text"):
        sizes["sliding_window"] = 4
    if family.model_type == "llama4_text":  # dense, no QK-norm, no chunks (the experts and chunks: their own rows)
        sizes.update(intermediate_size_mlp=40, moe_layers=[], use_qk_norm=False, attention_chunk_size=None)
    return {"model_type": family.model_type, **sizes}


def part(family: Family) -> str | None:
    return "decoder" if family.model_class == "WhisperDecoder" else None


def refused_values(family: Family) -> list[str]:
    cfg = base(family)
    hf_config(cfg, part=part(family))  # the base loads
    out = []
    for key, default in family.reads.items():
        for value in probes(key, default):
            try:
                hf_config({**cfg, key: value}, part=part(family))
            except ConversionError as e:
                if any(p.startswith(f"{key}=") for p in e.problems):
                    out.append(f"`{key}={value!r}`")
    return out


def section(family: Family) -> str:
    reads = ", ".join(f"`{k}` ({v!r})" for k, v in family.reads.items())
    aliases = ", ".join(f"`{k}` -> `{v}`" for k, v in family.aliases.items())
    inert = "; ".join(f"`{k}`: {why}" for k, why in family.inert.items())
    refused = ", ".join(refused_values(family)) or "-"
    return (f"### {family.model_type}: {family.config_class} -> {family.model_class} ({family.dialect})\n\n"
            f"- read (default): {reads}\n"
            + (f"- aliases (attribute_map; the alias wins): {aliases}\n" if aliases else "")
            + f"- refused by name (probed): {refused}\n"
            f"- known inert: {inert or '-'}\n")


def modules() -> str:
    """One row per family: the module that holds it, its classes, dialect and parts."""
    rows = ["| model_type | module | config -> model (causal LM) | dialect | whole model |", "|---|---|---|---|---|"]
    for t, f in FAMILIES.items():
        module = MODULES[t].rpartition(".")[2]
        lm = f" ({f.lm_class})" if f.lm_class else ""
        whole = "stack only: " + f.stack_only.split(":")[0] if f.outside is None else \
            ("causal-lm, model" if f.lm_class else "model")
        rows.append(f"| `{t}` | `families/{module}.py` | {f.config_class} -> {f.model_class}{lm} | {f.dialect} "
                    f"| {whole} |")
    return "\n".join(rows) + "\n"


def refused_model_types() -> str:
    """One row per model_type transformers has that `fb.from_hf` refuses by name (NOT_COMPUTED)."""
    rows = ["| model_type | refused: what it computes that the blocks do not |", "|---|---|"]
    rows += [f"| `{t}` | {why.replace('{', '').replace('}', '')} |" for t, why in sorted(NOT_COMPUTED.items())]
    return "\n".join(rows) + "\n"


def dialect_table() -> str:
    """docs/dialects.md's table: each dialect of `flax_blocks.checkpoints.dialects.DIALECTS`, its
    description and the model_types read with it."""
    rows = ["| dialect | checkpoints (names) | model_types read with it |", "|---|---|---|"]
    for name, d in dialects.DIALECTS.items():
        types = [f"`{t}`" for t, f in FAMILIES.items() if f.dialect == name]
        types += ['`whisper` (part="decoder")'] if name == PARTS["whisper"]["decoder"].dialect else []
        rows.append(f"| `{name}` | {d.description} | {', '.join(types) or '- (state dicts of PyTorch modules)'} |")
    return "\n".join(rows) + "\n"


def page() -> str:
    tables = [*FAMILIES.values(), PARTS["whisper"]["decoder"]]
    common = "; ".join(f"`{k}`" for k in COMMON)
    return ("Each family is one module of `flax_blocks/checkpoints/families/` (docs/adding-a-family.md):\n\n"
            + modules() + "\n"
            + "Every other key is one the family's transformers code never reads: ignored, as transformers "
            "ignores it, and listed (one warning and `fb.load_report(model)`); `ignore_keys=` reads named keys as "
            "absent. Refused anywhere: " + "; ".join(f"`{k}` ({why})" for k, why in REFUSED_ANYWHERE.items())
            + f". Known inert in every family (PretrainedConfig's own keys and generation defaults): {common}.\n\n"
            + "Refused by name: the model_types transformers has that compute what the blocks do not "
            "(`NOT_COMPUTED` in `flax_blocks/checkpoints/family.py`; any other model_type is refused as unknown):\n\n"
            + refused_model_types() + "\n"
            + "\n".join(section(f) for f in tables))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.hf.family_keys", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", metavar="FILE", help=f"replace the section between this file's markers ({DOC})")
    ap.add_argument("--dialects-doc", metavar="FILE",
                    help=f"replace the dialect table between this file's markers ({DIALECTS_DOC})")
    args = ap.parse_args(argv)
    text = page()
    if args.doc:
        markers.rewrite(args.doc, text, START, END, "family-keys")
    if args.dialects_doc:
        markers.rewrite(args.dialects_doc, dialect_table(), DIALECTS_START, DIALECTS_END, "dialect-table")
    if not args.doc and not args.dialects_doc:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
