"""Each Hugging Face family's config, read as transformers' own code for that family reads it.

One `Family` per model_type: the config class and model class it mirrors, the checkpoint
dialect of its weights, and one table of its config keys:

    reads   key -> the config class's default: the keys the family's modelling code (or its
            config class, rewriting them) reads, and only those; `reader` turns them into
            BlockConfig fields, refusing by name the values the blocks do not compute;
    aliases key -> the key it sets (the config class's attribute_map: GPT-2's hidden_size is
            n_embd); an alias in a file wins over the key it names, as in transformers;
    inert   key -> why it changes no output of the loaded model (dropout rates in eval, init
            ranges, generation defaults, heads we do not load ...);
    lm      the keys read around the stack (vocabulary, tied head, learned positions, soft-cap),
            by `flax_blocks.checkpoints.hf_models`; part of `reads`.

Any other key is one the family's transformers code never reads: it changes nothing there, so
it is ignored here too, and listed (one warning and the model's load report,
`fb.load_report(model)`): published configs carry many (`gradient_checkpointing` in
bert-base-uncased, `tie_weights_` in DistilBERT, a `sliding_window` on a LLaMA, which
LlamaModel never reads). The risk of a silent wrong load lives in the keys a family DOES read,
each read here as transformers reads it, and in weights that betray another family (refused by
name in `flax_blocks.checkpoints.dialects`). Key lists are shared only where transformers
shares them (LLaMA, Mistral and Qwen2 are separate tables although they look alike). Checked
against transformers 5.24's source; tests/test_hf_keys.py walks every config class and fails on
a key no table classifies, and parity_tests/fuzz_hf.py draws configs over these keys (and
neighbours' keys) and compares the loads with transformers.

Framework-free: read by `flax_blocks.checkpoints.hf_config` (the stack) and `flax_blocks.checkpoints.hf_models`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..spec.rope import ROPE_TYPES, RopeScaling

TRANSFORMERS = "5.24.0"  # the version these tables mirror (pyproject's hf extra pins it)

# HF activation names the blocks compute (transformers' ACT2FN): ours.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}

_GENERATION = "a generation default (transformers moves it to generation_config); fb.generate takes its own arguments"
# PretrainedConfig's own keys, shared by every family because transformers shares them.
COMMON: dict[str, str] = {
    "model_type": "names the family (read to choose this table)",
    "architectures": "names the classes that saved the checkpoint; the weights' names are read",
    "transformers_version": "the version that wrote the file",
    "_name_or_path": "where the config was read from",
    "return_dict": "output container only",
    "output_hidden_states": "output container only",
    "output_attentions": "output container only",
    "torchscript": "export flag",
    "use_bfloat16": "a TF-era flag no PyTorch model reads",
    "chunk_size_feed_forward": "computes the feed-forward in chunks: the same values",
    "is_encoder_decoder": "set by the encoder-decoder classes themselves",
    "id2label": "labels of a classification head, not loaded",
    "label2id": "labels of a classification head, not loaded",
    "num_labels": "size of a classification head, not loaded",
    "problem_type": "loss of a classification head, not loaded",
    "finetuning_task": "a note", "tokenizer_class": "the tokenizer's class", "prefix": "a tokenizer prompt prefix",
    "task_specific_params": "pipeline defaults", "_commit_hash": "a Hub revision",
    "attn_implementation": "the attention kernel: the same function (eager, sdpa)",
    "_attn_implementation_autoset": "the attention kernel: the same function",
    "_attn_implementation_internal": "the attention kernel: the same function",
    "auto_map": "remote code classes, used only with trust_remote_code; read as transformers' own class reads it",
    "use_cache": "keeps keys and values while generating: the same tokens",
    "transformers_weights": "names the weights file from_pretrained reads; the folder's files are chosen by it",
    "pad_token_id": "the padding token: an embedding's padding_idx only changes its gradient",
    "bos_token_id": "a special token id", "eos_token_id": "a special token id", "sep_token_id": "a special token id",
    "decoder_start_token_id": "a special token id",
    "initializer_range": "the std of the initial weights; the checkpoint's weights are read",
    "dtype": "the parameter dtype: read as param_dtype unless dtype= is given",
    "torch_dtype": "the parameter dtype (older files): read as param_dtype unless dtype= is given",
    **{k: _GENERATION for k in ("max_length", "min_length", "do_sample", "early_stopping", "num_beams",
                                "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
                                "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
                                "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
                                "output_scores", "return_dict_in_generate", "forced_bos_token_id",
                                "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
                                "suppress_tokens", "begin_suppress_tokens", "max_new_tokens")},
}

# PretrainedConfig's keys that every load reads (the family, the dtype, the weights file): never "ignored".
READ_EVERYWHERE = ("model_type", "dtype", "torch_dtype", "transformers_weights")

# Keys that change what a model computes whatever its family, refused wherever they are set.
REFUSED_ANYWHERE = {
    "quantization_config": "quantized weights (the blocks read plain float tensors)",
    "pruned_heads": "heads pruned from the attention (the blocks have every head)",
}

_DROPOUT = "a dropout rate: inference runs without dropout"
_INIT = "an initialisation setting; the checkpoint's weights are read"
_OUTSIDE = "read by a part outside the stack that the blocks do not load"


class Read:
    """A config as one family's code sees it: `c["key"]` is the config's value (an alias's when
    the file holds one) or, when the key is absent, the config class's default. Only keys of the
    family's `reads` may be asked for (a reader reading another key is a bug, raised as one);
    `problems` collects refusals, `ignored` the keys (and rope parameters) read as nothing."""

    def __init__(self, config: Mapping[str, Any], family: Family):
        self.config, self.family = config, family
        self.problems: list[str] = []
        self.ignored: dict[str, str] = {}

    def _source(self, key: str) -> str | None:
        """The config key that sets `key`: an alias the file holds (it wins), else the key itself."""
        for alias, target in self.family.aliases.items():
            if target == key and alias in self.config:
                return alias
        return key if key in self.config else None

    def __getitem__(self, key: str) -> Any:
        if key not in self.family.reads:
            raise KeyError(f"the {self.family.model_type} reader asked for {key!r}, which its table does not read")
        source = self._source(key)
        return self.config[source] if source is not None else self.family.reads[key]

    def given(self, key: str) -> bool:
        """Whether the config itself holds the key (or an alias of it), not the class default."""
        if key not in self.family.reads:
            raise KeyError(f"the {self.family.model_type} reader asked for {key!r}, which its table does not read")
        return self._source(key) is not None

    def refuse(self, key: str, why: str) -> None:
        source = self._source(key) or key
        self.problems.append(f"{source}={self.config.get(source, self.family.reads.get(key))!r}: {why}")


@dataclass(frozen=True)
class Family:
    """One model_type's config, as transformers reads it (see the module docstring)."""

    model_type: str
    config_class: str
    model_class: str
    dialect: str
    reads: Mapping[str, Any]
    reader: Callable[[Read], dict[str, Any]]
    inert: Mapping[str, str] = field(default_factory=dict)
    lm: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)

    def classify(self, key: str) -> str:
        """'read' (an alias too), 'inert' (known to change nothing) or 'unread' (never read by
        the family's code: ignored, as transformers ignores it)."""
        if key in self.reads or key in self.aliases:
            return "read"
        if key in self.inert or key in COMMON:
            return "inert"
        return "unread"


