"""More transformers models ported by hand to Flax NNX, written the way a porter writes them
and not tuned to the checker (parity_tests/port/test_port_zoo.py runs them): each port is
correct by default and has switches that plant one mistake.

    transformers model   port                 mistakes it can plant
    GPTJModel            FlaxGPTJModel        rotary="halves" (GPT-J pairs neighbours), sequential (its parallel
                                              block run sequentially), pos_offset=1, eps
    PhiModel             FlaxPhiModel         rotary="neighbours", sequential, exact_gelu
    FalconModel          FlaxFalconModel      rotary="neighbours", one_norm (ln_attn fed to the MLP), eps
    MistralModel         hf_zoo's LLaMA port  gqa="tile", norm="one-plus", act="gelu", ...
    Gemma2Model          FlaxGemma2Model      plain_w (w for 1 + w), head_dim_scale (for query_pre_attn_scalar),
                                              exact_gelu; soft-capped logits, eager attention
    ViTModel             FlaxViTModel         tanh_gelu, eps, parallel (a sequential layer run in parallel)
    WhisperEncoder       FlaxWhisperEncoder   causal_conv, tanh_gelu, eps
    T5EncoderModel       FlaxT5EncoderModel   scaled (1/sqrt(d_kv) where T5 has none), gelu (for ReLU), eps
    Qwen3Model           FlaxQwen3Model       no_qk_norm, eps, act="gelu"
    GPTBigCodeModel      FlaxGPTBigCodeModel  scale="d", causal_offset, exact_gelu (multi-query attention)

GPT-J's sin / cos table is a float32 buffer torch computes in `__init__`; the port computes its
own in float64 (that is correct): the checker must name torch's table as a float32 island.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from .hf_zoo import attend, causal, merge_heads, padding, rotate_half, rotate_pairs, split_heads


def sincos(positions: jax.Array, dim: int, theta: float = 10000.0) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) of the rotary angles, each (T, dim // 2), for positions (T,)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2) / dim))
    angles = positions[:, None].astype(inv_freq.dtype) * inv_freq[None, :]
    return jnp.sin(angles), jnp.cos(angles)


def rotate(x: jax.Array, sin: jax.Array, cos: jax.Array, pairing: str) -> jax.Array:
    """x (..., T, r) rotated by (sin, cos) of (T, r // 2): pairing "neighbours" rotates
    (2i, 2i + 1) (GPT-J, CodeGen), "halves" rotates (i, i + r/2) (LLaMA, NeoX, Phi)."""
    if pairing == "neighbours":
        s, c = jnp.repeat(sin, 2, axis=-1), jnp.repeat(cos, 2, axis=-1)
        return x * c + rotate_pairs(x) * s
    s, c = jnp.concatenate([sin, sin], -1), jnp.concatenate([cos, cos], -1)
    return x * c + rotate_half(x) * s


def partial_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array, pairing: str) -> jax.Array:
    """x (B, H, T, D): its first 2 * sin.shape[-1] features rotated, the rest passed."""
    r = 2 * sin.shape[-1]
    return jnp.concatenate([rotate(x[..., :r], sin, cos, pairing), x[..., r:]], axis=-1)


# ----------------------------------------------------------------------------------------
# GPT-J: parallel block (one ln_1 for both branches), rotary on neighbours, partial
# ----------------------------------------------------------------------------------------


class FlaxGPTJRotary(nnx.Module):
    def __init__(self, dim: int, offset: int):
        self.dim, self.offset = dim, offset

    def __call__(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:  # (T,) -> (T, dim/2) twice
        return sincos(positions + self.offset, self.dim)


class FlaxGPTJAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, pairing: str):
        e = cfg.n_embd
        self.n_head = cfg.n_head
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nnx.Linear(e, e, use_bias=False, rngs=rngs)
                                                                for _ in range(4))
        self.pairing = pairing

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        q, k, v = (split_heads(f(x), self.n_head) for f in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (partial_rotary(a, sin, cos, self.pairing) for a in (q, k))
        return self.out_proj(merge_heads(attend(q, k, v, keep, q.shape[-1] ** -0.5)))


class FlaxGPTJMLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.fc_in = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, rngs=rngs)
        self.fc_out = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x), approximate=True))  # gelu_new


class FlaxGPTJBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, eps: float, pairing: str, sequential: bool):
        self.ln_1 = nnx.LayerNorm(cfg.n_embd, epsilon=eps, rngs=rngs)
        self.attn = FlaxGPTJAttention(cfg, rngs=rngs, pairing=pairing)
        self.mlp = FlaxGPTJMLP(cfg, rngs=rngs)
        self.sequential = sequential

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        h = self.ln_1(x)
        if self.sequential:
            x = x + self.attn(h, sin, cos, keep)
            return x + self.mlp(self.ln_1(x))
        return x + self.attn(h, sin, cos, keep) + self.mlp(h)


class FlaxGPTJModel(nnx.Module):
    """GPTJModel's port (its call: input_ids, attention_mask). mistakes: rotary="halves",
    sequential, pos_offset=1, eps."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, rotary: str = "neighbours", sequential: bool = False,
                 pos_offset: int = 0, eps: float | None = None):
        eps = cfg.layer_norm_epsilon if eps is None else eps
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
        self.rotary_emb = FlaxGPTJRotary(cfg.rotary_dim, pos_offset)
        self.h = nnx.List([FlaxGPTJBlock(cfg, rngs=rngs, eps=eps, pairing=rotary, sequential=sequential)
                           for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.n_embd, epsilon=eps, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        t = input_ids.shape[1]
        x = self.wte(input_ids)
        sin, cos = self.rotary_emb(jnp.arange(t))
        keep = causal(t) if attention_mask is None else causal(t) & padding(attention_mask)
        for block in self.h:
            x = block(x, sin, cos, keep)
        return self.ln_f(x)


# ----------------------------------------------------------------------------------------
# Phi: parallel block, partial rotary on halves, biases everywhere
# ----------------------------------------------------------------------------------------


def rope_attention(x: jax.Array, projs: tuple, n_heads: int, n_kv: int, sin: jax.Array, cos: jax.Array,
                   pairing: str, keep: jax.Array, scale: float | None = None) -> jax.Array:
    """LLaMA-style attention before its output projection: q, k, v projected, split into
    (B, heads, T, D), rotated on their first 2 * sin.shape[-1] features, kv heads repeated;
    (B, T, heads * D)."""
    q = split_heads(projs[0](x), n_heads)
    k, v = split_heads(projs[1](x), n_kv), split_heads(projs[2](x), n_kv)
    q, k = (partial_rotary(a, sin, cos, pairing) for a in (q, k))
    k, v = jnp.repeat(k, n_heads // n_kv, axis=1), jnp.repeat(v, n_heads // n_kv, axis=1)
    return merge_heads(attend(q, k, v, keep, q.shape[-1] ** -0.5 if scale is None else scale))


class FlaxPhiAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, pairing: str):
        h, self.n_heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.dense = (nnx.Linear(h, h, rngs=rngs) for _ in range(4))
        self.pairing = pairing

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        return self.dense(rope_attention(x, (self.q_proj, self.k_proj, self.v_proj), self.n_heads, self.n_heads,
                                         sin, cos, self.pairing, keep))


class FlaxMLP(nnx.Module):
    """fc1, an activation, fc2 (Phi's, ViT's, Whisper's)."""

    def __init__(self, d: int, d_ff: int, *, rngs: nnx.Rngs, tanh_gelu: bool):
        self.fc1, self.fc2 = nnx.Linear(d, d_ff, rngs=rngs), nnx.Linear(d_ff, d, rngs=rngs)
        self.tanh_gelu = tanh_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=self.tanh_gelu))


class FlaxPhiLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, pairing: str, sequential: bool, exact_gelu: bool):
        self.input_layernorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.self_attn = FlaxPhiAttention(cfg, rngs=rngs, pairing=pairing)
        self.mlp = FlaxMLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, tanh_gelu=not exact_gelu)
        self.sequential = sequential

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        h = self.input_layernorm(x)
        if self.sequential:
            x = x + self.self_attn(h, sin, cos, keep)
            return x + self.mlp(self.input_layernorm(x))
        return x + self.self_attn(h, sin, cos, keep) + self.mlp(h)


class FlaxPhiModel(nnx.Module):
    """PhiModel's port. mistakes: rotary="neighbours", sequential, exact_gelu."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, rotary: str = "halves", sequential: bool = False,
                 exact_gelu: bool = False):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([FlaxPhiLayer(cfg, rngs=rngs, pairing=rotary, sequential=sequential,
                                             exact_gelu=exact_gelu) for _ in range(cfg.num_hidden_layers)])
        self.final_layernorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, rngs=rngs)
        head = cfg.hidden_size // cfg.num_attention_heads
        self.rotary_dim = int(head * cfg.rope_parameters["partial_rotary_factor"])
        self.theta = cfg.rope_parameters["rope_theta"]

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        t = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        sin, cos = sincos(jnp.arange(t), self.rotary_dim, self.theta)
        keep = causal(t) if attention_mask is None else causal(t) & padding(attention_mask)
        for layer in self.layers:
            x = layer(x, sin, cos, keep)
        return self.final_layernorm(x)


# ----------------------------------------------------------------------------------------
# Falcon (new decoder architecture): fused grouped qkv, ln_attn and ln_mlp, parallel
# ----------------------------------------------------------------------------------------


class FlaxFalconAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, pairing: str):
        h = cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, h // cfg.num_attention_heads
        self.query_key_value = nnx.Linear(h, (self.n_heads + 2 * self.n_kv) * self.head_dim, use_bias=cfg.bias,
                                          rngs=rngs)
        self.dense = nnx.Linear(h, h, use_bias=cfg.bias, rngs=rngs)
        self.pairing = pairing

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        g = self.n_heads // self.n_kv
        qkv = self.query_key_value(x).reshape(b, t, self.n_kv, g + 2, self.head_dim)  # per group: g q, 1 k, 1 v
        q = qkv[:, :, :, :g].reshape(b, t, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k, v = (jnp.repeat(qkv[:, :, :, i], g, axis=2).transpose(0, 2, 1, 3) for i in (g, g + 1))
        q, k = (partial_rotary(a, sin, cos, self.pairing) for a in (q, k))
        return self.dense(merge_heads(attend(q, k, v, keep, self.head_dim ** -0.5)))


class FlaxFalconMLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.dense_h_to_4h = nnx.Linear(cfg.hidden_size, cfg.ffn_hidden_size, use_bias=cfg.bias, rngs=rngs)
        self.dense_4h_to_h = nnx.Linear(cfg.ffn_hidden_size, cfg.hidden_size, use_bias=cfg.bias, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dense_4h_to_h(jax.nn.gelu(self.dense_h_to_4h(x), approximate=False))


class FlaxFalconLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, pairing: str, one_norm: bool, eps: float):
        self.ln_attn = nnx.LayerNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.self_attention = FlaxFalconAttention(cfg, rngs=rngs, pairing=pairing)
        self.mlp = FlaxFalconMLP(cfg, rngs=rngs)
        self.one_norm = one_norm

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        h = self.ln_attn(x)
        return x + self.self_attention(h, sin, cos, keep) + self.mlp(h if self.one_norm else self.ln_mlp(x))


class FlaxFalconModel(nnx.Module):
    """FalconModel's port (new_decoder_architecture). mistakes: rotary="neighbours",
    one_norm (ln_attn's output fed to the MLP too), eps."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, rotary: str = "halves", one_norm: bool = False,
                 eps: float | None = None):
        eps = cfg.layer_norm_epsilon if eps is None else eps
        self.word_embeddings = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.h = nnx.List([FlaxFalconLayer(cfg, rngs=rngs, pairing=rotary, one_norm=one_norm, eps=eps)
                           for _ in range(cfg.num_hidden_layers)])
        self.ln_f = nnx.LayerNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.head_dim, self.theta = cfg.hidden_size // cfg.num_attention_heads, cfg.rope_parameters["rope_theta"]

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        t = input_ids.shape[1]
        x = self.word_embeddings(input_ids)
        sin, cos = sincos(jnp.arange(t), self.head_dim, self.theta)
        keep = causal(t) if attention_mask is None else causal(t) & padding(attention_mask)
        for layer in self.h:
            x = layer(x, sin, cos, keep)
        return self.ln_f(x)


