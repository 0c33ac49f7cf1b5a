"""Differential fuzzing of `fb.from_hf` against transformers.

For each family a hypothesis strategy draws a config.json over the keys people set (sizes,
GQA ratios, head_dim, eps keys, activations, biases, rotary bases and fractions in their
older and newer spellings, windows shorter and longer than the sequence, layer_types
patterns, soft-caps, is_causal, tied heads with and without a stored head) plus stray keys of
neighbouring families. Each draw becomes a tiny model with perturbed weights, saved as a
save_pretrained folder whose config.json is exactly the drawn one; transformers reads it back
with `from_pretrained` (the reference: what a user of transformers gets from that folder) and
`fb.from_hf` reads the same folder. Each case ends as one of

    equal      float32 logits (last hidden states for encoders) within 1e-5 relative at the real
               tokens of a left-padded batch given HF's position_ids (past that, float32's own
               noise on the config is measured: HF's float32 must lie within max(1e-5, twice our
               float32's distance) of our float64 computation), and HF's 8 greedy tokens
               (generate) each one of our argmaxes (within 1e-5 of our best logit) along them;
    refused    one ConversionError that names a key of the config (key=value);
    hf-refused transformers itself refuses the config, the folder or the forward;
    wrong      loads and computes something else: a silent wrong load (the bug this hunts);
    crash      our loader raises anything but a ConversionError naming a key.

A decoder config with is_causal=False is refused as part="causal-lm" (no causal LM) and then
compared as part="model" with HF's base model.

    python -m parity_tests.hf.fuzz --minutes 30 --out parity_tests/results/fuzz_hf   # the long run

writes summary.md / summary.json (configs per family, outcomes, every non-equal case's
config). The suite (parity_tests/hf/test_config_fuzz.py) runs a fixed-seed budget. Encoders of
images and audio (ViT, Whisper) are not drawn here: they load as stacks, tested against HF in
parity_tests/hf/test_stacks_families.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

V, B, T, PAD, NEW = 64, 2, 7, 3, 8
RTOL = 1e-5
ABSENT = object()  # a key left out of config.json: the config class's default applies

def _models() -> dict[str, tuple[str, str, str]]:
    """family -> (config class, model class, the part we load: "causal-lm" or "model"), read from
    the families' registrations (those with token inputs: every family with its parts around the
    stack declared)."""
    from flax_blocks.checkpoints.family import FAMILIES

    return {t: (f.config_class, f.lm_class or f.model_class, "causal-lm" if f.lm_class else "model")
            for t, f in FAMILIES.items() if f.outside is not None}


MODELS = _models()
_ROLES = {"hidden": ("hidden_size", "n_embd", "dim"), "heads": ("num_attention_heads", "n_head", "n_heads"),
          "kv": ("num_key_value_heads",), "ffn": ("intermediate_size", "ffn_dim", "n_inner", "hidden_dim"),
          "layers": ("num_hidden_layers", "n_layer", "n_layers")}


def size_keys(family: str) -> tuple[str | None, ...]:
    """A family's own size keys, from its table: (hidden, heads, kv heads or None, ffn, layers)."""
    from flax_blocks.checkpoints.family import FAMILIES

    reads = FAMILIES[family].reads
    return tuple(next((k for k in keys if k in reads), None) for keys in _ROLES.values())


EPS = [1e-6, 1e-5, 0.1, 0.5]  # large ones make an eps read from the wrong key visible
LAYER_PATTERNS = ["sliding_attention", "full_attention"]


def _maybe(values: list) -> st.SearchStrategy:
    """One of the values or the key absent (its class default). Hypothesis leans towards the
    first choices, so each list starts with the values least like the class default: the
    defaults themselves are covered by the families' own tests."""
    return st.sampled_from([*values, ABSENT])


