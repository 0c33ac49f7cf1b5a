"""Whole Hugging Face models <-> `flax_blocks.lm.LanguageModel`: the parts around the stack.

The stack (layers, final norm) is translated by the family's dialect (`flax_blocks.checkpoints.dialects`);
each family's `Outside` (declared in its module, `flax_blocks.checkpoints.families`) says where it keeps the
rest: the token embedding, learned positions, token types, the embedding norm and the LM
head, relative to the base model (LlamaModel, GPT2Model, BertModel), and the base model's
prefix inside the model with a head (LlamaForCausalLM's "model.", GPT2LMHeadModel's
"transformer."), and what those parts compute beyond lookups: OPT's and RoBERTa's position
offsets and default positions, Gemma's embedding scale, Gemma 2's final logit soft-cap, OPT-350m's
projections. What a family computes there that the LanguageModel does not is refused by name. A
family without one (ViT, Whisper) loads as a stack only (part="stack").

    read_whole(config, state_dict, part) -> its LMConfig and tensors  (read_checkpoint's whole models)
    to_hf_model(model)               -> {HF name: array} (fb.to_hf(model)), names as
                                        HF's model.state_dict()
    twin_state_dict(model)           a model of either twin -> {torch name: numpy array}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..core.lm_config import ENCODER, LMConfig
from . import dialects, stream
from .family import FAMILIES, Outside, Read, families_of_dialect
from .hf_config import ConfigRead, read_config
from .io import ConversionError
from .stream import to_numpy

log = logging.getLogger("flax_blocks")

PARTS = ("stack", "model", "causal-lm")


def twin_state_dict(model: Any) -> dict[str, Any]:
    """{torch name: numpy array} of a model of either twin: a torch_blocks module's own
    state_dict, a flax_blocks module's `torch_state_dict` (the same names and layouts)."""
    if type(model).__module__.split(".")[0] == "torch_blocks":
        return {k: to_numpy(v) for k, v in model.state_dict().items()}
    from .convert import torch_state_dict

    return torch_state_dict(model)


def causal_lm_class(model_type: str) -> str:
    """The class of a family's causal LM in transformers (LlamaForCausalLM, GPT2LMHeadModel ...)."""
    lm_class = FAMILIES[model_type].lm_class
    if lm_class is None:
        raise ValueError(f"{model_type} has no causal LM in transformers")
    return lm_class


def _family(config: Mapping[str, Any]) -> tuple[str, Outside]:
    model_type: Any = config.get("model_type")  # a config value (None when absent)
    family = FAMILIES.get(model_type)
    if family is None or family.outside is None:
        why = family.stack_only if family is not None else "no family module reads it"
        raise ConversionError([f"{model_type}: {why}; only its transformer stack is read (part='stack')"],
                              header=f"cannot load a whole {model_type} model")
    return model_type, family.outside


def _whole_model_problems(model_type: str, c: Read) -> list[str]:
    """What a family computes around its stack that the LanguageModel does not: refused by name."""
    problems = []
    if _family(c.config)[1].position_offset == "pad" and c["pad_token_id"] is None:
        problems.append("pad_token_id None: RoBERTa's positions are numbered from its padding token (padding_idx)")
    return problems


def _positions(out: Outside, c: Read) -> tuple[int | None, int]:
    """(LMConfig.max_positions, position_offset) of a family's learned position table."""
    if not out.positions:
        return None, 0
    rows = int(c[out.max_positions[0]])
    if out.position_offset == "two":  # OPTLearnedPositionalEmbedding: max_position_embeddings + 2 rows
        return rows, 2
    if out.position_offset == "pad":  # RoBERTa: positions from padding_idx + 1 within max_position_embeddings rows
        offset = int(c["pad_token_id"]) + 1
        return rows - offset, offset
    return rows, 0


