"""DeepSeek-V2 (model_type deepseek_v2: DeepSeek-V2, V2-Lite, V2.5): multi-head latent attention
(q_proj, or q_a_proj -> RMSNorm -> q_b_proj with q_lora_rank; kv_a_proj_with_mqa -> RMSNorm ->
kv_b_proj; rotary on qk_rope_head_dim dims by V2's complex rotation of adjacent pairs) and, after
first_k_dense_replace dense layers, experts routed by a softmax, top-k plain ("greedy") or within
the topk_group best of n_group groups ("group_limited_greedy"), scaled by routed_scaling_factor
(never renormalised: V2's model does not read norm_topk_prob), beside an ungated shared MLP of
n_shared_experts * moe_intermediate_size. The dialect is shared with deepseek_v3."""

from __future__ import annotations

from typing import Any

from ..dialects import ATTENTION_BIAS, Dialect, Rule, experts, linear, norm, register_dialect, same
from ..family import (
    DECODER_INERT,
    LM_ROTARY,
    MOE_TRAINING,
    Family,
    Outside,
    Read,
    Reference,
    read_causal,
    read_experts,
    read_rope,
    read_sizes,
    register,
    rotary_defaults,
    silu_only,
)

# LLaMA's parts around the stack (embed_tokens, the layers, norm; lm_head beside the model); RMSNorm and rotary
# cast to float32 in HF. (Written here, not imported from families.llama: importing it would register LLaMA first.)
DEEPSEEK_OUTSIDE = Outside("model.", "embed_tokens.weight")
DEEPSEEK_REFERENCE = Reference(float32_inside=True)
_MLA = ("q_proj.weight", "q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight", "kv_b_proj.weight",
        "o_proj.weight", "o_proj.bias")
HF_DEEPSEEK = Dialect(
    "hf-deepseek", "Hugging Face DeepSeek V2 / V3 (self_attn.q_a_proj, kv_a_proj_with_mqa, kv_b_proj ...; "
                   "mlp.gate_proj in dense layers; mlp.gate, mlp.experts.{j}.gate_proj ... or the fused "
                   "mlp.experts.gate_up_proj, mlp.shared_experts in experts layers)",
    layer="layers.{i}.", final_norm="norm",
    rules=(*same(*(f"self_attn.{n}" for n in _MLA)),
           *linear("linear_gate", "mlp.gate_proj"), *linear("linear1", "mlp.up_proj"),
           *linear("linear2", "mlp.down_proj"), *norm("norm1", "input_layernorm"),
           *norm("norm2", "post_attention_layernorm"),
           *experts("mlp."), Rule("experts.e_score_correction_bias", ("mlp.gate.e_score_correction_bias",)),
           *linear("experts.shared_gate", "mlp.shared_experts.gate_proj"),
           *linear("experts.shared_up", "mlp.shared_experts.up_proj"),
           *linear("experts.shared_down", "mlp.shared_experts.down_proj")),
    ignore=("self_attn.rotary_emb.inv_freq",),
    settings={**ATTENTION_BIAS, "bias": False, "num_kv_heads": None, "head_dim": None, "sliding_window": None,
              "sliding_window_pattern": None, "latent_norm_eps": 1e-6, "shared_expert_gate": False,
              "decoder_sparse_step": 1},
    reads=("layer_norm_eps", "rope_theta", "rope_scaling", "qkv_bias", "mlp_bias", "causal", "kv_lora_rank",
           "rope_interleave", "num_experts", "num_experts_per_tok", "expert_d_ff", "norm_topk_prob",
           "shared_expert_d_ff", "mlp_only_layers", "routing", "n_group", "topk_group", "routed_scaling_factor"),
    outside="token embeddings (embed_tokens), the rotary inv_freq buffer and the LM head",
)
register_dialect(HF_DEEPSEEK)


def read_latent(c: Read, hidden: int, heads: int) -> dict[str, Any]:
    """DeepSeek's multi-head latent attention sizes and rotary (over qk_rope_head_dim dims, the
    config classes' head_dim); every head its own keys: fewer num_key_value_heads than heads makes
    transformers' repeat_kv multiply the heads kv_b_proj already gave (it fails on it); more (a
    published file's 128 beside shrunk heads) give num_key_value_groups 0, which its default SDPA
    path reads as every head its own keys."""
    kv = c["num_key_value_heads"]
    if kv is not None and kv < heads:
        c.refuse("num_key_value_heads", f"{kv} key/value heads beside {heads} heads: kv_b_proj gives every head its "
                                        "own keys, which transformers' repeat_kv then repeats (it fails on it too)")
    dr = int(c["qk_rope_head_dim"])
    if dr < 2 or dr % 2:
        c.refuse("qk_rope_head_dim", f"a rotary part of {dr} dims (rotary turns pairs of dims)")
        dr = 2
    q = c["q_lora_rank"]
    return {"kv_lora_rank": int(c["kv_lora_rank"]), "q_lora_rank": None if q is None else int(q),
            "qk_nope_head_dim": int(c["qk_nope_head_dim"]), "qk_rope_head_dim": dr,
            "v_head_dim": int(c["v_head_dim"]), **read_rope(c, head_dim=dr), "qkv_bias": bool(c["attention_bias"])}


def shared_width(c: Read) -> dict[str, Any]:
    """The shared MLP, n_shared_experts * moe_intermediate_size wide, ungated; transformers builds it
    even at n_shared_experts 0 (empty tensors, a zero output), which the blocks do not hold: refused."""
    n = c["n_shared_experts"]
    if not isinstance(n, int) or n < 1:
        c.refuse("n_shared_experts", f"{n!r}: a shared MLP of width {n!r} * moe_intermediate_size (transformers keeps "
                                     "its empty tensors; the blocks hold none)")
        return {}
    return {"shared_expert_d_ff": n * int(c["moe_intermediate_size"])}