def _rope(draw, theta_key: str = "rope_theta", partial: list | None = None, partial_key: str | None = None) -> dict:
    """Rotary settings in the spellings configs carry: none, a top-level (older) key, the
    rope_parameters dict (transformers 5), or both disagreeing (scaled types: `_scaled_rope`)."""
    theta = draw(st.sampled_from([100.0, 500.0, 10000.0]))
    kind = draw(st.sampled_from(["top", "dict", "both", "absent", "top", "dict"]))
    out: dict[str, Any] = {}
    if kind in ("top", "both"):
        out[theta_key] = theta
    if kind in ("dict", "both"):
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta * (3 if kind == "both" else 1)}
    if partial:
        factor = draw(_maybe(partial))
        if factor is not ABSENT:
            if kind in ("dict", "both") and draw(st.booleans()):
                out["rope_parameters"]["partial_rotary_factor"] = factor
            else:
                out[partial_key] = factor
    return out


def _layer_types(draw, n: int) -> list[str]:
    kind = draw(st.sampled_from(["alternate", "all_local", "all_full", "last_full", "random"]))
    if kind == "alternate":
        return [LAYER_PATTERNS[i % 2] for i in range(n)]
    if kind == "all_local":
        return ["sliding_attention"] * n
    if kind == "all_full":
        return ["full_attention"] * n
    if kind == "last_full":
        return ["sliding_attention"] * (n - 1) + ["full_attention"]
    return [draw(st.sampled_from(LAYER_PATTERNS)) for _ in range(n)]


STRAYS = {"layer_norm_eps": 0.5, "layer_norm_epsilon": 0.5, "rms_norm_eps": 0.5, "norm_epsilon": 0.5,
          "sliding_window": 3, "attn_logit_softcapping": 1.0, "partial_rotary_factor": 0.5, "rotary_pct": 0.5,
          "use_sliding_window": True, "hidden_activation": "relu", "hidden_act": "relu", "use_qkv_bias": True,
          "qkv_bias": False, "attention_bias": True, "mlp_bias": True, "query_pre_attn_scalar": 4,
          "max_window_layers": 0, "is_decoder": True, "add_cross_attention": False, "sliding_window_pattern": 2,
          "rope_local_base_freq": 100.0, "final_logit_softcapping": 0.5, "use_parallel_residual": True,
          "rope_theta": 123.0, "pretraining_tp": 2, "layer_types": "pattern", "num_key_value_heads": 1}


