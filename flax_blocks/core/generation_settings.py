"""A checkpoint's generation settings, and how `generate`'s arguments combine with them, as
transformers 5.24's `generate` does. Framework-free: both twins' `generate` use it.

    settings = GenerationSettings(eos_token_id=(2,), pad_token_id=None, do_sample=False)
    run = resolve(settings, eos_token_id=None, pad_token_id=None, do_sample=None,
                  temperature=None, top_k=None, top_p=None)       # -> Resolved

HF's rules (generation/utils.py `_prepare_generation_config`, `_prepare_special_tokens`,
`_get_logits_processor`): an argument given wins over the model's generation config, which
wins over the global defaults (do_sample False, temperature 1.0, top_k 50, top_p 1.0);
`eos_token_id` is an int or a list (a row ends at any of them); a None pad_token_id with an
eos takes eos[0]; greedy (do_sample False) ignores temperature, top_k and top_p; top_k 0 and
top_p 1.0 switch their warper off. One departure, kept from this library's older API: a
`temperature` > 0 passed without `do_sample` samples (temperature 0: greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HF_TOP_K = 50  # GenerationConfig._get_default_generation_params()'s top_k


def _ids(value: Any, name: str) -> tuple[int, ...] | None:
    """An int or a list of ints (HF's eos_token_id) as a tuple; None stays None."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{name} must be an int or a non-empty list of ints, got {value!r}")
    return tuple(items)


def _one_id(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int or None, got {value!r}")
    return value


@dataclass(frozen=True)
class GenerationSettings:
    """What a checkpoint's generation config names (None: not named, HF's default applies).

    eos_token_id: the ids that end a row (HF's int or list, kept as a tuple).
    pad_token_id: what follows a row's eos (None: eos_token_id[0], as HF).
    bos_token_id: the beginning-of-sequence id (kept for the caller; generate does not add it).
    do_sample, temperature, top_k, top_p: the sampling defaults."""

    eos_token_id: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_id", _ids(self.eos_token_id, "eos_token_id"))
        for name in ("pad_token_id", "bos_token_id", "top_k"):
            _one_id(getattr(self, name), name)
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool or None, got {self.do_sample!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name} must be a number or None, got {v!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationSettings:
        """The keys HF's GenerationConfig reads for these (others ignored)."""
        return cls(**{k: d.get(k) for k in ("eos_token_id", "pad_token_id", "bos_token_id", "do_sample",
                                             "temperature", "top_k", "top_p")})


@dataclass(frozen=True)
class Resolved:
    """One generate call's settings: sample (False: greedy), temperature, top_k / top_p (None:
    off), eos (None: no row ends early), pad (the id after a row's eos)."""

    sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos: tuple[int, ...] | None
    pad: int | None


def resolve(settings: GenerationSettings | None, *, eos_token_id: Any, pad_token_id: Any, do_sample: bool | None,
            temperature: float | None, top_k: int | None, top_p: float | None) -> Resolved:
    """The arguments of a `generate` call (None: not given) over the model's `settings`, as
    HF's generate combines them (see the module docstring)."""
    s = settings or GenerationSettings()
    eos = _ids(eos_token_id, "eos_token_id") if eos_token_id is not None else s.eos_token_id
    pad = pad_token_id if pad_token_id is not None else s.pad_token_id
    if pad is None and eos is not None:
        pad = eos[0]
    if do_sample is None:
        do_sample = temperature > 0 if temperature is not None else bool(s.do_sample)
    if not do_sample:
        return Resolved(False, 0.0, None, None, eos, pad)
    t = temperature if temperature is not None else s.temperature if s.temperature is not None else 1.0
    k = top_k if top_k is not None else s.top_k if s.top_k is not None else HF_TOP_K
    p = top_p if top_p is not None else s.top_p if s.top_p is not None else 1.0
    return Resolved(True, float(t), k or None, None if p >= 1.0 else float(p), eos, pad)
