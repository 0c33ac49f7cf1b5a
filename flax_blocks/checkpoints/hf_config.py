"""What a Hugging Face model says about itself: its config (config.json) read into a
BlockConfig (`read_config`, through its family's module in `flax_blocks.checkpoints.families`,
refusing by name whatever the blocks do not compute, ignoring and listing the keys the family's
code never reads), and the weights of a save_pretrained folder (`read_folder`, in
from_pretrained's choice of files).

Framework-free; read by `flax_blocks.checkpoints.hf` (from_hf / to_hf) and by the converter, which
checks an HF model object handed to `from_torch` against its own config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from ..core.config import BlockConfig, dtype_name
from ..core.options import BY_NAME
from . import dialects, stream
from .family import FAMILIES, NOT_COMPUTED, PARTS, Family, Read, audit, not_computed
from .io import ConversionError, read_state_dict
from .quantized import dequantize


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
    if part == "decoder" and model_type not in PARTS:
        raise ConversionError([f"part='decoder': a {model_type} model has one stack (encoder-decoder families: "
                               f"{', '.join(PARTS)})"], header="cannot read this Hugging Face model")
    return PARTS[model_type][part or "encoder"] if model_type in PARTS else FAMILIES[model_type]


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
