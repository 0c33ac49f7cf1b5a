"""Deliberately wrong Flax twins: the classic porting mistakes that parity checks must catch.

Each entry: (case the mistake shows in, Flax config override or None, mutation or None).
A mutation takes (case, flax module, inputs) and returns the wrong (module, inputs).
The modern options' mistakes are made on the weights where a permutation reproduces them
exactly (interleaved rotary = rotate-half on q/k dims permuted evens-first, as HF's LLaMA
conversion script knows; KV heads tiled = query heads regrouped), else by a wrong subclass.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_blocks as fb
from flax_blocks.attention import Attention, rotary
from flax_blocks.blocks import TransformerBlock
from flax_blocks.experts import ClampedSwiGLU, Experts, deepseek_route
from flax_blocks.layers import Norm
from flax_blocks.mla import LatentAttention

from .harness import Case, Inputs

BASE = fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, norm="post", activation="gelu")
MODERN = fb.BlockConfig(d_model=16, num_heads=4, d_ff=20, dropout=0.0, norm="pre", norm_type="rmsnorm",
                        activation="silu", bias=False)


def _attention(case: Case, module) -> Attention:
    return module.layers.self_attn if case.kind == "Encoder" else module.self_attn


def invert_flax_mask(case: Case, module, inp: Inputs):
    """Hand torch's convention (True = may NOT attend) to Flax unconverted."""
    return module, replace(inp, attention_mask=~inp.attention_mask)


def swap_q_and_k(case: Case, module, inp: Inputs):
    attn = _attention(case, module)
    k = attn.in_kernel[...]  # (E, K, G+2, hd): slots 0..G-1 q, G k
    g = k.shape[-2] - 2
    attn.in_kernel.set_value(k[..., [g, *range(1, g), 0, g + 1], :])
    return module, inp


def transpose_out_projection(case: Case, module, inp: Inputs):
    attn = module.self_attn
    h, d, e = attn.out_kernel[...].shape
    attn.out_kernel.set_value(attn.out_kernel[...].reshape(h * d, e).T.reshape(h, d, e))
    return module, inp


def layers_off_by_one(case: Case, module, inp: Inputs):
    state = nnx.state(module.layers, nnx.Param)
    nnx.update(module.layers, jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), state))
    return module, inp


def rotary_interleaved(case: Case, module, inp: Inputs):
    """Rotary on adjacent pairs (GPT-J / Meta's LLaMA) instead of rotate-half: the same as
    rotate-half applied to q and k whose head dims are ordered evens first, then odds."""
    attn = _attention(case, module)
    hd = attn.in_kernel[...].shape[-1]
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    w = np.array(attn.in_kernel[...])  # (E, K, G+2, hd), a writable copy
    g = w.shape[-2] - 2
    w[:, :, : g + 1] = w[:, :, : g + 1][..., perm]  # q and k slots; v keeps its dims
    attn.in_kernel.set_value(jnp.asarray(w))
    return module, inp


def kv_heads_tiled(case: Case, module, inp: Inputs):
    """Query head h paired with KV head h % K instead of h // (H / K)."""
    attn = _attention(case, module)
    w, wo = np.array(attn.in_kernel[...]), np.array(attn.out_kernel[...])  # (E,K,G+2,hd), (H,hd,E)
    _, kv, slots, hd = w.shape
    g = slots - 2
    h = kv * g
    # slot (j, i) holds query head j * g + i; the wrong twin puts there the heads with h % K == j
    order = [q for j in range(kv) for q in range(h) if q % kv == j]
    q = w[:, :, :g].reshape(w.shape[0], h, hd)[:, order].reshape(w.shape[0], kv, g, hd)
    w[:, :, :g] = q
    attn.in_kernel.set_value(jnp.asarray(w))
    attn.out_kernel.set_value(jnp.asarray(wo[order]))
    return module, inp


def swap_gate_and_up(case: Case, module, inp: Inputs):
    up, gate = module.linear1.kernel[...], module.linear_gate.kernel[...]
    module.linear1.kernel.set_value(gate)
    module.linear_gate.kernel.set_value(up)
    return module, inp


class _QKNormAfterRotary(Attention):
    def position_qk(self, q, k, positions, local=False, rope=True):
        theta = self.cfg.rope_theta
        q, k = rotary(q, positions, theta), rotary(k, positions, theta)
        return self.q_norm(q), self.k_norm(k)


