"""ModernBERT (model_type modernbert): ModernBertModel's pre-LN encoder layers under layers.{i}: a fused Wqkv
(rows [q; k; v]) and Wo, GeGLU from a fused Wi (rows [input; gate]: act(input) * gate), LayerNorms with
norm_bias; layer 0's attn_norm an identity (its embeddings end with a LayerNorm); global layers (layer_id % n
== 0, global_attn_every_n_layers) and local ones with a bidirectional window |i - j| <= local_attention // 2,
each kind with its own rotary base; a final_norm. The whole model (part="model") adds the token embedding and
its norm; the masked-LM head is not read."""

from __future__ import annotations

from typing import Any

from ..dialects import Dialect, Rule, fused, linear, norm, register_dialect
from ..family import (
    COMMON,
    DROPOUT,
    INIT,
    Family,
    Outside,
    Read,
    Reference,
    gated_mlp,
    read_activation,
    read_rope,
    read_sizes,
    register,
)

# Layer 0 has no attn_norm (nn.Identity): the blocks' stacked layers hold one, unused under
# first_attn_norm=False, read as ones (zeros for a bias) and never written (`fill`).
HF_MODERNBERT = Dialect(
    "hf-modernbert", "Hugging Face ModernBERT (layers.{i}.attn.Wqkv.weight, mlp.Wi.weight, attn_norm, ...)",
    layer="layers.{i}.", final_norm="final_norm",
    rules=(
        Rule("self_attn.in_proj_weight", ("attn.Wqkv.weight",)),
        Rule("self_attn.in_proj_bias", ("attn.Wqkv.bias",)),
        *linear("self_attn.out_proj", "attn.Wo"),
        *fused("mlp.Wi.weight", "linear_gate.weight", "linear1.weight"),
        *fused("mlp.Wi.bias", "linear_gate.bias", "linear1.bias"),
        *linear("linear2", "mlp.Wo"),
        Rule("norm1.weight", ("attn_norm.weight",), fill=1.0),
        Rule("norm1.bias", ("attn_norm.bias",), fill=0.0),
        *norm("norm2", "mlp_norm"),
    ),
    settings={"norm": "pre", "norm_type": "layernorm", "norm_weight_offset": 0.0, "scaling": "none",
              "residual": "add", "qk_norm": False, "layernorm_scaling": False, "partial_rotary_factor": 1.0,
              "parallel_residual": "none", "attn_logit_softcapping": None, "query_pre_attn_scalar": None,
              "qkv_bias": None, "rope_interleaved": False, "rope_local_only": False, "causal": False,
              "num_kv_heads": None, "first_attn_norm": False},
    reads=("activation", "mlp", "layer_norm_eps", "bias", "mlp_bias", "norm_bias", "rope_theta", "rope_scaling",
           "rope_local_theta", "sliding_window", "sliding_window_pattern", "pattern_global_first"),
    outside="token embeddings (embeddings.tok_embeddings) and their norm (embeddings.norm), the rotary buffers and "
            "the masked-LM head (head, decoder)",
)
register_dialect(HF_MODERNBERT)


def _layer_kinds(c: Read, n: int) -> list[str]:
    """ModernBertConfig.__post_init__: layer_types, else 'full_attention' where i % global_attn_every_n_layers
    == 0 (i from 0), 'sliding_attention' elsewhere."""
    every = c["global_attn_every_n_layers"]
    return list(c["layer_types"] or ["sliding_attention" if i % every else "full_attention" for i in range(n)])


def _windows(c: Read, types: list[str], n: int) -> dict[str, Any]:
    """layer_types as the blocks' window and pattern: no local layer -> no window; every layer local -> the
    window; layer l (from 1) global iff n divides l - 1 -> pattern n, global first; anything else refused.
    The window: HF's |i - j| <= local_attention // 2 is the blocks' |i - j| < local_attention // 2 + 1."""
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        c.refuse("layer_types", f"expected {n} of 'sliding_attention' / 'full_attention'")
        return {}
    local = [t == "sliding_attention" for t in types]
    window = int(c["local_attention"]) // 2 + 1
    if not any(local):
        return {}
    if all(local):
        return {"sliding_window": window}
    for every in range(2, n + 1):
        if all(local[i] == bool(i % every) for i in range(n)):
            return {"sliding_window": window, "sliding_window_pattern": every, "pattern_global_first": True}
    c.problems.append(f"layer_types={types!r}: the blocks' global layers are each n-th from the first "
                      "(global_attn_every_n_layers n), or none, or all; this is neither")
    return {}