def audit(config: Mapping[str, Any], family: Family) -> tuple[list[str], dict[str, str]]:
    """(problems, ignored) of a config's keys: every key set to a value no model we load has
    (quantized weights, pruned heads), and {key: why it changes nothing} for every key the
    family's code does not read (its known inert keys, and the keys its code never reads,
    which transformers ignores too)."""
    problems, ignored = [], {}
    for key, value in config.items():
        if key in READ_EVERYWHERE:
            continue
        if key in REFUSED_ANYWHERE:
            if value not in (None, {}, []):
                problems.append(f"{key}={value!r}: {REFUSED_ANYWHERE[key]}")
            continue
        kind = family.classify(key)
        if kind == "inert":
            ignored[key] = family.inert.get(key) or COMMON[key]
        elif kind == "unread":
            elsewhere = sorted(f.model_type for f in FAMILIES.values() if key in f.reads and f is not family)
            ignored[key] = (f"{family.model_class} never reads it, so transformers ignores it"
                            + (f" ({', '.join(elsewhere)} read{'s' if len(elsewhere) == 1 else ''} it)"
                               if elsewhere else ""))
    return problems, ignored


def unexpected(ignored: Mapping[str, str], family: Family) -> list[str]:
    """The ignored keys worth a warning: those the family's tables do not know as inert."""
    return [k for k in ignored if "." in k or family.classify(k) == "unread"]


# ------------------------------------------------------------------------------------------
# Pieces that several readers share (each family's table still lists its own keys)
# ------------------------------------------------------------------------------------------


def _activation(c: Read, key: str, *, gated: bool = False, tanh_gelu: bool = False) -> str | None:
    name = c[key]
    if tanh_gelu and name == "gelu":  # GemmaConfig's own rewrite (Gemma 1 only)
        name = "gelu_pytorch_tanh"
    ours = ACTIVATIONS.get(name)
    if ours is None:
        c.refuse(key, f"the blocks compute {', '.join(ACTIVATIONS)}")
    elif gated and ours == "relu":
        c.refuse(key, "a gated MLP with relu: the blocks gate with silu (SwiGLU) or GELU (GeGLU)")
    return ours


def _gated(activation: str | None) -> dict[str, Any]:
    """A gated MLP's kind from its activation: silu -> SwiGLU, GELU -> GeGLU."""
    if activation is None or activation == "relu":
        return {}
    return {"mlp": "swiglu" if activation == "silu" else "geglu", "activation": activation}


def _is_causal(c: Read) -> bool:
    """masking_utils.create_causal_mask: `if not getattr(config, "is_causal", True)` builds a
    bidirectional mask (every decoder family that builds its mask there)."""
    return bool(c["is_causal"])


