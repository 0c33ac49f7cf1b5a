"""A checkpoint's generation settings, read as transformers 5.24 reads them (framework-free:
both twins' `from_hf` call it).

`from_pretrained` (generation/utils.py `adjust_generation_fn`) reads the folder's
`generation_config.json`; without one, `GenerationConfig.from_pretrained(folder,
config_file_name="config.json")`: the same keys at config.json's top level. A model object
carries its `generation_config` (built by `GenerationConfig.from_model_config(config)` when
it was made from a config: the config's own keys, then its text config's)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from ..core.generation_settings import GenerationSettings
from .io import ConversionError

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