def lm_config(config: Mapping[str, Any], part: str, *, ignore_keys: tuple[str, ...] = ()
              ) -> tuple[str, Any, LMConfig]:
    """(dialect, BlockConfig, LMConfig) of an HF config for `part` ("model" or "causal-lm")."""
    read, lm = _lm_config(config, part, ignore_keys)
    return read.dialect, read.cfg, lm


def _lm_config(config: Mapping[str, Any], part: str, ignore_keys: tuple[str, ...]) -> tuple[ConfigRead, LMConfig]:
    read = read_config(config, ignore_keys=ignore_keys)
    cfg, num_layers, final_norm = read.cfg, read.num_layers, read.final_norm
    model_type, out = _family(config)
    c = Read({k: v for k, v in config.items() if k not in ignore_keys}, read.family)
    if part == "causal-lm" and (out.head is None or not cfg.causal):
        why = ("is_causal=False: transformers builds a bidirectional mask from it, so this is no causal language "
               "model" if out.head is not None else f"{model_type} is not a causal language model")
        raise ConversionError([f"{why}: part='model' gives its last hidden state"],
                              header=f"cannot load a {model_type} model as part='causal-lm'")
    problems = _whole_model_problems(model_type, c)
    window, why = _cache_window(config, read) if part == "causal-lm" else (None, "")
    if why and window is None:
        problems.append(why)
    if part == "causal-lm" and out.head_bias and c["tie_word_embeddings"]:
        problems.append("tie_word_embeddings=True: the head is the embedding and keeps a bias of its own, which a "
                        "tied LanguageModel head does not hold")
    scale = c[out.logit_scale] if out.logit_scale else None
    if part == "causal-lm" and out.logit_scale and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        problems.append(f"{out.logit_scale}={scale!r}: the logits are multiplied by it (transformers fails on "
                        "anything but a number)")
    if problems:
        raise ConversionError(problems, header=f"cannot load a whole {model_type} model as part={part!r}")
    if window is not None:  # read after all, by the cache: no longer among the ignored keys
        read = replace(read, ignored={k: v for k, v in read.ignored.items()
                                      if k not in ("sliding_window", "attention_chunk_size", "layer_types")},
                       notes=(*read.notes, why))
    tied = part == "causal-lm" and bool(c["tie_word_embeddings"])
    max_positions, offset = _positions(out, c)
    cap = c[out.final_logit_softcap] if out.final_logit_softcap else None
    lm = LMConfig(
        vocab_size=int(c["vocab_size"]), num_layers=num_layers, max_positions=max_positions,
        token_types=int(c["type_vocab_size"] or 0) if out.token_type else 0,
        embed_norm=out.embed_norm is not None, final_norm=final_norm,
        head="none" if part == "model" else ("tied" if tied else "untied"),
        head_bias=out.head_bias and part == "causal-lm",
        position_offset=offset, default_positions=out.default_positions,
        pad_token_id=int(c["pad_token_id"]) if out.default_positions == "ids" else None,
        embed_scale=float(c["hidden_size"]) ** 0.5 if out.embed_scale else _multiplier(c, out.embed_multiplier),
        final_logit_softcap=None if cap is None or part == "model" else float(cap),
        logit_scale=None if scale is None or part == "model" else float(scale),
        logits_divisor=None if part == "model" else _multiplier(c, out.logits_divisor),
        project_dim=_project_dim(out, c), cache_window=window, recompute_length=_recompute_length(out, cfg),
    )
    return read, lm


def _multiplier(c: Read, key: str | None) -> float | None:
    """A scalar multiplier's config value (Granite's embedding_multiplier, logits_scaling); None
    where the family has none or it is 1 (the same function)."""
    return None if key is None or float(c[key]) == 1.0 else float(c[key])