# ----------------------------------------------------------------------------------------
# Gemma 2: (1 + w) norms around both branches, query_pre_attn_scalar, soft-capped logits
# ----------------------------------------------------------------------------------------


class GemmaNorm(nnx.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), w stored from 0. mistake: plain_w (scales by w)."""

    def __init__(self, dim: int, eps: float, plain_w: bool):
        self.weight = nnx.Param(jnp.zeros((dim,)))
        self.eps, self.plain_w = eps, plain_w

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return y * (self.weight[...] if self.plain_w else 1 + self.weight[...])


class ScaledEmbed(nnx.Embed):
    """Gemma's embedding: the lookup times sqrt(hidden_size) (HF's ScaledWordEmbedding)."""

    def __call__(self, ids: jax.Array) -> jax.Array:
        return super().__call__(ids) * self.features ** 0.5


class FlaxGemma2Attention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, head_dim_scale: bool):
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nnx.Linear(h, self.n_heads * d, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(h, self.n_kv * d, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(h, self.n_kv * d, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(self.n_heads * d, h, use_bias=False, rngs=rngs)
        self.scale = d ** -0.5 if head_dim_scale else cfg.query_pre_attn_scalar ** -0.5
        self.cap = cfg.attn_logit_softcapping

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        q = split_heads(self.q_proj(x), self.n_heads)
        k, v = split_heads(self.k_proj(x), self.n_kv), split_heads(self.v_proj(x), self.n_kv)
        q, k = (partial_rotary(a, sin, cos, "halves") for a in (q, k))
        k, v = jnp.repeat(k, self.n_heads // self.n_kv, axis=1), jnp.repeat(v, self.n_heads // self.n_kv, axis=1)
        att = jnp.tanh((q @ k.swapaxes(-1, -2)) * self.scale / self.cap) * self.cap
        att = jnp.where(keep, att, jnp.finfo(att.dtype).min)
        return self.o_proj(merge_heads(jax.nn.softmax(att, axis=-1) @ v))


class FlaxGemma2MLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, exact_gelu: bool):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nnx.Linear(h, i, use_bias=False, rngs=rngs), nnx.Linear(h, i, use_bias=False,
                                                                                                 rngs=rngs)
        self.down_proj = nnx.Linear(i, h, use_bias=False, rngs=rngs)
        self.exact_gelu = exact_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=not self.exact_gelu) * self.up_proj(x))


class FlaxGemma2Layer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, plain_w: bool, head_dim_scale: bool, exact_gelu: bool):
        def norm():
            return GemmaNorm(cfg.hidden_size, cfg.rms_norm_eps, plain_w)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = FlaxGemma2Attention(cfg, rngs=rngs, head_dim_scale=head_dim_scale)
        self.mlp = FlaxGemma2MLP(cfg, rngs=rngs, exact_gelu=exact_gelu)

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), sin, cos, keep))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class FlaxGemma2Model(nnx.Module):
    """Gemma2Model's port (eager attention: soft-capped logits). mistakes: plain_w (norms
    scale by w), head_dim_scale (1/sqrt(head_dim) for 1/sqrt(query_pre_attn_scalar)),
    exact_gelu."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, plain_w: bool = False, head_dim_scale: bool = False,
                 exact_gelu: bool = False):
        self.embed_tokens = ScaledEmbed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([FlaxGemma2Layer(cfg, rngs=rngs, plain_w=plain_w, head_dim_scale=head_dim_scale,
                                                exact_gelu=exact_gelu) for _ in range(cfg.num_hidden_layers)])
        self.norm = GemmaNorm(cfg.hidden_size, cfg.rms_norm_eps, plain_w)
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_parameters["rope_theta"]

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        t = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        sin, cos = sincos(jnp.arange(t), self.head_dim, self.theta)
        keep = causal(t) if attention_mask is None else causal(t) & padding(attention_mask)
        for layer in self.layers:
            x = layer(x, sin, cos, keep)
        return self.norm(x)


