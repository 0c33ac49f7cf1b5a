"""Scaled rotary positions, as transformers computes them (`modeling_rope_utils.py`,
`ROPE_INIT_FUNCTIONS` of transformers 5.24): the `RopeScaling` a `BlockConfig` carries
(`rope_scaling`), and the few numbers both twins need from it.

Every type rescales rotary's inverse frequencies inv_freq_i = theta ** (-2i / dim), i < dim / 2
(dim: the rotary width, `BlockConfig.rotary_dim`), and two of them scale cos and sin too:

    linear    inv_freq / factor (positions stretched by factor).
    llama3    LLaMA 3.1's: frequencies whose wavelength 2 pi / inv_freq exceeds
              original / low_freq_factor are divided by factor, those below
              original / high_freq_factor are kept, the band between is blended.
    yarn      interpolated (inv_freq / factor) and extrapolated (inv_freq) frequencies blended by
              a linear ramp over the dims between the correction range of beta_fast and
              beta_slow rotations; cos and sin times attention_factor (0.1 ln(factor) + 1 unless
              given, or the mscale / mscale_all_dim ratio).
    longrope  inv_freq / short_factor_i, or / long_factor_i once the sequence passes
              original_max_position_embeddings; cos and sin times attention_factor
              (sqrt(1 + ln(factor) / ln(original)) unless given; factor defaults to
              max_position_embeddings / original).
    dynamic   NTK: past max_position_embeddings the base becomes
              theta * (factor * L / max - (factor - 1)) ** (dim / (dim - 2)), L the sequence length.

The sequence length L of `dynamic` and `longrope` is HF's: max(position_ids) + 1 over the whole
batch of the call (a forward, a prefill, one decoding step); keys already in a decoding cache
keep the rotation they were written with, as in HF's `generate`. (HF's dynamic rotary module
also remembers the longest length it has seen until a call shorter than max_position_embeddings
resets it; here each call computes from its own length, which is what a fresh HF model and its
`generate` compute.)

Framework-free: the twins compute the plain frequencies in their own arrays and scale them with
`multipliers` (static, float64), `dynamic_theta` (traced length) and `attention_factor`; the
numpy reference (parity_tests/twins/reference.py) writes HF's formulas out on its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import numpy as np

ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
RopeType = Literal["linear", "dynamic", "yarn", "longrope", "llama3"]

# rope_type -> (keys it requires, keys it may take), as transformers' _validate_<type>_rope_parameters;
# max_position_embeddings is the model config's own (HF reads it beside the dict).
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor", "max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
             "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
_OPTIONAL = {"linear": (), "dynamic": (),
             "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
                      "max_position_embeddings"),
             "longrope": ("factor", "attention_factor", "max_position_embeddings"),
             "llama3": ()}


@dataclass(frozen=True)
class RopeScaling:
    """A scaled rotary's parameters, named as transformers' `rope_parameters` names them (see the
    module docstring for what each type computes). Hashable (lists are kept as tuples), so a
    BlockConfig holding one stays a static argument of `jax.jit`.

    rope_type: "linear", "dynamic", "yarn", "longrope" or "llama3".
    factor: the context extension (all but longrope, where it defaults to
      max_position_embeddings / original_max_position_embeddings; yarn's may be None for the same).
    original_max_position_embeddings: the pre-training length (yarn, longrope, llama3).
    max_position_embeddings: the model's length (HF's config.max_position_embeddings): dynamic's
      threshold, and yarn's and longrope's default factor.
    low_freq_factor, high_freq_factor: llama3's band edges.
    attention_factor: yarn's and longrope's scale of cos and sin (None: HF's default formula).
    beta_fast, beta_slow, mscale, mscale_all_dim, truncate: yarn's ramp and attention factor.
    short_factor, long_factor: longrope's per-frequency divisors, dim / 2 each.
    """

    rope_type: RopeType
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not all(_number(v) for v in value):
                    raise ValueError(f"RopeScaling.{name} must be a list of numbers, got {value!r}")
                object.__setattr__(self, name, tuple(float(v) for v in value))
        missing = [k for k in _REQUIRED[self.rope_type] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"RopeScaling(rope_type={self.rope_type!r}) needs {', '.join(missing)} "
                             f"(transformers requires them too)")
        allowed = {"rope_type", "truncate", *_REQUIRED[self.rope_type], *_OPTIONAL[self.rope_type]}
        extra = [f.name for f in fields(self) if f.name not in allowed and getattr(self, f.name) is not None]
        if extra:
            raise ValueError(f"RopeScaling(rope_type={self.rope_type!r}) does not read {', '.join(extra)}")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                     "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and math.isfinite(value)):
                raise ValueError(f"RopeScaling.{name} must be a finite number, got {value!r}")
        for name in ("original_max_position_embeddings", "max_position_embeddings"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"RopeScaling.{name} must be a positive int, got {value!r}")
        if self.rope_type == "longrope" and self.factor is None and self.max_position_embeddings is None:
            raise ValueError("RopeScaling(rope_type='longrope') needs factor or max_position_embeddings (its "
                             "factor is then max_position_embeddings / original_max_position_embeddings)")
        if self.rope_type == "yarn" and self.factor is None and self.max_position_embeddings is None:
            raise ValueError("RopeScaling(rope_type='yarn') with factor None needs max_position_embeddings")
        if self.rope_type == "llama3" and not self.high_freq_factor != self.low_freq_factor:
            raise ValueError("RopeScaling(rope_type='llama3') needs high_freq_factor != low_freq_factor, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")
        if not isinstance(self.truncate, bool) or (self.rope_type != "yarn" and not self.truncate):
            raise ValueError(f"RopeScaling.truncate is yarn's (a bool), got {self.truncate!r} for {self.rope_type!r}")
        if self.rope_type in ("linear", "dynamic", "llama3") and self.factor == 0:
            raise ValueError(f"RopeScaling.factor must not be 0 for rope_type={self.rope_type!r}")

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], max_position_embeddings: int | None = None
                  ) -> tuple[RopeScaling, list[str]]:
        """(RopeScaling, the keys it ignores) from transformers' `rope_parameters` / `rope_scaling`
        dict (the older "type" spelling too), with the model's `max_position_embeddings` where the
        type reads it. "rope_theta" and "partial_rotary_factor" belong to BlockConfig and are not
        read here; a key the type's HF function does not read is ignored as HF ignores it (HF
        warns "Unrecognized keys") and returned. Raises ValueError for an unknown type or a
        missing required key (HF raises KeyError)."""
        p = dict(params)
        kind, legacy = p.pop("rope_type", None), p.pop("type", None)
        kind = legacy if kind is None else kind  # HF: rope_type, else the older "type"
        for key in ("rope_theta", "partial_rotary_factor"):
            p.pop(key, None)
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES} (or 'default'), got {kind!r}")
        reads = set(_REQUIRED[kind] + _OPTIONAL[kind])
        if "max_position_embeddings" in reads and max_position_embeddings is not None:
            p.setdefault("max_position_embeddings", int(max_position_embeddings))
        ignored = sorted(k for k in p if k not in reads)
        return cls(rope_type=kind, **{k: v for k, v in p.items() if k in reads}), ignored

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set, as a JSON-able dict (lists for the factors) that
        `BlockConfig(rope_scaling=...)` reads back; HF's `rope_parameters` entries but
        max_position_embeddings, which HF keeps in the model config."""
        out: dict[str, Any] = {"rope_type": self.rope_type}
        for name, value in asdict(self).items():
            if name == "rope_type" or value is None or (name == "truncate" and value):
                continue
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @property
    def original(self) -> int:
        """original_max_position_embeddings, for the types that have it (yarn, longrope, llama3)."""
        assert self.original_max_position_embeddings is not None, self.rope_type
        return self.original_max_position_embeddings

    @property
    def max_length(self) -> int:
        """max_position_embeddings, for the type that needs it (dynamic)."""
        assert self.max_position_embeddings is not None, self.rope_type
        return self.max_position_embeddings

    @property
    def needs_length(self) -> bool:
        """Whether the frequencies depend on the call's sequence length (dynamic, longrope)."""
        return self.rope_type in ("dynamic", "longrope")

    @property
    def resolved_factor(self) -> float:
        """The factor HF uses: given, or max_position_embeddings / original (yarn, longrope)."""
        if self.factor is not None:
            return float(self.factor)
        assert self.max_position_embeddings is not None and self.original_max_position_embeddings is not None
        return self.max_position_embeddings / self.original_max_position_embeddings

    def check(self, dim: int) -> None:
        """Raise ValueError unless the scaling fits a rotary width of `dim` dims."""
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                n = len(getattr(self, name))
                if n != (dim + 1) // 2:
                    raise ValueError(f"RopeScaling.{name} has {n} entries, the rotary dim {dim} needs {(dim + 1) // 2}")
        if self.rope_type == "yarn" and dim % 2 and dim // 2 != 1:
            raise ValueError(f"RopeScaling(rope_type='yarn') over an odd rotary dim {dim}: transformers' ramp has "
                             f"{dim // 2} entries for {(dim + 1) // 2} frequencies and fails too")
        if self.rope_type == "dynamic" and dim <= 2:
            raise ValueError(f"RopeScaling(rope_type='dynamic') needs a rotary width above 2, got {dim}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def attention_factor(s: RopeScaling) -> float:
    """The factor on cos and sin (yarn's and longrope's; 1 otherwise), as HF computes it."""
    if s.rope_type == "yarn":
        if s.attention_factor is not None:
            return float(s.attention_factor)
        factor = s.resolved_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if s.mscale and s.mscale_all_dim:
            return float(mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim))
        return mscale(factor)
    if s.rope_type == "longrope":
        if s.attention_factor is not None:
            return float(s.attention_factor)
        factor = s.resolved_factor
        assert s.original_max_position_embeddings is not None
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(s.original_max_position_embeddings))
    return 1.0