def _recompute_length(out: Outside, cfg: Any) -> int | None:
    """Phi3ForCausalLM.prepare_inputs_for_generation drops the cache when the sequence first
    passes original_max_position_embeddings, so that generation goes on with every key rotated
    by longrope's long factors (Outside.recompute_past_original); with other rotary the
    recomputed keys are the cached ones."""
    scaling = cfg.rope_scaling
    if not out.recompute_past_original or scaling is None or scaling.rope_type != "longrope":
        return None
    return scaling.original


def _project_dim(out: Outside, c: Read) -> int | None:
    """The embeddings' width where it differs from the stack's (OPT's word_embed_proj_dim)."""
    if out.projections is None or c[out.projections[0]] is None:
        return None
    width = int(c[out.projections[0]])
    return None if width == int(c["hidden_size"]) else width


def _cache_window(config: Mapping[str, Any], read: ConfigRead) -> tuple[int | None, str]:
    """(cache_window, why) of a family whose layers compute no window: transformers' generation
    cache (DynamicCache(config=...), get_layer_types_and_kwargs) still reads sliding_window,
    attention_chunk_size and layer_types off any config and keeps only the last W - 1 keys of
    each such layer, so HF's generate attends to a window its forward does not. A window for
    every layer is the model's cache_window; windows on some layers only are refused (why
    names them; window None)."""
    if read.cfg.sliding_window is not None or "layer_types" in read.family.reads:
        return None, ""  # the family computes its windows (or its config derives full layers): the cache agrees
    sliding, chunk, types = (config.get(k) for k in ("sliding_window", "attention_chunk_size", "layer_types"))
    reads = read.family.reads
    if "use_sliding_window" in reads and not config.get("use_sliding_window", reads["use_sliding_window"]):
        sliding = None  # the config class keeps sliding_window only with use_sliding_window (Qwen3MoeConfig)
    if types is None:
        types = ["sliding_attention" if sliding is not None else "chunked_attention" if chunk is not None
                 else "full_attention"] * read.num_layers
    sizes = {{"sliding_attention": sliding, "chunked_attention": chunk}.get(t) for t in types}
    if sizes == {None}:
        return None, ""
    if len(sizes) == 1 and (only := sizes.pop()) is not None:
        w = int(only)
        return w, (f"{read.family.model_class} never reads sliding_window / attention_chunk_size; transformers' "
                   f"generation cache does: its generate attends to the last {w} positions while decoding, and so "
                   f"does this model's cache (cache_window={w}); the forward sees every position")
    return None, (f"sliding_window={sliding!r}, attention_chunk_size={chunk!r}, "
                  f"layer_types={config.get('layer_types')!r}: {read.family.model_class} never reads them, but "
                  "transformers' generation cache gives some layers a window and not others, which the LanguageModel's "
                  "cache does not hold")


def _stored_head(lm: LMConfig, ours: dict[str, Any], stored: Any, name: str) -> tuple[LMConfig, tuple[str, ...]]:
    """tie_word_embeddings true over a file with its own head: what from_pretrained does. The
    file's head is kept (untied, into `ours`) when it differs from the embedding; (lm, notes)."""
    if "embed.weight" not in ours or stream.array_equal(stored, ours["embed.weight"]):
        return lm, ()
    note = (f"tie_word_embeddings is true but the file holds its own {name}weight, which differs from the embedding: "
            "kept, as transformers' from_pretrained keeps it")
    ours["head.weight"] = stored
    return replace(lm, head="untied"), (note,)


