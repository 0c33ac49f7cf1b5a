"""Hugging Face transformer stacks in and out: BERT, GPT-2, LLaMA / Mistral / Qwen2.

    from_hf(source)            an HF model (a save_pretrained folder or the model object)
                               -> a Flax Encoder computing its layers + final norm
    to_hf(module, dialect=...) a Flax Encoder -> {HF name: array} of the stack
    hf_config(config)          an HF config (dict) -> (dialect, BlockConfig, num_layers, final_norm)

Only the transformer stack is converted: hidden states (B, T, E) in, the model's last
hidden state out. Embeddings (token, position, token type, BERT's embedding LayerNorm),
poolers and LM heads stay on the HF side. Rotary positions are part of the LLaMA-family
layers and are computed by the Flax stack (positions 0..T-1). The settings come from the
model's own config (heads, KV heads, eps, activation, rotary base, causal, biases, final
norm); what the Flax blocks cannot compute (scaled rotary variants such as LLaMA 3's,
layer-dependent attention scaling, a sliding window shorter than the sequence) is refused
or noted, never silently approximated. The stack is built for inference: dropout 0.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import replace
from typing import Any, Mapping

from . import dialects
from .checkpoint_io import ConversionError, read_state_dict
from .config import BlockConfig, dtype_name
from .options import BY_NAME

log = logging.getLogger("flax_blocks")

# model_type -> the dialect of its keys (the settings below are read from the config)
MODEL_TYPES = {"bert": "hf-bert", "gpt2": "hf-gpt2", "llama": "hf-llama", "mistral": "hf-llama", "qwen2": "hf-llama"}

ACTIVATIONS = {  # HF's activation names -> ours
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": None,
    "relu": "relu", "silu": "silu", "swish": "silu",
}


def _first(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if config.get(n) is not None:
            return config[n]
    return default


def _rope_theta(config: Mapping[str, Any], problems: list[str]) -> float:
    """The rotary base; scaled variants (rope_type other than default) are refused."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        problems.append(f"rope_type {kind!r} (scaled rotary, as LLaMA 3's): the Flax blocks compute plain rotary "
                        "positions only (rope_theta)")
    return float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


