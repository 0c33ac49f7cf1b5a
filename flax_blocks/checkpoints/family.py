"""A Hugging Face family, declared in one place: its config read as transformers' own code for
that family reads it, the checkpoint names of its layers (a `flax_blocks.checkpoints.dialects`
Dialect), the parts around its stack, and what the parity tests need to know of transformers'
implementation. Each family is one module of `flax_blocks.checkpoints.families`, which
registers it here (`register`); every registry of the checkpoints (the model types, their
dialects, the parts around the stacks) is read from what the modules registered.

A family's config table, `Family`:

    reads   key -> the config class's default: the keys the family's modelling code (or its
            config class, rewriting them) reads, and only those; `reader` turns them into
            BlockConfig fields, refusing by name the values the blocks do not compute;
    aliases key -> the key it sets (the config class's attribute_map: GPT-2's hidden_size is
            n_embd); an alias in a file wins over the key it names, as in transformers;
    inert   key -> why it changes no output of the loaded model (dropout rates in eval, init
            ranges, generation defaults, heads we do not load ...);
    lm      the keys read around the stack (vocabulary, tied head, learned positions, soft-cap),
            by `flax_blocks.checkpoints.checkpoint`; part of `reads`.

Any other key is one the family's transformers code never reads: it changes nothing there, so
it is ignored here too, and listed (one warning and the model's load report,
`fb.load_report(model)`). The risk of a silent wrong load lives in the keys a family DOES read,
each read as transformers reads it, and in weights that betray another family (refused by
name in `flax_blocks.checkpoints.dialects`). Checked against transformers 5.24's source;
parity_tests/hf/test_config_keys.py walks every config class and fails on a key no table classifies.

Below the tables, the readers several families share (`read_sizes`, `read_rope`,
`read_activation`, `window_pattern`, `read_experts`, `read_nope_layers` ...). Framework-free.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.rope import ROPE_TYPES, RopeScaling

TRANSFORMERS = "5.24.0"  # the version the families mirror (pyproject's hf extra pins it)

# HF activation names the blocks compute (transformers' ACT2FN): ours.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}

GENERATION = "a generation default (transformers moves it to generation_config); fb.generate takes its own arguments"
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
    **{k: GENERATION for k in ("max_length", "min_length", "do_sample", "early_stopping", "num_beams",
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
    "quantization_config": "quantized weights (the blocks read plain float tensors, and the quant_methods "
                           "fp8 and mxfp4 dequantized as they are read)",
    "pruned_heads": "heads pruned from the attention (the blocks have every head)",
}

# quantization_config.quant_method values whose weights are read, dequantized (checkpoints.quantized)
QUANT_METHODS = ("fp8", "mxfp4")

DROPOUT = "a dropout rate: inference runs without dropout"
INIT = "an initialisation setting; the checkpoint's weights are read"
OUTSIDE_PART = "read by a part outside the stack that the blocks do not load"


@dataclass(frozen=True)
class Outside:
    """Where a family keeps the parts around its stack (names relative to the base model), and
    what those parts compute besides a lookup and a matrix product."""

    base: str  # the base model's prefix inside the model with a head
    embed: str
    positions: str | None = None  # learned position table (its config key: max_positions below)
    max_positions: tuple[str, ...] = ()
    token_type: str | None = None
    embed_norm: str | None = None  # the module name of a norm on the embeddings
    head: str | None = "lm_head."  # the LM head's module, beside the base model; None: no causal LM
    ignore: tuple[str, ...] = ()  # buffers and parts that are not computed (BERT's pooler)
    position_offset: str = "none"  # "two": position p reads row p + 2 of a table of max + 2 rows;
    # "pad": RoBERTa's padding_idx + 1, the table's rows counting the offset (max_position_embeddings)
    default_positions: str = "arange"  # LMConfig.default_positions: HF's positions without position_ids
    embed_scale: bool = False  # token embeddings times sqrt(hidden_size) (Gemma, Gemma 2, Gemma 3)
    final_logit_softcap: str | None = None  # the config key of a final logit soft-cap (Gemma 2, Gemma 3)
    projections: tuple[str, str, str] | None = None  # (width key, project_in, project_out): OPT's narrower embeddings
    recompute_past_original: bool = False  # generate recomputes every key past longrope's original length (Phi-3)
    head_bias: bool = False  # the LM head has a bias (Phi-1/2's lm_head)
    logit_scale: str | None = None  # the config key of a factor on the logits (Cohere's logit_scale)
    embed_multiplier: str | None = None  # the config key multiplying the token embeddings (Granite)
    logits_divisor: str | None = None  # the config key dividing the logits (Granite's logits_scaling)


@dataclass(frozen=True)
class Reference:
    """What the parity tests need to know of transformers' implementation of a family:
    float32_inside, its norms, rotary or eager softmax compute in float32 inside a float64
    model (float64 comparisons then run it with SDPA, its norms and rotary patched);
    eager_only, its attention is served by the eager kernel only (Gemma 2's soft-cap: its
    softmax patched instead); scales_inputs, the base model's forward multiplies
    inputs_embeds by sqrt(hidden_size) (Gemma, Gemma 2); sdpa, its eager attention computes
    something else than its SDPA one, which from_pretrained takes (Falcon's eager path adds the
    ALiBi biases twice): the tests run it with SDPA in every dtype."""

    float32_inside: bool = False
    eager_only: bool = False
    scales_inputs: bool = False
    sdpa: bool = False


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
        """The config key that sets `key`: an alias the file holds (it wins, unless the family's
        config class keeps the key itself: `keeps_key`), else the key itself."""
        if key in self.family.keeps_key and key in self.config:
            return key
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
    """One model_type, as transformers reads and computes it (see the module docstring).

    dialect: the name of the Dialect its checkpoints' layers are written in.
    lm_class: its causal LM's class (LlamaForCausalLM); None: it has none.
    outside: where it keeps the parts around its stack; None: it loads as a stack only, for
      the reason `stack_only` gives.
    reference: transformers' implementation as the parity tests need it.
    draws: values people set for its keys, which the differential fuzzer draws
      (parity_tests/hf/fuzz.py); "pattern" for layer_types draws a layout of local and
      global layers."""

    model_type: str
    config_class: str
    model_class: str
    dialect: str
    reads: Mapping[str, Any]
    reader: Callable[[Read], dict[str, Any]]
    inert: Mapping[str, str] = field(default_factory=dict)
    lm: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    keeps_key: tuple[str, ...] = ()  # keys whose config class keeps them over an alias (Qwen3MoeConfig)
    lm_class: str | None = None
    outside: Outside | None = None
    stack_only: str = ""
    reference: Reference = Reference()
    draws: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def classify(self, key: str) -> str:
        """'read' (an alias too), 'inert' (known to change nothing) or 'unread' (never read by
        the family's code: ignored, as transformers ignores it)."""
        if key in self.reads or key in self.aliases:
            return "read"
        if key in self.inert or key in COMMON:
            return "inert"
        return "unread"


# ------------------------------------------------------------------------------------------
# The registries, filled by the family modules (flax_blocks.checkpoints.families)
# ------------------------------------------------------------------------------------------

FAMILIES: dict[str, Family] = {}  # model_type -> its Family (an encoder-decoder's: its encoder)
PARTS: dict[str, dict[str, Family]] = {}  # model_type -> {"encoder": ..., "decoder": ...} of encoder-decoders
# A multimodal model_type whose language model is a family: (the key of its config, the prefixes its
# weights carry -> the causal LM's); every other weight (vision tower, projector) is never used.
LANGUAGE_MODELS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
MODULES: dict[str, str] = {}  # model_type -> the module that registered it


def register(*families: Family, parts: Mapping[str, Family] | None = None) -> None:
    """Add families to the registries; `parts`: an encoder-decoder's stacks ({"encoder",
    "decoder"}), the encoder its family."""
    module = sys._getframe(1).f_globals["__name__"]
    if parts is not None:
        families = (*families, parts["encoder"])
        PARTS[parts["encoder"].model_type] = dict(parts)
    for f in families:
        if f.model_type in FAMILIES:
            raise ValueError(f"model_type {f.model_type!r} registered twice")
        FAMILIES[f.model_type] = f
        MODULES[f.model_type] = module


def register_language_model(model_type: str, config_key: str, prefixes: tuple[tuple[str, str], ...]) -> None:
    """A multimodal model_type whose `config_key` holds a registered family's config and whose
    weights under `prefixes` ((theirs, ours) pairs) are that family's causal LM."""
    LANGUAGE_MODELS[model_type] = (config_key, prefixes)


def families_of_dialect(dialect: str) -> list[str]:
    """The model types whose layers are written in `dialect`, in registration order."""
    return [t for t, f in FAMILIES.items() if f.dialect == dialect] + \
        [p.model_type for parts in PARTS.values() for p in parts.values()
         if p.dialect == dialect and p.model_type not in FAMILIES]


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
            if key == "quantization_config" and isinstance(value, Mapping) and \
                    value.get("quant_method") in QUANT_METHODS:
                continue  # read by the folder's reader (checkpoints.quantized)
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


# model_types transformers has that the blocks do not compute: the reason, named.
NOT_COMPUTED = {
    "t5": "a learned relative position bias added to the attention logits, and an encoder-decoder",
    "mt5": "T5's relative position bias", "umt5": "T5's relative position bias",
    "bloom": "ALiBi position biases added to the attention logits (no rotary, no learned positions)",
    "mpt": "ALiBi position biases",
    "codegen": "GPT-J's interleaved rotary and parallel block, with q, k, v fused in a model-parallel layout",
    "gpt_neo": "local attention on alternate layers with unscaled logits",
    "mamba": "a state-space model, not attention", "rwkv": "a recurrent model, not attention",
    "falcon_mamba": "a state-space model (Mamba with RMS-normed B, C and dt), not attention",
    "falcon_h1": "Mamba-2 state-space heads beside attention in every layer, with muP multipliers",
    "llama4": "Llama4ForConditionalGeneration's vision tower and projector (its language model, text_config's "
              "llama4_text, loads from the folder or model with fb.from_hf)",
    "dbrx": "experts renormalised by a p-norm (moe_normalize_expert_weights) with input jitter, a fused Wqkv with "
            "clip_qkv and LayerNorms without bias",
    "phimoe": "sparsemixer routing (sampled top-2 with a jitter mask) and LayerNorms",
    "granitemoeshared": "Granite's multipliers and an ungated shared expert",
    "granitemoehybrid": "Mamba-2 layers beside attention, Granite's multipliers",
    "jamba": "Mamba layers beside attention (without rotary), experts every expert_layer_period layers",
    "qwen3_next": "Gated DeltaNet linear-attention layers, output-gated attention, (1 + w) RMSNorm and partial rotary "
                  "beside Qwen2-MoE's experts",
    "minimax": "lightning (linear) attention layers with alpha / beta residual scaling beside Mixtral's experts",
    "jetmoe": "a mixture of attention experts (MoA) beside its MLP experts",
    "flex_olmo": "OLMo 2's norms after the sublayers around OLMoE's experts",
    "glm4_moe": "experts routed by sigmoid scores with a selection bias and grouped top-k, an ungated shared expert",
    "olmo": "OLMo 1's LayerNorm without parameters and clipped q, k, v (olmo2 is supported)",
}


def not_computed(model_type: str, config: Mapping[str, Any]) -> str:
    """The reason a known model_type is refused, with the model's own numbers filled in."""
    reason = NOT_COMPUTED[model_type]
    fields = {key: config.get(key, "?") for key in ("num_local_experts", "num_experts_per_tok", "num_experts")}
    return reason.format(**fields)


# --- shared readers -------------------------------------------------------------------------------
# Pieces that several families' config readers share (each family's table still lists its own
# keys): activations, sizes, rotary positions and their scaling as the config classes standardise
# them, sliding-window layouts. Each takes the `Read` view of a config and refuses by name what
# the blocks do not compute. Framework-free.

def read_activation(c: Read, key: str, *, gated: bool = False, tanh_gelu: bool = False) -> str | None:
    name = c[key]
    if tanh_gelu and name == "gelu":  # GemmaConfig's own rewrite (Gemma 1 only)
        name = "gelu_pytorch_tanh"
    ours = ACTIVATIONS.get(name)
    if ours is None:
        c.refuse(key, f"the blocks compute {', '.join(ACTIVATIONS)}")
    elif gated and ours == "relu":
        c.refuse(key, "a gated MLP with relu: the blocks gate with silu (SwiGLU) or GELU (GeGLU)")
    return ours


def gated_mlp(activation: str | None) -> dict[str, Any]:
    """A gated MLP's kind from its activation: silu -> SwiGLU, GELU -> GeGLU."""
    if activation is None or activation == "relu":
        return {}
    return {"mlp": "swiglu" if activation == "silu" else "geglu", "activation": activation}


def read_causal(c: Read) -> bool:
    """masking_utils.create_causal_mask: `if not getattr(config, "is_causal", True)` builds a
    bidirectional mask (every decoder family that builds its mask there)."""
    return bool(c["is_causal"])


def read_rope(c: Read, *, default_theta: float = 10000.0, partial: float | None = None,
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


def explicit_head_dim(c: Read, hidden: int, heads: int, key: str = "head_dim") -> dict[str, Any]:
    """An explicit head_dim (q/k/v project to heads * head_dim); None: hidden / heads."""
    head_dim = c[key]
    return {"head_dim": int(head_dim)} if head_dim is not None and head_dim * heads != hidden else {}


def rotary_head_dim(c: Read, hidden: int, heads: int) -> None:
    """StableLM, GPT-NeoX: the attention splits hidden / heads whatever head_dim says, while the
    rotary table reads head_dim: another value is refused."""
    head_dim = c["head_dim"]
    if head_dim is not None and head_dim * heads != hidden:
        c.refuse("head_dim", f"{c.family.model_class}'s attention splits {hidden} / {heads} per head while its "
                             "rotary table reads head_dim")


def kv_or_none(heads: int, kv: int | None) -> int | None:
    return None if kv is None or kv == heads else int(kv)


def every_layer_local(c: Read, window: int | None, n_layers: int) -> dict[str, Any]:
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


def every_layer_local_key(c: Read, window: int | None) -> dict[str, Any]:
    """Mixtral, Qwen3-MoE: with a window every layer is local (create_sliding_window_causal_mask
    for the whole stack); their configs have no layer_types."""
    if window is not None and not c["is_causal"]:
        c.refuse("is_causal", "with a sliding window transformers builds a bidirectional window |i - j| <= W, "
                              "which the blocks do not compute")
    return {"sliding_window": None if window is None else int(window), "sliding_window_pattern": None}


def window_pattern(c: Read, types: list[str], window: int | None, n_layers: int, source: str = "") -> dict[str, Any]:
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


def read_sizes(c: Read, hidden: str, heads: str, ff: str | None, layers: str, kv: str | None = None) -> dict[str, Any]:
    h = int(c[heads])
    if kv and c[kv] is not None and (c[kv] <= 0 or h % c[kv]):
        c.refuse(kv, f"{c[kv]} key/value heads do not divide {h} query heads (a default of "
                     f"{c.family.config_class} when the file leaves the key out: transformers fails on it too)")
        kv = None
    out = {"d_model": int(c[hidden]), "num_heads": h, "num_layers": int(c[layers]), "dropout": 0.0,
           "num_kv_heads": kv_or_none(h, c[kv]) if kv else None}
    if ff is not None:
        out["d_ff"] = int(c[ff])
    return out


def silu_only(c: Read, key: str) -> dict[str, Any]:
    """The hf-llama dialect's gated MLP is SwiGLU: another activation is refused by name."""
    act = read_activation(c, key, gated=True)
    if act not in (None, "silu"):
        c.refuse(key, "the LLaMA-named families are read with SwiGLU (silu) MLPs only")
    return {}


def read_experts(c: Read, count: str, *, expert_width: str | None = None, shared: str | None = None,
                 layers: bool = False, norm: str | None = "norm_topk_prob") -> dict[str, Any]:
    """A mixture of experts' settings: `count` experts, the top num_experts_per_tok of the router's
    softmax (renormalised as `norm` says; None: the family fixes it), each `expert_width` wide
    (None: intermediate_size, d_ff), a shared expert `shared` wide; with `layers`, the dense layers
    Qwen2-MoE's rule keeps (decoder_sparse_step, mlp_only_layers, from 0). No experts (count 0):
    every layer dense."""
    n, k = int(c[count]), int(c["num_experts_per_tok"])
    if n == 0:
        return {"num_experts": 0}
    if not 1 <= k <= n:
        c.refuse("num_experts_per_tok", f"the top {k} of {n} experts (torch.topk fails on it in transformers too)")
        k = 1
    out: dict[str, Any] = {"num_experts": n, "num_experts_per_tok": k}
    if norm is not None:
        out["norm_topk_prob"] = bool(c[norm])
    if expert_width is not None:
        out["expert_d_ff"] = int(c[expert_width])
    if shared is not None:
        out["shared_expert_d_ff"] = int(c[shared])
    if layers:
        step = int(c["decoder_sparse_step"])
        if step < 1:
            c.refuse("decoder_sparse_step", "a step below 1 (transformers divides by it)")
            step = 1
        out["decoder_sparse_step"] = step
        out["mlp_only_layers"] = tuple(sorted({int(i) for i in c["mlp_only_layers"] or ()}))
    return out


# The mixtures of experts' training-loss settings: the loss a forward with labels adds; no output changes.
MOE_TRAINING = {"output_router_logits": "returns the router logits (and the load-balancing loss) for training; "
                                        "the logits are the same",
                "router_aux_loss_coef": "the weight of the load-balancing loss in the training loss; the logits are "
                                        "the same"}
LM_ROTARY = ("vocab_size", "tie_word_embeddings")
DECODER_INERT = {"attention_dropout": DROPOUT, "is_decoder": "not read by this family's model (always a decoder)",
                  "add_cross_attention": "not read by this family's model (it has no cross-attention)"}


# The rotary families' shared key defaults are written out per family (each class has its own).
def rotary_defaults(**kw: Any) -> dict[str, Any]:
    return {"rope_parameters": None, "rope_scaling": None, "rope_theta": 10000.0, "is_causal": True,
            "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 2048, **kw}


def read_nope_layers(c: Read, n: int, *, config_class: str, empty_is_default: bool = False) -> tuple[int, ...]:
    """The layers (from 0) left without rotary by no_rope_layers (a 1 (rotary) or 0 (none) per layer, the
    attention rotating where the layer's flag is truthy); absent (or, empty_is_default: Llama 4, empty):
    config_class's default [int((i + 1) % no_rope_layer_interval != 0) for each of the n layers]."""
    flags = c["no_rope_layers"]
    if flags is None or (empty_is_default and not flags):
        every = c["no_rope_layer_interval"]
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            c.refuse("no_rope_layer_interval", f"a positive layer count ({config_class} divides by it)")
            return ()
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, (list, tuple)) or len(flags) < n:
        c.refuse("no_rope_layers", f"a 1 (rotary) or 0 (none) for each of the {n} layers (the attention indexes "
                                   "it by layer: transformers fails on a shorter list)")
        return ()
    return tuple(i for i in range(n) if not flags[i])