# ----------------------------------------------------------------------------------------
# ViT: patches by a strided conv, a CLS token, pre-LN layers; pixel_values (B, C, H, W)
# ----------------------------------------------------------------------------------------


class FlaxViTAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        h, self.n_heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nnx.Linear(h, h, rngs=rngs) for _ in range(4))

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (split_heads(f(x), self.n_heads) for f in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(merge_heads(attend(q, k, v, None, q.shape[-1] ** -0.5)))


class FlaxViTLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, eps: float, tanh_gelu: bool, parallel: bool):
        self.layernorm_before = nnx.LayerNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.attention = FlaxViTAttention(cfg, rngs=rngs)
        self.layernorm_after = nnx.LayerNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.mlp = FlaxMLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, tanh_gelu=tanh_gelu)
        self.parallel = parallel

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.attention(self.layernorm_before(x))
        return h + self.mlp(self.layernorm_after(x if self.parallel else h))


class FlaxViTPatches(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        p = cfg.patch_size
        self.projection = nnx.Conv(cfg.num_channels, cfg.hidden_size, (p, p), strides=(p, p), padding="VALID",
                                   rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:  # (B, C, H, W) -> (B, patches, hidden)
        x = self.projection(pixel_values.transpose(0, 2, 3, 1))
        return x.reshape(x.shape[0], -1, x.shape[-1])


class FlaxViTPooler(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(cfg.hidden_size, cfg.hidden_size, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.dense(x[:, 0]))


class FlaxViTEmbeddings(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        h, n = cfg.hidden_size, (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embeddings = FlaxViTPatches(cfg, rngs=rngs)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, h)))
        self.position_embeddings = nnx.Param(jnp.zeros((1, n + 1, h)))

    def __call__(self, pixel_values: jax.Array) -> jax.Array:  # (B, C, H, W) as HF's
        x = self.patch_embeddings(pixel_values)
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1]))
        return jnp.concatenate([cls, x], axis=1) + self.position_embeddings[...]


