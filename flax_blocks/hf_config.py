"""What a Hugging Face model says about itself: its config (config.json) read into a
BlockConfig (`hf_config`, refusing by name whatever the blocks do not compute), and the
weights of a save_pretrained folder (`read_folder`, following HF's index files).

Framework-free; read by `flax_blocks.hf` (from_hf / to_hf) and by the converter, which
checks an HF model object handed to `from_torch` against its own config.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from . import dialects
from .checkpoint_io import ConversionError, read_state_dict
from .config import BlockConfig, dtype_name
from .dialects import MODEL_TYPES
from .options import BY_NAME

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


# Families whose layers compute what the blocks do not (yet): refused with the reason.
NOT_COMPUTED = {
    "mixtral": "a mixture of experts (block_sparse_moe: a router and 8 expert MLPs) in place of each MLP",
    "qwen2_moe": "a mixture of experts in place of the MLP", "qwen3_moe": "a mixture of experts in place of the MLP",
    "t5": "a learned relative position bias added to the attention logits, and RMSNorm without biases before an "
          "encoder-decoder stack", "mt5": "T5's relative position bias", "umt5": "T5's relative position bias",
    "gemma": "RMSNorm multiplying by (1 + w), GeGLU with tanh GELU and an explicit head_dim",
    "gemma2": "Gemma's norms plus attention-logit soft-capping, sandwich norms and alternating sliding windows",
    "gemma3_text": "Gemma's norms plus QK-norm, sliding-window layers and a separate rotary base for them",
    "qwen3": "QK-norm per head with an explicit head_dim", "olmo2": "norms after each sublayer (x + Norm(F(x))) "
             "and a QK-norm over the whole projection width",
    "phi3": "fused qkv_proj and gate_up_proj, partial rotary variants", "gpt_neox": "parallel residual, partial "
             "rotary and a fused per-head query_key_value", "stablelm": "partial rotary (and optional parallel residual)",
    "starcoder2": "sliding-window attention", "cohere": "parallel residual with a shared LayerNorm and logit scale",
}


def hf_config(config: Mapping[str, Any], *, dtype: Any = None) -> tuple[str, BlockConfig, int, bool]:
    """An HF config (config.json as a dict) -> (dialect, BlockConfig, num_layers, final_norm).

    Raises ConversionError naming every setting the Flax blocks cannot reproduce."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        why = f": {NOT_COMPUTED[model_type]}" if model_type in NOT_COMPUTED else ""
        raise ConversionError([f"model_type {model_type!r}{why}; supported: {', '.join(MODEL_TYPES)}"],
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
        window = config.get("sliding_window")
        if model_type == "mistral" and window is not None:
            problems.append(f"sliding_window={window}: each query of a Mistral attends only to the last {window} "
                            "keys, which the Flax blocks do not compute (they attend to every earlier key; "
                            "equal to HF only up to that many tokens)")
        if config.get("use_sliding_window") and model_type == "qwen2":
            problems.append(f"use_sliding_window=True (sliding_window={window}): layers with a sliding window "
                            "are not computed by the Flax blocks")
    if dtype is not None:
        kw["param_dtype"] = dtype_name(dtype)
    elif dtype_name(config.get("dtype") or config.get("torch_dtype")) in ("float32", "float64", "bfloat16", "float16"):
        kw["param_dtype"] = dtype_name(config.get("dtype") or config.get("torch_dtype"))
    if problems:
        raise ConversionError(problems, header=f"cannot reproduce this {model_type} model in the Flax blocks")
    num_layers = _first(config, "num_hidden_layers", "n_layer")
    return dialect, BlockConfig(**kw), int(num_layers), dialects.DIALECTS[dialect].final_norm is not None


_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")


def weight_files(path: str) -> list[str]:
    """The weight files of a save_pretrained folder, chosen as transformers chooses them: the
    shards an index file (model.safetensors.index.json, then pytorch_model.bin.index.json)
    names, else model.safetensors, else pytorch_model.bin. Other files (a Mistral repository's
    consolidated.safetensors, say) are not read."""
    for index in _INDEXES:
        index_path = os.path.join(path, index)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
            if not shards or missing:
                raise FileNotFoundError(f"{index_path} names shards that are not in the folder: {missing}"
                                        if missing else f"{index_path} has no weight_map")
            return [os.path.join(path, s) for s in shards]
    for name in _SINGLE:
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    present = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
    raise FileNotFoundError(f"{path}: none of {', '.join(_INDEXES + _SINGLE)} (the files HF's save_pretrained "
                            f"writes); weight-like files present: {present or 'none'}")


def read_folder(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, state dict) of a save_pretrained folder (see `weight_files`)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json (expected a folder written by save_pretrained)")
    with open(cfg_path) as f:
        config = json.load(f)
    sd: dict[str, Any] = {}
    for s in weight_files(path):
        sd.update(read_state_dict(s))
    return config, sd


def hf_model_config(source: Any) -> dict[str, Any] | None:
    """The config (as a dict) of a transformers model object, None for anything else."""
    config = getattr(source, "config", None)
    if config is None or not hasattr(source, "state_dict") or not isinstance(getattr(config, "model_type", None), str):
        return None
    return config.to_dict()


# Fields a caller may set freely when loading an HF model: not what its weights compute.
_FREE = {o.name for o in BY_NAME.values() if o.kind in ("init", "implementation")} | {"dtype", "param_dtype"}


def check_hf_source(cfg: BlockConfig | None, source: Any, dialect: str | None) -> str | None:
    """For a transformers model object handed to the converter: its family's dialect, after
    checking that `cfg` (when given) computes what the model computes. The model's own config
    says what it is (`model_type`); a family the blocks do not compute is refused by name, as
    is a `dialect=` or a config field that contradicts the model. None for other sources."""
    config = hf_model_config(source)
    if config is None:
        return dialect
    family, want, _, _ = hf_config(config)  # refuses unsupported families and settings by name
    problems = []
    if dialect is not None and dialect != family:
        problems.append(f"dialect={dialect!r} given, but a {config['model_type']} model is written in {family}")
    if cfg is not None:
        same = {"num_kv_heads": lambda c: c.kv_heads, "qkv_bias": lambda c: c.has_qkv_bias}  # None = the default
        problems += [f"{f}={getattr(cfg, f)!r} given, but the {config['model_type']} model has {f}={getattr(want, f)!r}"
                     for f in BY_NAME if f not in _FREE
                     and same.get(f, lambda c: getattr(c, f))(cfg) != same.get(f, lambda c: getattr(c, f))(want)]
    if problems:
        raise ConversionError(problems + ["fb.from_hf(model) reads every setting from the model's config"],
                              header=f"the config contradicts the source {type(source).__name__}")
    return family
