"""Whole Hugging Face models <-> `flax_blocks.lm.LanguageModel`: the parts around the stack.

The stack (layers, final norm) is translated by the family's dialect (`flax_blocks.dialects`);
this module's table says where each family keeps the rest: the token embedding, learned
positions, token types, the embedding norm and the LM head, relative to the base model
(LlamaModel, GPT2Model, BertModel), and the base model's prefix inside the model with a head
(LlamaForCausalLM's "model.", GPT2LMHeadModel's "transformer."). A family without an entry
here loads as a stack only (part="stack").

    load(config, state_dict, part)   -> LanguageModel    (fb.from_hf(source, part=...))
    to_hf_model(model)               -> {HF name: array} (fb.to_hf(model)), names as
                                        HF's model.state_dict()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from . import dialects
from .checkpoint_io import ConversionError
from .hf_config import hf_config
from .lm_spec import ENCODER, LMConfig

log = logging.getLogger("flax_blocks")

PARTS = ("stack", "model", "causal-lm")


@dataclass(frozen=True)
class Outside:
    """Where a family keeps the parts around its stack (names relative to the base model)."""

    base: str  # the base model's prefix inside the model with a head
    embed: str
    positions: str | None = None  # learned position table (its config key: max_positions below)
    max_positions: tuple[str, ...] = ()
    token_type: str | None = None
    embed_norm: str | None = None  # the module name of a norm on the embeddings
    head: str | None = "lm_head."  # the LM head's module, beside the base model; None: no causal LM
    ignore: tuple[str, ...] = ()  # buffers and parts that are not computed (BERT's pooler)


OUTSIDE: dict[str, Outside] = {
    "hf-llama": Outside("model.", "embed_tokens.weight"),
    "hf-gpt2": Outside("transformer.", "wte.weight", positions="wpe.weight", max_positions=("n_positions",)),
    "hf-bert": Outside("bert.", "embeddings.word_embeddings.weight", positions="embeddings.position_embeddings.weight",
                       max_positions=("max_position_embeddings",),
                       token_type="embeddings.token_type_embeddings.weight", embed_norm="embeddings.LayerNorm.",
                       head=None, ignore=("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")),
}


def lm_config(config: Mapping[str, Any], part: str) -> tuple[str, Any, LMConfig]:
    """(dialect, BlockConfig, LMConfig) of an HF config for `part` ("model" or "causal-lm")."""
    dialect, cfg, num_layers, final_norm = hf_config(config)
    out = OUTSIDE.get(dialect)
    model_type = config.get("model_type")
    if out is None:
        raise ConversionError([f"{model_type}: only its stack is read (part='stack')"],
                              header=f"cannot load a whole {model_type} model")
    if part == "causal-lm" and (out.head is None or not cfg.causal):
        raise ConversionError([f"{model_type} is not a causal language model: part='model' gives its last hidden "
                               "state"], header=f"cannot load a {model_type} model as part='causal-lm'")
    tied = bool(config.get("tie_word_embeddings", True))
    lm = LMConfig(
        vocab_size=int(config["vocab_size"]), num_layers=num_layers,
        max_positions=int(next(config[k] for k in out.max_positions if config.get(k))) if out.positions else None,
        token_types=int(config.get("type_vocab_size") or 0) if out.token_type else 0,
        embed_norm=out.embed_norm is not None, final_norm=final_norm,
        head="none" if part == "model" else ("tied" if tied else "untied"),
    )
    return dialect, cfg, lm


def load(config: Mapping[str, Any], sd: Mapping[str, Any], part: str, *, dtype: Any = None, seed: int = 0):
    """A LanguageModel computing an HF model's `part` from its config and state dict."""
    from .lm import from_torch_state_dict

    dialect, cfg, lm = lm_config(config, part)
    out = OUTSIDE[dialect]
    sd = {k: np.asarray(v) for k, v in sd.items()}
    tr = dialects.translate(sd, dialect)
    base = tr.prefix  # "" for a base model, "model." / "transformer." / "bert." inside a model with a head
    ours: dict[str, Any] = {f"{ENCODER}.{k}": v for k, v in tr.state_dict.items()}
    problems: list[str] = []
    taken = set()

    def take(name: str, theirs: str) -> None:
        if theirs in sd:
            ours[name] = sd[theirs]
            taken.add(theirs)
        else:
            problems.append(f"missing key {theirs}")

    take("embed.weight", base + out.embed)
    if out.positions:
        take("pos.weight", base + out.positions)
    if out.token_type and lm.token_types:
        take("token_type.weight", base + out.token_type)
    if out.embed_norm:
        take("embed_norm.weight", base + out.embed_norm + "weight")
        if cfg.bias:
            take("embed_norm.bias", base + out.embed_norm + "bias")
    head = (base and base[:-len(out.base)]) + (out.head or "")  # the head sits beside the base model
    if lm.head == "untied":
        if head + "weight" not in sd:
            problems.append(f"missing key {head}weight: the source has no LM head (a base model such as LlamaModel?); "
                            "part='causal-lm' needs the model with its head (LlamaForCausalLM), or take part='model'")
        else:
            take("head.weight", head + "weight")
    elif lm.head == "tied":
        taken.add(head + "weight")  # the state dict of a model object holds the tied weight twice
    stack = {k for k in sd if k not in tr.dropped}
    left = [k for k in sd if k not in taken and k not in stack
            and not any(k[len(base):].startswith(i) for i in out.ignore) and not k.startswith(head)]
    if part == "model":
        left = [k for k in left if k.startswith(base)]  # a head outside the base model is not read
    problems += [f"unexpected key {k}: not a part of the {config.get('model_type')} {part} the blocks compute"
                 for k in left]
    if problems:
        raise ConversionError(problems, header=f"cannot load this {config.get('model_type')} model as part={part!r}")
    if dtype is None:
        dtypes = {str(a.dtype) for a in ours.values()}
        if len(dtypes) == 1 and dtypes <= {"float32", "float64", "bfloat16", "float16"}:
            cfg = replace(cfg, param_dtype=dtypes.pop())
    else:
        from .config import dtype_name

        cfg = replace(cfg, param_dtype=dtype_name(dtype))
    log.info("from_hf: %s model as part=%s (%s head)", config.get("model_type"), part, lm.head)
    model = from_torch_state_dict(cfg, lm, ours, seed=seed, dtype=dtype)
    model.hf_dialect = dialect  # to_hf writes it back in this family's names (as from_hf's stacks)
    return model