def _rope(c: Read, *, default_theta: float = 10000.0, partial: float | None = None,
          theta_key: str = "rope_theta", partial_key: str | None = None, head_dim: int = 0,
          params: Mapping[str, Any] | None = None, source: str | None = None,
          original_default: bool = True) -> dict[str, Any]:
    """rope_theta, partial_rotary_factor and rope_scaling as the config class standardises them
    (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict, standardize_rope_params):
    rope_scaling, when given, replaces rope_parameters; the dict's own rope_theta wins over a
    top-level one, which wins over the family's default; a scaled type's
    original_max_position_embeddings defaults to max_position_embeddings. `partial`: the family
    rotates the first int(head_dim * factor) dims (its default factor). `params` / `source`: a
    dict of Gemma 3's per-layer-type parameters instead, named `source` in messages;
    original_default: whether standardize_rope_params saw the type (Phi-3's "su" is renamed after)."""
    if params is None:
        source = "rope_scaling" if c["rope_scaling"] else "rope_parameters"
        params = c["rope_scaling"] or c["rope_parameters"] or {}
    params = dict(params)
    head_dim = head_dim or int(c["head_dim"] or c["hidden_size"] // c["num_attention_heads"])  # HF's rotary width
    theta = params.get("rope_theta", c[theta_key] if c.given(theta_key) else default_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    dims = head_dim
    if partial is not None:
        given = partial_key is not None and c.given(partial_key)
        factor = params.get("partial_rotary_factor", c[partial_key] if partial_key is not None and given else partial)
        out["partial_rotary_factor"] = float(factor)
        dims = int(head_dim * float(factor))
        if dims < 1 or dims + dims % 2 > head_dim:  # HF rotates int(head_dim * factor) dims, rounded up to even
            key = ("rope_parameters" if "partial_rotary_factor" in params else
                   partial_key if given else f"{partial_key or 'partial_rotary_factor'} (the default)")
            c.problems.append(f"{key}={factor if key != 'rope_parameters' else params!r}: rotary on int({head_dim} * "
                              f"{factor}) = {dims} dims of each head, rounded up to an even {dims + dims % 2}, which "
                              "no head of that width holds")
    elif kind != "default" and params.get("partial_rotary_factor", 1.0) != 1.0:
        c.refuse(source or "rope_parameters",
                 f"partial_rotary_factor {params['partial_rotary_factor']} with rope_type {kind!r}: "
                 f"{c.family.model_class} rotates whole heads while transformers' scaled frequencies cover only part "
                 "of one (transformers fails on it too)")
        return out
    if kind == "default":
        return out
    if kind not in ROPE_TYPES:
        why = ("Gemma 4's proportional rotary, which the blocks do not compute" if kind == "proportional" else
               f"transformers knows no such rope_type (it computes default, {', '.join(ROPE_TYPES)})")
        c.problems.append(f"{source}={params!r}: rope_type {kind!r}: {why}")
        return out
    if kind in ("llama3", "yarn", "longrope") and original_default:  # standardize_rope_params' default
        params.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    try:
        scaling, unread = RopeScaling.from_dict(params, c["max_position_embeddings"])
        scaling.check(dims)
    except ValueError as e:
        c.problems.append(f"{source}={params!r}: {e}")
        return out
    c.ignored.update({f"{source}.{k}": f"transformers' {kind} rotary does not read it (it warns 'Unrecognized keys')"
                      for k in unread})
    out["rope_scaling"] = scaling
    return out


def _head_dim(c: Read, hidden: int, heads: int, key: str = "head_dim") -> dict[str, Any]:
    """An explicit head_dim (q/k/v project to heads * head_dim); None: hidden / heads."""
    head_dim = c[key]
    return {"head_dim": int(head_dim)} if head_dim is not None and head_dim * heads != hidden else {}


def _rotary_head_dim(c: Read, hidden: int, heads: int) -> None:
    """StableLM, GPT-NeoX: the attention splits hidden / heads whatever head_dim says, while the
    rotary table reads head_dim: another value is refused."""
    head_dim = c["head_dim"]
    if head_dim is not None and head_dim * heads != hidden:
        c.refuse("head_dim", f"{c.family.model_class}'s attention splits {hidden} / {heads} per head while its "
                             "rotary table reads head_dim")


def _kv(heads: int, kv: int | None) -> int | None:
    return None if kv is None or kv == heads else int(kv)


def _all_local(c: Read, window: int | None, n_layers: int) -> dict[str, Any]:
    """Mistral, Phi-3, Starcoder2: with sliding_window set, every layer is local
    (create_sliding_window_causal_mask for the whole stack). Their models never read
    layer_types, but their caches do (DynamicCache(config=...)): layer_types that say
    otherwise make transformers' cached decoding fail, so they are refused."""
    types = c["layer_types"]
    want = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    if types is not None and list(types) != want:
        c.problems.append(f"layer_types={list(types)!r}: {c.family.model_class} makes "
                          + ("every layer local (sliding_window is set)" if window is not None else "every layer full")
                          + " and ignores layer_types, while transformers' cache reads them (its cached decoding "
                          "then fails); refused")
    if window is not None and not c["is_causal"]:
        c.refuse("is_causal", "with a sliding window transformers builds a bidirectional window |i - j| <= W, "
                              "which the blocks do not compute")
    return {"sliding_window": None if window is None else int(window), "sliding_window_pattern": None}


def _pattern(c: Read, types: list[str], window: int | None, n_layers: int, source: str = "") -> dict[str, Any]:
    """layer_types (each 'sliding_attention' or 'full_attention') as the blocks' window and
    pattern: all local -> the window; layer l (from 1) global iff n divides l -> pattern n;
    none local -> no window; anything else refused."""
    if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        c.refuse("layer_types", f"expected {n_layers} of 'sliding_attention' / 'full_attention'")
        return {}
    local = [t == "sliding_attention" for t in types]
    if window is None or not any(local):
        return {"sliding_window": None, "sliding_window_pattern": None}
    if not c["is_causal"]:
        c.refuse("is_causal", "with a sliding window transformers builds a bidirectional window |i - j| <= W, "
                              "which the blocks do not compute")
    if all(local):
        return {"sliding_window": int(window), "sliding_window_pattern": None}
    for n in range(2, n_layers + 1):
        if all(local[i] == bool((i + 1) % n) for i in range(n_layers)):
            return {"sliding_window": int(window), "sliding_window_pattern": n}
    c.problems.append(f"{source or 'layer_types=' + repr(types)} (sliding_window={window}): the blocks' local layers "
                      f"are every layer, or every layer but each n-th (sliding_window_pattern n); {types} is neither")
    return {}


def _sizes(c: Read, hidden: str, heads: str, ff: str | None, layers: str, kv: str | None = None) -> dict[str, Any]:
    h = int(c[heads])
    if kv and c[kv] is not None and (c[kv] <= 0 or h % c[kv]):
        c.refuse(kv, f"{c[kv]} key/value heads do not divide {h} query heads (a default of "
                     f"{c.family.config_class} when the file leaves the key out: transformers fails on it too)")
        kv = None
    out = {"d_model": int(c[hidden]), "num_heads": h, "num_layers": int(c[layers]), "dropout": 0.0,
           "num_kv_heads": _kv(h, c[kv]) if kv else None}
    if ff is not None:
        out["d_ff"] = int(c[ff])
    return out


# ------------------------------------------------------------------------------------------
# The families
# ------------------------------------------------------------------------------------------

_LM_ROTARY = ("vocab_size", "tie_word_embeddings")
_DECODER_INERT = {"attention_dropout": _DROPOUT, "is_decoder": "not read by this family's model (always a decoder)",
                  "add_cross_attention": "not read by this family's model (it has no cross-attention)"}


def _bert(c: Read) -> dict[str, Any]:
    """BertModel / RobertaModel / XLMRobertaModel: post-LN; is_decoder makes the self-attention causal
    (BertSelfAttention.is_causal = config.is_decoder); cross-attention refused."""
    if c["add_cross_attention"]:
        c.refuse("add_cross_attention", "a decoder with cross-attention: only self-attention stacks are read")
    if c["position_embedding_type"] not in ("absolute", None):
        c.refuse("position_embedding_type", "a checkpoint trained with relative positions holds distance "
                                            "embeddings inside attention, which the Flax blocks do not compute and "
                                            "transformers 5 no longer does either (its BERT ignores the setting): "
                                            "refused rather than silently dropped")
    act = _activation(c, "hidden_act")
    causal = bool(c["is_decoder"]) and c["is_causal"] is not False  # create_causal_mask reads is_causal
    if not c["is_decoder"] and c["is_causal"]:
        c.refuse("is_causal", "an encoder (is_decoder false) that transformers makes causal under SDPA without "
                              "padding only; refused")
    return {**_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers"),
            "activation": act, "layer_norm_eps": float(c["layer_norm_eps"]), "causal": causal,
            "final_norm": False}


_BERT_READS = {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "num_hidden_layers": 12,
               "hidden_act": "gelu", "layer_norm_eps": 1e-12, "is_decoder": False, "add_cross_attention": False,
               "position_embedding_type": "absolute", "vocab_size": 30522, "max_position_embeddings": 512,
               "type_vocab_size": 2, "is_causal": None}
_BERT_INERT = {"hidden_dropout_prob": _DROPOUT, "attention_probs_dropout_prob": _DROPOUT,
               "classifier_dropout": _DROPOUT, "use_cache": COMMON["use_cache"],
               "tie_word_embeddings": "ties the masked-LM head, which is not loaded"}


def _distilbert(c: Read) -> dict[str, Any]:
    """DistilBertModel: post-LN, eps 1e-12 in the code (nn.LayerNorm(eps=1e-12))."""
    if c["is_causal"]:
        c.refuse("is_causal", "DistilBERT is read as bidirectional; transformers makes it causal under SDPA only")
    act = _activation(c, "activation")
    return {**_sizes(c, "dim", "n_heads", "hidden_dim", "n_layers"), "activation": act, "final_norm": False}


def _gpt2(c: Read) -> dict[str, Any]:
    """GPT2Model: pre-LN, Conv1D weights, n_inner None -> 4 * n_embd."""
    if not c["scale_attn_weights"]:
        c.refuse("scale_attn_weights", "unscaled attention logits: the blocks scale by 1 / sqrt(head_dim)")
    if c["scale_attn_by_inverse_layer_idx"]:
        c.refuse("scale_attn_by_inverse_layer_idx", "a per-layer logit scale 1 / (layer + 1) the blocks lack")
    if c["add_cross_attention"]:
        c.refuse("add_cross_attention", "a decoder with cross-attention: only self-attention stacks are read")
    n_inner = c["n_inner"]
    out = _sizes(c, "n_embd", "n_head", None, "n_layer")
    return {**out, "d_ff": int(n_inner) if n_inner is not None else 4 * out["d_model"],
            "activation": _activation(c, "activation_function"), "layer_norm_eps": float(c["layer_norm_epsilon"]),
            "causal": _is_causal(c), "final_norm": True}


def _opt(c: Read) -> dict[str, Any]:
    """OPTDecoder: do_layer_norm_before (post-LN: OPT-350m), LayerNorms with torch's eps 1e-5
    (nn.LayerNorm default), the final norm unless post-LN or _remove_final_layer_norm."""
    pre = bool(c["do_layer_norm_before"])
    if not c["enable_bias"]:
        c.refuse("enable_bias", "OPT's linear maps lose their biases but its LayerNorms keep theirs; the blocks "
                                "have biases in both or in neither")
    if not c["layer_norm_elementwise_affine"]:
        c.refuse("layer_norm_elementwise_affine", "LayerNorms without weight and bias")
    return {**_sizes(c, "hidden_size", "num_attention_heads", "ffn_dim", "num_hidden_layers"),
            "activation": _activation(c, "activation_function"), "norm": "pre" if pre else "post",
            "causal": _is_causal(c), "final_norm": pre and not c["_remove_final_layer_norm"]}


def _vit(c: Read) -> dict[str, Any]:
    """ViTModel's encoder: pre-LN, qkv_bias, head_dim read when set (getattr in ViTSelfAttention)."""
    if c["is_causal"]:
        c.refuse("is_causal", "ViT is read as bidirectional; transformers makes it causal under SDPA only")
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]),
            "activation": _activation(c, "hidden_act"), "layer_norm_eps": float(c["layer_norm_eps"]),
            "qkv_bias": bool(c["qkv_bias"]), "final_norm": True}


