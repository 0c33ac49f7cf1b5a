"""The option matrix of the parity suite: every BlockConfig option, each block kind, masks,
edge shapes and Encoder depths, varied one at a time around a base config (heads=2 !=
head_dim=6, so a wrong reshape of the packed projection cannot pass)."""

from __future__ import annotations

from dataclasses import replace

import flax_blocks as fb

from .harness import KINDS, Case

BASE = fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, norm="pre", activation="gelu")
BLOCK = Case("TransformerBlock", BASE)
# The modern options: 4 heads of head_dim 4 over 2 KV heads (heads and KV heads differ, so
# a wrong grouping cannot pass); a LLaMA-like block with all of them at once.
WIDE = fb.BlockConfig(d_model=16, num_heads=4, d_ff=20, dropout=0.0, norm="pre", activation="gelu")
LLAMA = fb.BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, d_ff=20, dropout=0.0, norm="pre",
                       norm_type="rmsnorm", mlp="swiglu", activation="silu", rope_theta=10000.0, qk_norm=True,
                       bias=False, causal=True)


# DeepSeek's multi-head latent attention: 4 heads of non-rotary key 4, rotary key 4 (shared), value 3 (!= 8),
# latent 6; its yarn (mscale and mscale_all_dim: the softmax scale grows with the factor)
MLA = replace(LLAMA, num_kv_heads=None, qk_norm=False, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4,
              v_head_dim=3, rope_theta=100.0)
_DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 4.0,
                  "mscale": 1.0, "mscale_all_dim": 0.7}
DEEPSEEK_V2 = dict(num_experts=8, expert_d_ff=6, routing="deepseek_v2", n_group=4, topk_group=2,
                   norm_topk_prob=False, routed_scaling_factor=2.0, shared_expert_d_ff=10, shared_expert_gate=False)
DEEPSEEK_V3 = dict(num_experts=8, expert_d_ff=6, num_experts_per_tok=3, routing="deepseek_v3", n_group=4,
                   topk_group=2, routed_scaling_factor=2.5, shared_expert_d_ff=10, shared_expert_gate=False)
_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}  # at theta 100, head_dim 8: one kept, one blended, two divided
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 4.0}  # ramp 0, 0.5
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 2.0, 4.0, 8.0],
             "original_max_position_embeddings": 4, "factor": 8.0}


def _cfg(**kw) -> Case:
    return replace(BLOCK, cfg=replace(BASE, **kw))