class FlaxViTModel(nnx.Module):
    """ViTModel's port: (sequence output, pooled output). mistakes: tanh_gelu, eps, parallel
    (a sequential layer run in parallel)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, tanh_gelu: bool = False, eps: float | None = None,
                 parallel: bool = False):
        eps = cfg.layer_norm_eps if eps is None else eps
        self.embeddings = FlaxViTEmbeddings(cfg, rngs=rngs)
        self.layers = nnx.List([FlaxViTLayer(cfg, rngs=rngs, eps=eps, tanh_gelu=tanh_gelu, parallel=parallel)
                                for _ in range(cfg.num_hidden_layers)])
        self.layernorm = nnx.LayerNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.pooler = FlaxViTPooler(cfg, rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = self.embeddings(pixel_values)
        for layer in self.layers:
            x = layer(x)
        x = self.layernorm(x)
        return x, self.pooler(x)


# ----------------------------------------------------------------------------------------
# Whisper's encoder: two convolutions over (B, mel, T) and GELU, learned positions
# ----------------------------------------------------------------------------------------


class FlaxWhisperAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, self.n_heads = cfg.d_model, cfg.encoder_attention_heads
        self.q_proj, self.v_proj, self.out_proj = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.k_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (split_heads(f(x), self.n_heads) for f in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(merge_heads(attend(q, k, v, None, q.shape[-1] ** -0.5)))


class FlaxWhisperLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, eps: float, tanh_gelu: bool):
        d = cfg.d_model
        self.self_attn_layer_norm = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.self_attn = FlaxWhisperAttention(cfg, rngs=rngs)
        self.final_layer_norm = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, cfg.encoder_ffn_dim, rngs=rngs), nnx.Linear(cfg.encoder_ffn_dim, d,
                                                                                       rngs=rngs)
        self.tanh_gelu = tanh_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.final_layer_norm(x)), approximate=self.tanh_gelu))


class FlaxWhisperEncoder(nnx.Module):
    """WhisperEncoder's port; input_features (B, mel, 2 * max_source_positions) as HF's.
    mistakes: causal_conv (conv1 padded (2, 0)), tanh_gelu (the layers'), eps."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, causal_conv: bool = False, tanh_gelu: bool = False,
                 eps: float = 1e-5):
        d = cfg.d_model
        self.conv1 = nnx.Conv(cfg.num_mel_bins, d, (3,), padding=((2, 0),) if causal_conv else ((1, 1),), rngs=rngs)
        self.conv2 = nnx.Conv(d, d, (3,), strides=(2,), padding=((1, 1),), rngs=rngs)
        self.embed_positions = nnx.Embed(cfg.max_source_positions, d, rngs=rngs)
        self.layers = nnx.List([FlaxWhisperLayer(cfg, rngs=rngs, eps=eps, tanh_gelu=tanh_gelu)
                                for _ in range(cfg.encoder_layers)])
        self.layer_norm = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)

    def __call__(self, input_features: jax.Array) -> jax.Array:
        x = jax.nn.gelu(self.conv1(input_features.transpose(0, 2, 1)), approximate=False)  # (B, T, d)
        x = jax.nn.gelu(self.conv2(x), approximate=False)
        x = x + self.embed_positions(jnp.arange(x.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


# ----------------------------------------------------------------------------------------
# T5's encoder: RMS norms, no softmax scale, relative position buckets in the first block
# ----------------------------------------------------------------------------------------


def t5_buckets(t: int, num_buckets: int, max_distance: int) -> jax.Array:
    """(T, T) bidirectional relative position buckets of key - query (HF's
    _relative_position_bucket)."""
    rel = jnp.arange(t)[None, :] - jnp.arange(t)[:, None]
    half = num_buckets // 2
    out = (rel > 0).astype(jnp.int32) * half
    n = jnp.abs(rel)
    exact = half // 2
    large = exact + (jnp.log(jnp.maximum(n, 1) / exact) / np.log(max_distance / exact) * (half - exact)).astype(
        jnp.int32)
    return out + jnp.where(n < exact, n, jnp.minimum(large, half - 1))


class FlaxT5Attention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, bias: bool, scaled: bool):
        d, inner = cfg.d_model, cfg.num_heads * cfg.d_kv
        self.n_heads = cfg.num_heads
        self.q, self.k, self.v = (nnx.Linear(d, inner, use_bias=False, rngs=rngs) for _ in range(3))
        self.o = nnx.Linear(inner, d, use_bias=False, rngs=rngs)
        if bias:
            self.relative_attention_bias = nnx.Embed(cfg.relative_attention_num_buckets, cfg.num_heads, rngs=rngs)
        self.buckets, self.max_distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        self.scaled = scaled

    def position_bias(self, t: int) -> jax.Array:  # (1, H, T, T)
        return self.relative_attention_bias(t5_buckets(t, self.buckets, self.max_distance)).transpose(2, 0, 1)[None]

    def __call__(self, x: jax.Array, bias: jax.Array, keep: jax.Array | None) -> jax.Array:
        q, k, v = (split_heads(f(x), self.n_heads) for f in (self.q, self.k, self.v))
        att = q @ k.swapaxes(-1, -2) * (q.shape[-1] ** -0.5 if self.scaled else 1.0) + bias
        if keep is not None:
            att = jnp.where(keep, att, jnp.finfo(att.dtype).min)
        return self.o(merge_heads(jax.nn.softmax(att, axis=-1) @ v))


class FlaxT5SelfAttentionLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, bias: bool, scaled: bool, eps: float):
        self.SelfAttention = FlaxT5Attention(cfg, rngs=rngs, bias=bias, scaled=scaled)
        self.layer_norm = nnx.RMSNorm(cfg.d_model, epsilon=eps, rngs=rngs)

    def __call__(self, x: jax.Array, bias: jax.Array, keep: jax.Array | None) -> jax.Array:
        return x + self.SelfAttention(self.layer_norm(x), bias, keep)


