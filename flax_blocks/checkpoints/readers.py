"""Pieces that several families' config readers share (each family's table still lists its own
keys): activations, sizes, rotary positions and their scaling as the config classes standardise
them, sliding-window layouts. Each takes the `Read` view of a config and refuses by name what
the blocks do not compute. Framework-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.rope import ROPE_TYPES, RopeScaling
from .family import ACTIVATIONS, DROPOUT, Read


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