CASES: list[Case] = [
    *(Case(kind, BASE) for kind in KINDS),
    *(Case(kind, replace(BASE, norm="post")) for kind in ("ResidualMHA", "FeedForward")),
    _cfg(norm="post"),
    _cfg(norm="none"),
    _cfg(residual="none"),
    _cfg(norm="post", residual="none"),
    _cfg(norm="post", scaling="deepnorm"),
    _cfg(norm="none", scaling="rezero"),
    _cfg(scaling="rezero"),
    _cfg(scaling="layerscale", parallel_residual="two_norms"),  # GPT-NeoX's parallel residual, gated per branch
    _cfg(activation="relu", norm_bias=False),  # LayerNorms without biases, linear maps with
    _cfg(activation="gelu_tanh"),
    _cfg(bias=False),
    _cfg(causal=True),
    replace(BLOCK, attention_mask=True),
    replace(BLOCK, key_mask=True),
    replace(BLOCK, attention_mask=True, key_mask=True),  # some rows lose every key
    # a sliding window in every layer (Mistral) beside masks that leave some rows without a key
    replace(BLOCK, cfg=replace(BASE, causal=True, sliding_window=2), attention_mask=True, key_mask=True),
    replace(BLOCK, batch=1),
    replace(BLOCK, seq=1),
    replace(BLOCK, cfg=replace(BASE, d_model=24, num_heads=8, d_ff=16)),  # heads 8 > head_dim 3
    Case("ResidualMHA", BASE, attention_mask=True, key_mask=True),
    Case("Encoder", BASE, num_layers=1),
    Case("Encoder", replace(BASE, norm="post"), num_layers=4),
    Case("Encoder", BASE, num_layers=6, final_norm=False, attention_mask=True, key_mask=True),
    Case("Encoder", replace(BASE, norm="post", scaling="deepnorm", causal=True), num_layers=3),
    _cfg(layer_norm_eps=1e-3),
    _cfg(norm="post", layer_norm_eps=1e-12),
    # the modern options, each alone, then together
    _cfg(norm_type="rmsnorm"),
    _cfg(norm_type="rmsnorm", norm="post", layer_norm_eps=1e-3),
    replace(BLOCK, cfg=replace(BASE, norm_type="rmsnorm", layer_norm_eps=1e-6), input_scale=0.05),
    _cfg(norm="peri"),
    _cfg(norm="peri", norm_type="rmsnorm", scaling="layerscale"),
    _cfg(mlp="swiglu", activation="silu"),
    _cfg(mlp="geglu", activation="gelu"),
    _cfg(activation="silu"),
    replace(BLOCK, cfg=replace(WIDE, num_kv_heads=2), attention_mask=True, key_mask=True),
    replace(BLOCK, cfg=replace(WIDE, num_kv_heads=1)),
    _cfg(qk_norm=True),
    # Gemma's (1 + w) (QK-norm's too), Gemma 2's soft-capped logits (a cap small enough to bend these) over a
    # causal mask, the query scale query_pre_attn_scalar ** -0.5; Granite's x + m * F(x) (residual_multiplier)
    replace(BLOCK, cfg=replace(BASE, qk_norm=True, norm_type="rmsnorm", norm_weight_offset=1.0, causal=True,
                               attn_logit_softcapping=0.5, query_pre_attn_scalar=2.0, residual_multiplier=0.22),
            key_mask=True),
    # 4 heads x 8 != d_model 16; rotary on the first 4 of 8 dims (GPT-NeoX rotary_pct)
    replace(BLOCK, cfg=replace(WIDE, rope_theta=10000.0, head_dim=8, partial_rotary_factor=0.5), seq=7),
    # an odd rotary dim (int(6 * 0.5) = 3): HF rotates 4 dims at theta^(-2i/3) (GPT-NeoX, Phi-3 with such sizes)
    replace(BLOCK, cfg=replace(WIDE, rope_theta=100.0, head_dim=6, partial_rotary_factor=0.5), seq=7),
    # rotary on adjacent pairs (GPT-J's rotate_every_two on its first 4 of 8 dims, Cohere's on all of them)
    replace(BLOCK, cfg=replace(WIDE, rope_theta=100.0, head_dim=8, partial_rotary_factor=0.5, rope_interleaved=True,
                               parallel_residual="shared_norm", causal=True), seq=7, key_mask=True),
    replace(BLOCK, cfg=replace(WIDE, rope_theta=500.0, qk_norm=True, causal=True), key_mask=True),
    _cfg(qkv_bias=True, bias=False, mlp_bias=True),
    _cfg(qkv_bias=False, mlp_bias=False),  # LLaMA's attention_bias without mlp_bias: out_proj's bias alone
    *(Case(kind, replace(BASE, norm="peri", norm_type="rmsnorm", mlp="swiglu", activation="silu", qk_norm=True))
      for kind in ("ResidualMHA", "FeedForward")),
    replace(BLOCK, cfg=LLAMA, seq=6),
    replace(BLOCK, cfg=replace(LLAMA, norm="peri"), seq=6, key_mask=True),
    # OLMo 2: x + Norm(F(x)), QK-norm over the whole q / k projection
    Case("Encoder", replace(LLAMA, norm="out", qk_norm_over="projection"), num_layers=3, seq=6, key_mask=True),
    Case("Encoder", replace(LLAMA, norm="peri", num_kv_heads=1, norm_weight_offset=1.0), num_layers=2),  # final norm
    # DyT (Zhu et al. 2025) for every norm, final norm included; LayerNorm Scaling (Sun et al.
    # 2025): 3 layers, so 1/sqrt(l) differs per layer (scanned index; unrolled with DyT, no bias)
    Case("Encoder", replace(BASE, norm_type="dyt"), num_layers=2, key_mask=True),
    Case("Encoder", replace(BASE, layernorm_scaling=True), num_layers=3),
    Case("Encoder", replace(LLAMA, norm_type="dyt", qk_norm=False, layernorm_scaling=True), num_layers=3, seq=6,
         scan_layers=False),
    # decoders: causal self-attention, cross-attention to a memory of another length
    Case("DecoderBlock", replace(BASE, causal=True)),
    Case("DecoderBlock", replace(BASE, norm="post", causal=True), key_mask=True, memory_key_mask=True),
    Case("DecoderBlock", replace(BASE, norm="peri"), attention_mask=True, memory_key_mask=True),
    Case("DecoderBlock", replace(LLAMA, norm="peri", head_dim=6), seq=6, memory_seq=7, key_mask=True,
         memory_key_mask=True),
    # local, local, global layers in one scanned stack (Gemma 3's pattern, of 3)
    Case("Decoder", replace(BASE, norm="post", causal=True, sliding_window=2, sliding_window_pattern=3), num_layers=3,
         key_mask=True, memory_key_mask=True),
    Case("Decoder", replace(BASE, norm="post", scaling="deepnorm", causal=True), num_layers=3),
    Case("Decoder", replace(LLAMA, partial_rotary_factor=0.5), num_layers=2, seq=6, memory_seq=3),
    Case("Decoder", replace(LLAMA, causal=True, rope_theta=100.0, rope_interleaved=True), num_layers=2, seq=6),
    # Cohere 2: local, local, global layers, rotary (on adjacent pairs) on the local ones alone
    Case("Decoder", replace(LLAMA, causal=True, rope_theta=100.0, rope_interleaved=True, sliding_window=3,
                            sliding_window_pattern=3, rope_local_only=True), num_layers=3, seq=6, key_mask=True),
    # rematerialised layers: the backward recomputes each layer's forward inside the scan
    Case("Encoder", replace(BASE, norm="post"), num_layers=3, key_mask=True, remat="full"),
    # ... with its first layer without rotary (SmolLM3 / Llama 4's NoPE layers: nope_layers, from 0), its queries
    # tempered by their slots (Llama 4's attn_temperature_tuning, floor 2: four values over 6 slots), the rotary
    # layer's q and k over their RMS after rotary (Llama 4's L2 QK-norm)
    Case("Decoder", replace(LLAMA, causal=True, nope_layers=(0,), query_temperature_floor=2.0,
                            query_temperature_scale=0.5, qk_norm=False, qk_l2_norm=True), num_layers=2, seq=6,
         remat="dots_saveable"),
    # unrolled layers (Flax's scan_layers=False): same parameters, a Python loop instead of the scan
    # StableLM's block: one LayerNorm (with its bias) for both parallel branches, linear maps without biases
    Case("Encoder", replace(BASE, parallel_residual="shared_norm", bias=False, norm_bias=True, residual_multiplier=0.5),
         num_layers=3, key_mask=True, scan_layers=False),
    Case("Decoder", replace(LLAMA, causal=True, sliding_window=2, sliding_window_pattern=2, rope_local_theta=100.0),
         num_layers=2, seq=6, scan_layers=False),  # Gemma 2's alternation, Gemma 3's local rotary base
    # scaled rotary, each type where it acts: small bases, and original lengths below the sequence where the
    # type reads the length (longrope's long factors, dynamic's larger base)
    replace(BLOCK, cfg=replace(LLAMA, head_dim=8, rope_theta=100.0, rope_scaling=_LLAMA3), seq=6),
    Case("Encoder", replace(LLAMA, head_dim=8, rope_theta=100.0, rope_scaling=_YARN, partial_rotary_factor=0.5),
         num_layers=2, seq=7, key_mask=True),
    replace(BLOCK, cfg=replace(LLAMA, head_dim=8, rope_scaling=_LONGROPE), seq=6, key_mask=True),
    Case("DecoderBlock", replace(LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 3.0,
                                                      "max_position_embeddings": 4}), seq=6, memory_seq=3),
    Case("Decoder", replace(LLAMA, sliding_window=3, sliding_window_pattern=2, rope_local_theta=100.0,
                            rope_scaling={"rope_type": "linear", "factor": 4.0}), num_layers=2, seq=6),  # Gemma 3
    # attention paths forced through the config at small T (auto takes dense here): Flax's
    # blocked online softmax in blocks that do not divide T, and torch's explicit softmax
    # without weights asked for (torch serves blocked with SDPA)
    Case("TransformerBlock", replace(LLAMA, norm="peri", head_dim=6, attention="blocked", attention_block=2,
                                     attn_logit_softcapping=0.5, query_pre_attn_scalar=2.0, sliding_window=3),
         seq=7, key_mask=True),  # (the key blocks wholly before a query block's windows are skipped)
    Case("Encoder", replace(BASE, causal=True, attention="blocked", attention_block=4, sliding_window=3,
                            sliding_window_pattern=2, rope_theta=1e4, rope_local_theta=10.0), seq=9, key_mask=True),
    Case("DecoderBlock", replace(LLAMA, attention="blocked", attention_block=2), seq=6, key_mask=True,
         memory_key_mask=True),
    Case("TransformerBlock", replace(BASE, attention="dense"), key_mask=True),
    # GPT-OSS's sinks on the blocked path: exp(sink) in the online softmax's denominator, d sink from the lse
    Case("TransformerBlock", replace(LLAMA, attention="blocked", attention_block=2, attn_sinks=True,
                                     sliding_window=3), seq=7, key_mask=True),
    # Falcon-RW's ALiBi: 3 heads (not a power of two: slopes 2^-4 of a power of two, then 2^-2 of the next),
    # position biases by each key's rank among the real keys (padding mid-row skipped), no rotary
    Case("TransformerBlock", replace(BASE, d_model=18, num_heads=3, causal=True, alibi=True), seq=7, key_mask=True),
    # mixtures of experts: Mixtral's (top-2 of 4 SwiGLU experts, renormalised), Qwen2-MoE's shared expert
    # with its gate and unrenormalised weights, top-1 of dense GELU experts; a stack mixing dense and experts
    # layers (decoder_sparse_step 2, layer 0 dense by mlp_only_layers: dense, experts, dense, experts)
    replace(BLOCK, cfg=replace(LLAMA, num_experts=4, expert_d_ff=6), seq=6, key_mask=True),
    replace(BLOCK, cfg=replace(LLAMA, num_experts=4, expert_d_ff=6, norm_topk_prob=False, shared_expert_d_ff=10),
            seq=6),
    Case("FeedForward", replace(BASE, bias=False, num_experts=3, num_experts_per_tok=1, norm_topk_prob=False)),
    Case("Encoder", replace(LLAMA, num_experts=4, expert_d_ff=6, shared_expert_d_ff=5, decoder_sparse_step=2,
                            mlp_only_layers=(0,)), num_layers=4, seq=6, key_mask=True),
    # DeepSeek: multi-head latent attention with direct queries over padded keys; low-rank queries, interleaved
    # rotary, yarn with mscale_all_dim, attention biases, a latent eps of its own; V2's routing (softmax, group
    # limited greedy, unrenormalised, scaled) and V3's (sigmoid, correction bias, groups by their top-2 sums)
    # with an ungated shared expert; a V3 stack whose first layer is dense (first_k_dense_replace = 1)
    replace(BLOCK, cfg=MLA, seq=6, key_mask=True),
    replace(BLOCK, cfg=replace(MLA, q_lora_rank=5, rope_interleave=True, qkv_bias=True, latent_norm_eps=1e-3,
                               rope_scaling=_DEEPSEEK_YARN), seq=6),
    replace(BLOCK, cfg=replace(LLAMA, **DEEPSEEK_V2), seq=6),
    replace(BLOCK, cfg=replace(LLAMA, **DEEPSEEK_V3), seq=6, key_mask=True),
    Case("Encoder", replace(MLA, q_lora_rank=5, rope_interleave=True, **{**DEEPSEEK_V3, "n_group": 2,
                                                                           "topk_group": 1},
                            mlp_only_layers=(0,)), num_layers=2, seq=6, key_mask=True),
    # the same mixed as runs of like layers (experts, experts, dense: Flax scans each run apart; the stack
    # above scans one (dense, experts) period twice)
    Case("Encoder", replace(LLAMA, num_experts=4, expert_d_ff=6, mlp_only_layers=(2,)), num_layers=3, seq=5),
    # GPT-OSS: sinks in every softmax, on local and global layers alternating (layer_types), q/k/v/o biases,
    # experts with biases (router and projections) and the clamped SwiGLU (a limit small enough to clamp here,
    # an alpha other than the default)
    Case("Encoder", replace(LLAMA, attn_sinks=True, qk_norm=False, bias=True, norm_bias=False, sliding_window=2,
                            sliding_window_pattern=2, num_experts=4, num_experts_per_tok=2, expert_d_ff=6,
                            experts_bias=True, swiglu_limit=0.3, swiglu_alpha=1.1), num_layers=2, seq=6,
         key_mask=True),
    # Llama 4's chunked attention (attention_chunk_size 3) in its rotary layer, the NoPE layer full (unchunked_layers),
    # the first sequence left-padded by 2: its chunks start at its first real key (slots 2-4, 5-7), the other's at 0
    Case("Encoder", replace(LLAMA, nope_layers=(1,), qk_norm=False, qk_l2_norm=True, attention_chunk_size=3,
                            unchunked_layers=(1,)), num_layers=2, seq=8, key_mask=True, left_pad=2),
    replace(BLOCK, cfg=replace(LLAMA, attention_chunk_size=2), seq=5),  # a block alone: chunks from slot 0
    # ... on Flax's blocked path (blocks of 2 across the chunks' edges; torch: dense), the first layer unchunked
    Case("Encoder", replace(LLAMA, attention="blocked", attention_block=2, attention_chunk_size=3,
                            unchunked_layers=(0,)), num_layers=2, seq=8, key_mask=True, left_pad=1),
]

