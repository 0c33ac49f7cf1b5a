"""A Hugging Face source read once, framework-free, for either twin: `read_checkpoint` -> `Checkpoint`.

    ckpt = read_checkpoint("my-llama", part="causal-lm")   # a folder, a Hub id or a transformers model
    ckpt.cfg, ckpt.lm                                      # BlockConfig, LMConfig (None for a stack)
    ckpt.tensors                                           # {our torch name: stream.Lazy}, not yet read

The config is read once (its family resolved once, every refusal raised here, before any tensor
is read), the weights are described by the files' headers in transformers' file order and
translated to the blocks' own torch names (`flax_blocks.checkpoints.dialects`). What is left is
placing, which is each twin's own: `fb.from_hf` creates JAX arrays (on a mesh, each device its
slice), `tb.from_hf` torch tensors. Both read each tensor once, as they place it; both mark the
model with what the load read (`mark`: the dialect and family `to_hf` writes back, the load
report). Framework-free: numpy only, so `torch_blocks` reads checkpoints without importing JAX.

In the order a load reads them:
    the config     `family_of`, `read_config` (config.json -> BlockConfig, through the family's module
                   in `flax_blocks.checkpoints.families`: what the blocks do not compute refused by
                   name, the keys the family's code never reads ignored and listed), `config_dtype`
    the files      `weight_files` (from_pretrained's choice), `read_folder`, `hf_state_dict` (a
                   model object's weights named as its save_pretrained writes them)
    whole models   `lm_config`, `read_whole`: the parts around the stack (embeddings, positions,
                   head) each family's `Outside` declares -> LMConfig and the twins' torch names;
                   what a family computes there that the LanguageModel does not is refused by name
    the checkpoint `Checkpoint`, `read_checkpoint`, `describe`, `mark`, `check_shapes`
    generation     `read_generation_config`: generation_config.json as transformers reads it
    the report     `LoadReport`, `load_report(model)`: the files read and the keys read as nothing
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

from ..core.config import BlockConfig, dtype_name
from ..core.lm_config import ENCODER, GenerationSettings, LMConfig
from ..core.options import BY_NAME
from . import dialects, stream
from .family import FAMILIES, LANGUAGE_MODELS, NOT_COMPUTED, Family, Outside, Read, audit, not_computed, unexpected
from .family import PARTS as ENCODER_DECODER
from .io import ConversionError, read_state_dict
from .quantized import dequantize, quantized_notes

log = logging.getLogger("flax_blocks")



# --- the config: what a Hugging Face model says about itself -------------------------------------

def family_of(config: Mapping[str, Any], part: str | None = None) -> Family:
    """The family table (flax_blocks.checkpoints.families) that reads this config: its model_type's,
    or for an encoder-decoder family (Whisper) its part's. Unknown and unsupported model_types
    are refused by name, with what the unsupported ones compute."""
    model_type = config.get("model_type")
    if part not in (None, "encoder", "decoder"):
        raise ValueError(f"part must be None, 'encoder' or 'decoder', got {part!r}")
    if model_type not in FAMILIES:
        if model_type in NOT_COMPUTED:
            problem = f"model_type {model_type!r}: {not_computed(model_type, config)}, which the blocks do not compute"
        else:
            problem = f"model_type {model_type!r}: no table reads it; supported: {', '.join(FAMILIES)}"
        raise ConversionError([problem], header="cannot read this Hugging Face model")
    if part == "decoder" and model_type not in ENCODER_DECODER:
        raise ConversionError([f"part='decoder': a {model_type} model has one stack (encoder-decoder families: "
                               f"{', '.join(ENCODER_DECODER)})"], header="cannot read this Hugging Face model")
    if model_type in ENCODER_DECODER:
        return ENCODER_DECODER[model_type][part or "encoder"]
    return FAMILIES[model_type]


@dataclass(frozen=True)
class ConfigRead:
    """What an HF config says the blocks compute: the dialect of its weights, the BlockConfig,
    the stack's depth and final norm, and {key: why it changes nothing} for every key read as
    nothing (known inert keys, keys the family's code never reads, `ignore_keys`)."""

    dialect: str
    cfg: BlockConfig
    num_layers: int
    final_norm: bool
    family: Family
    ignored: Mapping[str, str]
    notes: tuple[str, ...] = ()


def read_config(config: Mapping[str, Any], *, dtype: Any = None, part: str | None = None,
                ignore_keys: tuple[str, ...] = ()) -> ConfigRead:
    """An HF config (config.json as a dict) -> `ConfigRead`.

    The family's table (`flax_blocks.checkpoints.family`) reads the keys its transformers
    model reads (an alias of the config class's attribute_map too), with its config class's
    defaults for the keys the file leaves out; what the dialect's layers fix comes from the
    dialect. A key the family's code never reads is ignored, as transformers ignores it, and
    listed in `ignored`. Raises ConversionError naming every key whose value the blocks do not
    compute. ignore_keys: keys to read as absent (their class defaults apply), a departure from
    transformers the caller asks for. part: "encoder" (the default) or "decoder" of an
    encoder-decoder family (Whisper)."""
    family = family_of(config, part)
    ignore = set(ignore_keys)
    c = Read({k: v for k, v in config.items() if k not in ignore}, family)
    problems, ignored = audit(c.config, family)
    c.problems += problems
    kw = family.reader(c)
    num_layers, final_norm = kw.pop("num_layers"), kw.pop("final_norm")
    lay = dialects.DIALECTS[family.dialect]
    for k, v in lay.settings.items():  # what the dialect's layers fix; the reader must agree
        if k in kw and kw[k] is not None and kw[k] != v:
            c.problems.append(f"{k}={kw[k]!r} (from the config): the {lay.name} layers compute {k}={v!r}")
        kw[k] = v
    if dtype is not None:
        kw["param_dtype"] = dtype_name(dtype)
    elif (name := config_dtype(config)) is not None:
        kw["param_dtype"] = name
    if c.problems:
        raise ConversionError(c.problems, header=f"cannot reproduce this {family.model_type} model in the Flax blocks")
    try:
        cfg = BlockConfig(**{k: v for k, v in kw.items() if v is not None or k != "activation"})
    except (TypeError, ValueError) as e:  # a combination the readers let through: a bug, said as one
        raise ConversionError([f"{e} (settings read: {kw})"],
                              header=f"cannot reproduce this {family.model_type} model in the Flax blocks") from e
    ignored.update(c.ignored)
    ignored.update({k: "named in ignore_keys: read as absent (the config class's default), unlike transformers"
                    for k in config if k in ignore})
    return ConfigRead(family.dialect, cfg, num_layers, final_norm, family, ignored)


def hf_config(config: Mapping[str, Any], *, dtype: Any = None, part: str | None = None,
              ignore_keys: tuple[str, ...] = ()) -> tuple[str, BlockConfig, int, bool]:
    """(dialect, BlockConfig, num_layers, final_norm) of an HF config: `read_config`'s first four."""
    r = read_config(config, dtype=dtype, part=part, ignore_keys=ignore_keys)
    return r.dialect, r.cfg, r.num_layers, r.final_norm


# The dtypes a config.json names that transformers loads (torch's names): float32 and bfloat16
# checkpoints, float16 ones, and float64 (PretrainedConfig turns the name into getattr(torch, name)).
CONFIG_DTYPES = {"float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
                 "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The parameter dtype a config names (`dtype`, else the older `torch_dtype`, as
    PretrainedConfig reads them: dtype wins), as one of BlockConfig's dtype names; None when it
    names none ("auto", absent) or one the blocks do not hold."""
    value = config.get("dtype") if config.get("dtype") is not None else config.get("torch_dtype")
    if not isinstance(value, str):
        value = dtype_name(value)
    return CONFIG_DTYPES.get(str(value).removeprefix("torch.")) if value is not None else None


# The files from_pretrained reads in a folder, in its order (modeling_utils._get_resolved_checkpoint_files):
# the first that exists is read, whatever else the folder holds.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def weight_files(path: str, explicit: str | None = None) -> list[str]:
    """The weight files of a save_pretrained folder, chosen as transformers' from_pretrained
    chooses them: the file the config names in `transformers_weights` (`explicit`), else the
    first of model.safetensors, model.safetensors.index.json, pytorch_model.bin,
    pytorch_model.bin.index.json that exists (an index: the shards it names). Other files (a
    Mistral repository's consolidated.safetensors, a stale index beside a single file) are not
    read."""
    if explicit is not None:
        target = os.path.abspath(os.path.join(path, explicit))
        if not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise FileNotFoundError(f"{path}/config.json: transformers_weights={explicit!r} is neither a .safetensors "
                                    "file nor a .safetensors.index.json (transformers refuses it too)")
        if os.path.commonpath([os.path.abspath(path), target]) != os.path.abspath(path):
            raise FileNotFoundError(f"{path}/config.json: transformers_weights={explicit!r} lies outside the folder "
                                    "(transformers refuses it too)")
        names = [explicit]
    else:
        names = [n for n in WEIGHT_FILES if os.path.isfile(os.path.join(path, n))][:1]
    if not names:
        present = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
        raise FileNotFoundError(f"{path}: none of {', '.join(WEIGHT_FILES)} (the files HF's save_pretrained "
                                f"writes); weight-like files present: {present or 'none'}")
    name = names[0]
    if not name.endswith(".index.json"):
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(f"{path}: transformers_weights names {name}, which is not in the folder")
        return [os.path.join(path, name)]
    index_path = os.path.join(path, name)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"{path}: transformers_weights names {name}, which is not in the folder")
    with open(index_path) as f:
        shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
    if not shards or missing:
        raise FileNotFoundError(f"{index_path} names shards that are not in the folder: {missing}"
                                if missing else f"{index_path} has no weight_map")
    return [os.path.join(path, s) for s in shards]


def read_folder(path: str, *, dequantized: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, state dict) of a save_pretrained folder (see `weight_files`): the state
    dict's values are `flax_blocks.checkpoints.stream.Lazy`, described by the files' headers, not read.
    A folder whose quantization_config is fp8 or mxfp4 gives its quantized tensors dequantized
    (`flax_blocks.checkpoints.quantized`: named, shaped and typed as transformers' dequantize=True
    load holds them, in the config's dtype, dequantized as they are read); dequantized=False: as stored."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json (expected a folder written by save_pretrained)")
    with open(cfg_path) as f:
        config = json.load(f)
    sd: dict[str, Any] = {}
    for s in weight_files(path, config.get("transformers_weights")):
        sd.update(stream.read_safetensors(s) if s.endswith(".safetensors") else read_state_dict(s, lazy=True))
    if dequantized and "quantization_config" in config:
        sd = dequantize(config, sd, config_dtype(config))
    return config, sd


def hf_model_config(source: Any) -> dict[str, Any] | None:
    """The config (as a dict) of a transformers model object, None for anything else."""
    config = getattr(source, "config", None)
    if config is None or not hasattr(source, "state_dict") or not isinstance(getattr(config, "model_type", None), str):
        return None
    return config.to_dict()


def hf_state_dict(source: Any) -> Any:
    """A transformers model object's weights named as its save_pretrained writes them (the
    checkpoint files' names: transformers 5 renames some modules in the library, ViT's among
    them, and converts back when saving); any other source is returned as it is."""
    if hf_model_config(source) is None:
        return source
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time renaming: the module's names are the files'
        return source.state_dict()
    return revert_weight_conversion(source, source.state_dict())


# Fields a caller may set freely when loading an HF model: not what its weights compute.
_FREE = {o.name for o in BY_NAME.values() if o.kind in ("init", "implementation")} | {"dtype", "param_dtype"}


def check_hf_source(cfg: BlockConfig | None, source: Any, dialect: str | None) -> str | None:
    """For a transformers model object handed to the converter: its family's dialect, after
    checking that `cfg` (when given) computes what the model computes. The model's own config
    says what it is (`model_type`); a family the blocks do not compute is refused by name, as
    is a `dialect=` or a config field that contradicts the model. None for other sources."""
    config = hf_model_config(source)
    if config is None:
        return dialect
    family, want, _, _ = hf_config(config)  # refuses unsupported families and settings by name
    problems = []
    if dialect is not None and dialect != family:
        problems.append(f"dialect={dialect!r} given, but a {config['model_type']} model is written in {family}")
    if cfg is not None:
        same = {"num_kv_heads": lambda c: c.kv_heads, "qkv_bias": lambda c: c.has_qkv_bias}  # None = the default
        problems += [f"{f}={getattr(cfg, f)!r} given, but the {config['model_type']} model has {f}={getattr(want, f)!r}"
                     for f in BY_NAME if f not in _FREE
                     and same.get(f, attrgetter(f))(cfg) != same.get(f, attrgetter(f))(want)]
    if problems:
        raise ConversionError(problems + ["fb.from_hf(model) reads every setting from the model's config"],
                              header=f"the config contradicts the source {type(source).__name__}")
    return family


# --- whole models: the parts around the stack ----------------------------------------------------

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


# --- the checkpoint: a source read once ----------------------------------------------------------

PARTS = ("stack", "encoder", "decoder", "model", "causal-lm")
_FLOATS = {"float32", "float64", "bfloat16", "float16"}


@dataclass(frozen=True)
class Checkpoint:
    """What a source holds, in the blocks' terms, before any tensor is read.

    part: "stack", "encoder" or "decoder" (a stack: `stack` names its class, Encoder or
      Decoder) or "model" / "causal-lm" (a whole LanguageModel: `lm` is its LMConfig).
    cfg: the BlockConfig; its param_dtype is the dtype asked for, else the tensors' one float
      dtype (a bfloat16 checkpoint stays bfloat16).
    num_layers, final_norm: the stack's depth and whether it ends with a norm.
    tensors: {torch name of the twins (a stack's `layers.0.self_attn.in_proj_weight`, a whole
      model's `embed.weight`, `encoder.layers.0...`): stream.Lazy or array}, unread.
    dialect, family: the HF naming and model_type it came from (what `to_hf` writes back).
    config, origin, read, notes: config.json's dict, where it came from, what its reading
      ignored, and what the load decided (for the load report).
    """

    part: str
    cfg: BlockConfig
    lm: LMConfig | None
    stack: str
    num_layers: int
    final_norm: bool
    tensors: Mapping[str, Any]
    dialect: str
    family: str | None
    config: Mapping[str, Any]
    origin: Mapping[str, Any]
    read: ConfigRead
    notes: tuple[str, ...] = ()


def read_checkpoint(source: Any, *, part: str = "stack", dtype: Any = None, ignore_keys: tuple[str, ...] = (),
                    revision: str | None = None) -> Checkpoint:
    """`source` (a save_pretrained folder, a Hub id at `revision`, or a transformers model
    object) read for `part` (see `Checkpoint`), every check done: a config the blocks do not
    compute, a missing or unexpected tensor, is refused here (ConversionError), before any
    tensor is read. dtype: the dtype the twins will place the tensors in (None: the
    checkpoint's); ignore_keys: config keys read as absent (see `fb.from_hf`)."""
    if isinstance(ignore_keys, str):
        raise TypeError(f"ignore_keys must be a tuple of config keys, e.g. ({ignore_keys!r},), got the string "
                        f"{ignore_keys!r}")
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(repr(p) for p in PARTS)}, got {part!r}")
    config, sd, origin = read_source(source, revision)
    ckpt = describe(config, sd, part, dtype=dtype, ignore_keys=tuple(ignore_keys), origin=origin)
    if ckpt.lm is not None and part == "causal-lm":  # generate follows the checkpoint's settings, as HF's
        ckpt = replace(ckpt, lm=replace(ckpt.lm, generation=_generation_settings(source, config, origin)))
    return ckpt


def _generation_settings(source: Any, config: Mapping[str, Any], origin: Mapping[str, Any]) -> Any:
    """The generation settings transformers' from_pretrained gives `source` (a folder's
    generation_config.json, else its config.json; a model object's generation_config)."""
    if "folder" in origin:
        return read_generation_config(origin["folder"], config)
    return read_generation_config(model_generation_config(source), config)


def describe(config: Mapping[str, Any], sd: Mapping[str, Any], part: str, *, dtype: Any = None,
             ignore_keys: tuple[str, ...] = (), origin: Mapping[str, Any] | None = None) -> Checkpoint:
    """The Checkpoint of a config.json's dict and a state dict named as the whole HF model's
    (`read_checkpoint` without the reading of a source)."""
    origin = origin or {"source": "a state dict"}
    if part in ("model", "causal-lm"):
        read, lm, tensors, notes = read_whole(config, sd, part, ignore_keys=ignore_keys)
        return Checkpoint(part, placed_dtype(read.cfg, tensors, dtype), lm, "Encoder", lm.num_layers, read.final_norm,
                          tensors, read.dialect, config.get("model_type"), config, origin, read, notes)
    return _read_stack(config, sd, part, dtype=dtype, ignore_keys=ignore_keys, origin=origin)


def read_source(source: Any, revision: str | None = None
                ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(config.json's dict, the state dict named as in the whole model (values unread), where it
    came from: {"source": ..., "folder": ..., "files": [...]}) of a folder, a Hub id or a
    transformers model object."""
    config: dict[str, Any] | None
    if isinstance(source, (str, os.PathLike)):
        folder = os.fspath(source)
        if not os.path.isdir(folder) or revision is not None:  # a Hub id (or a revision, which a folder refuses)
            from .hub import resolve

            folder = resolve(folder, revision)
        config, sd = read_folder(folder)
        origin = {"source": os.fspath(source), "folder": os.path.abspath(folder),
                  "files": [os.path.basename(f) for f in weight_files(folder, config.get("transformers_weights"))]}
        if "quantization_config" in config:
            origin["notes"] = quantized_notes(config)
    elif (config := hf_model_config(source)) is not None:
        sd = read_state_dict(hf_state_dict(source))
        origin = {"source": f"a {type(source).__name__} object", "files": []}
    else:
        raise TypeError(f"source must be a save_pretrained folder or a transformers model, got {type(source).__name__}")
    config, sd, origin = _language_model(config, sd, origin)
    return config, _whole_model_names(config, sd), origin


def _language_model(config: dict[str, Any], sd: dict[str, Any], origin: dict[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A multimodal model whose language model is a registered family (`LANGUAGE_MODELS`; Gemma 3
    from 4B up): its text config (the file's dtype carried over) and its language
    model's weights named as the family's causal LM; the rest (vision tower, projector) is
    left unread and noted in the load report. Other configs pass through."""
    entry = LANGUAGE_MODELS.get(config.get("model_type"))  # type: ignore[arg-type]
    if entry is None:
        return config, sd, origin
    key, prefixes = entry
    text = dict(config.get(key) or {})
    for dtype_key in ("dtype", "torch_dtype"):
        if dtype_key in config and "dtype" not in text and "torch_dtype" not in text:
            text[dtype_key] = config[dtype_key]
    ours, rest = {}, []
    for name, a in sd.items():
        for theirs, mine in prefixes:
            if name.startswith(theirs):
                ours[mine + name[len(theirs):]] = a
                break
        else:
            rest.append(name)
    parts = sorted({n.split(".")[0] for n in rest})
    note = (f"a {config['model_type']} model: its language model ({text.get('model_type')}) read; "
            f"{', '.join(parts) or 'nothing else'} ({len(rest)} tensors) left unread")
    return text, ours, {**origin, "notes": (*origin.get("notes", ()), note)}


def _whole_model_names(config: dict[str, Any], sd: dict[str, Any]) -> dict[str, Any]:
    """A part saved on its own (a WhisperEncoder: architectures ["WhisperEncoder"], its keys
    without "encoder.") named as in the whole model, which the dialects read."""
    if config.get("architectures") == ["WhisperEncoder"] and not any(k.startswith("encoder.") for k in sd):
        return {f"encoder.{k}": v for k, v in sd.items()}
    return sd


def placed_dtype(cfg: BlockConfig, tensors: Mapping[str, Any], dtype: Any) -> BlockConfig:
    """cfg with the param_dtype the twins place in: `dtype` when given, else the tensors' own
    when they share one float dtype (a bfloat16 or float16 checkpoint stays so)."""
    if dtype is not None:
        return replace(cfg, param_dtype=dtype_name(dtype))
    dtypes = {str(a.dtype) for a in tensors.values()}
    if len(dtypes) == 1 and dtypes <= _FLOATS:
        return replace(cfg, param_dtype=dtypes.pop())
    return cfg


def _read_stack(config: Mapping[str, Any], sd: Mapping[str, Any], part: str, *, dtype: Any,
                ignore_keys: tuple[str, ...], origin: Mapping[str, Any]) -> Checkpoint:
    """part "stack", "encoder" or "decoder": the family's layers (and final norm) in the twins'
    torch names."""
    read = read_config(config, dtype=dtype, part=None if part == "stack" else part, ignore_keys=ignore_keys)
    tensors = dialects.translate(sd, read.dialect, num_heads=read.cfg.num_heads,
                                 num_kv_heads=read.cfg.kv_heads).state_dict
    cfg = placed_dtype(read.cfg, tensors, dtype)
    return Checkpoint(part, cfg, None, dialects.DIALECTS[read.dialect].stack, read.num_layers, read.final_norm,
                      tensors, read.dialect, config.get("model_type"), config, origin, read, read.notes)


def mark(model: Any, ckpt: Checkpoint) -> Any:
    """`model` (of either twin) marked with what `ckpt` read: the dialect and family `to_hf`
    writes it back as, and its load report (`load_report(model)`; one warning for the keys
    transformers never reads and for each note). Returns the model."""
    model.hf_dialect = ckpt.dialect  # a plain attribute (static in nnx.split)
    if ckpt.lm is not None:
        model.hf_family = ckpt.family
    report_ignored(model, ckpt.config, ckpt.part, ckpt.origin, ckpt.read, ckpt.notes)
    return model


def check_shapes(ckpt: Checkpoint, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise one ConversionError naming every tensor a twin's module (`expected`: {torch name:
    shape}) lacks, does not expect, or expects in another shape."""
    problems = [f"missing key {k} (shape {shape})" for k, shape in expected.items() if k not in ckpt.tensors]
    problems += [f"unexpected key {k}" for k in ckpt.tensors if k not in expected]
    problems += [f"{k}: expected shape {expected[k]}, the checkpoint has {tuple(a.shape)}"
                 for k, a in ckpt.tensors.items() if k in expected and tuple(a.shape) != tuple(expected[k])]
    if problems:
        raise ConversionError(problems, header=f"cannot place this {ckpt.config.get('model_type')} checkpoint "
                                               f"(part={ckpt.part!r})")


# --- generation settings: generation_config.json as transformers 5.24 reads it -------------------

# `from_pretrained` (generation/utils.py `adjust_generation_fn`) reads the folder's
# `generation_config.json`; without one, `GenerationConfig.from_pretrained(folder,
# config_file_name="config.json")`: the same keys at config.json's top level. A model object
# carries its `generation_config` (built by `GenerationConfig.from_model_config(config)` when
# it was made from a config: the config's own keys, then its text config's).

GENERATION_CONFIG = "generation_config.json"


def read_generation_config(source: str | os.PathLike | Mapping[str, Any] | None,
                           config: Mapping[str, Any]) -> GenerationSettings:
    """The generation settings of `source`: a folder (its generation_config.json, else the
    keys of `config`, its config.json's dict, as transformers falls back to it), a dict (a
    generation config's keys: `model.generation_config.to_dict()`), or None (`config`'s keys).
    A generation_config.json that is no JSON object, or holds values of the wrong kind, is
    refused naming the file and the key."""
    where = "config.json"
    if isinstance(source, (str, os.PathLike)):
        folder = os.fspath(source)
        path = os.path.join(folder, GENERATION_CONFIG)
        if not os.path.isfile(path):  # transformers' fallback: config.json's top level (a multimodal one's too)
            path = os.path.join(folder, "config.json")
        source = _json_object(path) if os.path.isfile(path) else None
        where = path
    elif source is not None:
        where = "the generation config"
    keys = dict(config if source is None else source)
    try:
        return GenerationSettings.from_dict(keys)
    except ValueError as e:
        raise _refused(f"{where}: {e}") from None


def _refused(problem: str) -> ConversionError:
    return ConversionError([problem], "cannot read the generation config")


def _json_object(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise _refused(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(out, dict):
        raise _refused(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


def model_generation_config(model: Any) -> dict[str, Any] | None:
    """A transformers model object's `generation_config` as a dict (None: it has none)."""
    gen = getattr(model, "generation_config", None)
    return None if gen is None else dict(gen.to_dict())


# --- the load report: what from_hf did with a checkpoint -----------------------------------------

# A config key that a family's transformers code never reads changes nothing there, so it is
# ignored here too; published configs carry many (bert-base-uncased's `gradient_checkpointing`,
# DistilBERT's `tie_weights_`). The report lists each with the reason, so that what a load
# passed over is one call away instead of a guess.

@dataclass(frozen=True)
class LoadReport:
    """model_type and part of the load; source: the folder, Hub id or model class read;
    folder: the folder its files were read from (a Hub id's in the cache; None for a model
    object); files: the weight files read, in from_pretrained's choice; ignored: (config key,
    why it changes nothing) pairs, rope parameters as "rope_scaling.key"; notes: anything else
    the load decided (a stored head kept under tied embeddings, ...); config_json: the config
    read, as JSON (`config`), which `fb.save_hf` writes back."""

    model_type: str
    part: str
    source: str
    folder: str | None = None
    files: tuple[str, ...] = ()
    ignored: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    config_json: str = "{}"

    @property
    def config(self) -> dict[str, Any]:
        """The config.json read (a dict)."""
        return json.loads(self.config_json)

    @property
    def ignored_keys(self) -> dict[str, str]:
        """{config key: why it changes nothing}."""
        return dict(self.ignored)

    def __str__(self) -> str:
        lines = [f"{self.model_type} as part={self.part!r} from {self.source}"]
        lines += [f"  read {f}" for f in self.files]
        lines += [f"  ignored {k}: {why}" for k, why in self.ignored]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def make_report(config: Mapping[str, Any], part: str, origin: Mapping[str, Any], ignored: Mapping[str, str],
                notes: tuple[str, ...] = ()) -> LoadReport:
    """A LoadReport of a config read for `part` from `origin` ({"source": ..., "files": [...]})."""
    return LoadReport(str(config.get("model_type")), part, str(origin.get("source", "?")), origin.get("folder"),
                      tuple(origin.get("files", ())), tuple(sorted(ignored.items())), notes,
                      json.dumps(config, sort_keys=True))


def load_report(model: Any) -> LoadReport:
    """The LoadReport of a model `fb.from_hf` loaded (its `load_report` attribute)."""
    report = getattr(model, "load_report", None)
    if not isinstance(report, LoadReport):
        raise ValueError(f"this {type(model).__name__} was not loaded by fb.from_hf: it has no load report")
    return report


def report_ignored(model: Any, config: Mapping[str, Any], part: str, origin: Mapping[str, Any], read: ConfigRead,
                   notes: tuple[str, ...] = ()) -> None:
    """Attach the load report to `model`; warn once about the config keys that transformers'
    code for the family never reads (the known inert ones are listed without a warning), and
    about each note (the source's own, a multimodal model's unread parts, come first)."""
    notes = (*origin.get("notes", ()), *notes)
    model.load_report = make_report(config, part, origin, read.ignored, notes)
    for note in notes:
        log.warning("from_hf: %s", note)
    surprising = unexpected(read.ignored, read.family)
    if surprising:
        log.warning("from_hf: %s never reads %s: ignored, as transformers ignores %s (fb.load_report(model) lists "
                    "them)", read.family.model_class, ", ".join(surprising), "it" if len(surprising) == 1 else "them")