def _llama(c: Read) -> dict[str, Any]:
    """LlamaModel: RMSNorm (rms_norm_eps), SwiGLU (hidden_act), biases on the attention's maps
    (attention_bias) and the MLP's (mlp_bias), head_dim, rotary; never a window."""
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    attn, mlp = bool(c["attention_bias"]), bool(c["mlp_bias"])
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": None if mlp == attn else mlp,
            "causal": _is_causal(c),
            "sliding_window": None, "sliding_window_pattern": None, **_rope(c), "final_norm": True}


def _silu_only(c: Read, key: str) -> dict[str, Any]:
    """The hf-llama dialect's gated MLP is SwiGLU: another activation is refused by name."""
    act = _activation(c, key, gated=True)
    if act not in (None, "silu"):
        c.refuse(key, "the LLaMA-named families are read with SwiGLU (silu) MLPs only")
    return {}


def _mistral(c: Read) -> dict[str, Any]:
    """MistralModel: LLaMA's layers without biases; every layer local when sliding_window is set."""
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False, "causal": _is_causal(c), **_rope(c),
            **_all_local(c, c["sliding_window"], sizes["num_layers"]), "final_norm": True}


def _qwen2_layer_types(c: Read, n_layers: int) -> list[str]:
    """Qwen2Config / Qwen3Config.__post_init__: layer_types as given, else local from
    max_window_layers on when use_sliding_window (and a window) is set."""
    if c["layer_types"] is not None:
        types = list(c["layer_types"])
        if "sliding_attention" in types and not (c["use_sliding_window"] and c["sliding_window"] is not None):
            c.refuse("layer_types", "local layers without a window (use_sliding_window false or sliding_window "
                                    "None): transformers refuses this config when it builds the model")
        return types
    first = c["max_window_layers"]
    return ["sliding_attention" if c["sliding_window"] is not None and c["use_sliding_window"] and i >= first
            else "full_attention" for i in range(n_layers)]


def _qwen2_source(c: Read) -> str:
    """The keys a Qwen layout came from, for messages: layer_types when given, else the keys
    Qwen2Config builds it from."""
    if c["layer_types"] is not None:
        return ""
    return f"use_sliding_window={c['use_sliding_window']!r}, max_window_layers={c['max_window_layers']!r}"


def _qwen2(c: Read) -> dict[str, Any]:
    """Qwen2Model: LLaMA's layers with biases on q, k, v only; the window from layer_types
    (Qwen2Config: sliding_window kept only with use_sliding_window)."""
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    window = c["sliding_window"] if c["use_sliding_window"] else None
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False,
            "qkv_bias": True, "causal": _is_causal(c), **_rope(c),
            **_pattern(c, _qwen2_layer_types(c, sizes["num_layers"]), window, sizes["num_layers"], _qwen2_source(c)),
            "final_norm": True}