# ModernBERT's encoder: global, local, local, global layers (each period starts global), a bidirectional window
# |i - j| < 2 over padded keys, two rotary bases, GeGLU, no biases, the first layer's attention unnormed
CASES.append(Case("Encoder", replace(WIDE, bias=False, mlp="geglu", rope_theta=100.0, rope_local_theta=10.0,
                                     sliding_window=2, sliding_window_pattern=3, pattern_global_first=True,
                                     first_attn_norm=False), num_layers=4, seq=7, key_mask=True))

# Llama 4's experts: each chosen logit's sigmoid multiplying its expert's input (not its output), an ungated shared
# expert beside (top-2 here, so the k inputs' scaled copies are summed; Llama 4's own top-1 and its stack of dense
# and experts layers: parity_tests/hf/test_models_families.py)
LLAMA4_MOE = dict(num_experts=4, num_experts_per_tok=2, expert_d_ff=6, norm_topk_prob=False, routing="llama4",
                  routing_weights_on="input", shared_expert_d_ff=6, shared_expert_gate=False)
CASES.append(replace(BLOCK, cfg=replace(LLAMA, **LLAMA4_MOE), seq=6, key_mask=True))

# Cases whose float64 run means nothing: jax.nn.dot_product_attention computes its softmax
# in float32, so the forced "fused" path is compared in float32 only.
FLOAT32_CASES: list[Case] = [
    Case("TransformerBlock", replace(LLAMA, attention="fused"), seq=6, key_mask=True),
    Case("Encoder", replace(BASE, causal=True, attention="fused", sliding_window=3), seq=7, key_mask=True),
]