def read_whole(config: Mapping[str, Any], sd: Mapping[str, Any], part: str, *, ignore_keys: tuple[str, ...] = ()
               ) -> tuple[ConfigRead, LMConfig, dict[str, Any], tuple[str, ...]]:
    """An HF model's `part` ("model" or "causal-lm") read from its config and state dict:
    (the config read, the LMConfig, {the twins' LanguageModel torch name: tensor}, notes);
    framework-free (`flax_blocks.checkpoints.checkpoint.read_checkpoint` wraps it for either twin).

    Every tensor is read or the load is refused naming it. A head stored beside a config that
    says tie_word_embeddings: what from_pretrained does, the file's head is kept (untied when it
    differs from the embedding). The state dict's values may be `flax_blocks.checkpoints.stream.Lazy`
    (a folder's files, described by their headers): they stay unread until placed."""
    read, lm = _lm_config(config, part, ignore_keys)
    dialect, cfg = read.dialect, read.cfg
    _, out = _family(config)
    tr = dialects.translate(sd, dialect, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads)
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
        if cfg.has_norm_bias:  # (BERT: bias; ModernBERT: norm_bias)
            take("embed_norm.bias", base + out.embed_norm + "bias")
    if lm.project_dim is not None:
        assert out.projections is not None  # project_dim comes from them
        take("project_in.weight", base + out.projections[1] + "weight")
        take("project_out.weight", base + out.projections[2] + "weight")
    head = (base and base[:-len(out.base)]) + (out.head or "")  # the head sits beside the base model
    if lm.head == "untied":
        if head + "weight" not in sd:
            problems.append(f"missing key {head}weight: the source has no LM head (a base model such as LlamaModel?); "
                            "part='causal-lm' needs the model with its head (LlamaForCausalLM), or take part='model'")
        else:
            take("head.weight", head + "weight")
            if lm.head_bias:
                take("head.bias", head + "bias")
    elif lm.head == "tied" and head + "weight" in sd:  # a model object's state dict holds the tied weight twice
        taken.add(head + "weight")
    stack = {k for k in sd if k not in tr.dropped}
    left = [k for k in sd if k not in taken and k not in stack
            and not any(k[len(base):].startswith(i) for i in out.ignore) and not (out.head and k.startswith(head))]
    if part == "model":
        left = [k for k in left if k.startswith(base)]  # a head outside the base model is not read
    problems += [f"unexpected key {k}: not a part of the {config.get('model_type')} {part} the blocks compute"
                 for k in left]
    if problems:
        raise ConversionError(problems, header=f"cannot load this {config.get('model_type')} model as part={part!r}")
    notes: tuple[str, ...] = ()
    if lm.head == "tied" and head + "weight" in sd:  # read (a block of rows at a time) once all checks passed
        lm, notes = _stored_head(lm, ours, sd[head + "weight"], head)
    log.info("from_hf: %s model as part=%s (%s head)", config.get("model_type"), part, lm.head)
    return read, lm, ours, (*read.notes, *notes)


def _family_of(model, dialect: str, family: str | None = None) -> tuple[str, Outside]:
    """The family a LanguageModel is written as: the one from_hf read it from when `dialect` is
    that family's, else the first family of `dialect` with a table (hf-bert: BERT, hf-llama:
    LLaMA); its parts around the stack must compute what the model computes."""
    family = family or getattr(model, "hf_family", None)
    if family not in FAMILIES or FAMILIES[family].dialect != dialect or FAMILIES[family].outside is None:
        family = next((t for t in families_of_dialect(dialect) if FAMILIES[t].outside is not None), None)
    if family is None:
        raise ConversionError([f"{dialect}: no family of that dialect has its parts around the stack declared"],
                              header="cannot write this whole model")
    out, lm, problems = FAMILIES[family].outside, model.lm, []
    assert out is not None  # chosen above among the families that declare their parts around the stack
    if out.embed_multiplier is not None or out.logits_divisor is not None:
        pass  # scalars the family's config holds (Granite): written into it by save_hf
    elif (lm.embed_scale is not None) != out.embed_scale:
        problems.append(f"embed_scale={lm.embed_scale}: {family} " + ("scales its embeddings by sqrt(hidden_size)"
                                                                     if out.embed_scale else "has no embedding scale"))
    elif out.embed_scale and lm.embed_scale != float(model.cfg.d_model) ** 0.5:
        problems.append(f"embed_scale={lm.embed_scale}: {family} scales by sqrt(hidden_size) = "
                        f"{float(model.cfg.d_model) ** 0.5}")
    if lm.logits_divisor is not None and out.logits_divisor is None:
        problems.append(f"logits_divisor={lm.logits_divisor}: {family} does not divide its logits")
    if lm.final_logit_softcap is not None and out.final_logit_softcap is None:
        problems.append(f"final_logit_softcap={lm.final_logit_softcap}: {family} has no final logit soft-cap")
    if lm.logit_scale is not None and out.logit_scale is None:
        problems.append(f"logit_scale={lm.logit_scale}: {family} does not scale its logits")
    want = {"none": (0, "arange"), "two": (2, "mask")}.get(out.position_offset)
    if want is not None and (lm.position_offset, lm.default_positions) != want:
        problems.append(f"position_offset={lm.position_offset}, default_positions={lm.default_positions!r}: {family} "
                        f"has {want}")
    if out.position_offset == "pad" and lm.max_positions is not None and lm.default_positions != "ids":
        problems.append(f"default_positions={lm.default_positions!r}: {family} numbers its positions from the ids")
    if problems:
        raise ConversionError(problems, header=f"cannot write this whole model as {family} ({dialect})")
    return family, out


