"""Real transformers models and Flax NNX ports of them written by hand, as a porter writes
them: `nnx.Linear` / `nnx.LayerNorm` / `nnx.RMSNorm` / `nnx.Embed`, HF's module names
mirrored, masks, positions and rotary tables built the port's own way (a (B, 1, 1, T) or
additive mask, positions of shape (T,), (cos, sin) of shape (T, D)). Each port has switches
that plant one known porting mistake. The port checker's tests on real models
(parity_tests/port/test_port_hf.py) use them; they know nothing of the checker's internals.

    transformers model   port               mistakes it can plant
    GPT2Model            FlaxGPT2Model      gelu (exact for gelu_new), scale, causal offset, head split,
                                            final norm skipped, position embeddings dropped or offset;
                                            mask_style="additive": HF's old Flax masks (-1e9, -1e4)
    BertModel            FlaxBertModel      gelu (tanh for exact), eps, padding mask inverted,
                                            token-type embeddings dropped, fast variance;
                                            mask_style="bool": a boolean (B, 1, 1, T) mask
    LlamaModel           FlaxLlamaModel     rotary interleaved (in attention, or the model's tables), GQA
                                            tiled, norm eps outside the root, (1 + w) scale, LayerNorm for
                                            RMSNorm, norm eps, GELU for SiLU, causal offset (mask built
                                            by the model)
    Qwen2Model           FlaxLlamaModel     (biases on q, k, v)
    GPTNeoXModel         FlaxGPTNeoXModel   rotary interleaved or on the head's last features, parallel
                                            residual read as sequential

A copy mistake (GPT-2's square `c_proj` Conv1D transposed) is a rule given to copy_weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

# ----------------------------------------------------------------------------------------
# Shared pieces of a port
# ----------------------------------------------------------------------------------------


def split_heads(x: jax.Array, heads: int, order: str = "heads-first") -> jax.Array:
    """(B, T, heads * D) -> (B, heads, T, D); order="heads-last" reads the features as
    (D, heads) (the mistake)."""
    b, t, e = x.shape
    if order == "heads-last":
        return x.reshape(b, t, e // heads, heads).transpose(0, 3, 1, 2)
    return x.reshape(b, t, heads, e // heads).transpose(0, 2, 1, 3)


def merge_heads(x: jax.Array, order: str = "heads-first") -> jax.Array:
    """(B, heads, T, D) -> (B, T, heads * D); order="heads-last" lays the features out as
    (D, heads) (the mistake undone the same wrong way)."""
    b, h, t, d = x.shape
    if order == "heads-last":
        return x.transpose(0, 2, 3, 1).reshape(b, t, h * d)
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array | None, scale: float,
           upcast: bool = False) -> jax.Array:
    """softmax(q k^T * scale) v over (B, H, T, D); keep: True where a query may attend;
    upcast: the softmax in float32, as HF's eager code does."""
    att = (q @ k.swapaxes(-1, -2)) * scale
    if keep is not None:
        att = jnp.where(keep, att, jnp.finfo(att.dtype).min)
    return jax.nn.softmax(att.astype(jnp.float32) if upcast else att, axis=-1).astype(q.dtype) @ v


def attend_additive(q: jax.Array, k: jax.Array, v: jax.Array, future: jax.Array, bias: jax.Array | None,
                    scale: float, upcast: bool = False) -> jax.Array:
    """HF's old Flax style: future keys filled with -1e9, a (B, 1, 1, T) additive padding bias
    (-1e4 where padding) added; upcast: the softmax in float32, as HF's eager code does."""
    att = jnp.where(future, -1e9, (q @ k.swapaxes(-1, -2)) * scale)
    if bias is not None:
        att = att + bias
    weights = jax.nn.softmax(att.astype(jnp.float32) if upcast else att, axis=-1).astype(q.dtype)
    return weights @ v


def causal(t: int, offset: int = 0) -> jax.Array:
    """(T, T) True on and below the diagonal (offset 1: one future token too; -1: not itself)."""
    return jnp.tril(jnp.ones((t, t), bool), k=offset)


def padding(attention_mask: jax.Array | None) -> jax.Array | None:
    """(B, T) 1 / 0 -> (B, 1, 1, T) True where a key may be attended."""
    return None if attention_mask is None else attention_mask[:, None, None, :].astype(bool)