@st.composite
def configs(draw, family: str) -> dict[str, Any]:
    """One config.json of `family` (its keys, plus the fuzzer's own `_stored_head` flag)."""
    from flax_blocks.checkpoints.family import FAMILIES

    table = FAMILIES[family]
    heads = draw(st.sampled_from([2, 4]))
    hidden = draw(st.sampled_from([32, 48]))
    layers = draw(st.sampled_from([1, 2, 3]))
    keys = size_keys(family)
    c: dict[str, Any] = {"model_type": family, keys[0]: hidden, keys[1]: heads, keys[3]: 40, keys[4]: layers,
                         "vocab_size": V, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    decoder = MODELS[family][2] == "causal-lm"
    if not decoder:
        c["pad_token_id"] = 1  # RoBERTa's positions start past it
    if table.outside is not None and table.outside.positions:
        c[table.outside.max_positions[0]] = 24  # a learned position table: past the prompt and its new tokens
    if keys[2]:
        c[keys[2]] = draw(st.sampled_from([heads, heads // 2, 1]))
    if decoder:
        c["is_causal"] = draw(_maybe([True, False]))
        c["tie_word_embeddings"] = draw(_maybe([True, False]))
        c["_stored_head"] = draw(st.sampled_from([True, False]))  # tie_word_embeddings true over its own head
    per_layer_type = "rope_local_base_freq" in table.reads  # Gemma 3: its rotary parameters are its draws'
    if "rope_parameters" in table.reads and not per_layer_type:
        partial_key = next((k for k in ("rotary_pct", "partial_rotary_factor") if k in table.reads), None)
        c.update(_rope(draw, "rotary_emb_base" if "rotary_emb_base" in table.reads else "rope_theta",
                       *(([0.25, 0.5, 1.0, 0.3] if partial_key == "rotary_pct" else [0.5, 0.75, 1.0, 0.3], partial_key)
                         if partial_key else ())))
    if "head_dim" in table.reads:
        c["head_dim"] = draw(_maybe([12, 16, 8, None]))
    for eps_key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
        if eps_key in table.reads:
            c[eps_key] = draw(_maybe(EPS))
    for key, values in table.draws.items():  # the values people set for the family's own keys
        if key == "layer_types":
            if draw(st.booleans()):
                c[key] = _layer_types(draw, layers)
            continue
        c[key] = draw(_maybe([hidden if v == "hidden" else v for v in values]))
    for key in ("num_experts", "num_local_experts"):  # a mixture of experts: few experts, narrow ones
        if key in table.reads and c.get(key, ABSENT) is ABSENT and key not in table.aliases:
            c[key] = 4
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in table.reads:
            c[key] = 24
    if "rope_parameters" in table.reads and draw(st.sampled_from([False, True, False])):
        _scaled_rope(draw, family, c)
    if draw(st.sampled_from([False, True, False, False])):  # some configs carry a neighbour's key
        key = draw(st.sampled_from(sorted(k for k in STRAYS if k not in table.reads and k not in c)))
        c[key] = _layer_types(draw, layers) if key == "layer_types" else STRAYS[key]
    if draw(st.sampled_from([False, True])):  # and published ones keys of older versions and tools
        c.update(draw(st.sampled_from(LEGACY)))
    return {k: v for k, v in c.items() if v is not ABSENT}


# Keys published config.json files carry that no family's code reads (each seen in a popular
# checkpoint's file): transformers ignores them.
LEGACY = [{"gradient_checkpointing": False}, {"tie_weights_": True}, {"activation_dropout": 0.1},
          {"is_llama_config": True, "rope_interleaved": False}, {"use_mrope": False},
          {"norm_type": "layer_norm", "mlp_type": "default"}, {"output_past": True, "_num_labels": 2},
          {"transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}}}, {"full_attn_mod": 1},
          {"n_ctx": 1024, "predict_special_tokens": True}]


def _rotary_dim(family: str, c: dict[str, Any]) -> int:
    """HF's rotary dim of a drawn config: its head width times its partial rotary factor."""
    keys = size_keys(family)
    head = c.get("head_dim") if family not in ("gpt_neox", "stablelm") else None
    head = head if isinstance(head, int) else c[keys[0]] // c[keys[1]]
    params = c.get("rope_parameters")
    params = params if isinstance(params, dict) else {}  # absent, None, or drawn ABSENT (left out)
    default = {"gpt_neox": 0.25, "stablelm": 0.25}.get(family, 1.0)
    partial_key = {"gpt_neox": "rotary_pct", "stablelm": "partial_rotary_factor", "phi3": "partial_rotary_factor"}
    factor = params.get("partial_rotary_factor", c.get(partial_key.get(family, ""), default))
    factor = default if factor is ABSENT else factor
    return int(head * factor)


def _scaled_rope(draw, family: str, c: dict[str, Any]) -> None:
    """A scaled rotary of a type transformers ships, at lengths where it acts within the prompt
    and the generated tokens (original / max_position_embeddings of 4, 8 or 32 positions),
    spelled as configs spell it (rope_scaling, or inside rope_parameters)."""
    kinds = ["longrope", "su"] if family == "phi3" else ["linear", "dynamic", "yarn", "longrope", "llama3"]
    kind = draw(st.sampled_from(kinds))
    length = draw(st.sampled_from([4, 8, 32]))
    n = (_rotary_dim(family, c) + 1) // 2
    params: dict[str, Any] = {
        "linear": {"factor": 2.0}, "dynamic": {"factor": 2.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": length,
                 **draw(st.sampled_from([{}, {"beta_fast": 8.0, "beta_slow": 2.0}, {"attention_factor": 0.8}]))},
        "llama3": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": length},
        "longrope": {"short_factor": [1.0 + i / 4 for i in range(n)], "long_factor": [1.0 + i for i in range(n)],
                     "original_max_position_embeddings": length, **draw(st.sampled_from([{}, {"factor": 8.0}]))},
        "su": {"short_factor": [1.0 + i / 4 for i in range(n)], "long_factor": [1.0 + i for i in range(n)]},
    }[kind]
    if kind == "dynamic" or family == "phi3":
        c["max_position_embeddings"] = 4 * length
        c["original_max_position_embeddings" if family == "phi3" else "max_position_embeddings"] = length
    flat = [] if family == "gemma3_text" else ["rope_parameters"]  # Gemma 3's is per layer type
    spelling = draw(st.sampled_from(["rope_scaling", "type", *flat]))
    if spelling == "rope_parameters":
        c["rope_parameters"] = {**(c.get("rope_parameters") or {}), "rope_type": kind, **params}
    else:
        c["rope_scaling"] = {("type" if spelling == "type" else "rope_type"): kind, **params}


# ------------------------------------------------------------------------------------------
# One case
# ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    family: str
    kind: str  # equal, refused, hf-refused, wrong, crash
    detail: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    error: float | None = None


def _batch(seed: int = 0):
    ids = np.random.default_rng(seed).integers(3, V, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, :PAD] = 0
    return ids, mask, np.maximum(mask.cumsum(1) - 1, 0)


def _build_folder(family: str, config: dict[str, Any], folder: str, seed: int, saved_as: str | None = None) -> None:
    """A model of `config` with perturbed weights, saved (in `saved_as`, a torch dtype name,
    when given); config.json rewritten as drawn."""
    import torch
    import transformers

    cfg_cls, model_cls, _ = MODELS[family]
    raw = {k: v for k, v in config.items() if not k.startswith("_")}
    stored_head = config.get("_stored_head") and raw.get("tie_word_embeddings", True) is not False
    kw = {k: v for k, v in raw.items() if k != "model_type"}
    if stored_head:
        kw["tie_word_embeddings"] = False  # a head of its own in the file, then the config says tied
    hf_config = getattr(transformers, cfg_cls)(**copy.deepcopy(kw))  # it standardises nested rope dicts in place
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config).eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02 if gemma and "embed_tokens" in name else 0.2)
            else:
                p.add_(0.1 * torch.randn_like(p))
    if saved_as is not None:
        model.to(getattr(torch, saved_as))
    model.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    raw["architectures"] = saved.get("architectures")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)


def _reference(family: str, folder: str, part: str, float64: bool = False):
    """transformers' reading of the folder, in float32 (float64 when asked): (logits or hidden
    states, greedy tokens or None; in float64, the logits alone)."""
    import torch
    import transformers

    _, model_cls, _ = MODELS[family]
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")  # the same tensors, without a thread pool per tiny load
    extra = {"dtype": torch.float64 if float64 else torch.float32}
    from flax_blocks.checkpoints.family import FAMILIES

    attn = "sdpa" if FAMILIES[family].reference.sdpa else "eager"  # (Falcon's eager path adds ALiBi twice)
    model = getattr(transformers, model_cls).from_pretrained(folder, attn_implementation=attn, **extra).eval()
    ids, mask, pos = _batch()
    with torch.no_grad():
        if MODELS[family][2] == "model":
            out = model(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
            return out, None
        if part == "model":
            base = model.base_model(torch.tensor(ids), attention_mask=torch.tensor(mask),
                                    position_ids=torch.tensor(pos)).last_hidden_state.numpy()
            return base, None
        logits = model(torch.tensor(ids), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(pos)).logits.numpy()
        if float64:
            return logits, None
        tokens = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=NEW,
                                do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    return logits, tokens


def _ours(lm, part: str, encoder: bool, tokens=None):
    """Our logits (and, given HF's greedy tokens, our logits teacher-forced on them). Eager
    when FUZZ_HF_EAGER=1 (the long run's workers: across thousands of configs each op's
    compiled form for the drawn shapes is reused, 3.4 configs/s), compiled otherwise (a few
    configs: one compile of the model costs less than compiling its ops; Gemma 3's budget
    of 3 in the suite: 35 s eager, 16 s compiled); a mixture of experts always compiled (its
    dispatch's scans run op by op otherwise: Mixtral's published config 84 s eager)."""
    import contextlib

    import jax
    import jax.numpy as jnp

    ids, mask, pos = _batch()
    eager = jax.disable_jit() if os.environ.get("FUZZ_HF_EAGER") == "1" and not lm.cfg.num_experts \
        else contextlib.nullcontext()  # the experts' dispatch scans per block: op by op it costs 80 s
    with eager:
        if encoder:
            return np.asarray(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask))), None
        out = np.asarray(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask), positions=jnp.asarray(pos)))
        if tokens is None:
            return out, None
        full_mask = np.concatenate([mask, np.ones((B, NEW), np.int64)], axis=1)
        full_pos = np.maximum(full_mask.cumsum(1) - 1, 0)
        scaling = lm.cfg.rope_scaling
        if lm.lm.cache_window is not None or (scaling is not None and scaling.needs_length) or lm.lm.recompute_length:
            # HF's generate decodes through a windowed cache, or rotates each step's keys at that step's length
            return out, _forced_through_the_cache(lm, tokens, full_mask, full_pos)
        forced = np.asarray(lm(jnp.asarray(tokens), attention_mask=jnp.asarray(full_mask),
                               positions=jnp.asarray(full_pos)))
    return out, forced