class _RotaryOnLastDims(Attention):
    """Partial rotary on the last rotary_dim dims of each head instead of the first."""

    def position_qk(self, q, k, positions, local=False, rope=True):
        theta, r = self.cfg.rope_theta, self.cfg.rotary_dim
        rot = lambda a: jnp.concatenate([a[..., :-r], rotary(a[..., -r:], positions, theta)], axis=-1)  # noqa: E731
        return rot(q), rot(k)


class _TemperatureFromSlotZero(Attention):
    """Llama 4's query temperature at floor(slot / floor) where HF takes floor((slot + 1) / floor)."""

    def tempered(self, q, index, rope):
        return super().tempered(q, jnp.asarray(index) - 1, rope)


def temperature_from_slot_zero(case: Case, module, inp: Inputs):
    _attention(case, module).__class__ = _TemperatureFromSlotZero
    return module, inp


class _L2NormOnTheNopeLayers(Attention):
    """Llama 4's L2 QK-norm applied in the layers without rotary too (HF: the rotary layers alone)."""

    def position_qk(self, q, k, positions, local=False, rope=True):
        q, k = super().position_qk(q, k, positions, local, rope)
        return (q, k) if rope is True else (self.l2_normed(q), self.l2_normed(k))


def l2_norm_on_the_nope_layers(case: Case, module, inp: Inputs):
    _attention(case, module).__class__ = _L2NormOnTheNopeLayers
    return module, inp


def rotary_on_last_dims(case: Case, module, inp: Inputs):
    _attention(case, module).__class__ = _RotaryOnLastDims
    return module, inp


class _QKNormPerHeadForProjection(Attention):
    """OLMo 2's QK-norm (RMSNorm over the whole projection) computed per head: each head's own
    mean square, times the full-width weight cut into heads."""

    def qk_normed(self, norm, a):
        h = a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + norm.eps)
        return h * norm.scale[...].reshape(a.shape[2:])


def qk_norm_per_head(case: Case, module, inp: Inputs):
    _attention(case, module).__class__ = _QKNormPerHeadForProjection
    return module, inp


class _SoftcapAfterMask(Attention):
    """Gemma 2's soft-cap applied to the masked logits: a masked pair's -inf becomes -c, so it
    keeps a weight of exp(-c) relative to a zero logit."""

    def logits(self, qk, mask):
        c = self.cfg.attn_logit_softcapping
        masked = super().logits(qk, None)  # scaled and capped ...
        masked = jnp.where(mask, c * jnp.arctanh(masked / c), -jnp.inf) if mask is not None else masked  # ... uncapped
        return c * jnp.tanh(masked / c)  # masked, then capped


def softcap_after_mask(case: Case, module, inp: Inputs):
    _attention(case, module).__class__ = _SoftcapAfterMask
    return module, inp


def _zero_biases(*names):
    """The Flax twin's biases of these modules zeroed: the same as a twin that has none there."""
    def mutate(case: Case, module, inp: Inputs):
        for name in names:
            bias = getattr(module, name).bias
            bias.set_value(jnp.zeros_like(bias[...]))
        return module, inp

    return mutate


def qk_norm_after_rotary(case: Case, module, inp: Inputs):
    _attention(case, module).__class__ = _QKNormAfterRotary
    return module, inp


def memory_mask_on_self_attention(case: Case, module, inp: Inputs):
    """The memory's padding mask handed to the decoder's self-attention (the masks swapped)."""
    return module, replace(inp, key_mask=inp.memory_key_mask, memory_key_mask=inp.key_mask)


class _DyTAlphaAfterTanh(Norm):
    """DyT as weight * alpha * tanh(x) + bias (alpha outside the tanh)."""

    def __call__(self, x):
        y = self.alpha[...] * jnp.tanh(x) * self.scale[...]
        return y if self.bias is None else y + self.bias[...]


class _DyTWithoutAlpha(Norm):
    """DyT as weight * tanh(x) + bias (the learned alpha left out)."""

    def __call__(self, x):
        y = jnp.tanh(x) * self.scale[...]
        return y if self.bias is None else y + self.bias[...]