class FlaxT5DenseReluDense(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, gelu: bool):
        self.wi = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, rngs=rngs)
        self.gelu = gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wo((jax.nn.gelu if self.gelu else jax.nn.relu)(self.wi(x)))


class FlaxT5FFLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, gelu: bool, eps: float):
        self.DenseReluDense = FlaxT5DenseReluDense(cfg, rngs=rngs, gelu=gelu)
        self.layer_norm = nnx.RMSNorm(cfg.d_model, epsilon=eps, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.DenseReluDense(self.layer_norm(x))


class FlaxT5Block(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, first: bool, scaled: bool, gelu: bool, eps: float):
        self.layer = nnx.List([FlaxT5SelfAttentionLayer(cfg, rngs=rngs, bias=first, scaled=scaled, eps=eps),
                               FlaxT5FFLayer(cfg, rngs=rngs, gelu=gelu, eps=eps)])

    def __call__(self, x: jax.Array, bias: jax.Array, keep: jax.Array | None) -> jax.Array:
        return self.layer[1](self.layer[0](x, bias, keep))


class FlaxT5Stack(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, scaled: bool, gelu: bool, eps: float):
        self.block = nnx.List([FlaxT5Block(cfg, rngs=rngs, first=i == 0, scaled=scaled, gelu=gelu, eps=eps)
                               for i in range(cfg.num_layers)])
        self.final_layer_norm = nnx.RMSNorm(cfg.d_model, epsilon=eps, rngs=rngs)

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        bias = self.block[0].layer[0].SelfAttention.position_bias(x.shape[1])  # shared by every block
        for block in self.block:
            x = block(x, bias, keep)
        return self.final_layer_norm(x)


class FlaxT5EncoderModel(nnx.Module):
    """T5EncoderModel's port. mistakes: scaled (1/sqrt(d_kv) on the logits), gelu (for ReLU),
    eps."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, scaled: bool = False, gelu: bool = False, eps: float | None = None):
        eps = cfg.layer_norm_epsilon if eps is None else eps
        self.shared = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.encoder = FlaxT5Stack(cfg, rngs=rngs, scaled=scaled, gelu=gelu, eps=eps)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        return self.encoder(self.shared(input_ids), padding(attention_mask))


# ----------------------------------------------------------------------------------------
# Qwen3: LLaMA's layers with an RMSNorm on each head's queries and keys
# ----------------------------------------------------------------------------------------


class FlaxQwen3Attention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, qk_norm: bool, eps: float):
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nnx.Linear(h, self.n_heads * d, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(h, self.n_kv * d, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(h, self.n_kv * d, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(self.n_heads * d, h, use_bias=False, rngs=rngs)
        self.q_norm, self.k_norm = (nnx.RMSNorm(d, epsilon=eps, rngs=rngs) for _ in range(2))
        self.qk_norm = qk_norm

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, -1)
        k = self.k_proj(x).reshape(b, t, self.n_kv, -1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = split_heads(self.v_proj(x), self.n_kv)
        q, k = (partial_rotary(a, sin, cos, "halves") for a in (q, k))
        k, v = jnp.repeat(k, self.n_heads // self.n_kv, axis=1), jnp.repeat(v, self.n_heads // self.n_kv, axis=1)
        return self.o_proj(merge_heads(attend(q, k, v, keep, q.shape[-1] ** -0.5)))


class FlaxQwen3Layer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, qk_norm: bool, eps: float, act: str):
        from .hf_zoo import FlaxLlamaMLP

        self.input_layernorm = nnx.RMSNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.self_attn = FlaxQwen3Attention(cfg, rngs=rngs, qk_norm=qk_norm, eps=eps)
        self.post_attention_layernorm = nnx.RMSNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.mlp = FlaxLlamaMLP(cfg, rngs=rngs, act=act)

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, keep: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), sin, cos, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class FlaxQwen3Model(nnx.Module):
    """Qwen3Model's port. mistakes: no_qk_norm (q_norm / k_norm held, never called), eps,
    act="gelu"."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, no_qk_norm: bool = False, eps: float | None = None,
                 act: str = "silu"):
        eps = cfg.rms_norm_eps if eps is None else eps
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([FlaxQwen3Layer(cfg, rngs=rngs, qk_norm=not no_qk_norm, eps=eps, act=act)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = nnx.RMSNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_parameters["rope_theta"]

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        t = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        sin, cos = sincos(jnp.arange(t), self.head_dim, self.theta)
        keep = causal(t) if attention_mask is None else causal(t) & padding(attention_mask)
        for layer in self.layers:
            x = layer(x, sin, cos, keep)
        return self.norm(x)


# ----------------------------------------------------------------------------------------
# GPT-BigCode: GPT-2's layout with nn.Linear and one key / value head (multi-query)
# ----------------------------------------------------------------------------------------


class FlaxBigCodeAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, scale: str, causal_offset: int):
        e = cfg.n_embd
        self.n_head, self.head_dim = cfg.n_head, e // cfg.n_head
        self.c_attn = nnx.Linear(e, e + 2 * self.head_dim, rngs=rngs)  # queries, one key head, one value head
        self.c_proj = nnx.Linear(e, e, rngs=rngs)
        self.scale, self.causal_offset = scale, causal_offset

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        b, t, e = x.shape
        q, k, v = jnp.split(self.c_attn(x), [e, e + self.head_dim], axis=-1)
        q = split_heads(q, self.n_head)
        k, v = (jnp.broadcast_to(a[:, None], (b, self.n_head, t, self.head_dim)) for a in (k, v))
        mask = causal(t, self.causal_offset)
        scale = 1 / self.head_dim if self.scale == "d" else self.head_dim ** -0.5
        return self.c_proj(merge_heads(attend(q, k, v, mask if keep is None else mask & keep, scale)))


class FlaxBigCodeMLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, exact_gelu: bool):
        self.c_fc = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, rngs=rngs)
        self.c_proj = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, rngs=rngs)
        self.exact_gelu = exact_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=not self.exact_gelu))  # gelu_pytorch_tanh


class FlaxBigCodeBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, scale: str, causal_offset: int, exact_gelu: bool):
        self.ln_1 = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.attn = FlaxBigCodeAttention(cfg, rngs=rngs, scale=scale, causal_offset=causal_offset)
        self.ln_2 = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.mlp = FlaxBigCodeMLP(cfg, rngs=rngs, exact_gelu=exact_gelu)

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class FlaxGPTBigCodeModel(nnx.Module):
    """GPTBigCodeModel's port (multi-query). mistakes: scale="d", causal_offset=+-1,
    exact_gelu."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, scale: str = "sqrt", causal_offset: int = 0,
                 exact_gelu: bool = False):
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(cfg.n_positions, cfg.n_embd, rngs=rngs)
        self.h = nnx.List([FlaxBigCodeBlock(cfg, rngs=rngs, scale=scale, causal_offset=causal_offset,
                                            exact_gelu=exact_gelu) for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        x = self.wte(input_ids) + self.wpe(jnp.arange(input_ids.shape[1]))
        for block in self.h:
            x = block(x, padding(attention_mask))
        return self.ln_f(x)


# ----------------------------------------------------------------------------------------
# The models, tiny
# ----------------------------------------------------------------------------------------


def config(name: str):
    """A tiny transformers config: d_model 32, 4 heads of 8, 2 layers."""
    import transformers as tr

    common = dict(vocab_size=96, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=4)
    if name == "gptj":
        return tr.GPTJConfig(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                             bos_token_id=1, eos_token_id=2)
    if name == "phi":
        return tr.PhiConfig(**common, intermediate_size=64, partial_rotary_factor=0.5)
    if name == "falcon":
        return tr.FalconConfig(**common, num_kv_heads=2, new_decoder_architecture=True, bias=True,
                               ffn_hidden_size=64)
    if name == "mistral":
        return tr.MistralConfig(**common, intermediate_size=64, num_key_value_heads=2, sliding_window=None)
    if name == "gemma2":
        return tr.Gemma2Config(**common, intermediate_size=64, num_key_value_heads=2, head_dim=8,
                               query_pre_attn_scalar=16, sliding_window=16, attn_logit_softcapping=5.0)
    if name == "vit":
        return tr.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            image_size=8, patch_size=4, num_channels=3)
    if name == "qwen3":
        return tr.Qwen3Config(**common, intermediate_size=64, num_key_value_heads=2, head_dim=8)
    if name == "gpt_bigcode":
        return tr.GPTBigCodeConfig(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, multi_query=True,
                                   bos_token_id=1, eos_token_id=2)
    if name == "whisper":
        return tr.WhisperConfig(num_mel_bins=8, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                                encoder_ffn_dim=64, max_source_positions=8, decoder_layers=1,
                                decoder_attention_heads=4, decoder_ffn_dim=64, vocab_size=96)
    if name == "t5":
        return tr.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                           relative_attention_num_buckets=8, relative_attention_max_distance=16)
    raise KeyError(f"no tiny config for {name!r}; expected one of {sorted(PORTS)}")


def _mistral(cfg, *, rngs: nnx.Rngs, **mistakes) -> nnx.Module:
    """Mistral's port is LLaMA's (hf_zoo.FlaxLlamaModel): the same layers."""
    from .hf_zoo import FlaxLlamaModel

    return FlaxLlamaModel(cfg, rngs=rngs, **mistakes)


PORTS = {"gptj": ("GPTJModel", FlaxGPTJModel), "phi": ("PhiModel", FlaxPhiModel),
         "falcon": ("FalconModel", FlaxFalconModel), "mistral": ("MistralModel", _mistral),
         "gemma2": ("Gemma2Model", FlaxGemma2Model), "vit": ("ViTModel", FlaxViTModel),
         "whisper": ("WhisperEncoder", FlaxWhisperEncoder), "t5": ("T5EncoderModel", FlaxT5EncoderModel),
         "qwen3": ("Qwen3Model", FlaxQwen3Model), "gpt_bigcode": ("GPTBigCodeModel", FlaxGPTBigCodeModel)}
EAGER = {"gemma2"}  # soft-capped logits: transformers runs them eagerly


def torch_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The transformers model `name` with random weights (seeded; every vector moved off its
    init), in eval mode."""
    import transformers as tr

    cfg = config(name)
    cfg._attn_implementation = "eager" if name in EAGER else "sdpa"
    torch.manual_seed(seed)
    if name == "whisper":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        model = WhisperEncoder(cfg).eval()
    else:
        model = getattr(tr, PORTS[name][0])(cfg).eval()
    with torch.no_grad():  # norms (and biases) off their init, so that two norms differ
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def port(name: str, cfg, seed: int = 0, **mistakes) -> nnx.Module:
    """The port of `name` for `cfg`, with `mistakes` planted, in eval mode."""
    model = PORTS[name][1](cfg, rngs=nnx.Rngs(seed), **mistakes)
    model.eval()
    return model


def inputs(name: str, seed: int = 0, batch: int = 2, length: int = 9) -> dict[str, np.ndarray]:
    """input_ids (B, T) and attention_mask (B, T), the second sequence's last 3 tokens padding;
    ViT: pixel_values (B, 3, 8, 8)."""
    rng = np.random.default_rng(seed)
    if name == "vit":
        return {"pixel_values": rng.standard_normal((batch, 3, 8, 8))}
    if name == "whisper":
        return {"input_features": rng.standard_normal((batch, 8, 16))}
    mask = np.ones((batch, length), np.int64)
    mask[-1, -3:] = 0
    return {"input_ids": rng.integers(3, 96, (batch, length)), "attention_mask": mask}


# Factories for the command line (`python -m parity_tests.port TORCH FLAX`) ---------------


def gptj() -> torch.nn.Module:
    """The tiny GPTJModel (its forward: input_ids, cache, attention_mask, ...)."""
    return torch_model("gptj")


def flax_gptj() -> FlaxGPTJModel:
    """Its port (its call: input_ids, attention_mask)."""
    return port("gptj", config("gptj"))
