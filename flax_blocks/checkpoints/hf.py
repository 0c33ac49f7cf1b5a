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
from typing import Any

from ..core.config import BlockConfig
from . import dialects
from .checkpoint import Checkpoint, mark, read_checkpoint
from .hf_models import twin_state_dict
from .io import ConversionError

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
    ckpt = read_checkpoint(source, part=part, dtype=dtype, ignore_keys=ignore_keys, revision=revision)
    return place(ckpt, dtype=dtype, seed=seed, mesh=mesh, rules=rules)


def place(ckpt: Checkpoint, *, dtype: Any = None, seed: int = 0, mesh: Any = None, rules: Any = None):
    """A Flax model holding a read Checkpoint's tensors (each read once, as it is placed; on
    `mesh` each device reads its slice), marked with its dialect, family and load report:
    a LanguageModel for a whole model, else an Encoder or Decoder."""
    from .. import stacks
    from .convert import from_torch
    from .convert.load import from_torch_state_dict

    if ckpt.lm is not None:
        model = from_torch_state_dict(ckpt.cfg, ckpt.lm, ckpt.tensors, seed=seed, dtype=dtype, mesh=mesh, rules=rules)
    else:
        log.info("from_hf: %s model, dialect %s, %d layers", ckpt.family, ckpt.dialect, ckpt.num_layers)
        model = from_torch(getattr(stacks, ckpt.stack), ckpt.cfg, ckpt.tensors, dialect="torch",
                           num_layers=ckpt.num_layers, final_norm=ckpt.final_norm, dtype=dtype, seed=seed, mesh=mesh,
                           rules=rules)
    return mark(model, ckpt)


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
    sd = dialects.to_dialect(twin_state_dict(module), dialect, module.cfg, prefix=prefix)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}