def _qwen3(c: Read) -> dict[str, Any]:
    """Qwen3Model: Qwen2's windows, QK-norm per head, explicit head_dim, attention_bias on q, k,
    v and o (never the MLP)."""
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    window = c["sliding_window"] if c["use_sliding_window"] else None
    attn = bool(c["attention_bias"])
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "causal": _is_causal(c), **_rope(c),
            **_pattern(c, _qwen2_layer_types(c, sizes["num_layers"]), window, sizes["num_layers"], _qwen2_source(c)),
            "final_norm": True}


def _phi3(c: Read) -> dict[str, Any]:
    """Phi3Model: fused qkv and gate_up, no biases, rotary on the first partial_rotary_factor
    of each head (Phi3Config keeps it in rope_parameters), every layer local with a window."""
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "causal": _is_causal(c),
            **_rope(c, partial=1.0, partial_key="partial_rotary_factor",
                    head_dim=int(c["head_dim"] or sizes["d_model"] // sizes["num_heads"]), **_phi3_rope(c)),
            **_all_local(c, c["sliding_window"], sizes["num_layers"]), "final_norm": True}


def _phi3_rope(c: Read) -> dict[str, Any]:
    """Phi3Config's own rope reading: the older "su" and "yarn" types are longrope, any type
    but default and longrope is refused by transformers, and the top-level
    original_max_position_embeddings (a field of Phi3Config) replaces the dict's."""
    source = "rope_scaling" if c["rope_scaling"] else "rope_parameters"
    params = dict(c["rope_scaling"] or c["rope_parameters"] or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "longrope":  # standardize_rope_params: Phi3Config's own field replaces the dict's
        params["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    renamed = kind in ("su", "yarn")
    if renamed:  # renamed after standardize_rope_params: the dict's own original length only
        params["rope_type"] = kind = "longrope"
    if kind not in ("default", "longrope"):
        c.refuse(source, f"rope_type {kind!r}: Phi3Config accepts default and longrope only (transformers refuses "
                         "the config)")
        params = {}
    return {"params": params, "source": source, "original_default": not renamed}


def _gemma(c: Read) -> dict[str, Any]:
    """GemmaModel: (1 + w) RMSNorm, GeGLU (GemmaConfig rewrites hidden_act 'gelu' to tanh
    GELU), explicit head_dim, attention_bias on q, k, v, o."""
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    if c["use_bidirectional_attention"]:
        c.refuse("use_bidirectional_attention", "Gemma with bidirectional attention (EmbeddingGemma): read as causal "
                                                "here; refused")
    attn = bool(c["attention_bias"])
    act = _activation(c, "hidden_act", gated=True, tanh_gelu=True)
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_gated(act),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "causal": _is_causal(c), **_rope(c), "final_norm": True}


def _gemma2_common(c: Read, act_key: str) -> dict[str, Any]:
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    if c["use_bidirectional_attention"]:
        c.refuse("use_bidirectional_attention", "bidirectional attention (EmbeddingGemma): refused")
    attn = bool(c["attention_bias"])
    act = _activation(c, act_key, gated=True)  # Gemma 2 / 3: "gelu" stays exact GELU
    scalar = c["query_pre_attn_scalar"]
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_gated(act),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "query_pre_attn_scalar": None if scalar is None else float(scalar), "causal": _is_causal(c),
            "final_norm": True}


def _gemma2(c: Read) -> dict[str, Any]:
    """Gemma2Model: sandwich norms, soft-capped logits, query_pre_attn_scalar, layer_types
    (Gemma2Config: every second layer global when not given)."""
    out = _gemma2_common(c, "hidden_activation")
    n = out["num_layers"]
    types = c["layer_types"] or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    cap = c["attn_logit_softcapping"]
    return {**out, **_rope(c), "attn_logit_softcapping": None if cap is None else float(cap),
            **_pattern(c, list(types), c["sliding_window"], n)}


def _gemma3(c: Read) -> dict[str, Any]:
    """Gemma3TextModel: Gemma 2's layers with QK-norm and two rotary bases (full and sliding
    layers); its attention never applies attn_logit_softcapping (the key is inert)."""
    out = _gemma2_common(c, "hidden_activation")
    n = out["num_layers"]
    every = c["sliding_window_pattern"] if c["sliding_window_pattern"] is not None else 6
    types = c["layer_types"] or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    # Gemma3TextConfig.convert_rope_params_to_dict: per-layer-type parameters (defaults when absent), a flat
    # rope_scaling updating the full layers' (over the default's rope_type: an older "type" key then changes nothing)
    params = c["rope_parameters"]
    if params is None:
        params = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
    if c["rope_scaling"] and "full_attention" not in params:
        c.refuse("rope_parameters", "no full_attention entry for rope_scaling to update (transformers fails on it too)")
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    if c["rope_scaling"]:
        full.update(c["rope_scaling"])
    full.setdefault("rope_theta", c["rope_theta"] if c.given("rope_theta") else 1_000_000.0)
    local.setdefault("rope_theta", c["rope_local_base_freq"] if c.given("rope_local_base_freq") else 10_000.0)
    rotary = _rope(c, params=full, source="rope_scaling" if c["rope_scaling"] else "rope_parameters.full_attention")
    window = _pattern(c, list(types), c["sliding_window"], n)
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default" and window.get("sliding_window") is not None:
        c.problems.append(f"rope_parameters.sliding_attention={local!r}: rope_type {kind!r} on the sliding layers; "
                          "the blocks' local layers take plain rotary at their own base")
    local_theta = float(local["rope_theta"]) if window.get("sliding_window") is not None else None
    return {**out, **rotary, "rope_local_theta": local_theta, **window}


def _olmo2(c: Read) -> dict[str, Any]:
    """Olmo2Model: norms on the sublayer outputs, QK-norm over the whole projections,
    attention_bias on q, k, v, o."""
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    attn = bool(c["attention_bias"])
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]), **_silu_only(c, "hidden_act"),
            "layer_norm_eps": float(c["rms_norm_eps"]), "bias": attn, "mlp_bias": False if attn else None,
            "causal": _is_causal(c), **_rope(c), "final_norm": True}