def first_dense(c: Read, n_layers: int) -> dict[str, Any]:
    """first_k_dense_replace: layers 0 .. k-1 run the dense MLP (intermediate_size), the others the experts."""
    k = int(c["first_k_dense_replace"] or 0)
    return {"mlp_only_layers": tuple(range(min(k, n_layers)))}


def _deepseek_v2(c: Read) -> dict[str, Any]:
    """DeepseekV2Model: RMSNorm (rms_norm_eps), multi-head latent attention (V2's complex rotary on
    adjacent pairs), the dense SwiGLU (mlp_bias) in the first first_k_dense_replace layers, then
    the experts (softmax, greedy or group_limited_greedy, routed_scaling_factor) and the shared MLP."""
    sizes = read_sizes(c, "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    if c["num_experts_per_tok"] is None:  # DeepseekV2Config's default
        c.refuse("num_experts_per_tok", "None: the router's torch.topk takes no k (transformers fails on it too)")
        return {**sizes, "final_norm": True}
    out = {**sizes, **silu_only(c, "hidden_act"), "layer_norm_eps": float(c["rms_norm_eps"]), "bias": False,
           "causal": read_causal(c), "mlp_bias": bool(c["mlp_bias"]),
           **read_latent(c, sizes["d_model"], sizes["num_heads"]), "rope_interleave": True,
           **read_experts(c, "n_routed_experts", expert_width="moe_intermediate_size", norm=None),
           "norm_topk_prob": False, "routing": "deepseek_v2", "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": float(c["routed_scaling_factor"]), **shared_width(c),
           **first_dense(c, sizes["num_layers"]), "final_norm": True}
    method = c["topk_method"]
    if method == "group_limited_greedy":
        out.update(groups(c, out["num_experts"], out["num_experts_per_tok"], v3=False))
    elif method != "greedy":
        c.refuse("topk_method", f"{method!r}: DeepseekV2TopkRouter computes 'greedy' and 'group_limited_greedy' "
                                "(it fails on another)")
    return out


def groups(c: Read, n: int, k: int, *, v3: bool) -> dict[str, Any]:
    """n_group equal groups of the n experts, topk_group of them kept; what transformers' routers
    cannot compute (groups that do not divide the experts, more kept than there are, V3's top-2 of
    a group of one, a top k reaching past the kept groups, whose order torch.topk leaves open) refused."""
    g, kg = c["n_group"], c["topk_group"]
    if not isinstance(g, int) or not isinstance(kg, int) or g < 1 or n % g or not 1 <= kg <= g:
        c.refuse("n_group", f"n_group={g!r}, topk_group={kg!r} over {n} experts: the router views the experts as "
                            "n_group equal groups and keeps topk_group of them (transformers fails on these)")
        return {}
    if v3 and n // g < 2:
        c.refuse("n_group", f"groups of {n // g} expert: DeepseekV3TopkRouter ranks a group by its top-2 scores "
                            "(transformers fails on it)")
        return {}
    if v3 and k > kg * (n // g):
        c.refuse("num_experts_per_tok", f"the top {k} of {kg} kept groups of {n // g} experts: the rest are chosen "
                                        "among -inf scores, in an order torch.topk leaves open")
        return {}
    return {"n_group": g, "topk_group": kg}


# Keys of both config classes their models never read.
DEEPSEEK_INERT = {**DECODER_INERT, **MOE_TRAINING,
                  "pretraining_tp": "a training-time sharding hint the DeepSeek models do not read",
                  "head_dim": "the config class sets it to qk_rope_head_dim, whatever the file says (the rotary width)",
                  "qk_head_dim": "the config class sets it to qk_nope_head_dim + qk_rope_head_dim"}

DEEPSEEK_DRAWS: dict[str, tuple[Any, ...]] = {
    "q_lora_rank": (None, 8), "kv_lora_rank": (8, 12), "qk_nope_head_dim": (4, 8), "qk_rope_head_dim": (4, 2),
    "v_head_dim": (6, 4), "n_routed_experts": (8, 4), "num_experts_per_tok": (3, 2), "n_shared_experts": (1, 2, 0),
    "first_k_dense_replace": (1, 0), "routed_scaling_factor": (2.5, 1.0), "attention_bias": (True, False)}

register(Family("deepseek_v2", "DeepseekV2Config", "DeepseekV2Model", "hf-deepseek",
                rotary_defaults(max_position_embeddings=2048, hidden_size=4096, num_attention_heads=32,
                                num_key_value_heads=None, intermediate_size=11008, num_hidden_layers=32,
                                hidden_act="silu", rms_norm_eps=1e-6, vocab_size=102400, attention_bias=False,
                                mlp_bias=False, first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
                                n_group=None, n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_group=None,
                                topk_method="greedy", v_head_dim=128, num_experts_per_tok=None,
                                moe_intermediate_size=1407),
                _deepseek_v2, {**DEEPSEEK_INERT, "norm_topk_prob": "DeepseekV2's router never renormalises (it does "
                                                                   "not read the key)"}, lm=LM_ROTARY,
                aliases={"num_experts": "n_routed_experts"},
                lm_class="DeepseekV2ForCausalLM", outside=DEEPSEEK_OUTSIDE, reference=DEEPSEEK_REFERENCE,
                draws={**DEEPSEEK_DRAWS, "topk_method": ("greedy", "group_limited_greedy"), "n_group": (2, 4),
                       "topk_group": (1, 2)}))
