"""Hugging Face models in and out of the Flax twin: BERT / RoBERTa, DistilBERT, GPT-2, OPT, ViT,
LLaMA / Mistral / Qwen2, Phi-3, Qwen3, Gemma, Gemma 2, Gemma 3 (text), OLMo 2, GPT-NeoX, Starcoder2,
StableLM, Whisper (encoder, and its decoder with part='decoder'), and the other families of
`flax_blocks.checkpoints.families`.

    from_hf(source, part=...)   an HF model (a save_pretrained folder, a Hub id or the model object)
                                -> a Flax Encoder (its layers + final norm) or a whole LanguageModel
    place(ckpt)                 a read `checkpoint.Checkpoint` -> the Flax model holding its tensors
    to_hf(module, dialect=...)  a Flax (or torch_blocks) stack or LanguageModel -> {HF name: array}
    to_hf_model(model, ...)     a whole LanguageModel's names, as HF's model.state_dict()

The source is read by the framework-free `flax_blocks.checkpoints.checkpoint` (config,
family, every refusal, the tensors named as the twins name them); what is here is the Flax
twin's placing and the way back. A stack's input is hidden states (B, T, E), its output the
model's last hidden state; embeddings, poolers and heads are the whole model's (part="model" /
"causal-lm"). Rotary positions are part of the rotary families' layers. Every scaled rotary
(linear, dynamic, LLaMA 3's, yarn, longrope) is read; what the Flax blocks cannot compute (a
model_type of `family.NOT_COMPUTED`, a value a family's key takes that the blocks lack) is
refused by name, never silently approximated. The model is built for inference: dropout 0.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..core.config import BlockConfig
from ..core.lm_config import ENCODER
from . import dialects
from .checkpoint import Checkpoint, check_shapes, mark, read_checkpoint
from .family import FAMILIES, Outside, families_of_dialect
from .io import ConversionError
from .stream import to_numpy

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
      included). Either reads the family's table (`flax_blocks.checkpoints.checkpoint.read_whole`:
      what a family computes there that the model does not is refused by name);
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
    """A Flax model holding a read Checkpoint's tensors, marked with its dialect, family and
    load report: a LanguageModel for a whole model, else an Encoder or Decoder. The model is
    built abstract (`nnx.eval_shape`: no random values drawn), the checkpoint's dtypes, names
    and shapes checked against it (one ConversionError naming every difference, nothing
    read), then each tensor read once as it is placed (on `mesh` each device reads its slice;
    `flax_blocks.checkpoints.convert.place`); only the dropout RNG state comes from `seed`."""
    from flax import nnx

    from .. import stacks
    from ..lm import LanguageModel
    from .convert.place import check_dtypes, materialize_rng_state, named_params, place_named

    check_dtypes(ckpt.tensors, dtype)  # before the model is built in a dtype it cannot hold
    lm = ckpt.lm
    if lm is not None:
        model = nnx.eval_shape(lambda: LanguageModel(ckpt.cfg, lm, rngs=nnx.Rngs(seed)))
    else:
        log.info("from_hf: %s model, dialect %s, %d layers", ckpt.family, ckpt.dialect, ckpt.num_layers)
        model = nnx.eval_shape(lambda: getattr(stacks, ckpt.stack)(
            ckpt.cfg, num_layers=ckpt.num_layers, final_norm=ckpt.final_norm, rngs=nnx.Rngs(seed)))
    named = named_params(model)
    check_shapes(ckpt, {t: p.shape for t, (_, _, p) in named.items()})
    place_named(model, ckpt.tensors, named, dtype=dtype, mesh=mesh, rules=rules)
    materialize_rng_state(model, seed, mesh=mesh)
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
    HF's model.state_dict() (`to_hf_model`: LlamaForCausalLM's
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
    if type(module).__name__ == "LanguageModel":
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


def twin_state_dict(model: Any) -> dict[str, Any]:
    """{torch name: numpy array} of a model of either twin: a torch_blocks module's own
    state_dict, a flax_blocks module's `torch_state_dict` (the same names and layouts)."""
    if type(model).__module__.split(".")[0] == "torch_blocks":
        return {k: to_numpy(v) for k, v in model.state_dict().items()}
    from .convert import torch_state_dict

    return torch_state_dict(model)


def causal_lm_class(model_type: str) -> str:
    """The class of a family's causal LM in transformers (LlamaForCausalLM, GPT2LMHeadModel ...)."""
    lm_class = FAMILIES[model_type].lm_class
    if lm_class is None:
        raise ValueError(f"{model_type} has no causal LM in transformers")
    return lm_class


