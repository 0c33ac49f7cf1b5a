"""A model of either twin back to a Hugging Face folder that transformers' `from_pretrained` reads.

    fb.save_hf(model, folder)                     # a model (or stack) that came from fb.from_hf
    fb.save_hf(model, folder, family="llama")     # one built from scratch, written as a family

writes config.json and the weights as safetensors, one file (model.safetensors) or shards of at
most `max_shard_size` bytes with their index (model.safetensors.index.json), named as the
family's checkpoints name them (`fb.to_hf`), a tied head left out as save_pretrained leaves it.

The config is the one the model was read from (every key kept, the dtype updated to the
tensors written), or for a model built from scratch the family's config written from its
BlockConfig and LMConfig; either way it is read back as `fb.from_hf` reads it and must give the
model's own settings, else the save is refused naming the fields (a Gemma written as a LLaMA
would lose its (1 + w) norms). Parts of the source that the model does not hold (BERT's pooler,
the embeddings around a stack loaded with part="stack") are copied from the folder it was
loaded from (`base=`: another folder), so that transformers finds every weight it expects.

On a mesh, each array is gathered to the host one at a time (across processes with
jax.experimental.multihost_utils) and process 0 writes: the host holds one shard at a time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from ..core.config import DTYPES, dtype_name
from ..core.lm_config import GenerationSettings
from . import dialects, quantized
from .checkpoint import GENERATION_CONFIG, WEIGHT_FILES, read_config, read_folder
from .family import FAMILIES, LANGUAGE_MODELS
from .io import ConversionError

log = logging.getLogger("flax_blocks")

# Fields that say how a model is computed or trained, not what: never compared with the config read back.
_FREE = ("dropout", "init", "dtype", "param_dtype", "attention", "attention_block", "dyt_alpha_init",
         "deepnorm_beta", "layerscale_init")


def save_hf(model: Any, folder: str | os.PathLike, *, family: str | None = None, base: Any = None,
            max_shard_size: int | str = "5GB", dtype: Any = None, quantization: str | None = None) -> list[str]:
    """Write `model` (a LanguageModel or a stack from `fb.from_hf`, or a LanguageModel built
    from scratch with `family` named, e.g. "llama") to `folder` as a Hugging Face checkpoint.

    base: a save_pretrained folder holding the parts the model does not (default: the folder
      the model was loaded from); a stack needs it for its embeddings and head.
    max_shard_size: bytes per safetensors file (an int, or "5GB", "500MB"); the weights go in
      one model.safetensors when they fit, else in shards with an index.
    dtype: the dtype the tensors are written in (default: the model's).
    quantization: None writes plain weights: a model read from a quantized folder (fp8,
      mxfp4) is written dequantized, without its quantization_config (a warning says so);
      "fp8" writes block-scaled FP8 as transformers reads it (`flax_blocks.checkpoints.quantized`):
      the weights its source folder stored in FP8 (an unchanged one: bit for bit, with its own
      scales), or for another model every 2-D weight of the layers, in the source's
      quantization_config (else [128, 128] blocks, dynamic activations); the rest in `dtype`.
    Returns the files written. Weight files of an earlier save in `folder` are replaced (as
    save_pretrained does), so that from_pretrained cannot read a stale one first."""
    folder = os.fspath(folder)
    limit = _bytes(max_shard_size)
    want = model.cfg.param_dtype if dtype is None else dtype_name(dtype)
    if want not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    model = _on_this_host(model)
    config = _config(model, family)
    config[("dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype")] = want
    tensors = _quantized(model, config, _tensors(model, config, base), quantization)
    first = _is_torch(model) or _process_index() == 0
    files = _write(folder, config, tensors, want, limit, first)
    generation = getattr(getattr(model, "lm", None), "generation", None)
    if first and generation not in (None, GenerationSettings()):  # as save_pretrained does
        files.append(write_generation_config(folder, generation))
    return files


def _quantized(model: Any, config: dict[str, Any], tensors: dict[str, Any], quantization: str | None
               ) -> dict[str, Any]:
    """The tensors (and config) in the format `quantization` asks (see save_hf)."""
    method = quantized.method_of(config)
    if quantization is None:
        if config.pop("quantization_config", None) is not None:
            log.warning("save_hf: the model was read from a %s-quantized folder; its weights are written "
                        "dequantized, without quantization_config (quantization='fp8' writes FP8)", method)
        return tensors
    if quantization != "fp8":
        raise ValueError(f"quantization must be None (plain weights) or 'fp8' (block-scaled FP8), got "
                         f"{quantization!r}")
    report = getattr(model, "load_report", None)
    folder = getattr(report, "folder", None)
    stored: dict[str, Any] = {}
    if method == "fp8" and folder and os.path.isdir(folder):
        stored = {k: v for k, v in read_folder(folder, dequantized=False)[1].items() if k.endswith("_scale_inv")}
    else:
        config["quantization_config"] = dict(quantized.FP8_CONFIG)
    return quantized.fp8_tensors(tensors, config, stored)


def _process_index() -> int:
    import jax

    return jax.process_index()


def _is_torch(model: Any) -> bool:
    return type(model).__module__.split(".")[0] == "torch_blocks"


def _on_this_host(model: Any) -> Any:
    """`model` itself, or (a Flax model in a multi-process run, where some arrays span other
    hosts' devices) a copy whose arrays are gathered whole onto every process: one host then
    writes them."""
    if _is_torch(model):
        return model
    import jax
    from flax import nnx

    if jax.process_count() == 1:
        return model
    from jax.experimental import multihost_utils

    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: multihost_utils.process_allgather(a, tiled=True)
                         if isinstance(a, jax.Array) and not a.is_fully_addressable else a, state)
    return nnx.merge(graphdef, state)


def _bytes(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "B": 1}
    text = str(size).strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit) and text[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * scale)
    raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as '5GB', got {size!r}")


def _np_dtype(dtype: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _config(model: Any, family: str | None) -> dict[str, Any]:
    """config.json's dict for `model` (its architectures the class of what is written), checked
    by reading it back."""
    from .checkpoint import LoadReport
    from .hf import causal_lm_class

    kind = type(model).__name__
    if kind not in ("LanguageModel", "Encoder", "Decoder"):
        raise TypeError(f"save_hf writes a LanguageModel or a stack (Encoder, Decoder), got {kind}")
    report = getattr(model, "load_report", None)
    if family is None and isinstance(report, LoadReport):
        config = dict(report.config)
        if config.get("model_type") in LANGUAGE_MODELS:  # the language model of a multimodal folder
            config = dict(config[LANGUAGE_MODELS[config["model_type"]][0]])
        model_type = str(config.get("model_type"))
    elif family is not None:
        from .hf_writers import config_for

        model_type, config = family, config_for(family, model)
    else:
        raise ConversionError(["this model was not loaded by fb.from_hf: name the family to write it as "
                               f"(family=..., one of {', '.join(sorted(FAMILIES))})"],
                              header=f"cannot save this {kind} as a Hugging Face folder")
    if kind == "LanguageModel":
        head = model.lm.head != "none"
        config["architectures"] = [causal_lm_class(model_type) if head else FAMILIES[model_type].model_class]
    _check_read_back(model, config)
    return config


def _check_read_back(model: Any, config: Mapping[str, Any]) -> None:
    """The config must read back (as fb.from_hf reads it) to the model's own settings."""
    import dataclasses

    want, problems = model.cfg, []
    part = "decoder" if getattr(model, "hf_dialect", None) == "hf-whisper-decoder" else None
    try:
        got = read_config(config, part=part).cfg
    except ConversionError as e:
        raise ConversionError(e.problems, header="the config written would not load") from None
    for f in dataclasses.fields(want):
        if f.name not in _FREE and getattr(got, f.name) != getattr(want, f.name):
            problems.append(f"{f.name}: the model has {getattr(want, f.name)!r}, its config.json would give "
                            f"{getattr(got, f.name)!r}")
    if type(model).__name__ == "LanguageModel":
        from .checkpoint import lm_config

        part = "causal-lm" if model.lm.head != "none" else "model"
        _, _, lm = lm_config(config, part)
        has_norm = model.encoder.final_norm is not None  # LMConfig.final_norm None: the placement's default
        lm = dataclasses.replace(lm, final_norm=None if lm.final_norm == has_norm else lm.final_norm)
        mine = dataclasses.replace(model.lm, final_norm=None if model.lm.final_norm in (None, has_norm) else has_norm)
        for f in dataclasses.fields(lm):  # (generation: written to generation_config.json)
            if f.name not in ("init_std", "head_init", "generation") and getattr(lm, f.name) != getattr(mine, f.name):
                problems.append(f"lm.{f.name}: the model has {getattr(mine, f.name)!r}, its config.json would "
                                f"give {getattr(lm, f.name)!r}")
    if problems:
        raise ConversionError(problems, header=f"cannot write this model as {config.get('model_type')}: the config "
                                               "would load as another model")


def _tensors(model: Any, config: Mapping[str, Any], base: Any) -> dict[str, Any]:
    """{HF name: array or stream.Lazy}: the model's (a tied head left out), then what the base
    folder holds that the model does not."""
    from .hf import to_hf

    source = _base_state_dict(model, base)
    family = config["model_type"]
    if type(model).__name__ == "LanguageModel":
        from .hf import to_hf_model

        ours = to_hf_model(model, FAMILIES[family].dialect, family=family)
        if source is not None:  # the base's stack is the model's, whichever layout the base holds it in
            dialect = getattr(model, "hf_dialect", None) or FAMILIES[family].dialect
            tr = dialects.translate(source, dialect, num_heads=model.cfg.num_heads,
                                    num_kv_heads=model.cfg.kv_heads)
            source = {k: source[k] for k in tr.dropped}
    else:  # a stack: its layers under the base model's prefix, the rest from the base folder
        if source is None:
            raise ConversionError(["a stack holds the layers only: pass base= (the save_pretrained folder it came "
                                   "from) for the embeddings and head around it"],
                                  header="cannot save this stack as a Hugging Face folder")
        dialect = getattr(model, "hf_dialect", None) or FAMILIES[family].dialect
        tr = dialects.translate(source, dialect, num_heads=model.cfg.num_heads,
                                    num_kv_heads=model.cfg.kv_heads)
        ours = to_hf(model, dialect, prefix=tr.prefix)
        source = {k: source[k] for k in tr.dropped}
    out = {k: a for k, a in {**(source or {}), **ours}.items() if not _is_tied_copy(k, model, config)}
    return out


def _is_tied_copy(name: str, model: Any, config: Mapping[str, Any]) -> bool:
    family = FAMILIES.get(config.get("model_type"))  # type: ignore[arg-type]
    out = None if family is None else family.outside
    return type(model).__name__ == "LanguageModel" and model.lm.head == "tied" and out is not None \
        and name == (out.head or "") + "weight"


def _base_state_dict(model: Any, base: Any) -> dict[str, Any] | None:
    """The state dict (lazy) of `base`, or of the folder the model was loaded from; None if neither."""
    if base is None:
        report = getattr(model, "load_report", None)
        base = getattr(report, "folder", None)
        if not base or not os.path.isdir(base):
            return None
    if isinstance(base, (str, os.PathLike)):
        return read_folder(os.fspath(base))[1]
    from .checkpoint import hf_state_dict

    return dict(hf_state_dict(base))


def _write(folder: str, config: dict[str, Any], tensors: Mapping[str, Any], dtype: str, limit: int,
           first: bool = True) -> list[str]:
    """config.json and the safetensors files, each tensor cast to `dtype` as its shard is
    written (only by the `first` process of a multi-process run)."""
    from safetensors.numpy import save_file

    target = _np_dtype(dtype)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = int(np.prod(tensors[name].shape)) * target.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if not first:
        return []
    os.makedirs(folder, exist_ok=True)
    _remove_weights(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    total = 0
    for file, names in zip(files, shards, strict=True):
        arrays = {n: np.ascontiguousarray(_cast(n, np.asarray(tensors[n]), target)) for n in names}
        total += sum(a.nbytes for a in arrays.values())
        save_file(arrays, os.path.join(folder, file), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: file for file, names in zip(files, shards, strict=True) for n in names}}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        files.append("model.safetensors.index.json")
    return [os.path.join(folder, f) for f in ["config.json", *files]]


def _cast(name: str, a: np.ndarray, target: np.dtype) -> np.ndarray:
    """A tensor in the dtype written; FP8 weights and their scales (`_scale_inv`) as they are."""
    keep = str(a.dtype).startswith("float8") or name.endswith("_scale_inv")
    return a if keep else a.astype(target, copy=False)


def _remove_weights(folder: str) -> None:
    """Weight files an earlier save left (the ones from_pretrained reads, and the shards their
    indexes name), as save_pretrained removes its own."""
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        if name.endswith(".index.json") and os.path.isfile(path):
            with open(path) as f:
                for shard in set(json.load(f).get("weight_map", {}).values()):
                    if os.path.isfile(os.path.join(folder, shard)):
                        os.remove(os.path.join(folder, shard))
        if os.path.isfile(path):
            os.remove(path)


def write_generation_config(folder: str | os.PathLike, settings: GenerationSettings) -> str:
    """`settings` as `folder`'s generation_config.json (the keys it names; one eos id as an int,
    several as a list, as transformers writes them) -> the file's path."""
    out: dict[str, Any] = {k: v for k, v in asdict(settings).items() if v is not None}
    if "eos_token_id" in out:
        eos = list(out["eos_token_id"])
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    path = os.path.join(os.fspath(folder), GENERATION_CONFIG)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
    return path
