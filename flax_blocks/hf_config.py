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
        problems.append(f"rope_type {kind!r} (scaled rotary, as LLaMA 3's llama3 or Phi-3's longrope / su): the "
                        "Flax blocks compute plain rotary positions only (rope_theta)")
    return float(params.get("rope_theta") or config.get("rope_theta") or config.get("rotary_emb_base") or 10000.0)


def _partial_rotary(config: Mapping[str, Any], default: float = 1.0) -> float:
    """The fraction of each head that rotary rotates: rope_parameters.partial_rotary_factor (transformers 5),
    partial_rotary_factor, or GPT-NeoX's rotary_pct (older config.json files)."""
    params = config.get("rope_parameters") or {}
    value = _first(params, "partial_rotary_factor", default=None)
    value = _first(config, "partial_rotary_factor", "rotary_pct", default=default) if value is None else value
    return float(value)


# Families whose layers compute what the blocks do not (yet): refused with the reason.
NOT_COMPUTED = {
    "mixtral": "a mixture of experts (block_sparse_moe: a router and 8 expert MLPs) in place of each MLP",
    "qwen2_moe": "a mixture of experts in place of the MLP", "qwen3_moe": "a mixture of experts in place of the MLP",
    "t5": "a learned relative position bias added to the attention logits, and RMSNorm without biases before an "
          "encoder-decoder stack", "mt5": "T5's relative position bias", "umt5": "T5's relative position bias",
    "cohere": "parallel residual with a shared LayerNorm and logit scale",
}

# Config keys a family names otherwise than the options' `hf=` keys (flax_blocks.options), tried
# first: DistilBERT's dim / n_heads / hidden_dim / activation, OPT's ffn_dim.
FAMILY_KEYS = {
    "distilbert": {"d_model": ("dim",), "num_heads": ("n_heads",), "d_ff": ("hidden_dim",),
                   "activation": ("activation",)},
    "opt": {"d_ff": ("ffn_dim",)},
    "gemma2": {"activation": ("hidden_activation",)},
    "gemma3_text": {"activation": ("hidden_activation",)},
    "starcoder2": {"layer_norm_eps": ("norm_epsilon",)},
    "whisper": {"num_heads": ("encoder_attention_heads",), "d_ff": ("encoder_ffn_dim",), "d_model": ("d_model",),
                "num_kv_heads": ("encoder_attention_heads",)},
    "whisper-decoder": {"num_heads": ("decoder_attention_heads",), "d_ff": ("decoder_ffn_dim",),
                        "d_model": ("d_model",), "num_kv_heads": ("decoder_attention_heads",)},
}


def _read(config: Mapping[str, Any], model_type: str, field: str, default: Any = None) -> Any:
    return _first(config, *FAMILY_KEYS.get(model_type, {}).get(field, ()), *BY_NAME[field].hf, default=default)


def _bert(config: Mapping[str, Any], kw: dict[str, Any], problems: list[str]) -> None:
    """BERT and RoBERTa: is_decoder makes the self-attention causal (transformers 5.24:
    BertLayer's attention is_causal=config.is_decoder, and the model builds a causal mask);
    cross-attention and relative positions are refused."""
    kw["causal"] = bool(config.get("is_decoder", False))
    if config.get("add_cross_attention"):
        problems.append("add_cross_attention=True (a decoder with cross-attention): only self-attention stacks "
                        "are converted")


def _opt(config: Mapping[str, Any], kw: dict[str, Any], problems: list[str]) -> bool:
    """OPT: the norm placement from do_layer_norm_before (post-LN is x <- Norm(x + F(x)), as the
    blocks' post-LN; OPT then has no final norm); returns whether there is a final norm."""
    pre = bool(config.get("do_layer_norm_before", True))
    kw["norm"] = "pre" if pre else "post"
    if not config.get("enable_bias", True):
        problems.append("enable_bias=False: OPT's linear maps lose their biases but its LayerNorms keep theirs; the "
                        "Flax blocks have biases in both or in neither")
    if not config.get("layer_norm_elementwise_affine", True):
        problems.append("layer_norm_elementwise_affine=False: LayerNorms without weight and bias are not computed "
                        "by the Flax blocks")
    return pre and not config.get("_remove_final_layer_norm", False)


def _phi3(config: Mapping[str, Any], kw: dict[str, Any], problems: list[str]) -> None:
    """Phi-3: rotary as LLaMA's (scaled variants, longrope / su / yarn, refused by _rope_theta)
    on the first partial_rotary_factor of each head (Phi-4-mini: 0.75), no biases; its
    sliding_window (every layer) is read by _windows."""
    kw["partial_rotary_factor"] = _partial_rotary(config)