def _family_of(model, dialect: str, family: str | None = None) -> tuple[str, Outside]:
    """The family a LanguageModel is written as: the one from_hf read it from when `dialect` is
    that family's, else the first family of `dialect` with a table (hf-bert: BERT, hf-llama:
    LLaMA); its parts around the stack must compute what the model computes."""
    family = family or getattr(model, "hf_family", None)
    if family not in FAMILIES or FAMILIES[family].dialect != dialect or FAMILIES[family].outside is None:
        family = next((t for t in families_of_dialect(dialect) if FAMILIES[t].outside is not None), None)
    if family is None:
        raise ConversionError([f"{dialect}: no family of that dialect has its parts around the stack declared"],
                              header="cannot write this whole model")
    out, lm, problems = FAMILIES[family].outside, model.lm, []
    assert out is not None  # chosen above among the families that declare their parts around the stack
    if out.embed_multiplier is not None or out.logits_divisor is not None:
        pass  # scalars the family's config holds (Granite): written into it by save_hf
    elif (lm.embed_scale is not None) != out.embed_scale:
        problems.append(f"embed_scale={lm.embed_scale}: {family} " + ("scales its embeddings by sqrt(hidden_size)"
                                                                     if out.embed_scale else "has no embedding scale"))
    elif out.embed_scale and lm.embed_scale != float(model.cfg.d_model) ** 0.5:
        problems.append(f"embed_scale={lm.embed_scale}: {family} scales by sqrt(hidden_size) = "
                        f"{float(model.cfg.d_model) ** 0.5}")
    if lm.logits_divisor is not None and out.logits_divisor is None:
        problems.append(f"logits_divisor={lm.logits_divisor}: {family} does not divide its logits")
    if lm.final_logit_softcap is not None and out.final_logit_softcap is None:
        problems.append(f"final_logit_softcap={lm.final_logit_softcap}: {family} has no final logit soft-cap")
    if lm.logit_scale is not None and out.logit_scale is None:
        problems.append(f"logit_scale={lm.logit_scale}: {family} does not scale its logits")
    want = {"none": (0, "arange"), "two": (2, "mask")}.get(out.position_offset)
    if want is not None and (lm.position_offset, lm.default_positions) != want:
        problems.append(f"position_offset={lm.position_offset}, default_positions={lm.default_positions!r}: {family} "
                        f"has {want}")
    if out.position_offset == "pad" and lm.max_positions is not None and lm.default_positions != "ids":
        problems.append(f"default_positions={lm.default_positions!r}: {family} numbers its positions from the ids")
    if problems:
        raise ConversionError(problems, header=f"cannot write this whole model as {family} ({dialect})")
    return family, out


def to_hf_model(model, dialect: str, *, prefix: str | None = None, family: str | None = None
                ) -> dict[str, np.ndarray]:
    """{HF name: numpy array} of a whole LanguageModel, named as HF's checkpoint files of the
    model with a head (LlamaForCausalLM, GPT2LMHeadModel, OPTForCausalLM, GPTNeoXForCausalLM's
    gpt_neox.embed_in.weight ... embed_out.weight) or of the base model (LlamaModel, GPT2Model,
    BertModel, RobertaModel) for head="none". A tied head is written as lm_head.weight too,
    as HF's state_dict() holds it (the same values as the embedding). The family is the one
    from_hf read the model from (`hf_family`), else the first of `dialect`'s with a table."""
    _, out = _family_of(model, dialect, family)
    lm = model.lm
    base = ("" if lm.head == "none" else out.base) if prefix is None else prefix
    sd = twin_state_dict(model)
    hf: dict[str, np.ndarray] = {base + out.embed: sd["embed.weight"]}
    if lm.max_positions is not None:
        if not out.positions:
            raise ConversionError([f"{dialect} has no learned positions"], header="cannot write this whole model")
        hf[base + out.positions] = sd["pos.weight"]
    if lm.token_types:
        if not out.token_type:
            raise ConversionError([f"{dialect} has no token-type embeddings"], header="cannot write this whole model")
        hf[base + out.token_type] = sd["token_type.weight"]
    if lm.embed_norm:
        if not out.embed_norm:
            raise ConversionError([f"{dialect} has no norm on the embeddings"], header="cannot write this whole model")
        for k in ("weight", "bias"):
            if f"embed_norm.{k}" in sd:
                hf[base + out.embed_norm + k] = sd[f"embed_norm.{k}"]
    if lm.project_dim is not None:
        if out.projections is None:
            raise ConversionError([f"{dialect} has no projection of its embeddings"],
                                  header="cannot write this whole model")
        hf[base + out.projections[1] + "weight"] = sd["project_in.weight"]
        hf[base + out.projections[2] + "weight"] = sd["project_out.weight"]
    stack = {k[len(ENCODER) + 1:]: v for k, v in sd.items() if k.startswith(ENCODER + ".")}
    hf.update(dialects.to_dialect(stack, dialect, model.cfg, prefix=base))
    if lm.head != "none":
        if out.head is None:
            raise ConversionError([f"{dialect} has no LM head"], header="cannot write this whole model")
        hf[out.head + "weight"] = sd["head.weight"] if lm.head == "untied" else sd["embed.weight"]
        if "head.bias" in sd:
            hf[out.head + "bias"] = sd["head.bias"]
    return {k: np.ascontiguousarray(v) for k, v in hf.items()}