def _dyt_as(cls):
    def mutate(case: Case, module, inp: Inputs):
        for name in ("norm1", "norm2"):
            getattr(module, name).__class__ = cls
        return module, inp

    return mutate


class _LayersFromZero(TransformerBlock):
    """LayerNorm Scaling with the layer index counted from 0: layer 0's scale is 1 / sqrt(0)."""

    def run(self, x, ctx):
        ctx.layer = ctx.layer - 1
        return super().run(x, ctx)


class _ScaledByOneOverL(TransformerBlock):
    """LayerNorm Scaling by 1 / l instead of 1 / sqrt(l) (the index squared under the square root)."""

    def run(self, x, ctx):
        ctx.layer = ctx.layer * ctx.layer
        return super().run(x, ctx)


class _SoftmaxAfterTopK(Experts):
    """The top k of the logits, then a softmax over those k: equal to the renormalised softmax
    (Mixtral), wrong where the weights are not renormalised (Qwen2-MoE, OLMoE)."""

    def route(self, logits):
        top, experts = jax.lax.top_k(logits, self.cfg.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), experts


class _SharedExpertUngated(Experts):
    """Qwen2-MoE's shared expert added without its sigmoid gate."""

    def shared(self, t):
        h = self.act(self.shared_gate(t)) * self.shared_up(t)
        return self.shared_down(h)


class _CorrectionBiasInWeights(Experts):
    """DeepSeek V3's routing with the weights taken from the biased scores (sigmoid + the
    e_score_correction_bias), where the bias serves the choice only."""

    def route(self, logits):
        bias = self.e_score_correction_bias[...]
        _, experts = deepseek_route(self.cfg, logits, bias)
        w = jnp.take_along_axis(jax.nn.sigmoid(logits) + bias, experts, axis=-1)
        if self.cfg.norm_topk_prob:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor, experts


class _RotaryOnTheNonRotaryPart(LatentAttention):
    """Multi-head latent attention whose queries rotate their first qk_rope_head_dim dims (the
    non-rotary part, kept for kv_b_proj's keys) instead of the last (the rotary part)."""

    def project(self, x, positions):
        q, latent, k_rot = super().project(x, positions)
        dn, dr = self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim
        q_lin = self.q_proj(x).reshape(q.shape)  # the unrotated queries
        return jnp.concatenate([self.rotate(q_lin[..., :dr], positions), q_lin[..., dr:dn], q_lin[..., dn:]],
                               axis=-1), latent, k_rot


class _MscaleOnce(fb.BlockConfig):
    """DeepSeek's softmax scale times yarn's mscale once, where yarn_apply_mscale multiplies by it twice."""

    @property
    def latent_scale(self) -> float:
        s = self.rope_scaling
        assert s is not None and s.factor is not None and s.mscale_all_dim
        return super().latent_scale / (0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0)


def mscale_once(case: Case, module, inp: Inputs):
    attn = _attention(case, module)
    attn.cfg = _MscaleOnce(**{f.name: getattr(attn.cfg, f.name) for f in dataclasses.fields(attn.cfg)})
    return module, inp


class _WindowPastOnly(Attention):
    """A bidirectional window (|i - j| < W, ModernBERT) bounded on the past side alone, as the causal
    window i - W < j is: every later key stays visible."""

    def windowed(self, mask, rows, index, t, s, local):
        qpos, kpos = index + jnp.arange(t), jnp.arange(s)
        inside = (kpos[None, :] > qpos[:, None] - self.cfg.sliding_window)[None, None]
        m = inside if mask is None else mask & inside
        has = jnp.any(m, axis=-1, keepdims=True)
        return m | ~has, (has if rows is None else rows & has)


def _restricted(mask, rows, inside):
    """mask and rows (as `Attention.windowed` returns them) with only the pairs `inside` (T, S) left."""
    m = inside[None, None] if mask is None else mask & inside[None, None]
    has = jnp.any(m, axis=-1, keepdims=True)
    return m | ~has, (has if rows is None else rows & has)