def _gpt_neox(c: Read) -> dict[str, Any]:
    """GPTNeoXModel: parallel residual (use_parallel_residual), partial rotary (GPTNeoXConfig
    reads the older rotary_pct / rotary_emb_base into rope_parameters), attention_bias on the
    attention's maps only."""
    attn = bool(c["attention_bias"])
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    _rotary_head_dim(c, sizes["d_model"], sizes["num_heads"])
    return {**sizes, "activation": _activation(c, "hidden_act"), "layer_norm_eps": float(c["layer_norm_eps"]),
            "parallel_residual": "two_norms" if c["use_parallel_residual"] else "none",
            "bias": attn, "mlp_bias": None if attn else True, "norm_bias": None if attn else True,
            "causal": _is_causal(c),
            **_rope(c, partial=c["rotary_pct"] if c.given("rotary_pct") else 0.25, theta_key="rotary_emb_base",
                    partial_key="rotary_pct", head_dim=sizes["d_model"] // sizes["num_heads"]),
            "final_norm": True}


def _starcoder2(c: Read) -> dict[str, Any]:
    """Starcoder2Model: LayerNorms (norm_epsilon), a dense MLP, biases with use_bias (the
    LayerNorms keep theirs), every layer local with a window."""
    use_bias = bool(c["use_bias"])
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    return {**sizes, **_head_dim(c, sizes["d_model"], sizes["num_heads"]),
            "activation": _activation(c, "hidden_act"), "layer_norm_eps": float(c["norm_epsilon"]),
            "bias": use_bias, "norm_bias": None if use_bias else True, "causal": _is_causal(c), **_rope(c),
            **_all_local(c, c["sliding_window"], sizes["num_layers"]), "final_norm": True}


def _stablelm(c: Read) -> dict[str, Any]:
    """StableLmModel: LayerNorms, q/k/v biases (use_qkv_bias), partial rotary, one shared norm
    with use_parallel_residual; qk_layernorm refused."""
    if c["qk_layernorm"]:
        c.refuse("qk_layernorm", "a LayerNorm of its own for each head of q and k; the blocks' QK-norm is one "
                                 "scale-only norm shared by the heads")
    if not c["is_causal"]:
        c.refuse("is_causal", "StableLM's layers do not pass is_causal on: transformers computes it "
                              "bidirectional under eager attention and causal under SDPA without padding")
    sizes = _sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                   "num_key_value_heads")
    _rotary_head_dim(c, sizes["d_model"], sizes["num_heads"])
    return {**sizes, **_silu_only(c, "hidden_act"), "layer_norm_eps": float(c["layer_norm_eps"]),
            "qkv_bias": bool(c["use_qkv_bias"]),
            "parallel_residual": "shared_norm" if c["use_parallel_residual"] else "none", "causal": _is_causal(c),
            **_rope(c, partial=0.25, partial_key="partial_rotary_factor",
                    head_dim=sizes["d_model"] // sizes["num_heads"]), "final_norm": True}


def _whisper(part: str) -> Callable[[Read], dict[str, Any]]:
    def read(c: Read) -> dict[str, Any]:
        """WhisperEncoder / WhisperDecoder: pre-LN, torch's LayerNorm eps, no k_proj bias."""
        heads = int(c[f"{part}_attention_heads"])
        if part == "encoder" and c["is_causal"]:
            c.refuse("is_causal", "Whisper's encoder is read as bidirectional")
        if part == "decoder" and c["is_causal"] is False:
            c.refuse("is_causal", "a bidirectional Whisper decoder: the blocks' Decoder is causal")
        return {"d_model": int(c["d_model"]), "num_heads": heads, "d_ff": int(c[f"{part}_ffn_dim"]),
                "num_layers": int(c[f"{part}_layers"]), "dropout": 0.0, "num_kv_heads": None,
                "activation": _activation(c, "activation_function"), "final_norm": True}
    read.__doc__ = f"Whisper's {part}: pre-LN, torch's LayerNorm eps, no k_proj bias."
    return read


# The rotary families' shared key defaults are written out per family (each class has its own).
def _rotary(**kw: Any) -> dict[str, Any]:
    return {"rope_parameters": None, "rope_scaling": None, "rope_theta": 10000.0, "is_causal": True,
            "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 2048, **kw}


_LLAMA_INERT = {**_DECODER_INERT, "pretraining_tp": "a training-time sharding hint transformers 5's LLaMA no longer "
                                                    "reads"}

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("bert", "BertConfig", "BertModel", "hf-bert", _BERT_READS, _bert, _BERT_INERT,
           lm=("vocab_size", "max_position_embeddings", "type_vocab_size")),
    Family("roberta", "RobertaConfig", "RobertaModel", "hf-bert",
           {**_BERT_READS, "vocab_size": 50265, "pad_token_id": 1}, _bert, _BERT_INERT,
           lm=("vocab_size", "max_position_embeddings", "type_vocab_size", "pad_token_id")),
    Family("xlm-roberta", "XLMRobertaConfig", "XLMRobertaModel", "hf-bert",
           {**_BERT_READS, "vocab_size": 30522, "pad_token_id": 1}, _bert, _BERT_INERT,
           lm=("vocab_size", "max_position_embeddings", "type_vocab_size", "pad_token_id")),
    Family("distilbert", "DistilBertConfig", "DistilBertModel", "hf-distilbert",
           {"dim": 768, "n_heads": 12, "hidden_dim": 3072, "n_layers": 6, "activation": "gelu", "vocab_size": 30522,
            "max_position_embeddings": 512, "is_causal": None},
           _distilbert,
           {"dropout": _DROPOUT, "attention_dropout": _DROPOUT, "qa_dropout": _DROPOUT, "seq_classif_dropout": _DROPOUT,
            "tie_word_embeddings": "ties the masked-LM head, which is not loaded",
            "sinusoidal_pos_embds": "initialises the position table with sinusoids; the checkpoint's table is read"},
           lm=("vocab_size", "max_position_embeddings"),
           aliases={"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}),
    Family("gpt2", "GPT2Config", "GPT2Model", "hf-gpt2",
           {"n_embd": 768, "n_head": 12, "n_inner": None, "n_layer": 12, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False, "is_causal": True, "vocab_size": 50257, "n_positions": 1024,
            "tie_word_embeddings": True},
           _gpt2,
           {"resid_pdrop": _DROPOUT, "embd_pdrop": _DROPOUT, "attn_pdrop": _DROPOUT,
            "reorder_and_upcast_attn": "computes the attention products in float32: the same function",
            **{k: "the sequence-summary head of GPT2DoubleHeadsModel, not loaded" for k in (
                "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                "summary_first_dropout")},
            "n_ctx": "an old name for n_positions that transformers no longer reads"},
           lm=("vocab_size", "n_positions", "tie_word_embeddings"),
           aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
                    "num_hidden_layers": "n_layer"}),
    Family("opt", "OPTConfig", "OPTModel", "hf-opt",
           {"hidden_size": 768, "num_attention_heads": 12, "ffn_dim": 3072, "num_hidden_layers": 12,
            "activation_function": "relu", "do_layer_norm_before": True, "_remove_final_layer_norm": False,
            "enable_bias": True, "layer_norm_elementwise_affine": True, "is_causal": True, "vocab_size": 50272,
            "max_position_embeddings": 2048, "word_embed_proj_dim": None, "tie_word_embeddings": True},
           _opt, {"dropout": _DROPOUT, "attention_dropout": _DROPOUT, "layerdrop": "skips layers in training only",
                  "init_std": _INIT},
           lm=("vocab_size", "max_position_embeddings", "word_embed_proj_dim", "tie_word_embeddings")),
    Family("vit", "ViTConfig", "ViTModel", "hf-vit",
           {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "num_hidden_layers": 12,
            "hidden_act": "gelu", "layer_norm_eps": 1e-12, "qkv_bias": True, "head_dim": None, "is_causal": None},
           _vit, {"hidden_dropout_prob": _DROPOUT, "attention_probs_dropout_prob": _DROPOUT,
                  **{k: _OUTSIDE + " (patch embeddings, pooler)" for k in (
                      "image_size", "patch_size", "num_channels", "encoder_stride", "pooler_output_size",
                      "pooler_act")}}),
    Family("llama", "LlamaConfig", "LlamaModel", "hf-llama",
           _rotary(hidden_size=4096, num_attention_heads=32, num_key_value_heads=None, intermediate_size=11008,
                   num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
                   head_dim=None),
           _llama, _LLAMA_INERT, lm=_LM_ROTARY),
    Family("mistral", "MistralConfig", "MistralModel", "hf-llama",
           _rotary(max_position_embeddings=131072, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=14336,
                   num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-6, head_dim=None, sliding_window=4096,
                   layer_types=None),
           _mistral, _DECODER_INERT, lm=_LM_ROTARY),
    Family("qwen2", "Qwen2Config", "Qwen2Model", "hf-llama",
           _rotary(max_position_embeddings=32768, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                   intermediate_size=22016,
                   num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-6, use_sliding_window=False,
                   sliding_window=4096, max_window_layers=28, layer_types=None, head_dim=None, vocab_size=151936),
           _qwen2, _DECODER_INERT, lm=_LM_ROTARY),
    Family("qwen3", "Qwen3Config", "Qwen3Model", "hf-qwen3",
           _rotary(max_position_embeddings=32768, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                   intermediate_size=22016,
                   num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-6, head_dim=128, attention_bias=False,
                   use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None,
                   vocab_size=151936),
           _qwen3, _DECODER_INERT, lm=_LM_ROTARY),
    Family("phi3", "Phi3Config", "Phi3Model", "hf-phi3",
           _rotary(max_position_embeddings=4096, hidden_size=3072, num_attention_heads=32, num_key_value_heads=None,
                   intermediate_size=8192,
                   num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-5, partial_rotary_factor=1.0,
                   sliding_window=None, layer_types=None, head_dim=None, vocab_size=32064,
                   original_max_position_embeddings=4096),
           _phi3, {**_DECODER_INERT, "resid_pdrop": _DROPOUT, "embd_pdrop": _DROPOUT,
                   },
           lm=_LM_ROTARY),
    Family("gemma", "GemmaConfig", "GemmaModel", "hf-gemma",
           _rotary(max_position_embeddings=8192, hidden_size=3072, num_attention_heads=16, num_key_value_heads=16,
                   intermediate_size=24576,
                   num_hidden_layers=28, hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, head_dim=256,
                   attention_bias=False, use_bidirectional_attention=None, vocab_size=256000,
                   tie_word_embeddings=True),
           _gemma, _DECODER_INERT, lm=(*_LM_ROTARY, "hidden_size")),
    Family("gemma2", "Gemma2Config", "Gemma2Model", "hf-gemma2",
           _rotary(max_position_embeddings=8192, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=9216,
                   num_hidden_layers=26, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, head_dim=256,
                   attention_bias=False, use_bidirectional_attention=None, query_pre_attn_scalar=256,
                   sliding_window=4096, layer_types=None, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   vocab_size=256000, tie_word_embeddings=True),
           _gemma2, {**_DECODER_INERT, "hidden_act": "Gemma2Config reads hidden_activation; hidden_act is never "
                                                      "read", "cache_implementation": _GENERATION,
                     "sliding_window_size": "an older name for sliding_window that transformers no longer reads"},
           lm=(*_LM_ROTARY, "hidden_size", "final_logit_softcapping")),
    Family("gemma3_text", "Gemma3TextConfig", "Gemma3TextModel", "hf-gemma3",
           _rotary(max_position_embeddings=131072, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=9216,
                   num_hidden_layers=26, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, head_dim=256,
                   attention_bias=False, use_bidirectional_attention=False, query_pre_attn_scalar=256,
                   sliding_window=4096, layer_types=None, sliding_window_pattern=None, rope_local_base_freq=10000.0,
                   final_logit_softcapping=None, vocab_size=262208, tie_word_embeddings=True),
           _gemma3, {**_DECODER_INERT, "attn_logit_softcapping": "Gemma 3's attention never applies it (transformers "
                                                                 "5.24's Gemma3Attention passes softcap=None)",
                     "_sliding_window_pattern": "derived from sliding_window_pattern (layer_types is read)",
                     "hidden_act": "Gemma3TextConfig reads hidden_activation; hidden_act is never read",
                     "cache_implementation": _GENERATION},
           lm=(*_LM_ROTARY, "hidden_size", "final_logit_softcapping")),
    Family("olmo2", "Olmo2Config", "Olmo2Model", "hf-olmo2",
           _rotary(hidden_size=4096, num_attention_heads=32, num_key_value_heads=None, intermediate_size=11008,
                   num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False,
                   head_dim=None, vocab_size=50304),
           _olmo2, _DECODER_INERT, lm=_LM_ROTARY),
    Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXModel", "hf-gpt-neox",
           {k: v for k, v in _rotary(
               hidden_size=6144, num_attention_heads=64, intermediate_size=24576, num_hidden_layers=44,
               hidden_act="gelu", layer_norm_eps=1e-5, use_parallel_residual=True, attention_bias=True,
               rotary_pct=0.25, rotary_emb_base=10000.0, head_dim=None, vocab_size=50432).items()
            if k != "rope_theta"},
           _gpt_neox, {**_DECODER_INERT, "hidden_dropout": _DROPOUT, "classifier_dropout": _DROPOUT,
                       **{k: "GPTNeoXConfig reads rotary_emb_base / rotary_pct (or rope_parameters); a top-level "
                             f"{k} is never read" for k in ("rope_theta", "partial_rotary_factor")}},
           lm=_LM_ROTARY),
    Family("starcoder2", "Starcoder2Config", "Starcoder2Model", "hf-starcoder2",
           _rotary(max_position_embeddings=4096, hidden_size=3072, num_attention_heads=24, num_key_value_heads=2,
                   intermediate_size=12288,
                   num_hidden_layers=30, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, use_bias=True,
                   sliding_window=None, layer_types=None, head_dim=None, vocab_size=49152, tie_word_embeddings=True),
           _starcoder2, {**_DECODER_INERT, "residual_dropout": _DROPOUT, "embedding_dropout": _DROPOUT},
           lm=_LM_ROTARY),
    Family("stablelm", "StableLmConfig", "StableLmModel", "hf-stablelm",
           _rotary(max_position_embeddings=4096, hidden_size=2560, num_attention_heads=32, num_key_value_heads=32,
                   intermediate_size=6912,
                   num_hidden_layers=32, hidden_act="silu", layer_norm_eps=1e-5, use_qkv_bias=False,
                   qk_layernorm=False, use_parallel_residual=False, partial_rotary_factor=0.25, head_dim=None,
                   vocab_size=50304),
           _stablelm, {**_DECODER_INERT, "hidden_dropout": _DROPOUT}, lm=_LM_ROTARY),
)}

_WHISPER_READS = {"d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6, "encoder_ffn_dim": 1536,
                  "decoder_layers": 4, "decoder_attention_heads": 6, "decoder_ffn_dim": 1536,
                  "activation_function": "gelu", "is_causal": None}
_WHISPER_INERT = {
    **{k: _DROPOUT for k in ("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop",
                             "decoder_layerdrop")},
    "init_std": _INIT, "vocab_size": _OUTSIDE + " (the decoder's embeddings)",
    **{k: _OUTSIDE + " (the convolutions, positions and embeddings around the stacks)" for k in (
        "num_mel_bins", "scale_embedding", "max_source_positions", "max_target_positions")},
    **{k: "SpecAugment masking, in training only" for k in (
        "apply_spec_augment", "mask_time_prob", "mask_time_length", "mask_time_min_masks", "mask_feature_prob",
        "mask_feature_length", "mask_feature_min_masks")},
    **{k: "the audio-classification head, not loaded" for k in ("use_weighted_layer_sum", "classifier_proj_size")},
    "median_filter_width": "word-timestamp alignment in generation", "tie_word_embeddings": "the decoder's head",
    "max_length": _GENERATION,
}
# Whisper's two stacks read different keys of one config: one table each.
PARTS: dict[str, dict[str, Family]] = {"whisper": {
    part: Family("whisper", "WhisperConfig", f"Whisper{part.capitalize()}", dialect, _WHISPER_READS, _whisper(part),
                 _WHISPER_INERT, aliases={"num_key_value_heads": "encoder_attention_heads",
                                          "num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model",
                                          "num_hidden_layers": "encoder_layers"})
    for part, dialect in (("encoder", "hf-whisper"), ("decoder", "hf-whisper-decoder"))}}
FAMILIES["whisper"] = PARTS["whisper"]["encoder"]

# model_types transformers has that the blocks do not compute: the reason, named.
NOT_COMPUTED = {
    "mixtral": "a mixture of experts in place of each MLP (a router and {num_local_experts} expert MLPs, "
               "{num_experts_per_tok} per token)",
    "qwen2_moe": "a mixture of experts in place of the MLP ({num_experts} experts)",
    "qwen3_moe": "a mixture of experts in place of the MLP ({num_experts} experts)",
    "t5": "a learned relative position bias added to the attention logits, and an encoder-decoder",
    "mt5": "T5's relative position bias", "umt5": "T5's relative position bias",
    "cohere": "parallel residual with a shared LayerNorm without bias and a logit scale",
    "falcon": "ALiBi or rotary by config, multi-query attention with one fused query_key_value and a parallel "
              "block (new_decoder_architecture: two norms)",
    "bloom": "ALiBi position biases added to the attention logits (no rotary, no learned positions)",
    "mpt": "ALiBi position biases",
    "gptj": "rotary on interleaved (adjacent) pairs of dimensions and a parallel block sharing one LayerNorm",
    "codegen": "GPT-J's interleaved rotary and parallel block, with q, k, v fused in a model-parallel layout",
    "phi": "a parallel block with partial rotary and a dense MLP under Phi-1/2's names (phi3 is supported)",
    "gpt_neo": "local attention on alternate layers with unscaled logits",
    "gpt_bigcode": "multi-query attention with a fused c_attn of another layout",
    "mamba": "a state-space model, not attention", "rwkv": "a recurrent model, not attention",
    "deepseek_v2": "multi-head latent attention and experts", "deepseek_v3": "multi-head latent attention and experts",
    "llama4": "chunked attention, experts and no rotary on some layers",
    "olmo": "OLMo 1's LayerNorm without parameters and clipped q, k, v (olmo2 is supported)",
    "granite": "multipliers on the embeddings, residuals, attention and logits",
}


# Multimodal model_types whose language model is a supported family: the key of its config and
# the prefixes its weights carry (the checkpoints' names, then transformers 5's), stripped to the
# causal LM's names; every other weight (vision tower, projector) is a part the text model never uses.
LANGUAGE_MODELS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "gemma3": ("text_config", (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                               ("model.language_model.", "model."))),
}


def not_computed(model_type: str, config: Mapping[str, Any]) -> str:
    """The reason a known model_type is refused, with the model's own numbers filled in."""
    reason = NOT_COMPUTED[model_type]
    fields = {key: config.get(key, "?") for key in ("num_local_experts", "num_experts_per_tok", "num_experts")}
    return reason.format(**fields)