def to_hf_model(model, dialect: str, *, prefix: str | None = None) -> dict[str, np.ndarray]:
    """{HF name: numpy array} of a whole LanguageModel, named as HF's model.state_dict() of
    the model with a head (LlamaForCausalLM, GPT2LMHeadModel) or of the base model
    (LlamaModel, GPT2Model, BertModel) for head="none". A tied head is written as
    lm_head.weight too, as HF's state_dict() holds it (the same values as the embedding)."""
    from .convert import torch_state_dict

    out = OUTSIDE.get(dialect)
    if out is None:
        raise ConversionError([f"{dialect}: no table of the parts around its stack"],
                              header="cannot write this whole model")
    lm = model.lm
    base = ("" if lm.head == "none" else out.base) if prefix is None else prefix
    sd = torch_state_dict(model)
    hf: dict[str, np.ndarray] = {base + out.embed: sd["embed.weight"]}
    if lm.max_positions is not None:
        if not out.positions:
            raise ConversionError([f"{dialect} has no learned positions"], header="cannot write this whole model")
        hf[base + out.positions] = sd["pos.weight"]
    if lm.token_types:
        hf[base + out.token_type] = sd["token_type.weight"]
    if lm.embed_norm:
        for k in ("weight", "bias"):
            if f"embed_norm.{k}" in sd:
                hf[base + out.embed_norm + k] = sd[f"embed_norm.{k}"]
    stack = {k[len(ENCODER) + 1:]: v for k, v in sd.items() if k.startswith(ENCODER + ".")}
    hf.update(dialects.to_dialect(stack, dialect, model.cfg, prefix=base))
    if lm.head != "none":
        if out.head is None:
            raise ConversionError([f"{dialect} has no LM head"], header="cannot write this whole model")
        hf[out.head + "weight"] = sd["head.weight"] if lm.head == "untied" else sd["embed.weight"]
        if "head.bias" in sd:
            hf[out.head + "bias"] = sd["head.bias"]
    return {k: np.ascontiguousarray(v) for k, v in hf.items()}
