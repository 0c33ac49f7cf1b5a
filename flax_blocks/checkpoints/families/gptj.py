"""GPT-J (model_type gptj): a parallel block reading one shared LayerNorm, x + Attn(ln_1(x)) +
MLP(ln_1(x)); q, k, v and out_proj without biases, the MLP (fc_in, fc_out) and the norms with
them; rotary on interleaved (adjacent) pairs of the first rotary_dim dims of each head
(rotate_every_two, base 10000, its sin / cos table built in float32); a final LayerNorm and an
LM head with a bias."""

from __future__ import annotations

import math
from typing import Any

from ..dialects import CLASSIC, Dialect, linear, norm, qkv, register_dialect
from ..family import (
    DECODER_INERT,
    DROPOUT,
    Family,
    Outside,
    Read,
    Reference,
    read_activation,
    read_causal,
    read_sizes,
    register,
)

HF_GPTJ = Dialect(
    "hf-gptj", "Hugging Face GPT-J (h.{i}.attn.q_proj ... out_proj, mlp.fc_in / fc_out, one ln_1)",
    layer="h.{i}.", final_norm="ln_f",
    rules=(
        *qkv("attn.q_proj", "attn.k_proj", "attn.v_proj"),
        *linear("self_attn.out_proj", "attn.out_proj"),
        *linear("linear1", "mlp.fc_in"),
        *linear("linear2", "mlp.fc_out"),
        *norm("norm1", "ln_1"),
    ),
    ignore=("attn.bias", "attn.masked_bias"),  # the causal-mask buffers of older GPT-J checkpoints
    settings={**{k: v for k, v in CLASSIC.items() if k not in ("rope_theta", "partial_rotary_factor", "bias",
                                                                 "qkv_bias", "mlp_bias", "norm_bias",
                                                                 "rope_interleaved", "parallel_residual")},
              "norm": "pre", "rope_theta": 10000.0, "rope_interleaved": True, "bias": False, "qkv_bias": None,
              "mlp_bias": True, "norm_bias": True, "parallel_residual": "shared_norm"},
    reads=("activation", "layer_norm_eps", "num_kv_heads", "partial_rotary_factor", "causal"),
    outside="token embeddings (wte), the rotary sin / cos table and the LM head with its bias (lm_head)",
)
register_dialect(HF_GPTJ)


def _rotary(c: Read, head_dim: int) -> dict[str, Any]:
    """GPTJAttention rotates the first rotary_dim dims of each head with a table of rotary_dim
    columns (GPTJConfig takes an int only)."""
    dim = c["rotary_dim"]
    if not isinstance(dim, int) or dim < 2 or dim % 2 or dim > head_dim:
        c.refuse("rotary_dim", f"rotary on adjacent pairs of the first rotary_dim dims of a head of {head_dim}: "
                               "an even int from 2 to head_dim (transformers fails otherwise)")
        return {}
    factor = dim / head_dim
    while int(head_dim * factor) < dim:  # BlockConfig.rotary_dim is int(head_dim * factor): 30 / 44 gives 29
        factor = math.nextafter(factor, 1.0)
    return {"partial_rotary_factor": factor} if dim != head_dim else {}


def _gptj(c: Read) -> dict[str, Any]:
    """GPTJModel: GPTJBlock's parallel block over ln_1, n_inner None -> 4 * n_embd, head_dim
    n_embd / n_head, rotary on rotary_dim dims of each head in adjacent pairs."""
    if not c["is_causal"]:
        c.refuse("is_causal", "GPTJAttention keeps is_causal=True: transformers computes it bidirectional under "
                              "eager attention and causal under SDPA without padding")
    sizes = read_sizes(c, "n_embd", "n_head", None, "n_layer")
    n_inner = c["n_inner"]
    return {**sizes, "d_ff": int(n_inner) if n_inner is not None else 4 * sizes["d_model"],
            "activation": read_activation(c, "activation_function"),
            "layer_norm_eps": float(c["layer_norm_epsilon"]), "causal": read_causal(c),
            **_rotary(c, sizes["d_model"] // sizes["num_heads"]), "final_norm": True}


register(Family("gptj", "GPTJConfig", "GPTJModel", "hf-gptj",
                {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
                 "rotary_dim": 64, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "is_causal": True, "tie_word_embeddings": False},
                _gptj, {**DECODER_INERT, "resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT, "attn_pdrop": DROPOUT},
                lm=("vocab_size", "tie_word_embeddings"),
                aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                         "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
                lm_class="GPTJForCausalLM", outside=Outside("transformer.", "wte.weight", head_bias=True),
                reference=Reference(float32_inside=True),  # the sin / cos table and eager q.k in float32
                draws={"activation_function": ("gelu_new", "gelu"), "rotary_dim": (4, 8, 6, 2),
                       "n_inner": (40, None)}))