def _rotary(c: Read, has_local: bool) -> dict[str, Any]:
    """ModernBertConfig.convert_rope_params_to_dict: per-layer-type parameters (defaults when absent), a flat
    rope_scaling updating both kinds', rope_theta from global_rope_theta / local_rope_theta (160000 and 10000)
    where the dict has none. The local layers take plain rotary at their own base."""
    params = c["rope_parameters"] or {}
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    if c["rope_scaling"]:
        full.update(c["rope_scaling"])
        local.update(c["rope_scaling"])
    full.setdefault("rope_theta", c["global_rope_theta"] if c.given("global_rope_theta") else 160_000.0)
    local.setdefault("rope_theta", c["local_rope_theta"] if c.given("local_rope_theta") else 10_000.0)
    rotary = read_rope(c, params=full, source="rope_parameters.full_attention", theta_key="global_rope_theta",
                       head_dim=int(c["hidden_size"]) // int(c["num_attention_heads"]))
    if not has_local:
        return rotary
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":  # named by the key that set it (rope_scaling updates both kinds' parameters)
        scaled = c["rope_scaling"] and any(k in c["rope_scaling"] for k in ("rope_type", "type"))
        key = "rope_scaling" if scaled else "rope_parameters"
        c.problems.append(f"{key}={c[key]!r}: rope_type {kind!r} on the sliding layers ({local!r}); the blocks' "
                          "local layers take plain rotary at their own base")
    return {**rotary, "rope_local_theta": float(local["rope_theta"])}


def _modernbert(c: Read) -> dict[str, Any]:
    """ModernBertModel: pre-LN LayerNorms (norm_eps, norm_bias), fused Wqkv and Wo (attention_bias), GeGLU
    (hidden_activation, mlp_bias), layer 0 without attn_norm, global and local layers, bidirectional."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    if sizes["d_model"] % sizes["num_heads"]:
        c.refuse("num_attention_heads", f"{sizes['num_heads']} heads do not divide hidden_size {sizes['d_model']} "
                                        "(transformers fails on it too)")
        return {**sizes, "final_norm": True}
    windows = _windows(c, _layer_kinds(c, sizes["num_layers"]), sizes["num_layers"])
    return {**sizes, **gated_mlp(read_activation(c, "hidden_activation", gated=True)),
            "layer_norm_eps": float(c["norm_eps"]), "bias": bool(c["attention_bias"]), "mlp_bias": bool(c["mlp_bias"]),
            "norm_bias": bool(c["norm_bias"]), **_rotary(c, "sliding_window" in windows), **windows,
            "final_norm": True}


MODERNBERT_READS = {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 1152, "num_hidden_layers": 22,
                    "hidden_activation": "gelu", "norm_eps": 1e-5, "norm_bias": False, "attention_bias": False,
                    "mlp_bias": False, "layer_types": None, "global_attn_every_n_layers": 3, "local_attention": 128,
                    "rope_parameters": None, "rope_scaling": None, "global_rope_theta": None,
                    "local_rope_theta": None, "max_position_embeddings": 8192, "vocab_size": 50368}
_HEAD = "read by the masked-LM / classification heads, which are not loaded"
MODERNBERT_INERT = {
    "attention_dropout": DROPOUT, "embedding_dropout": DROPOUT, "mlp_dropout": DROPOUT,
    "classifier_dropout": DROPOUT, "initializer_cutoff_factor": INIT, "decoder_bias": _HEAD,
    "classifier_pooling": _HEAD, "classifier_bias": _HEAD, "classifier_activation": _HEAD,
    "sparse_prediction": _HEAD, "sparse_pred_ignore_index": _HEAD, "cls_token_id": COMMON["sep_token_id"],
    "tie_word_embeddings": "ties the masked-LM decoder, which is not loaded",
    "deterministic_flash_attn": "flash attention's deterministic backward: the same values",
    "reference_compile": "torch.compile of older transformers' model (5.24 drops it): the same values",
}

register(Family("modernbert", "ModernBertConfig", "ModernBertModel", "hf-modernbert", MODERNBERT_READS, _modernbert,
                MODERNBERT_INERT, lm=("vocab_size",),
                outside=Outside("model.", "embeddings.tok_embeddings.weight", embed_norm="embeddings.norm.",
                                head=None),
                reference=Reference(float32_inside=True),
                draws={"hidden_activation": ("gelu", "gelu_pytorch_tanh", "silu"),
                       "global_attn_every_n_layers": (1, 2, 3),
                       "local_attention": (2, 3, 4, 128), "norm_bias": (True, False),
                       "attention_bias": (True, False), "mlp_bias": (True, False)}))