class _ChunksFromSlotZero(Attention):
    """Llama 4's chunks counted from slot 0 in every row, where HF counts them from a row's first real token
    (its left padding shifts them)."""

    def chunked(self, mask, rows, index, t, s, chunked):
        c = self.cfg.attention_chunk_size
        return _restricted(mask, rows, (index + jnp.arange(t))[:, None] // c == jnp.arange(s)[None, :] // c)


class _ChunkAsWindow(Attention):
    """Llama 4's chunked attention read as a sliding window of attention_chunk_size (i - j < C)."""

    def chunked(self, mask, rows, index, t, s, chunked):
        c = self.cfg.attention_chunk_size
        return _restricted(mask, rows, (index + jnp.arange(t))[:, None] - jnp.arange(s)[None, :] < c)


def _attention_as(cls):
    def mutate(case: Case, module, inp: Inputs):
        _attention(case, module).__class__ = cls
        return module, inp

    return mutate


def experts_mlps_off_by_one(case: Case, module, inp: Inputs):
    """A mixed stack's experts MLPs cut from their stack one layer off (each experts layer runs the previous one's)."""
    state = nnx.state(module.experts_mlps, nnx.Param)
    nnx.update(module.experts_mlps, jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), state))
    return module, inp


class _SinkLeftOut(Attention):
    """GPT-OSS's attention with the sinks left out of the softmax's denominator (a plain softmax)."""

    def softmax(self, logits):
        return jax.nn.softmax(logits, axis=-1)


class _AlibiSlopesReversed(Attention):
    """Falcon's ALiBi with the heads' slopes in reverse order (head 0 takes the last head's slope)."""

    def alibi_bias(self, mask, rows, s):
        return super().alibi_bias(mask, rows, s)[:, ::-1]


class _AlibiNegated(Attention):
    """Falcon's ALiBi subtracted (the bias's sign flipped: later keys favoured less, not more)."""

    def alibi_bias(self, mask, rows, s):
        return -super().alibi_bias(mask, rows, s)


def sink_left_out(case: Case, module, inp: Inputs):
    _attention(case, module).__class__ = _SinkLeftOut
    return module, inp


def clamp_missing(case: Case, module, inp: Inputs):
    """GPT-OSS's experts computing (up + 1) * gate * sigmoid(alpha * gate) without clamping gate and up."""
    module.experts.glu = ClampedSwiGLU(float("inf"), module.cfg.swiglu_alpha)
    return module, inp


def _experts_as(cls):
    def mutate(case: Case, module, inp: Inputs):
        module.experts.__class__ = cls
        return module, inp

    return mutate


def _stack_layers_as(cls):
    def mutate(case: Case, module, inp: Inputs):
        module.layers.__class__ = cls  # the stacked layers' graphdef, hence the scan body, change with it
        return module, inp

    return mutate


BLOCK = Case("TransformerBlock", BASE)
DYT = Case("TransformerBlock", replace(BASE, norm="pre", norm_type="dyt"))
LN_SCALING = Case("Encoder", replace(BASE, norm="pre", layernorm_scaling=True), num_layers=3)
RESIDUAL_X = Case("Encoder", replace(BASE, norm="pre", residual_multiplier=0.22), num_layers=2)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0],
             "original_max_position_embeddings": 4, "factor": 8.0}
_DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "max_position_embeddings": 3}
_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}

MOE = replace(MODERN, mlp="swiglu", num_experts=4, expert_d_ff=6)
MLA = replace(MODERN, causal=True, rope_theta=100.0, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4,
              v_head_dim=3)
DEEPSEEK_V3 = replace(MOE, num_experts=8, num_experts_per_tok=3, routing="deepseek_v3", n_group=4, topk_group=2,
                      routed_scaling_factor=2.5)