def rotary(t: int, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each (T, dim), the frequencies in two halves (HF's rotate_half layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2) / dim))
    freqs = jnp.arange(t)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """x (B, H, T, D) rotated on its first cos.shape[-1] features; interleaved: adjacent
    features pair up (GPT-J / Meta's layout: the mistake against HF's checkpoints)."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleaved:
        half = r // 2
        cos_i, sin_i = jnp.repeat(cos[:, :half], 2, axis=-1), jnp.repeat(sin[:, :half], 2, axis=-1)
        pairs = x_rot.reshape(*x_rot.shape[:-1], half, 2)
        rot = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x_rot.shape)
        x_rot = x_rot * cos_i + rot * sin_i
    else:
        x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return jnp.concatenate([x_rot, x_pass], axis=-1)


class RMSNorm(nnx.Module):
    """A hand-written RMSNorm with HF's parameter name (`weight`); upcast: computed in float32
    and cast back, as HF's LlamaRMSNorm does. mistakes: eps="outside" (x / (rms + eps)),
    one_plus=True (scales by 1 + weight)."""

    def __init__(self, dim: int, eps: float, *, eps_place: str = "inside", one_plus: bool = False,
                 upcast: bool = False):
        self.weight = nnx.Param(jnp.ones((dim,)))
        self.eps, self.eps_place, self.one_plus, self.upcast = eps, eps_place, one_plus, upcast

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32) if self.upcast else x
        ms = jnp.mean(h * h, axis=-1, keepdims=True)
        y = h / (jnp.sqrt(ms) + self.eps) if self.eps_place == "outside" else h * jax.lax.rsqrt(ms + self.eps)
        return (1 + self.weight[...] if self.one_plus else self.weight[...]) * y.astype(x.dtype)


# ----------------------------------------------------------------------------------------
# GPT-2
# ----------------------------------------------------------------------------------------


class FlaxGPT2Attention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, split: str, scale: str, causal_offset: int, mask_style: str):
        e = cfg.n_embd
        self.n_head = cfg.n_head
        self.c_attn = nnx.Linear(e, 3 * e, rngs=rngs)
        self.c_proj = nnx.Linear(e, e, rngs=rngs)
        self.split, self.scale, self.causal_offset, self.mask_style = split, scale, causal_offset, mask_style

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:  # (B, T, E), (B, 1, 1, T)
        t = x.shape[1]
        order = "heads-last" if self.split.startswith("heads-last") else "heads-first"
        q, k, v = (split_heads(a, self.n_head, order) for a in jnp.split(self.c_attn(x), 3, axis=-1))
        d = q.shape[-1]
        scale = {"d": 1 / d, "none": 1.0}.get(self.scale, d ** -0.5)
        if self.mask_style == "additive":  # keep: an additive (B, 1, 1, T) bias here
            y = attend_additive(q, k, v, ~causal(t, self.causal_offset), keep, scale)
        else:
            mask = causal(t, self.causal_offset)
            y = attend(q, k, v, mask if keep is None else mask & keep, scale)
        return self.c_proj(merge_heads(y, "heads-last" if self.split == "heads-last-both" else "heads-first"))


class FlaxGPT2MLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, exact_gelu: bool):
        self.c_fc = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, rngs=rngs)
        self.c_proj = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, rngs=rngs)
        self.exact_gelu = exact_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=not self.exact_gelu))  # gelu_new: tanh


class FlaxGPT2Block(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, **mistakes):
        self.ln_1 = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.attn = FlaxGPT2Attention(cfg, rngs=rngs, split=mistakes["split"], scale=mistakes["scale"],
                                      causal_offset=mistakes["causal_offset"], mask_style=mistakes["mask_style"])
        self.ln_2 = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.mlp = FlaxGPT2MLP(cfg, rngs=rngs, exact_gelu=mistakes["exact_gelu"])

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class FlaxGPT2Model(nnx.Module):
    """GPT2Model's port. mistakes: exact_gelu, scale="d" / "none", causal_offset=+-1,
    split="heads-last" (or "heads-last-both": merged back that way too), skip_ln_f, no_wpe,
    pos_offset=n (positions from n, as OPT's are offset by 2), mask_inverted (with
    mask_style="additive": the padding bias on the real tokens)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, exact_gelu: bool = False, scale: str = "sqrt", causal_offset: int = 0,
                 split: str = "heads-first", skip_ln_f: bool = False, no_wpe: bool = False, pos_offset: int = 0,
                 mask_style: str = "keep", mask_inverted: bool = False):
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(cfg.n_positions, cfg.n_embd, rngs=rngs)
        self.h = nnx.List([FlaxGPT2Block(cfg, rngs=rngs, exact_gelu=exact_gelu, scale=scale,
                                         causal_offset=causal_offset, split=split, mask_style=mask_style)
                           for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.skip_ln_f, self.no_wpe, self.pos_offset, self.mask_style = skip_ln_f, no_wpe, pos_offset, mask_style
        self.mask_inverted = mask_inverted

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        pos = jnp.arange(input_ids.shape[1]) + self.pos_offset  # (T,)
        x = self.wte(input_ids) if self.no_wpe else self.wte(input_ids) + self.wpe(pos)
        keep = padding(attention_mask)
        if self.mask_style == "additive" and attention_mask is not None:  # HF's old Flax GPT-2: -1e4 on padding
            real = attention_mask[:, None, None, :].astype(x.dtype)
            keep = (real if self.mask_inverted else 1.0 - real) * -10000.0  # mask_inverted: real tokens masked
        for block in self.h:
            x = block(x, keep)
        return x if self.skip_ln_f else self.ln_f(x)


# ----------------------------------------------------------------------------------------
# BERT
# ----------------------------------------------------------------------------------------


class FlaxBertEmbeddings(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, eps: float, no_token_type: bool, fast_variance: bool):
        h = cfg.hidden_size
        self.word_embeddings = nnx.Embed(cfg.vocab_size, h, rngs=rngs)
        self.position_embeddings = nnx.Embed(cfg.max_position_embeddings, h, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, h, rngs=rngs)
        self.LayerNorm = nnx.LayerNorm(h, epsilon=eps, use_fast_variance=fast_variance, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.hidden_dropout_prob, rngs=rngs)
        self.no_token_type = no_token_type

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        x = self.word_embeddings(input_ids) + self.position_embeddings(jnp.arange(input_ids.shape[1]))
        if not self.no_token_type:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class FlaxBertSelfAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.query, self.key, self.value = (nnx.Linear(h, h, rngs=rngs) for _ in range(3))

    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:  # (B, 1, 1, T): additive, or bool keep
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        att = (q @ k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
        if mask is not None and mask.dtype == jnp.bool_:
            att = jnp.where(mask, att, -1e9)
        elif mask is not None:
            att = att + mask
        return merge_heads(jax.nn.softmax(att, axis=-1) @ v)


class FlaxBertOutput(nnx.Module):
    """BertSelfOutput and BertOutput: dense, dropout, LayerNorm(x + residual)."""

    def __init__(self, d_in: int, cfg, *, rngs: nnx.Rngs, eps: float):
        self.dense = nnx.Linear(d_in, cfg.hidden_size, rngs=rngs)
        self.LayerNorm = nnx.LayerNorm(cfg.hidden_size, epsilon=eps, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.hidden_dropout_prob, rngs=rngs)

    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class FlaxBertAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, eps: float):
        self.self = FlaxBertSelfAttention(cfg, rngs=rngs)
        self.output = FlaxBertOutput(cfg.hidden_size, cfg, rngs=rngs, eps=eps)

    def __call__(self, x: jax.Array, bias: jax.Array | None) -> jax.Array:
        return self.output(self.self(x, bias), x)


class FlaxBertIntermediate(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, tanh_gelu: bool):
        self.dense = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, rngs=rngs)
        self.tanh_gelu = tanh_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(self.dense(x), approximate=self.tanh_gelu)


class FlaxBertLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, eps: float, tanh_gelu: bool):
        self.attention = FlaxBertAttention(cfg, rngs=rngs, eps=eps)
        self.intermediate = FlaxBertIntermediate(cfg, rngs=rngs, tanh_gelu=tanh_gelu)
        self.output = FlaxBertOutput(cfg.intermediate_size, cfg, rngs=rngs, eps=eps)

    def __call__(self, x: jax.Array, bias: jax.Array | None) -> jax.Array:
        x = self.attention(x, bias)
        return self.output(self.intermediate(x), x)


class FlaxBertEncoder(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, **kw):
        self.layer = nnx.List([FlaxBertLayer(cfg, rngs=rngs, **kw) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, x: jax.Array, bias: jax.Array | None) -> jax.Array:
        for layer in self.layer:
            x = layer(x, bias)
        return x


class FlaxBertPooler(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(cfg.hidden_size, cfg.hidden_size, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.dense(x[:, 0]))


class FlaxBertModel(nnx.Module):
    """BertModel's port: (sequence output, pooled output). mistakes: tanh_gelu, eps (every
    LayerNorm), mask_inverted, no_token_type, fast_variance (the embeddings' LayerNorm)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, tanh_gelu: bool = False, eps: float | None = None,
                 mask_inverted: bool = False, no_token_type: bool = False, fast_variance: bool = False,
                 mask_style: str = "additive"):
        eps = cfg.layer_norm_eps if eps is None else eps
        self.embeddings = FlaxBertEmbeddings(cfg, rngs=rngs, eps=eps, no_token_type=no_token_type,
                                             fast_variance=fast_variance)
        self.encoder = FlaxBertEncoder(cfg, rngs=rngs, eps=eps, tanh_gelu=tanh_gelu)
        self.pooler = FlaxBertPooler(cfg, rngs=rngs)
        self.mask_inverted, self.mask_style = mask_inverted, mask_style

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 token_type_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        bias = None
        if attention_mask is not None:  # (B, 1, 1, T): additive (0 where a key may be attended), or bool
            masked = attention_mask == 1 if self.mask_inverted else attention_mask == 0
            bias = jnp.where(masked, jnp.finfo(x.dtype).min, 0.0)[:, None, None, :].astype(x.dtype)
            if self.mask_style == "bool":
                bias = ~masked[:, None, None, :]
        x = self.encoder(x, bias)
        return x, self.pooler(x)


# ----------------------------------------------------------------------------------------
# LLaMA (and Qwen2: biases on q, k, v)
# ----------------------------------------------------------------------------------------


def make_norm(dim: int, eps: float, norm: str, *, rngs: nnx.Rngs) -> nnx.Module:
    """The port's RMSNorm: nnx.RMSNorm, or a hand-written one computing in float32 as HF's
    does ("upcast"), or (mistakes) nnx.LayerNorm, or a hand-written one with eps outside the
    root or a (1 + w) scale."""
    if norm == "layernorm":
        return nnx.LayerNorm(dim, epsilon=eps, rngs=rngs)
    if norm in ("eps-outside", "one-plus", "upcast"):
        return RMSNorm(dim, eps, eps_place="outside" if norm == "eps-outside" else "inside",
                       one_plus=norm == "one-plus", upcast=norm == "upcast")
    return nnx.RMSNorm(dim, epsilon=eps, rngs=rngs)


def rotate_pairs(x: jax.Array) -> jax.Array:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): adjacent features pair up."""
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


class FlaxLlamaAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, rope: str, gqa: str, upcast: bool):
        h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        bias = getattr(cfg, "attention_bias", False)  # Qwen2: biases on q, k, v, none on o
        qkv_bias = cfg.model_type == "qwen2" or bias
        self.q_proj = nnx.Linear(h, self.n_heads * d, use_bias=qkv_bias, rngs=rngs)
        self.k_proj = nnx.Linear(h, self.n_kv * d, use_bias=qkv_bias, rngs=rngs)
        self.v_proj = nnx.Linear(h, self.n_kv * d, use_bias=qkv_bias, rngs=rngs)
        self.o_proj = nnx.Linear(self.n_heads * d, h, use_bias=bias, rngs=rngs)
        self.rope, self.gqa, self.upcast = rope, gqa, upcast

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, keep: jax.Array | None) -> jax.Array:
        t = x.shape[1]
        q = split_heads(self.q_proj(x), self.n_heads)
        k, v = split_heads(self.k_proj(x), self.n_kv), split_heads(self.v_proj(x), self.n_kv)
        if self.rope == "interleaved-tables":  # the tables come interleaved from the model
            q, k = (a * cos + rotate_pairs(a) * sin for a in (q, k))
        else:
            q, k = (apply_rotary(a, cos, sin, interleaved=self.rope == "interleaved") for a in (q, k))
        n_rep = self.n_heads // self.n_kv
        if self.gqa == "tile":
            k, v = jnp.tile(k, (1, n_rep, 1, 1)), jnp.tile(v, (1, n_rep, 1, 1))
        else:
            k, v = jnp.repeat(k, n_rep, axis=1), jnp.repeat(v, n_rep, axis=1)
        if keep is None or keep.shape[-2] == 1:  # a padding mask: the causal part is applied here
            keep = causal(t) if keep is None else causal(t) & keep
        return self.o_proj(merge_heads(attend(q, k, v, keep, self.head_dim ** -0.5, upcast=self.upcast)))


class FlaxLlamaMLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, act: str):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nnx.Linear(h, i, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(h, i, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(i, h, use_bias=False, rngs=rngs)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        act = jax.nn.gelu if self.act == "gelu" else jax.nn.silu
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class FlaxLlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, norm: str, eps: float, act: str, **attn):
        self.input_layernorm = make_norm(cfg.hidden_size, eps, norm, rngs=rngs)
        self.self_attn = FlaxLlamaAttention(cfg, rngs=rngs, **attn)
        self.post_attention_layernorm = make_norm(cfg.hidden_size, eps, norm, rngs=rngs)
        self.mlp = FlaxLlamaMLP(cfg, rngs=rngs, act=act)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, keep: jax.Array | None) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class FlaxLlamaModel(nnx.Module):
    """LlamaModel's (and Qwen2Model's) port; (cos, sin) of shape (T, head_dim) computed here.
    Variations: mask_in_root (the model builds the (B, 1, T, T) causal-and-padding mask its
    layers take), upcast (norms and softmax in float32, as HF's code). mistakes:
    rope="interleaved" (in attention) / "interleaved-tables" (the model's tables and
    attention's rotation both pair adjacent features), gqa="tile", norm="layernorm" /
    "eps-outside" / "one-plus", eps (every norm), act="gelu", causal_offset=+-1 (with
    mask_in_root)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, rope: str = "halves", gqa: str = "repeat", norm: str = "rms",
                 eps: float | None = None, act: str = "silu", mask_in_root: bool = False, causal_offset: int = 0,
                 upcast: bool = False):
        eps = cfg.rms_norm_eps if eps is None else eps
        norm = "upcast" if upcast and norm == "rms" else norm
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([FlaxLlamaDecoderLayer(cfg, rngs=rngs, norm=norm, eps=eps, act=act, rope=rope, gqa=gqa,
                                                      upcast=upcast) for _ in range(cfg.num_hidden_layers)])
        self.norm = make_norm(cfg.hidden_size, eps, norm, rngs=rngs)
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.theta = cfg.rope_parameters["rope_theta"]
        self.rope, self.mask_in_root, self.causal_offset = rope, mask_in_root, causal_offset

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        t = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        cos, sin = rotary(t, self.head_dim, self.theta)
        if self.rope == "interleaved-tables":
            cos, sin = (jnp.repeat(a[:, : self.head_dim // 2], 2, axis=-1) for a in (cos, sin))
        keep = padding(attention_mask)
        if self.mask_in_root:
            keep = causal(t, self.causal_offset)[None, None] if keep is None else causal(t, self.causal_offset) & keep
        for layer in self.layers:
            x = layer(x, cos, sin, keep)
        return self.norm(x)


# ----------------------------------------------------------------------------------------
# GPT-NeoX: fused qkv viewed per head, partial rotary, parallel residual
# ----------------------------------------------------------------------------------------


class FlaxGPTNeoXAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, rope: str):
        h = cfg.hidden_size
        self.n_heads, self.head_size = cfg.num_attention_heads, h // cfg.num_attention_heads
        self.rotary_ndims = int(self.head_size * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        self.theta = cfg.rope_parameters["rope_theta"]
        self.query_key_value = nnx.Linear(h, 3 * h, use_bias=cfg.attention_bias, rngs=rngs)
        self.dense = nnx.Linear(h, h, use_bias=cfg.attention_bias, rngs=rngs)
        self.rope = rope

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        b, t, _ = x.shape
        qkv = self.query_key_value(x).reshape(b, t, self.n_heads, 3 * self.head_size).transpose(0, 2, 1, 3)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        cos, sin = rotary(t, self.rotary_ndims, self.theta)
        if self.rope == "last":  # the mistake: the head's last rotary_ndims features rotated
            d = self.head_size - self.rotary_ndims
            q, k = (jnp.concatenate([a[..., :d], apply_rotary(a[..., d:], cos, sin)], axis=-1) for a in (q, k))
        else:
            q, k = (apply_rotary(a, cos, sin, interleaved=self.rope == "interleaved") for a in (q, k))
        mask = causal(t) if keep is None else causal(t) & keep
        return self.dense(merge_heads(attend(q, k, v, mask, self.head_size ** -0.5)))


class FlaxGPTNeoXMLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.dense_h_to_4h = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, rngs=rngs)
        self.dense_4h_to_h = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dense_4h_to_h(jax.nn.gelu(self.dense_h_to_4h(x), approximate=False))


class FlaxGPTNeoXLayer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, rope: str, sequential: bool):
        self.input_layernorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.post_attention_layernorm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.attention = FlaxGPTNeoXAttention(cfg, rngs=rngs, rope=rope)
        self.mlp = FlaxGPTNeoXMLP(cfg, rngs=rngs)
        self.sequential = sequential

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        a = self.attention(self.input_layernorm(x), keep)
        if self.sequential:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        return x + a + self.mlp(self.post_attention_layernorm(x))


class FlaxGPTNeoXModel(nnx.Module):
    """GPTNeoXModel's port. mistakes: rope="interleaved" / "last" (the partial rotary on the
    head's last features), sequential (the residual of a use_parallel_residual model read as
    sequential)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, rope: str = "halves", sequential: bool = False):
        self.embed_in = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([FlaxGPTNeoXLayer(cfg, rngs=rngs, rope=rope, sequential=sequential)
                                for _ in range(cfg.num_hidden_layers)])
        self.final_layer_norm = nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        x = self.embed_in(input_ids)
        keep = padding(attention_mask)
        for layer in self.layers:
            x = layer(x, keep)
        return self.final_layer_norm(x)