def multipliers(s: RopeScaling, theta: float, dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(m, m_long), float64 (dim / 2,) each: the scaled frequencies are the plain ones times m
    (longrope: times m_long once the sequence passes original_max_position_embeddings; None for
    the other types). dynamic has none (its base moves: `dynamic_theta`): m is ones."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    half = len(inv_freq)  # ceil(dim / 2): an odd rotary dim still has its frequencies at 0, 2, ..
    if s.rope_type == "linear":
        assert s.factor is not None
        return np.full(half, 1.0 / s.factor), None
    if s.rope_type == "llama3":  # inv / f below the low band, inv above the high one, blended between
        assert s.factor is not None and s.original_max_position_embeddings is not None
        assert s.low_freq_factor is not None and s.high_freq_factor is not None
        f, old = float(s.factor), s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        m = np.where(wavelen > old / s.low_freq_factor, 1.0 / f, 1.0)
        medium = ~(wavelen < old / s.high_freq_factor) & ~(wavelen > old / s.low_freq_factor)
        return np.where(medium, (1 - smooth) / f + smooth, m), None
    if s.rope_type == "yarn":  # interpolated inv / f and extrapolated inv, blended by a ramp over the dims
        original = s.original_max_position_embeddings
        assert original is not None
        factor = s.resolved_factor
        fast, slow = s.beta_fast or 32, s.beta_slow or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(fast), correction_dim(slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # HF's: dim // 2 long
        extrapolated = 1 - ramp
        m = (1 - extrapolated) / factor + extrapolated
        return np.broadcast_to(m, (half,)).copy(), None  # an odd dim's ceil(dim / 2) frequencies share ramp[0]
    if s.rope_type == "longrope":
        assert s.short_factor is not None and s.long_factor is not None
        return 1.0 / np.asarray(s.short_factor, np.float64), 1.0 / np.asarray(s.long_factor, np.float64)
    return np.ones(half), None


def dynamic_theta(s: RopeScaling, theta: Any, dim: int, length: Any) -> Any:
    """dynamic NTK's base for a call whose sequence length, already raised to at least
    max_position_embeddings, is `length` (a scalar array of either twin, or a number):
    theta * (factor * L / max - (factor - 1)) ** (dim / (dim - 2))."""
    assert s.factor is not None and s.max_position_embeddings is not None
    return theta * ((s.factor * length / s.max_position_embeddings) - (s.factor - 1)) ** (dim / (dim - 2))


def interleave_order(width: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, inverse) index arrays of `width` (even) rotated dims: rotary on adjacent pairs
    (2i, 2i + 1) (GPT-J's rotate_every_two, Cohere's, DeepSeek's rope_interleave) is rotate-half on
    x[..., order] (evens first, then odds), read back through x[..., inverse]. DeepSeek's MLA keeps
    the reordered dims (its q . k products are the same): rotate-half on x[..., order] gives HF
    DeepSeek V3's `apply_rotary_pos_emb_interleave` exactly, and V2's complex rotation permuted."""
    order = np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])
    return order, np.argsort(order)