def to_hf_model(model, dialect: str, *, prefix: str | None = None, family: str | None = None
                ) -> dict[str, np.ndarray]:
    """{HF name: numpy array} of a whole LanguageModel, named as HF's checkpoint files of the
    model with a head (LlamaForCausalLM, GPT2LMHeadModel, OPTForCausalLM, GPTNeoXForCausalLM's
    gpt_neox.embed_in.weight ... embed_out.weight) or of the base model (LlamaModel, GPT2Model,
    BertModel, RobertaModel) for head="none". A tied head is written as lm_head.weight too,
    as HF's state_dict() holds it (the same values as the embedding). The family is the one
    from_hf read the model from (`hf_family`), else the first of `dialect`'s with a table."""
    _, out = _family_of(model, dialect, family)
    lm = model.lm
    base = ("" if lm.head == "none" else out.base) if prefix is None else prefix
    sd = twin_state_dict(model)
    hf: dict[str, np.ndarray] = {base + out.embed: sd["embed.weight"]}
    if lm.max_positions is not None:
        if not out.positions:
            raise ConversionError([f"{dialect} has no learned positions"], header="cannot write this whole model")
        hf[base + out.positions] = sd["pos.weight"]
    if lm.token_types:
        if not out.token_type:
            raise ConversionError([f"{dialect} has no token-type embeddings"], header="cannot write this whole model")
        hf[base + out.token_type] = sd["token_type.weight"]
    if lm.embed_norm:
        if not out.embed_norm:
            raise ConversionError([f"{dialect} has no norm on the embeddings"], header="cannot write this whole model")
        for k in ("weight", "bias"):
            if f"embed_norm.{k}" in sd:
                hf[base + out.embed_norm + k] = sd[f"embed_norm.{k}"]
    if lm.project_dim is not None:
        if out.projections is None:
            raise ConversionError([f"{dialect} has no projection of its embeddings"],
                                  header="cannot write this whole model")
        hf[base + out.projections[1] + "weight"] = sd["project_in.weight"]
        hf[base + out.projections[2] + "weight"] = sd["project_out.weight"]
    stack = {k[len(ENCODER) + 1:]: v for k, v in sd.items() if k.startswith(ENCODER + ".")}
    hf.update(dialects.to_dialect(stack, dialect, model.cfg, prefix=base))
    if lm.head != "none":
        if out.head is None:
            raise ConversionError([f"{dialect} has no LM head"], header="cannot write this whole model")
        hf[out.head + "weight"] = sd["head.weight"] if lm.head == "untied" else sd["embed.weight"]
        if "head.bias" in sd:
            hf[out.head + "bias"] = sd["head.bias"]
    return {k: np.ascontiguousarray(v) for k, v in hf.items()}