def _attention_bias(model_type: str, config: Mapping[str, Any], problems: list[str], kw: dict[str, Any]) -> None:
    """Qwen3, Gemma (2, 3), OLMo 2: attention_bias puts biases on q, k, v and o, never on the MLP."""
    attention = bool(config.get("attention_bias", False))
    kw.update(bias=attention, mlp_bias=False if attention else None)


def _qwen3(config: Mapping[str, Any], kw: dict[str, Any], problems: list[str]) -> None:
    """Qwen3: biases refused (_no_biases); its windows are read by _windows."""
    _attention_bias("qwen3", config, problems, kw)


def _layer_types(config: Mapping[str, Any], model_type: str, num_layers: int) -> list[str]:
    """Each layer's attention kind as HF decides it: config.json's layer_types (transformers 5
    writes them), else the family's rule: Qwen2 / Qwen3 local from max_window_layers on when
    use_sliding_window, Gemma 2 every second layer global, Gemma 3 every
    sliding_window_pattern-th (6), the others (Mistral, Phi-3, Starcoder2) every layer local
    when sliding_window is set."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    window = config.get("sliding_window")
    if window is None:
        return ["full_attention"] * num_layers
    if model_type in ("qwen2", "qwen3"):
        first = config.get("max_window_layers", num_layers) if config.get("use_sliding_window") else num_layers
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    n = {"gemma2": 2, "gemma3_text": config.get("sliding_window_pattern", 6)}.get(model_type)
    if n is not None:
        return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def _windows(config: Mapping[str, Any], model_type: str, num_layers: int, kw: dict[str, Any],
             problems: list[str]) -> None:
    """sliding_window and sliding_window_pattern from HF's layer kinds: every layer local ->
    the window, pattern None; layer l (from 1) global iff l % n == 0 -> pattern n; none local ->
    no window. Any other layout (Qwen's local layers from max_window_layers on, with some
    global ones before them) is refused by name. Qwen2 / Qwen3 without use_sliding_window
    have no window whatever sliding_window says (their configs drop it)."""
    types = _layer_types(config, model_type, num_layers)
    window = config.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = None
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        problems.append(f"layer_types {types}: expected {num_layers} of 'sliding_attention' / 'full_attention'")
        return
    local = [t == "sliding_attention" for t in types]
    if window is None or not any(local):
        kw.update(sliding_window=None, sliding_window_pattern=None)
        return
    kw["sliding_window"] = int(window)
    if all(local):
        kw["sliding_window_pattern"] = None
        return
    for n in range(2, num_layers + 1):
        if all(local[i] == bool((i + 1) % n) for i in range(num_layers)):
            kw["sliding_window_pattern"] = n
            return
    problems.append(f"layer_types {types} (sliding_window={window}): the Flax blocks' local layers are every layer, "
                    "or every layer but each n-th (sliding_window_pattern n); this layout is neither")


def _gemma2(model_type: str, config: Mapping[str, Any], kw: dict[str, Any], problems: list[str]) -> None:
    """Gemma 2 / Gemma 3: soft-cap and query scale read; Gemma 3's two rotary bases (global
    rope_parameters.full_attention, local rope_parameters.sliding_attention; older configs
    rope_theta and rope_local_base_freq), scaled variants refused; bidirectional attention
    (EmbeddingGemma) refused."""
    _attention_bias(model_type, config, problems, kw)
    kw["attn_logit_softcapping"] = _read(config, model_type, "attn_logit_softcapping")
    kw["query_pre_attn_scalar"] = _read(config, model_type, "query_pre_attn_scalar")
    params = config.get("rope_parameters") or {}
    if model_type == "gemma2":
        kw["rope_theta"] = _rope_theta(config, problems)
        return
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    kw["rope_theta"] = _rope_theta({**config, "rope_parameters": full}, problems)
    kw["rope_local_theta"] = float(local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0)
    if local.get("rope_type", "default") != "default":
        problems.append(f"rope_type {local['rope_type']!r} on the local layers: the Flax blocks compute plain rotary "
                        "positions only")
    if config.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True (EmbeddingGemma): the Flax blocks read Gemma 3 as causal")


def _gpt_neox(config: Mapping[str, Any], kw: dict[str, Any], problems: list[str]) -> None:
    """GPT-NeoX: use_parallel_residual (default True) -> parallel_residual='two_norms' (else the
    sequential pre-LN form), partial rotary (rotary_pct, default 0.25), its rotary base; biases
    on every linear map and LayerNorm unless attention_bias=False, which the blocks cannot split."""
    kw["parallel_residual"] = "two_norms" if config.get("use_parallel_residual", True) else "none"
    kw["rope_theta"] = _rope_theta(config, problems)
    kw["partial_rotary_factor"] = _partial_rotary(config, default=0.25)
    # attention_bias=False: the attention loses its biases, the MLP and the LayerNorms keep theirs
    attention = bool(config.get("attention_bias", True))
    kw.update(bias=attention, mlp_bias=None if attention else True, norm_bias=None if attention else True)


def _stablelm(config: Mapping[str, Any], kw: dict[str, Any], problems: list[str]) -> None:
    """StableLM: q/k/v biases with use_qkv_bias; use_parallel_residual -> one shared norm;
    partial rotary (0.25 by default); qk_layernorm refused (a LayerNorm with its own weights for
    each head: the blocks' QK-norm is one scale-only norm shared by the heads)."""
    kw["rope_theta"] = _rope_theta(config, problems)
    kw["partial_rotary_factor"] = _partial_rotary(config, default=0.25)
    kw["qkv_bias"] = bool(config.get("use_qkv_bias", False))
    kw["parallel_residual"] = "shared_norm" if config.get("use_parallel_residual") else "none"
    if config.get("qk_layernorm"):
        problems.append("qk_layernorm=True: StableLM normalises q and k with a LayerNorm of its own for each head "
                        "(mean subtracted, per-head weights); the Flax blocks' QK-norm is one scale-only norm "
                        "shared by the heads")


# Encoder-decoder families: part -> (dialect, the FAMILY_KEYS entry, the layer count's key).
PARTS = {"whisper": {"encoder": ("hf-whisper", "whisper", "encoder_layers"),
                     "decoder": ("hf-whisper-decoder", "whisper-decoder", "decoder_layers")}}


def hf_config(config: Mapping[str, Any], *, dtype: Any = None, part: str | None = None
              ) -> tuple[str, BlockConfig, int, bool]:
    """An HF config (config.json as a dict) -> (dialect, BlockConfig, num_layers, final_norm).

    Settings a family fixes in its code come from its dialect's `settings`, the rest from the
    config (`FAMILY_KEYS`, then the options' `hf=` keys). Raises ConversionError naming every
    setting the Flax blocks cannot reproduce. part: "encoder" (the default) or "decoder" of an
    encoder-decoder family (Whisper); the decoder's dialect reads a Decoder stack."""
    model_type = config.get("model_type")
    if part not in (None, "encoder", "decoder"):
        raise ValueError(f"part must be None, 'encoder' or 'decoder', got {part!r}")
    if model_type not in MODEL_TYPES:
        why = f": {NOT_COMPUTED[model_type]}" if model_type in NOT_COMPUTED else ""
        raise ConversionError([f"model_type {model_type!r}{why}; supported: {', '.join(MODEL_TYPES)}"],
                              header="cannot read this Hugging Face model")
    dialect = MODEL_TYPES[model_type]
    if part == "decoder" and model_type not in PARTS:
        raise ConversionError([f"part='decoder': a {model_type} model has one stack (encoder-decoder families: "
                               f"{', '.join(PARTS)})"], header="cannot read this Hugging Face model")
    layer_key = None
    if model_type in PARTS:
        dialect, keys_of, layer_key = PARTS[model_type][part or "encoder"]
        model_type = keys_of  # the part's keys (FAMILY_KEYS) are read under its own name
    lay = dialects.DIALECTS[dialect]
    problems: list[str] = []
    d_model = _read(config, model_type, "d_model")
    heads = _read(config, model_type, "num_heads")
    kv = _read(config, model_type, "num_kv_heads", default=heads)
    act_name = _read(config, model_type, "activation")
    if model_type in ("gemma", "gemma2", "gemma3_text") and act_name == "gelu":  # as GemmaConfig reads it
        act_name = "gelu_pytorch_tanh"
    activation = ACTIVATIONS.get(act_name)
    if activation is None:
        problems.append(f"activation {act_name!r}: supported {', '.join(k for k, v in ACTIVATIONS.items() if v)}")
    if model_type == "gpt2" and config.get("n_inner") is None:
        d_ff = 4 * d_model
    else:
        d_ff = _read(config, model_type, "d_ff")
    settings = dict(lay.settings)
    kw: dict[str, Any] = dict(d_model=d_model, num_heads=heads, d_ff=d_ff, dropout=0.0,
                              num_kv_heads=None if kv == heads else kv)
    if "layer_norm_eps" not in settings:
        kw["layer_norm_eps"] = float(_read(config, model_type, "layer_norm_eps"))
    kw.update(settings)
    if activation is not None and "activation" not in settings:
        kw["activation"] = activation
    elif activation not in (None, settings.get("activation")):
        problems.append(f"activation {act_name!r}: {dialect} layers use {settings['activation']!r}")
    head_dim = _read(config, model_type, "head_dim")
    if head_dim is not None and head_dim * heads != d_model:  # explicit (Qwen3, Gemma): q/k/v to heads * head_dim
        kw["head_dim"] = int(head_dim)
    final_norm = lay.final_norm is not None
    if dialect == "hf-bert":
        _bert(config, kw, problems)
    elif layer_key is None and (config.get("is_decoder") or config.get("add_cross_attention")):
        problems.append("a decoder with cross-attention (is_decoder / add_cross_attention): only self-attention "
                        "stacks are converted")
    if config.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {config['position_embedding_type']!r}: a checkpoint trained with "
                        "it holds relative position terms inside attention (distance_embedding), which the Flax "
                        "blocks do not compute and transformers 5 no longer does either (its BERT ignores the "
                        "setting and computes absolute positions only): refused rather than silently dropped")
    if model_type == "gpt2":
        if not config.get("scale_attn_weights", True):
            problems.append("scale_attn_weights=False: the Flax blocks scale logits by 1/sqrt(head_dim)")
        if config.get("scale_attn_by_inverse_layer_idx"):
            problems.append("scale_attn_by_inverse_layer_idx=True: a per-layer logit scale the Flax blocks lack")
    if model_type == "opt":
        final_norm = _opt(config, kw, problems)
    if model_type == "vit":
        kw["qkv_bias"] = bool(config.get("qkv_bias", True))
    if dialect in ("hf-llama", "hf-phi3", "hf-qwen3", "hf-gemma", "hf-olmo2"):
        kw["rope_theta"] = _rope_theta(config, problems)
    if model_type == "qwen3":
        _qwen3(config, kw, problems)
    if model_type in ("gemma", "olmo2"):  # (Gemma 2 / 3: in _gemma2)
        _attention_bias(model_type, config, problems, kw)
    if model_type == "gpt_neox":
        _gpt_neox(config, kw, problems)
    if model_type == "phi3":
        _phi3(config, kw, problems)
    if model_type in ("gemma2", "gemma3_text"):
        _gemma2(model_type, config, kw, problems)
    if model_type == "starcoder2":
        kw["rope_theta"] = _rope_theta(config, problems)
        use_bias = bool(config.get("use_bias", True))  # False: the linear maps lose theirs, the LayerNorms keep them
        kw.update(bias=use_bias, norm_bias=None if use_bias else True)
    if model_type == "stablelm":
        _stablelm(config, kw, problems)
    num_layers = int(_first(config, *((layer_key,) if layer_key else ()), "num_hidden_layers", "n_layer", "n_layers"))
    if "sliding_window" in lay.reads:
        _windows(config, model_type, num_layers, kw, problems)
    if dialect == "hf-llama":
        attn_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
        if model_type == "qwen2":  # q/k/v biases, none elsewhere
            kw.update(bias=False, qkv_bias=True)
        elif attn_bias != mlp_bias:
            problems.append(f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: the Flax blocks have biases on "
                            "every linear map or on none (besides q/k/v)")
        else:
            kw["bias"] = attn_bias
    if dtype is not None:
        kw["param_dtype"] = dtype_name(dtype)
    elif dtype_name(config.get("dtype") or config.get("torch_dtype")) in ("float32", "float64", "bfloat16", "float16"):
        kw["param_dtype"] = dtype_name(config.get("dtype") or config.get("torch_dtype"))
    if problems:
        raise ConversionError(problems, header=f"cannot reproduce this {model_type} model in the Flax blocks")
    return dialect, BlockConfig(**kw), num_layers, final_norm


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


def hf_state_dict(source: Any) -> Any:
    """A transformers model object's weights named as its save_pretrained writes them (the
    checkpoint files' names: transformers 5 renames some modules in the library, ViT's among
    them, and converts back when saving); any other source is returned as it is."""
    if hf_model_config(source) is None:
        return source
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time renaming: the module's names are the files'
        return source.state_dict()
    return revert_weight_conversion(source, source.state_dict())


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
