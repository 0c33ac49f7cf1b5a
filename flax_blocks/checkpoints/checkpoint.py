"""A Hugging Face source read once, for either twin: `read_checkpoint` -> `Checkpoint`.

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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..core.config import BlockConfig, dtype_name
from ..core.lm_config import LMConfig
from . import dialects
from .family import LANGUAGE_MODELS
from .generation_config import model_generation_config, read_generation_config
from .hf_config import ConfigRead, hf_model_config, hf_state_dict, read_config, read_folder, weight_files
from .hf_models import read_whole
from .io import ConversionError, read_state_dict
from .load_report import report_ignored
from .quantized import quantized_notes

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
