"""What a language model adds around its stack, declared once for both frameworks.

    tokens (B, T) -> embed (* embed_scale) (+ learned positions) (+ token types) (-> embed_norm)
                  -> the library's Encoder (layers + final norm)
                  -> head (its own weight, or the token embedding's transpose when tied) -> logits
                  (* logit_scale) (-> / logits_divisor) (-> final_logit_softcap * tanh(logits / final_logit_softcap))

`LMConfig` says which of those parts a model has; `components` declares their parameters
(torch name, Flax path, shape, axes, init, transform) as `flax_blocks.core.declarations` does for
the blocks, so `flax_blocks.lm.LanguageModel` and `torch_blocks.lm.LanguageModel` build the
same parameters, and the converter maps one onto the other by the same rules. Torch names:
embed.weight (V, E), pos.weight (P, E), token_type.weight (types, E), embed_norm.*,
encoder.layers.{i}.* / encoder.norm.*, head.weight (V, E), head.bias (V,). Framework-free.

The generation settings a checkpoint names (`GenerationSettings`, `LMConfig.generation`) and
how a `generate` call's arguments combine with them (`resolve`), as transformers 5.24's
`generate` does; both twins' `generate` use them:

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

import math
from dataclasses import dataclass
from typing import Any

from . import declarations
from .config import BlockConfig
from .declarations import LINEAR, Component, Param

HEADS = ("untied", "tied", "none")
HEAD_INITS = ("normal", "xavier")
DEFAULT_POSITIONS = ("arange", "mask", "ids")
ENCODER = "encoder"  # the stack's attribute / torch prefix


# --- generation settings ----------------------------------------------------------------------------

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


# --- the language model's parts ---------------------------------------------------------------------

@dataclass(frozen=True)
class LMConfig:
    """The parts of a language model around its stack; hashable (it keys compiled programs).

    vocab_size: rows of the token embedding (and of the head).
    num_layers: the stack's depth.
    max_positions: learned absolute position embeddings of this many positions (GPT-2's wpe,
      BERT's position_embeddings); None: none (rotary positions live in the blocks, from
      cfg.rope_theta). Rotary models take any position a cache holds.
    position_offset: position p reads row p + position_offset of the position table, which
      has max_positions + position_offset rows (OPT: 2; RoBERTa: padding_idx + 1). Rows below
      the offset are read only by padding tokens whose positions are derived (-1: row
      position_offset - 1, as HF's OPT and RoBERTa read them).
    default_positions: the positions of a call without positions= (and without a cache):
      "arange" 0..T-1 (HF's forward default for GPT-2, BERT, LLaMA ...); "mask" the
      attention mask's real tokens numbered from 0, padding -1 (HF's OPT:
      cumsum(mask) * mask - 1); "ids" the same over the tokens != pad_token_id (HF's RoBERTa,
      create_position_ids_from_input_ids). "mask" and "ids" need position_offset >= 1.
    pad_token_id: the padding token of default_positions="ids".
    embed_scale: the token embeddings are multiplied by it (Gemma: sqrt(hidden_size)),
      rounded to float32 and then to the embeddings' dtype, as HF's float32 buffer cast to
      the weights' dtype; None: not scaled.
    final_logit_softcap: c: logits <- c * tanh(logits / c) after the head (Gemma 2's
      final_logit_softcapping); None: none.
    logit_scale: s: logits <- logits * s after the head, before any soft-cap (Cohere's
      logit_scale, 0.0625 by default); None: none.
    logits_divisor: d: logits <- logits / d after the head (Granite's logits_scaling); None: none.
    token_types: rows of BERT's token-type embedding; 0: none.
    embed_norm: a norm (the blocks' norm type and eps) on the embedded input (BERT).
    final_norm: the stack's final norm; None: the stack's default (pre-LN and Peri-LN).
    head: "untied" (its own (V, E) weight), "tied" (logits = h @ embed.weight^T, as GPT-2 and
      tie_word_embeddings) or "none" (the model returns its last hidden state).
    head_bias: a bias on the head (not with "tied" or "none").
    init_std: the std of the embeddings' normal init, and of the head's with head_init="normal"
      (HF's initializer_range).
    head_init: "normal" (N(0, init_std), as HF) or "xavier" (xavier-uniform over (E, V), bound
      sqrt(6 / (E + V)): the lab's); an untied head's bias starts at zero either way.
    project_dim: P: the token embeddings (and a tied head) are P wide and projected to the
      stack's width by project_in (d_model x P, no bias) before positions are added, the last
      hidden state back by project_out (P x d_model, no bias) before the head (OPT-350m's
      word_embed_proj_dim, HF's project_in / project_out); None: the embeddings are d_model wide.
    recompute_length: R: `generate` recomputes every key once, when the sequence first passes R
      tokens (HF's Phi-3 generate drops its cache there, so that longrope's long factors rotate
      every key, not only the new ones); None: the cache is kept throughout.
    cache_window: W: a decoding cache (`init_cache`, `generate`) keeps only the last W - 1
      keys before each chunk, so a chunk's queries see those and the chunk's own keys; the
      forward without a cache sees every earlier key. transformers' generation cache
      (DynamicCache) does this where a config carries sliding_window (or
      attention_chunk_size) that the family's layers never read; None: the cache keeps all.
    generation: the checkpoint's generation settings (eos ids, pad, bos, sampling defaults:
      `GenerationSettings`), which `generate` follows unless told otherwise in
      both twins; set by `from_hf(..., part="causal-lm")` from generation_config.json; None: HF's
      global defaults (greedy, no eos).
    """

    vocab_size: int
    num_layers: int
    max_positions: int | None = None
    token_types: int = 0
    embed_norm: bool = False
    final_norm: bool | None = None
    head: str = "untied"
    head_bias: bool = False
    init_std: float = 0.02
    head_init: str = "normal"
    position_offset: int = 0
    default_positions: str = "arange"
    pad_token_id: int | None = None
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    logit_scale: float | None = None
    logits_divisor: float | None = None
    project_dim: int | None = None
    recompute_length: int | None = None
    cache_window: int | None = None
    generation: GenerationSettings | None = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{name} must be a positive int, got {v!r}")
        if self.max_positions is not None and (not isinstance(self.max_positions, int) or self.max_positions < 1):
            problems.append(f"max_positions must be a positive int or None, got {self.max_positions!r}")
        if not isinstance(self.token_types, int) or self.token_types < 0:
            problems.append(f"token_types must be an int >= 0, got {self.token_types!r}")
        if self.head not in HEADS:
            problems.append(f"head must be one of {HEADS}, got {self.head!r}")
        elif self.head_bias and self.head != "untied":
            problems.append(f"head_bias needs head='untied' (got head={self.head!r})")
        if self.head_init not in HEAD_INITS:
            problems.append(f"head_init must be one of {HEAD_INITS}, got {self.head_init!r}")
        elif self.head_init != "normal" and self.head != "untied":
            problems.append(f"head_init={self.head_init!r} needs head='untied' (got head={self.head!r}: "
                            "a tied head is the embedding)")
        if not isinstance(self.init_std, (int, float)) or isinstance(self.init_std, bool) or not self.init_std > 0:
            problems.append(f"init_std must be a positive number, got {self.init_std!r}")
        if not isinstance(self.position_offset, int) or isinstance(self.position_offset, bool) \
                or self.position_offset < 0:
            problems.append(f"position_offset must be an int >= 0, got {self.position_offset!r}")
        elif self.position_offset and self.max_positions is None:
            problems.append(f"position_offset={self.position_offset} needs learned positions (max_positions)")
        if self.default_positions not in DEFAULT_POSITIONS:
            problems.append(f"default_positions must be one of {DEFAULT_POSITIONS}, got {self.default_positions!r}")
        elif self.default_positions != "arange" and not (isinstance(self.position_offset, int)
                                                          and self.position_offset >= 1):
            problems.append(f"default_positions={self.default_positions!r} reads row position_offset - 1 at padding: "
                            f"it needs position_offset >= 1, got {self.position_offset!r}")
        if (self.default_positions == "ids") != (self.pad_token_id is not None):
            problems.append(f"pad_token_id goes with default_positions='ids' (got pad_token_id={self.pad_token_id!r}, "
                            f"default_positions={self.default_positions!r})")
        for name in ("embed_scale", "final_logit_softcap", "logits_divisor"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                problems.append(f"{name} must be a positive number or None, got {v!r}")
        for name in ("final_logit_softcap", "logits_divisor"):
            if getattr(self, name) is not None and self.head == "none":
                problems.append(f"{name} needs a head (head='none' returns hidden states)")
        s = self.logit_scale
        if s is not None and (not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s)):
            problems.append(f"logit_scale must be a finite number or None, got {s!r}")
        elif s is not None and self.head == "none":
            problems.append("logit_scale needs a head (head='none' returns hidden states)")
        for name in ("project_dim", "recompute_length", "cache_window"):
            w = getattr(self, name)
            if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
                problems.append(f"{name} must be a positive int or None, got {w!r}")
        if self.generation is not None and not isinstance(self.generation, GenerationSettings):
            problems.append(f"generation must be a GenerationSettings or None, got {type(self.generation).__name__}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def position_rows(self) -> int | None:
        """Rows of the learned position table: max_positions + position_offset."""
        return None if self.max_positions is None else self.max_positions + self.position_offset


def _embedding(rows: int, e: int, dim: str, std: float, width: str = "d_model") -> Component:
    axes = ("vocab", "embed" if width == "d_model" else None)  # a projected width is no "embed" axis
    return Component("embedding", (Param("weight", "embedding", (rows, e), (dim, width), axes,
                                         ((rows, ("normal", std)),)),))


def _projection(out: int, inp: int, dims: tuple[str, str], std: float) -> Component:
    """OPT's project_in / project_out: a linear map without bias, torch's (out, in) weight."""
    axes = ("embed", None) if dims[1] == "d_model" else (None, "embed")  # the Flax kernel's (in, out)
    return Component("linear", (Param("weight", "kernel", (out, inp), dims, axes, ((out, ("normal", std)),),
                                      LINEAR),))


def components(lm: LMConfig, cfg: BlockConfig) -> tuple[tuple[str, Component], ...]:
    """The model's own components besides the stack, in torch's order: (name, Component)."""
    e, v, std = cfg.d_model, lm.vocab_size, lm.init_std
    p, width = (e, "d_model") if lm.project_dim is None else (lm.project_dim, "project_dim")
    out: list[tuple[str, Component]] = [("embed", _embedding(v, p, "vocab_size", std, width))]
    if lm.project_dim is not None:
        out.append(("project_in", _projection(e, p, ("d_model", "project_dim"), std)))
    if lm.position_rows is not None:  # learned positions (max_positions)
        out.append(("pos", _embedding(lm.position_rows, e, "position_rows", std)))
    if lm.token_types:
        out.append(("token_type", _embedding(lm.token_types, e, "token_types", std)))
    if lm.embed_norm:
        out.append(("embed_norm", declarations.norm(cfg, e)))
    if lm.project_dim is not None:
        out.append(("project_out", _projection(p, e, ("project_dim", "d_model"), std)))
    if lm.head == "untied":
        spec = ("normal", std) if lm.head_init == "normal" else declarations.xavier_uniform(p, v)
        params = [Param("weight", "kernel", (v, p), ("vocab_size", width), ("embed" if width == "d_model" else None,
                                                                           "vocab"),
                        ((v, spec),), LINEAR)]
        if lm.head_bias:
            params.append(Param("bias", "bias", (v,), ("vocab_size",), ("vocab",), ((v, ("const", 0.0)),)))
        out.append(("head", Component("linear", tuple(params))))
    return tuple(out)


# the attributes that are None when a model lacks them
OPTIONAL = ("project_in", "pos", "token_type", "embed_norm", "project_out", "head")


def build_order(lm: LMConfig, cfg: BlockConfig) -> tuple[tuple[str, Component | None], ...]:
    """Every part in the order both twins build (and so draw the initial weights of) them,
    torch's: the embeddings, the stack (ENCODER, None: it is no Component), project_out and the head."""
    parts = components(lm, cfg)
    after = ("project_out", "head")
    return (*[p for p in parts if p[0] not in after], (ENCODER, None), *[p for p in parts if p[0] in after])


def default_positions(lm: LMConfig, real):
    """The positions a call without positions= gives (see LMConfig.default_positions), from
    `real` (B, T) integers, 1 at a real token (the attention mask's, or the ids != pad_token_id):
    cumsum(real) * real - 1, as HF's OPT and RoBERTa compute them (padding: -1). Written with
    the array methods numpy, jax and torch share."""
    return real.cumsum(1) * real - 1