MUTATIONS = {
    "layer_norm_eps_1e-6": (BLOCK, replace(BASE, layer_norm_eps=1e-6), None),
    "tanh_gelu_for_exact": (BLOCK, replace(BASE, activation="gelu_tanh"), None),
    "inverted_mask": (replace(BLOCK, attention_mask=True), None, invert_flax_mask),
    "swapped_q_and_k": (BLOCK, None, swap_q_and_k),
    "transposed_out_projection": (BLOCK, None, transpose_out_projection),
    "layers_off_by_one": (Case("Encoder", BASE, num_layers=3), None, layers_off_by_one),
    # the modern options
    "rotary_interleaved": (Case("TransformerBlock", replace(MODERN, rope_theta=10000.0), seq=7), None,
                           rotary_interleaved),
    "kv_heads_tiled": (Case("TransformerBlock", replace(MODERN, num_kv_heads=2)), None, kv_heads_tiled),
    "rmsnorm_eps_machine_epsilon": (  # torch.nn.RMSNorm(eps=None) in float32, where 1e-6 was meant
        Case("TransformerBlock", replace(MODERN, layer_norm_eps=1e-6), input_scale=0.05),
        replace(MODERN, layer_norm_eps=float(np.finfo(np.float32).eps)), None),
    "gate_and_up_swapped": (Case("TransformerBlock", replace(MODERN, mlp="swiglu")), None, swap_gate_and_up),
    # mixtures of experts: the k weights left as the softmax gave them where Mixtral renormalises; the softmax
    # over the top k logits where Qwen2-MoE / OLMoE take the top k of the softmax (unrenormalised); Qwen2-MoE's
    # shared expert added without its sigmoid gate
    "top_k_not_renormalised": (Case("TransformerBlock", MOE), replace(MOE, norm_topk_prob=False), None),
    "softmax_after_top_k": (Case("TransformerBlock", replace(MOE, norm_topk_prob=False)), None,
                            _experts_as(_SoftmaxAfterTopK)),
    "shared_expert_ungated": (Case("TransformerBlock", replace(MOE, shared_expert_d_ff=8)), None,
                              _experts_as(_SharedExpertUngated)),
    "mixed_stack_experts_off_by_one": (Case("Encoder", replace(MOE, decoder_sparse_step=2), num_layers=4), None,
                                       experts_mlps_off_by_one),  # dense, experts, dense, experts
    # GPT-OSS: the sinks left out of the softmax; the experts' SwiGLU clamp missing (a limit that clamps here)
    "sink_left_out": (Case("TransformerBlock", replace(MODERN, causal=True, attn_sinks=True), seq=6), None,
                      sink_left_out),
    # Falcon-RW's ALiBi: the slopes in reverse head order; the bias subtracted
    "alibi_slopes_reversed": (Case("TransformerBlock", replace(MODERN, causal=True, alibi=True), seq=6, key_mask=True),
                              None, _attention_as(_AlibiSlopesReversed)),
    "alibi_negated": (Case("TransformerBlock", replace(MODERN, causal=True, alibi=True), seq=6), None,
                      _attention_as(_AlibiNegated)),
    "swiglu_clamp_missing": (Case("TransformerBlock", replace(MOE, experts_bias=True, swiglu_limit=0.3)), None,
                             clamp_missing),
    "memory_mask_on_self_attention": (  # memory as long as the target, so the swapped masks fit
        Case("DecoderBlock", replace(BASE, causal=True), memory_seq=5, memory_key_mask=True), None,
        memory_mask_on_self_attention),
    "qk_norm_after_rotary": (Case("TransformerBlock", replace(MODERN, qk_norm=True, rope_theta=100.0), seq=7),
                             None, qk_norm_after_rotary),
    # Gemma's RMSNorm read as LLaMA's: w where 1 + w was meant (every norm: QK-norm and block norms)
    "norm_w_for_1_plus_w": (Case("TransformerBlock", replace(MODERN, norm_weight_offset=1.0, qk_norm=True)),
                            replace(MODERN, qk_norm=True), None),
    # GPT-J's / Cohere's adjacent pairs rotated as halves (rope_interleaved ignored)
    "halves_for_interleaved_rotary": (Case("TransformerBlock", replace(MODERN, rope_theta=100.0, rope_interleaved=True),
                                           seq=7), replace(MODERN, rope_theta=100.0), None),
    # Cohere 2's global layers rotated too (rope_local_only ignored); a block alone is layer 1, local under a
    # pattern, so the global layer is a 2-layer encoder's second
    "rotary_on_the_global_layers": (Case("Encoder", replace(MODERN, causal=True, rope_theta=100.0, sliding_window=3,
                                                            sliding_window_pattern=2, rope_local_only=True),
                                         num_layers=2, seq=7),
                                    replace(MODERN, causal=True, rope_theta=100.0, sliding_window=3,
                                            sliding_window_pattern=2), None),
    # SmolLM3's / Llama 4's NoPE layers rotated (nope_layers ignored); a block alone is layer 1 (index 0)
    "rotary_on_the_nope_layers": (Case("TransformerBlock", replace(MODERN, causal=True, rope_theta=100.0,
                                                                   nope_layers=(0,)), seq=7),
                                  replace(MODERN, causal=True, rope_theta=100.0), None),
    # Llama 4's query temperature one slot early (HF's + 1 left out)
    "query_temperature_off_by_one": (Case("TransformerBlock", replace(MODERN, causal=True, rope_theta=100.0,
                                                                      nope_layers=(0,), query_temperature_floor=2.0,
                                                                      query_temperature_scale=0.5), seq=7),
                                     None, temperature_from_slot_zero),
    # Llama 4's L2 QK-norm in its NoPE layers too (HF builds it in the rotary layers alone)
    "l2_qk_norm_on_the_nope_layers": (Case("TransformerBlock", replace(MODERN, causal=True, rope_theta=100.0,
                                                                       nope_layers=(0,), qk_l2_norm=True), seq=7),
                                      None, l2_norm_on_the_nope_layers),
    # Llama 4's chunked attention: the chunk one key longer; the chunks from slot 0 where a left-padded row's start
    # at its first real key; a sliding window of the chunk's size; the NoPE layer chunked too (unchunked_layers lost)
    "chunk_size_off_by_one": (Case("TransformerBlock", replace(MODERN, causal=True, attention_chunk_size=2), seq=6),
                              replace(MODERN, causal=True, attention_chunk_size=3), None),
    "chunks_from_slot_zero": (Case("TransformerBlock", replace(MODERN, causal=True, attention_chunk_size=2), seq=6,
                                   key_mask=True, left_pad=1), None, _attention_as(_ChunksFromSlotZero)),
    "chunk_as_sliding_window": (Case("TransformerBlock", replace(MODERN, causal=True, attention_chunk_size=2), seq=6),
                                None, _attention_as(_ChunkAsWindow)),
    "unchunked_layers_chunked": (Case("Encoder", replace(MODERN, causal=True, attention_chunk_size=2,
                                                         unchunked_layers=(1,)), num_layers=2, seq=6),
                                 replace(MODERN, causal=True, attention_chunk_size=2), None),
    "rotary_on_the_wrong_part": (Case("TransformerBlock", replace(MODERN, rope_theta=100.0, head_dim=8,
                                                                  partial_rotary_factor=0.5), seq=7),
                                 None, rotary_on_last_dims),
    "sequential_for_parallel_residual": (Case("TransformerBlock", replace(MODERN, parallel_residual="two_norms")),
                                         replace(MODERN), None),
    "per_head_for_projection_qk_norm": (Case("TransformerBlock", replace(MODERN, num_kv_heads=2, qk_norm=True,
                                                                         qk_norm_over="projection")),
                                        None, qk_norm_per_head),
    "pre_norm_for_out_norm": (Case("TransformerBlock", replace(MODERN, norm="out")), replace(MODERN, norm="pre"), None),
    "softcap_after_the_mask": (Case("TransformerBlock", replace(MODERN, causal=True, attn_logit_softcapping=1.0)),
                               None, softcap_after_mask),
    # scaled rotary: yarn's factor on cos and sin forgotten, longrope's short factors kept past the
    # original length, dynamic NTK's base left as it is, llama3 read as a plain linear stretch
    "yarn_without_its_attention_factor": (Case("TransformerBlock", replace(MODERN, rope_theta=100.0,
                                                                           rope_scaling=_YARN)),
                                          replace(MODERN, rope_theta=100.0, rope_scaling={**_YARN,
                                                                                          "attention_factor": 1.0}),
                                          None),
    "longrope_short_factors_past_the_original_length": (
        Case("TransformerBlock", replace(MODERN, rope_theta=100.0, rope_scaling=_LONGROPE), seq=6),
        replace(MODERN, rope_theta=100.0, rope_scaling={**_LONGROPE, "long_factor": _LONGROPE["short_factor"]}),
        None),
    "dynamic_base_never_grows": (Case("TransformerBlock", replace(MODERN, rope_theta=100.0, rope_scaling=_DYNAMIC),
                                      seq=7), replace(MODERN, rope_theta=100.0), None),
    "llama3_as_linear": (Case("TransformerBlock", replace(MODERN, rope_theta=100.0, head_dim=8, rope_scaling=_LLAMA3),
                              seq=6),
                         replace(MODERN, rope_theta=100.0, head_dim=8, rope_scaling={"rope_type": "linear",
                                                                                     "factor": 4.0}), None),
    "window_off_by_one": (Case("TransformerBlock", replace(MODERN, causal=True, sliding_window=2), seq=6),
                          replace(MODERN, causal=True, sliding_window=3), None),  # i - W <= j where i - W < j
    # ModernBERT: its bidirectional window bounded on one side only; HF's |i - j| <= local_attention // 2 read
    # as < (the window one key short on each side); the global layer of each period taken last (Gemma's
    # phase); layer 0's identity attn_norm applied as the other layers' LayerNorm
    "bidirectional_window_one_sided": (Case("TransformerBlock", replace(MODERN, sliding_window=2), seq=6), None,
                                       _attention_as(_WindowPastOnly)),
    "bidirectional_window_off_by_one": (Case("TransformerBlock", replace(MODERN, sliding_window=3), seq=6),
                                        replace(MODERN, sliding_window=2), None),
    "global_layer_last_in_each_period": (
        Case("TransformerBlock", replace(MODERN, rope_theta=100.0, sliding_window=2, sliding_window_pattern=2,
                                         pattern_global_first=True), seq=6),
        replace(MODERN, rope_theta=100.0, sliding_window=2, sliding_window_pattern=2), None),
    "first_attn_norm_applied": (Case("TransformerBlock", replace(MODERN, first_attn_norm=False)), MODERN, None),
    # LLaMA's mlp_bias read from attention_bias (MLP without its biases); StableLM's LayerNorm biases
    # dropped with the linear maps' (bias=False read for every bias)
    "mlp_bias_dropped": (Case("TransformerBlock", replace(BASE, bias=False, mlp_bias=True)), None,
                         _zero_biases("linear1", "linear2")),
    "norm_bias_dropped": (Case("TransformerBlock", replace(BASE, norm="pre", bias=False, norm_bias=True)), None,
                          _zero_biases("norm1", "norm2")),
    "dyt_alpha_after_tanh": (DYT, None, _dyt_as(_DyTAlphaAfterTanh)),
    "dyt_without_alpha": (DYT, None, _dyt_as(_DyTWithoutAlpha)),
    "layernorm_scaling_by_1_over_l": (LN_SCALING, None, _stack_layers_as(_ScaledByOneOverL)),
    "layernorm_scaling_from_0": (LN_SCALING, None, _stack_layers_as(_LayersFromZero)),
    # DeepSeek: rotary on the queries' non-rotary part; V3's rotary read as rotate-half where rope_interleave
    # pairs adjacent dims; V3's correction bias in the weights as well as in the choice
    "mla_rotary_on_the_non_rotary_part": (Case("TransformerBlock", MLA, seq=6), None,
                                          _attention_as(_RotaryOnTheNonRotaryPart)),
    "mla_rope_interleave_ignored": (Case("TransformerBlock", replace(MLA, rope_interleave=True), seq=6), MLA, None),
    "mla_yarn_mscale_once": (Case("TransformerBlock", replace(MLA, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "mscale": 1.0,
        "mscale_all_dim": 0.7}), seq=6), None, mscale_once),
    "correction_bias_in_the_weights": (Case("TransformerBlock", DEEPSEEK_V3, seq=6), None,
                                       _experts_as(_CorrectionBiasInWeights)),
    # Granite's residual_multiplier dropped: x + F(x) for x + m * F(x)
    "residual_multiplier_ignored": (RESIDUAL_X, replace(RESIDUAL_X.cfg, residual_multiplier=1.0), None),
}

# Llama 4's experts: the router's sigmoid weight on the expert's output where Llama 4 scales its input; the
# top-1 weighted by the softmax over every logit where Llama 4 takes the chosen logit's sigmoid
LLAMA4_MOE = replace(MOE, num_experts_per_tok=1, norm_topk_prob=False, routing="llama4", routing_weights_on="input",
                     shared_expert_d_ff=8, shared_expert_gate=False)
MUTATIONS.update({
    "routing_weights_on_the_output": (Case("TransformerBlock", LLAMA4_MOE),
                                      replace(LLAMA4_MOE, routing_weights_on="output"), None),
    "llama4_weights_by_softmax": (Case("TransformerBlock", LLAMA4_MOE), replace(LLAMA4_MOE, routing="softmax"), None),
})
