"""Hugging Face transformer stacks in and out: BERT / RoBERTa, DistilBERT, GPT-2, OPT, ViT,
LLaMA / Mistral / Qwen2, Phi-3, Qwen3, Gemma, Gemma 2, Gemma 3 (text), OLMo 2, GPT-NeoX, Starcoder2,
StableLM, Whisper (encoder, and its decoder with part='decoder').

    from_hf(source)             an HF model (a save_pretrained folder or the model object)
                                -> a Flax Encoder computing its layers + final norm
    to_hf(module, dialect=...)  a Flax Encoder -> {HF name: array} of the stack

Only the transformer stack is converted: hidden states (B, T, E) in, the model's last
hidden state out. Embeddings (token, position, token type, BERT's embedding LayerNorm),
poolers and LM heads stay on the HF side, as do OPT's project_in / project_out (an OPT with
word_embed_proj_dim != hidden_size projects the token embeddings before the stack and the
final hidden state after it: the Flax stack's output is the one before project_out). Rotary
positions are part of the rotary families' layers and are computed by the Flax stack
(positions 0..T-1). The settings come from the model's own config (`flax_blocks.checkpoints.hf_config`:
heads, KV heads, eps, activation, rotary base, causal, norm placement, biases, final norm);
every scaled rotary (linear, dynamic, LLaMA 3's, yarn, longrope) is read; what the Flax blocks
cannot compute (a model_type of `family.NOT_COMPUTED`, a value a family's key takes that the
blocks lack) is refused by name, never silently approximated. The stack is built for inference: dropout 0.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from ..core.config import BlockConfig
from . import dialects
from .family import LANGUAGE_MODELS
from .hf_config import hf_model_config, hf_state_dict, read_config, read_folder, weight_files
from .io import ConversionError, read_state_dict
from .load_report import report_ignored

log = logging.getLogger("flax_blocks")


def from_hf(source: Any, *, part: str = "stack", dtype: Any = None, seed: int = 0, ignore_keys: tuple[str, ...] = (),
            mesh: Any = None, rules: Any = None, revision: str | None = None):
    """A Flax `Encoder` computing a Hugging Face model's transformer stack, or (part=) the
    whole model as a `flax_blocks.lm.LanguageModel`.

    part: "stack" (the default, described below); "encoder" / "decoder" of an
      encoder-decoder family (Whisper: "stack" is its encoder; "decoder" a Decoder, called
      with the encoder's output as memory); "model": the HF base model, token ids
      (and BERT's token_type_ids) -> its last hidden state, with the token embedding,
      learned or rotary positions, BERT's embedding norm and the final norm (every family
      above but ViT and Whisper; BERT's and RoBERTa's poolers are not read); "causal-lm":
      the model with its LM head, tied or not: tokens -> logits (the causal families: GPT-2,
      OPT, LLaMA, Mistral, Qwen2, Phi-3, Qwen3, Gemma 1-3, OLMo 2, GPT-NeoX, StableLM,
      Starcoder2; OPT's position offset, Gemma's embedding scale and final soft-cap
      included). Either reads the family's table in `flax_blocks.checkpoints.hf_models` (what a family
      computes there that the model does not, OPT's project_in, is refused by name);
      `fb.generate` decodes a "causal-lm".

    source: a folder written by `save_pretrained` (config.json and *.safetensors, or
      pytorch_model.bin), a Hub id ("Qwen/Qwen3-0.6B", at `revision`: from huggingface_hub's
      cache, downloaded when online; HF_HUB_OFFLINE and HF_HUB_CACHE honoured) or a
      transformers model object (BertModel, GPT2LMHeadModel, LlamaForCausalLM, ViTModel, ...;
      read as its save_pretrained would write it). A folder's files are read through a memory
      map a tensor (or a device's slice of one) at a time as each parameter is placed, after
      every check has passed on their headers alone: host memory holds about one layer of a
      parameter beyond the model itself.
    dtype: the parameters' dtype, each tensor cast as it is read; None keeps the checkpoint's
      (a bfloat16 checkpoint stays bfloat16; float64 needs jax_enable_x64).
    mesh, rules: create every parameter sharded over `mesh` (a jax.sharding.Mesh) as it is
      read, each device reading only its slice (each process only its devices' slices in a
      multi-process run): the declared logical axes through `rules` (a
      `flax_blocks.sharding.ShardingRules`; default TENSOR_PARALLEL: attention heads and the
      FFN width over "model", the rest replicated; on a mesh with an "expert" axis
      (`make_mesh(expert=n)`) also EXPERT_PARALLEL: each device reads its experts only).
    ignore_keys: config keys to read as absent (their config class's defaults apply), a
      departure from transformers you ask for (say, to load a model without a setting the
      blocks refuse). Every config key is read as the family's transformers code reads it
      (`flax_blocks.checkpoints.families`); a key that code never reads is ignored, as
      transformers ignores it, and listed: one warning, and `fb.load_report(model)`.
    Returns an Encoder (with .cfg and .num_layers) mapping hidden states (B, T, E) to the
    HF model's last hidden state for those inputs embedded (after its embeddings), with
    `key_mask=` (B, T), True = real token, for padding. Query positions that are padding
    themselves may differ from HF's (whose values there are meaningless anyway).
    Sliding windows are read (Mistral, Qwen2, Phi-3, Starcoder2: every layer local; Gemma 2 / 3:
    every n-th layer global); a layout the blocks cannot express is refused.
    The stack remembers its family's dialect (`hf_dialect`), which `to_hf` writes back, and
    what the load read and ignored (`fb.load_report(model)`).
    """
    config, sd, origin = _read_source(source, revision)
    if isinstance(ignore_keys, str):
        raise TypeError(f"ignore_keys must be a tuple of config keys, e.g. ({ignore_keys!r},), got the string "
                        f"{ignore_keys!r}")
    ignore_keys = tuple(ignore_keys)
    if part in ("model", "causal-lm"):
        from . import hf_models

        return hf_models.load(config, sd, part, dtype=dtype, seed=seed, ignore_keys=ignore_keys, mesh=mesh,
                              rules=rules, origin=origin)
    if part not in ("stack", "encoder", "decoder"):
        raise ValueError(f"part must be one of 'stack', 'encoder', 'decoder', 'model', 'causal-lm', got {part!r}")
    return _load_stack(config, sd, part, dtype=dtype, seed=seed, ignore_keys=ignore_keys, mesh=mesh, rules=rules,
                       origin=origin)


def _read_source(source: Any, revision: str | None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(config.json's dict, the state dict named as in the whole model, where it came from:
    {"source": ..., "files": [...]}) of a folder, a Hub id or a transformers model object (see
    `from_hf`)."""
    config: dict[str, Any] | None
    if isinstance(source, (str, os.PathLike)):
        from .hub import resolve

        folder = resolve(os.fspath(source), revision)
        config, sd = read_folder(folder)
        origin = {"source": os.fspath(source), "folder": os.path.abspath(folder),
                  "files": [os.path.basename(f) for f in weight_files(folder, config.get("transformers_weights"))]}
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


def _load_stack(config: dict[str, Any], sd: dict[str, Any], part: str, *, dtype: Any, seed: int,
                ignore_keys: tuple[str, ...], mesh: Any, rules: Any, origin: dict[str, Any]):
    """`from_hf`'s part "stack", "encoder" or "decoder": the Encoder (or Decoder) of the
    family's layers, remembering its dialect."""
    from .. import stacks
    from .convert import from_torch

    read = read_config(config, dtype=dtype, part=None if part == "stack" else part, ignore_keys=ignore_keys)
    dialect, cfg, num_layers, final_norm = read.dialect, read.cfg, read.num_layers, read.final_norm
    stack = dialects.translate(sd, dialect, num_heads=cfg.num_heads, cfg=cfg).state_dict
    if dtype is None:
        dtypes = {str(a.dtype) for a in stack.values()}
        if len(dtypes) == 1 and dtypes <= {"float32", "float64", "bfloat16", "float16"}:
            cfg = replace(cfg, param_dtype=dtypes.pop())
    log.info("from_hf: %s model, dialect %s, %d layers", config.get("model_type"), dialect, num_layers)
    cls = getattr(stacks, dialects.DIALECTS[dialect].stack)
    module = from_torch(cls, cfg, stack, dialect="torch", num_layers=num_layers, final_norm=final_norm,
                        dtype=dtype, seed=seed, mesh=mesh, rules=rules)
    module.hf_dialect = dialect  # a plain attribute (static in nnx.split): to_hf's default
    report_ignored(module, config, part, origin, read)
    return module


def _whole_model_names(config: dict[str, Any], sd: dict[str, Any]) -> dict[str, Any]:
    """A part saved on its own (a WhisperEncoder: architectures ["WhisperEncoder"], its keys
    without "encoder.") named as in the whole model, which the dialects read."""
    if config.get("architectures") == ["WhisperEncoder"] and not any(k.startswith("encoder.") for k in sd):
        return {f"encoder.{k}": v for k, v in sd.items()}
    return sd


def dialect_for(cfg: BlockConfig, stack: str = "Encoder") -> str:
    """The HF dialect whose family settings `cfg` has. Several families hold some configs
    (a post-LN BERT-like stack is also a DistilBERT's with eps 1e-12, a pre-LN causal one a
    GPT-2's or an OPT's, a LLaMA-like one a Phi-3's): then none is chosen, the error lists
    them, and dialect= says which."""
    hf = {n: lay for n, lay in dialects.DIALECTS.items() if lay.rules is not None and lay.stack == stack}
    fits = [n for n, lay in hf.items() if all(getattr(cfg, k) == v for k, v in lay.settings.items())]
    if len(fits) > 1:
        raise ConversionError([f"{n}: {hf[n].description}" for n in fits],
                              header=f"several Hugging Face dialects hold this config ({', '.join(fits)}); pass "
                                     "dialect=")
    if not fits:
        raise ConversionError([f"{n}: needs " + ", ".join(f"{k}={v!r}" for k, v in lay.settings.items())
                               for n, lay in hf.items()],
                              header="no Hugging Face dialect fits this config; pass dialect=")
    return fits[0]


def to_hf(module, dialect: str | None = None, *, prefix: str | None = None) -> dict[str, Any]:
    """{HF name: numpy array} of a Flax Encoder's stack: its layers and final norm; of a
    whole `LanguageModel` (from_hf(..., part="model" / "causal-lm")), every weight, named as
    HF's model.state_dict() (`flax_blocks.checkpoints.hf_models.to_hf_model`: LlamaForCausalLM's
    model.embed_tokens.weight ... lm_head.weight; a base model's without prefix), loadable
    with strict=True (BERT: all but the pooler).

    dialect: one of flax_blocks.checkpoints.dialects.DIALECTS' hf-* names (None: the one the module was
      read from by from_hf, else the one whose family settings the module's cfg has; a
      config the family cannot hold is refused, naming the fields).
    prefix: put before every name, e.g. "model." for LlamaForCausalLM, "bert." for
      BertForMaskedLM, "model." for OPTForCausalLM; "" names them as in BertModel /
      GPT2Model / LlamaModel / OPTModel / ViTModel's checkpoint files.
    The arrays keep the module's dtype. Load them with
      missing, unexpected = hf_model.load_state_dict(tb.to_tensors(sd), strict=False)
    where `unexpected` is empty and `missing` lists only what lies outside the stack
    (embeddings, pooler, heads)."""
    import numpy as np

    from .convert import torch_state_dict

    if type(module).__name__ == "LanguageModel":
        from .hf_models import to_hf_model

        return to_hf_model(module, dialect or getattr(module, "hf_dialect", None) or dialect_for(module.cfg),
                           prefix=prefix)
    if type(module).__name__ not in ("Encoder", "Decoder"):
        raise TypeError(f"to_hf converts an Encoder or a Decoder (a stack) or a LanguageModel, "
                        f"got {type(module).__name__}")
    prefix = prefix or ""
    dialect = dialect or getattr(module, "hf_dialect", None) or dialect_for(module.cfg, type(module).__name__)
    if dialect == "torch":
        raise ValueError("dialect 'torch' is our own naming: use flax_blocks.torch_state_dict")
    sd = dialects.to_dialect(torch_state_dict(module), dialect, module.cfg, prefix=prefix)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}