def _forced_through_the_cache(lm, tokens: np.ndarray, mask: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Our logits (B, T + NEW, V) along HF's generated `tokens`, decoded as generate decodes: the
    prompt as one cached chunk, then one token a step through the cache."""
    import jax.numpy as jnp

    cache = lm.init_cache(B, T + NEW)
    out, cache = lm(jnp.asarray(tokens[:, :T]), attention_mask=jnp.asarray(mask[:, :T]),
                    positions=jnp.asarray(pos[:, :T]), cache=cache)
    steps = [np.asarray(out)]
    for i in range(T, T + NEW):
        if lm.lm.recompute_length is not None and i + 1 == lm.lm.recompute_length + 1:  # generate's recompute
            cache = lm.init_cache(B, T + NEW)
            out, cache = lm(jnp.asarray(tokens[:, :i + 1]), attention_mask=jnp.asarray(mask[:, :i + 1]),
                            positions=jnp.asarray(pos[:, :i + 1]), cache=cache)
            steps.append(np.asarray(out)[:, -1:])
            continue
        out, cache = lm(jnp.asarray(tokens[:, i:i + 1]), attention_mask=jnp.asarray(mask[:, i:i + 1]), cache=cache)
        steps.append(np.asarray(out))
    return np.concatenate(steps, axis=1)


def _greedy_agrees(forced: np.ndarray, tokens: np.ndarray) -> bool:
    """HF's greedy tokens are each one of our argmaxes (within RTOL of our best logit) given
    the tokens before them: then our greedy decoding is HF's, up to exact ties."""
    steps = forced[:, T - 1:T - 1 + NEW]  # the logits that chose each new token
    chosen = np.take_along_axis(steps, tokens[:, T:, None], axis=-1)[..., 0]
    scale = np.abs(steps).max()
    return bool((steps.max(-1) - chosen <= RTOL * scale).all())


def _names_a_key(message: str, family: str, config: dict[str, Any]) -> bool:
    """The refusal names a key: one of the config's, or one the family reads (at its default)."""
    from flax_blocks.checkpoints.family import FAMILIES

    keys = {*config, *FAMILIES[family].reads}
    return any(f"{k}=" in message or f"{k} (the default)=" in message for k in keys) or "model_type" in message


def run_case(family: str, config: dict[str, Any], seed: int = 0, saved_as: str | None = None) -> Outcome:
    """One config: built, saved (in `saved_as` when given, a torch dtype name), read back by
    transformers and by fb.from_hf, both in float32, and compared (see the module docstring)."""
    import jax
    from flax import nnx

    import flax_blocks as fb

    part = MODELS[family][2]
    encoder = part == "model"
    with tempfile.TemporaryDirectory() as folder:
        try:
            _build_folder(family, config, folder, seed, saved_as)
        except Exception as e:  # noqa: BLE001 - transformers refusing the config is an outcome
            return Outcome(family, "hf-refused", f"build: {type(e).__name__}: {str(e)[:200]}", config)
        if saved_as is not None:  # read in the file's dtype by default
            try:
                kept = {str(a.dtype) for a in jax.tree.leaves(nnx.state(fb.from_hf(folder, part=part), nnx.Param))}
            except fb.ConversionError as e:
                return _refused(family, config, str(e))
            if kept != {saved_as}:
                return Outcome(family, "wrong", f"saved in {saved_as}, read by default as {sorted(kept)}", config)
        try:
            lm = fb.from_hf(folder, part=part, dtype="float32")
        except fb.ConversionError as e:
            if not encoder and "is_causal=False" in str(e) and config.get("is_causal") is False:
                part = "model"  # no causal LM: its base model is compared instead
                try:
                    lm = fb.from_hf(folder, part="model", dtype="float32")
                except fb.ConversionError as e2:
                    return _refused(family, config, str(e2))
            else:
                return _refused(family, config, str(e))
        except Exception as e:  # noqa: BLE001
            return Outcome(family, "crash", f"{type(e).__name__}: {str(e)[:300]}", config)
        try:
            ref, tokens = _reference(family, folder, part)
        except Exception as e:  # noqa: BLE001
            return Outcome(family, "hf-refused", f"forward: {type(e).__name__}: {str(e)[:200]}", config)
        try:
            ours, forced = _ours(lm, part, encoder, tokens)
        except Exception as e:  # noqa: BLE001
            return Outcome(family, "crash", f"our forward: {type(e).__name__}: {str(e)[:300]}", config)
        live = _batch()[1].astype(bool)
        err = _relative(ours, ref, live)
        detail = part
        if not err <= RTOL:  # past 1e-5: float32's noise on this config, or wrong
            exact = _float64(folder, part, encoder)
            err64, noise = _relative(exact, ref, live), _relative(ours, exact, live)
            detail = (f"{part}; float32 noise: HF {err64:.1e} from our float64, ours {noise:.1e} (within "
                      f"max(1e-5, 2 x ours))")
            if not err64 <= max(RTOL, 2 * noise):  # noisier still: both sides in float64 settle it
                try:
                    hf64 = _reference(family, folder, part, float64=True)[0]
                except Exception as e:  # noqa: BLE001 - GPT-2's reorder_and_upcast_attn asserts float32
                    return Outcome(family, "wrong", f"{part}: relative error {err:.1e} "
                                                    f"(HF from our float64 {err64:.1e}, "
                                                    f"our float32 from our float64 {noise:.1e}; HF cannot run in "
                                                    f"float64 to settle it: {type(e).__name__}: {str(e)[:100]})",
                                   config, err)
                rows = np.isfinite(hf64).all(axis=tuple(range(1, hf64.ndim)))  # HF's float64 NaNs a padded element
                both = _relative(exact[rows], hf64[rows], live[rows]) if rows.any() else float("inf")
                if not both <= RTOL:
                    return Outcome(family, "wrong", f"{part}: relative error {err:.1e} "
                                                    f"(HF from our float64 {err64:.1e}, "
                                                    f"our float32 from our float64 {noise:.1e}, HF's float64 from ours "
                                                    f"{both:.1e})", config, err)
                detail = (f"{part}; float32 noise: HF {err64:.1e} from our float64, ours {noise:.1e}; HF's float64 "
                          f"from ours {both:.1e} on {int(rows.sum())} of {len(rows)} elements (HF's float64 is finite "
                          f"there; its Gemma norms still round to float32)")
    if tokens is not None and not _greedy_agrees(forced, tokens):
        return Outcome(family, "wrong", "greedy tokens differ from HF generate's", config, err)
    return Outcome(family, "equal", detail, config, err)


def _relative(ours: np.ndarray, ref: np.ndarray, live: np.ndarray) -> float:
    return float(np.abs(ours - ref)[live].max() / np.abs(ref[live]).max())


def _float64(folder: str, part: str, encoder: bool) -> np.ndarray:
    """Our computation of the folder in float64 (x64 on for the call): what float32 rounds."""
    import jax

    import flax_blocks as fb

    with jax.enable_x64(True):
        return _ours(fb.from_hf(folder, part=part, dtype="float64"), part, encoder)[0]


def _refused(family: str, config: dict[str, Any], message: str) -> Outcome:
    if _names_a_key(message, family, config):
        return Outcome(family, "refused", message.split("\n", 1)[-1].strip()[:300], config)
    return Outcome(family, "crash", f"refused without naming a key: {message[:300]}", config)


# ------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------


def fuzz(family: str, examples: int, seed: int, record) -> None:
    """Draw `examples` configs of `family` with hypothesis (seeded, no shrinking), run each,
    hand each Outcome to `record`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(configs(family))
    def one(config):
        record(run_case(family, config))

    one()


def summarise(outcomes: list[Outcome], seconds: float, seed: int) -> tuple[str, dict[str, Any]]:
    families = sorted({o.family for o in outcomes})
    counts = {f: Counter(o.kind for o in outcomes if o.family == f) for f in families}
    kinds = ["equal", "refused", "hf-refused", "wrong", "crash"]
    lines = ["# Differential fuzzing of fb.from_hf against transformers", "",
             f"Generated by `python -m parity_tests.hf.fuzz` (seed {seed}, {seconds / 60:.1f} min, "
             f"transformers {_version()}): {len(outcomes)} configs, "
             f"{sum(o.kind == 'wrong' for o in outcomes)} silent wrong loads, "
             f"{sum(o.kind == 'crash' for o in outcomes)} crashes.", "",
             "| family | configs | " + " | ".join(kinds) + " | worst relative error (equal) |",
             "|---|---|" + "---|" * len(kinds) + "---|"]
    for f in families:
        worst = max((o.error for o in outcomes if o.family == f and o.kind == "equal"), default=None)
        lines.append(f"| {f} | {sum(counts[f].values())} | " + " | ".join(str(counts[f][k]) for k in kinds)
                     + f" | {'-' if worst is None else f'{worst:.1e}'} |")
    reasons = Counter(o.detail.split(":")[0] for o in outcomes if o.kind == "refused")
    lines += ["", "Refusals by the key they name (first problem):", ""]
    lines += [f"- `{r}`: {n}" for r, n in reasons.most_common()]
    bad = [o for o in outcomes if o.kind in ("wrong", "crash")]
    lines += ["", f"Wrong loads and crashes: {len(bad)}", ""]
    lines += [f"- {o.family} {o.kind}: {o.detail} -- `{json.dumps(o.config)}`" for o in bad]
    data = {"seed": seed, "seconds": seconds, "transformers": _version(), "configs": len(outcomes),
            "per_family": {f: dict(counts[f]) for f in families},
            "cases": [o.__dict__ for o in outcomes if o.kind != "equal"]}
    return "\n".join(lines) + "\n", data


def _version() -> str:
    import transformers

    return transformers.__version__


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "flax_blocks"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def run(minutes: float, seed: int, families: list[str], chunk: int, worker: int = 0) -> list[Outcome]:
    """Round after round over the families, `chunk` configs each, until `minutes` have passed."""
    _quiet()
    outcomes: list[Outcome] = []
    start, rnd = time.time(), 0
    while time.time() - start < minutes * 60:
        for i, family in enumerate(families):
            if time.time() - start >= minutes * 60:
                break
            fuzz(family, chunk, seed * 1_000_003 + worker * 100_003 + rnd * 1009 + i, outcomes.append)
        rnd += 1
        print(f"worker {worker} round {rnd}: {len(outcomes)} configs, {time.time() - start:.0f} s, "
              f"{dict(Counter(o.kind for o in outcomes))}", flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.hf.fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="time budget (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", nargs="*", default=list(MODELS), help="families to draw (default: all)")
    ap.add_argument("--chunk", type=int, default=10, help="configs per family per round")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes, each drawing its own configs")
    ap.add_argument("--out", default=None, help="folder for summary.md and summary.json")
    args = ap.parse_args(argv)
    start = time.time()
    os.environ["FUZZ_HF_EAGER"] = "1"  # thousands of configs: eager, reusing each op's compiled form
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = [pool.submit(run, args.minutes, args.seed, args.families, args.chunk, w) for w in range(args.jobs)]
            outcomes = [o for p in parts for o in p.result()]
    else:
        outcomes = run(args.minutes, args.seed, args.families, args.chunk)
    text, data = summarise(outcomes, time.time() - start, args.seed)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)
    return 1 if any(o.kind in ("wrong", "crash") for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