# ----------------------------------------------------------------------------------------
# The models, tiny (random weights, no download)
# ----------------------------------------------------------------------------------------


def config(name: str, **overrides):
    """A tiny transformers config: d_model 32, 4 heads of 8 (heads != head_dim), d_ff 128,
    one shape for every family (the comparisons share their compiled operations)."""
    import transformers as tr

    common = dict(vocab_size=96, max_position_embeddings=32, bos_token_id=1, eos_token_id=2)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if name == "gpt2":
        cfg = tr.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                            eos_token_id=2)
    elif name == "bert":
        cfg = tr.BertConfig(**common, **sizes)
    elif name in ("llama", "qwen2"):
        cls = tr.LlamaConfig if name == "llama" else tr.Qwen2Config
        cfg = cls(**common, **sizes, num_key_value_heads=2, rms_norm_eps=1e-5)
    elif name == "gpt_neox":
        cfg = tr.GPTNeoXConfig(**common, **sizes, rotary_pct=0.5)
    else:
        raise KeyError(f"no tiny config for {name!r}; expected one of {sorted(PORTS)}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


PORTS = {"gpt2": ("GPT2Model", FlaxGPT2Model), "bert": ("BertModel", FlaxBertModel),
         "llama": ("LlamaModel", FlaxLlamaModel), "qwen2": ("Qwen2Model", FlaxLlamaModel),
         "gpt_neox": ("GPTNeoXModel", FlaxGPTNeoXModel)}


def torch_model(name: str, seed: int = 0, attn: str = "sdpa", **overrides) -> torch.nn.Module:
    """The transformers model `name` with random weights (seeded), in eval mode."""
    import transformers as tr

    cfg = config(name, **overrides)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return getattr(tr, PORTS[name][0])(cfg).eval()


def port(name: str, cfg, seed: int = 0, **mistakes) -> nnx.Module:
    """The hand-written port of `name` for `cfg`, with `mistakes` planted, in eval mode."""
    model = PORTS[name][1](cfg, rngs=nnx.Rngs(seed), **mistakes)
    model.eval()
    return model


def inputs(name: str, seed: int = 0, batch: int = 2, length: int = 9, pad: bool = True) -> dict[str, np.ndarray]:
    """input_ids (B, T) and attention_mask (B, T) (the second sequence's last 3 tokens are
    padding when `pad`); BERT also token_type_ids (a second segment from position 4)."""
    rng = np.random.default_rng(seed)
    out = {"input_ids": rng.integers(3, 96, (batch, length))}
    mask = np.ones((batch, length), np.int64)
    if pad:
        mask[-1, -3:] = 0
    out["attention_mask"] = mask
    if name == "bert":
        types = np.zeros((batch, length), np.int64)
        types[:, 4:] = 1
        out["token_type_ids"] = types
    return out


# Factories for the command line (`python -m parity_tests.port TORCH FLAX`) ---------------


def gpt2_12x256() -> torch.nn.Module:
    """A GPT-2-sized transformers GPT2Model for the timing figure: 12 layers, d_model 256, 8
    heads, 256 positions, vocabulary 512 (random weights, seeded)."""
    import transformers as tr

    torch.manual_seed(0)
    return tr.GPT2Model(tr.GPT2Config(vocab_size=512, n_positions=256, n_embd=256, n_layer=12, n_head=8,
                                      bos_token_id=1, eos_token_id=2)).eval()


def flax_gpt2_12x256() -> FlaxGPT2Model:
    return port("gpt2", gpt2_12x256().config)