def hf_config(config: Mapping[str, Any], *, dtype: Any = None) -> tuple[str, BlockConfig, int, bool]:
    """An HF config (config.json as a dict) -> (dialect, BlockConfig, num_layers, final_norm).

    Raises ConversionError naming every setting the Flax blocks cannot reproduce."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConversionError([f"model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}"],
                              header="cannot read this Hugging Face model")
    dialect = MODEL_TYPES[model_type]
    problems: list[str] = []
    d_model = _first(config, *BY_NAME["d_model"].hf)
    heads = _first(config, *BY_NAME["num_heads"].hf)
    kv = _first(config, *BY_NAME["num_kv_heads"].hf, default=heads)
    act_name = _first(config, *BY_NAME["activation"].hf)
    activation = ACTIVATIONS.get(act_name)
    if activation is None:
        problems.append(f"activation {act_name!r}: supported {', '.join(k for k, v in ACTIVATIONS.items() if v)}")
    if model_type == "gpt2" and config.get("n_inner") is None:
        d_ff = 4 * d_model
    else:
        d_ff = _first(config, *BY_NAME["d_ff"].hf)
    settings = dict(dialects.DIALECTS[dialect].settings)
    kw: dict[str, Any] = dict(
        d_model=d_model, num_heads=heads, d_ff=d_ff, dropout=0.0,
        layer_norm_eps=float(_first(config, *BY_NAME["layer_norm_eps"].hf)),
        num_kv_heads=None if kv == heads else kv, **settings,
    )
    if activation is not None and "activation" not in settings:
        kw["activation"] = activation
    elif activation not in (None, settings.get("activation")):
        problems.append(f"activation {act_name!r}: {dialect} layers use {settings['activation']!r}")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != d_model:
        problems.append(f"head_dim {head_dim} with {heads} heads and hidden size {d_model}: the Flax blocks "
                        "have head_dim = hidden size / heads")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        problems.append("a decoder with cross-attention (is_decoder / add_cross_attention): only self-attention "
                        "stacks are converted")
    if config.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {config['position_embedding_type']!r}: relative position terms "
                        "inside attention are not computed by the Flax blocks")
    if model_type == "gpt2":
        if not config.get("scale_attn_weights", True):
            problems.append("scale_attn_weights=False: the Flax blocks scale logits by 1/sqrt(head_dim)")
        if config.get("scale_attn_by_inverse_layer_idx"):
            problems.append("scale_attn_by_inverse_layer_idx=True: a per-layer logit scale the Flax blocks lack")
    if dialect == "hf-llama":
        kw["rope_theta"] = _rope_theta(config, problems)
        attn_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
        if model_type == "qwen2":  # q/k/v biases, none elsewhere
            kw.update(bias=False, qkv_bias=True)
        elif attn_bias != mlp_bias:
            problems.append(f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: the Flax blocks have biases on "
                            "every linear map or on none (besides q/k/v)")
        else:
            kw["bias"] = attn_bias
        if config.get("use_sliding_window") and model_type == "qwen2":
            problems.append("use_sliding_window=True: layers with a sliding window are not supported")
    if dtype is not None:
        kw["param_dtype"] = dtype_name(dtype)
    elif dtype_name(config.get("dtype") or config.get("torch_dtype")) in ("float32", "float64", "bfloat16", "float16"):
        kw["param_dtype"] = dtype_name(config.get("dtype") or config.get("torch_dtype"))
    if problems:
        raise ConversionError(problems, header=f"cannot reproduce this {model_type} model in the Flax blocks")
    num_layers = _first(config, "num_hidden_layers", "n_layer")
    return dialect, BlockConfig(**kw), int(num_layers), dialects.DIALECTS[dialect].final_norm is not None


def _read_folder(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, state dict) of a save_pretrained folder: every *.safetensors shard, or
    pytorch_model.bin."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json (expected a folder written by save_pretrained)")
    with open(cfg_path) as f:
        config = json.load(f)
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards and os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        shards = [os.path.join(path, "pytorch_model.bin")]
    if not shards:
        raise FileNotFoundError(f"{path}: no *.safetensors and no pytorch_model.bin")
    sd: dict[str, Any] = {}
    for s in shards:
        sd.update(read_state_dict(s))
    return config, sd


def from_hf(source: Any, *, dtype: Any = None, seed: int = 0):
    """A Flax `Encoder` computing a Hugging Face model's transformer stack.

    source: a folder written by `save_pretrained` (config.json and *.safetensors, or
      pytorch_model.bin) or a transformers model object (BertModel, GPT2LMHeadModel,
      LlamaForCausalLM, ...). Only the stack is read: layers and final norm.
    dtype: cast the weights (and param_dtype) to it; None keeps the checkpoint's dtype
      (float64 needs jax_enable_x64).
    Returns an Encoder (with .cfg and .num_layers) mapping hidden states (B, T, E) to the
    HF model's last hidden state for those inputs embedded (after its embeddings), with
    `key_mask=` (B, T), True = real token, for padding. Query positions that are padding
    themselves may differ from HF's (whose values there are meaningless anyway).
    Mistral's sliding window is not applied: equal to HF for sequences up to sliding_window.
    """
    from .blocks import Encoder
    from .convert import from_torch

    if isinstance(source, (str, os.PathLike)):
        config, sd = _read_folder(os.fspath(source))
    elif hasattr(source, "config") and hasattr(source, "state_dict"):
        config, sd = source.config.to_dict(), read_state_dict(source)
    else:
        raise TypeError(f"source must be a save_pretrained folder or a transformers model, got {type(source).__name__}")
    dialect, cfg, num_layers, final_norm = hf_config(config, dtype=dtype)
    stack = dialects.translate(sd, dialect).state_dict
    if dtype is None:
        dtypes = {str(a.dtype) for a in stack.values()}
        if len(dtypes) == 1 and dtypes <= {"float32", "float64", "bfloat16", "float16"}:
            cfg = replace(cfg, param_dtype=dtypes.pop())
    if config.get("sliding_window") and config.get("model_type") == "mistral":
        log.info("Mistral sliding_window=%s is not applied: equal to HF for sequences up to that length",
                 config["sliding_window"])
    log.info("from_hf: %s model, dialect %s, %d layers", config.get("model_type"), dialect, num_layers)
    return from_torch(Encoder, cfg, stack, dialect="torch", num_layers=num_layers, final_norm=final_norm,
                         dtype=dtype, seed=seed)


def dialect_for(cfg: BlockConfig) -> str:
    """The HF dialect whose family settings `cfg` has (hf-bert, hf-gpt2, hf-llama)."""
    fits = [n for n, lay in dialects.DIALECTS.items()
            if lay.rules is not None and all(getattr(cfg, k) == v for k, v in lay.settings.items())]
    if len(fits) != 1:
        raise ConversionError([f"{n}: needs " + ", ".join(f"{k}={v!r}" for k, v in lay.settings.items())
                               for n, lay in dialects.DIALECTS.items() if lay.rules is not None],
                              header="no Hugging Face dialect fits this config; pass dialect=")
    return fits[0]


def to_hf(module, dialect: str | None = None, *, prefix: str = "") -> dict[str, Any]:
    """{HF name: numpy array} of a Flax Encoder's stack: its layers and final norm.

    dialect: "hf-bert", "hf-gpt2" or "hf-llama" (None: the one whose family settings the
      module's cfg has; a config the family cannot hold is refused, naming the fields).
    prefix: put before every name, e.g. "model." for LlamaForCausalLM, "bert." for
      BertForMaskedLM; "" names them as in BertModel / GPT2Model / LlamaModel.
    The arrays keep the module's dtype. Load them with
      missing, unexpected = hf_model.load_state_dict(tb.to_tensors(sd), strict=False)
    where `unexpected` is empty and `missing` lists only what lies outside the stack
    (embeddings, pooler, heads)."""
    import numpy as np

    from .convert import torch_state_dict

    if type(module).__name__ != "Encoder":
        raise TypeError(f"to_hf converts an Encoder (a stack), got {type(module).__name__}")
    dialect = dialect or dialect_for(module.cfg)
    if dialect == "torch":
        raise ValueError("dialect 'torch' is our own naming: use flax_blocks.torch_state_dict")
    sd = dialects.to_dialect(torch_state_dict(module), dialect, module.cfg, prefix=prefix)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}
