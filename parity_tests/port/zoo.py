"""A zoo of ports made of no block of this project: six torch models and their hand-written
Flax NNX ports, each port with switches that plant a known porting mistake. The port
checker's tests (parity_tests/port/test_port.py) and docs/porting.md use them.

    torch model                      flax port                      mistakes it can plant
    GPT (fused qkv, manual softmax)  GPT                            tanh GELU in one layer, head split, 1/d scale,
                                                                    mask sense
    block on nn.MultiheadAttention   block on nnx.MultiHeadAttention padding-mask sense, eps
    ViT (patch Conv2d)               ViT (nnx.Conv)                 eps
    T5-style encoder (rel. bias)     T5-style encoder               1/sqrt(d) scale T5 does not use, RMSNorm eps
    Conv1d mixer (causal, gated)     Conv1d mixer                   tanh GELU in layer 1, padding on the wrong side
    MLP-Mixer                        MLP-Mixer                      nnx.LayerNorm's default eps (1e-6 for 1e-5),
                                                                    tokens not transposed
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn as tnn
import torch.nn.functional as F
from flax import nnx

# ----------------------------------------------------------------------------------------
# GPT with a fused qkv projection
# ----------------------------------------------------------------------------------------


class TorchAttention(tnn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = tnn.Linear(d, 3 * d)
        self.proj = tnn.Linear(d, d)

    def forward(self, x):  # (B, T, d)
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (a.view(b, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        att = F.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class TorchMLP(tnn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = tnn.Linear(d, 4 * d)
        self.fc2 = tnn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TorchGPTBlock(tnn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = tnn.LayerNorm(d), TorchAttention(d, heads)
        self.ln2, self.mlp = tnn.LayerNorm(d), TorchMLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(tnn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, ctx: int = 16):
        super().__init__()
        self.wte, self.wpe = tnn.Embedding(vocab, d), tnn.Embedding(ctx, d)
        self.blocks = tnn.ModuleList([TorchGPTBlock(d, heads) for _ in range(layers)])
        self.ln_f = tnn.LayerNorm(d)
        self.head = tnn.Linear(d, vocab, bias=False)

    def forward(self, idx):  # (B, T) int -> (B, T, vocab)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class FlaxAttention(nnx.Module):
    def __init__(self, d: int, heads: int, *, split: str = "heads-first", scale: str = "sqrt", mask: str = "right",
                 rngs: nnx.Rngs):
        self.heads, self.split, self.scale, self.mask = heads, split, scale, mask
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h, hd = self.heads, d // self.heads

        def split(a):
            if self.split == "heads-first":
                return a.reshape(b, t, h, hd).transpose(0, 2, 1, 3)
            return a.reshape(b, t, hd, h).transpose(0, 3, 1, 2)  # mistake: (head_dim, heads)

        q, k, v = (split(a) for a in jnp.split(self.qkv(x), 3, axis=-1))
        att = q @ k.swapaxes(-2, -1) / (math.sqrt(hd) if self.scale == "sqrt" else hd)
        allowed = jnp.tril(jnp.ones((t, t), bool))
        if self.mask != "right":
            allowed = ~allowed  # mistake: a torch-sense mask used as a flax one
        att = jax.nn.softmax(jnp.where(allowed, att, -jnp.inf), axis=-1)
        return self.proj((att @ v).transpose(0, 2, 1, 3).reshape(b, t, d))


class FlaxMLP(nnx.Module):
    def __init__(self, d: int, *, approximate: bool = False, rngs: nnx.Rngs):
        self.approximate = approximate
        self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=self.approximate))


class FlaxGPTBlock(nnx.Module):
    def __init__(self, d: int, heads: int, *, approximate: bool = False, eps: float = 1e-5, rngs: nnx.Rngs, **attn):
        self.ln1 = nnx.LayerNorm(d, epsilon=eps, use_fast_variance=False, rngs=rngs)
        self.attn = FlaxAttention(d, heads, rngs=rngs, **attn)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.mlp = FlaxMLP(d, approximate=approximate, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class FlaxGPT(nnx.Module):
    """mistakes: {"tanh_gelu_layer": i, "eps_layer": i, "split": "heads-last", "scale": "d", "mask": "inverted"}."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, ctx: int = 16, *,
                 rngs: nnx.Rngs | None = None, **mistakes):
        rngs = rngs or nnx.Rngs(0)
        attn = {k: mistakes[k] for k in ("split", "scale", "mask") if k in mistakes}
        self.wte, self.wpe = nnx.Embed(vocab, d, rngs=rngs), nnx.Embed(ctx, d, rngs=rngs)
        self.blocks = nnx.List([FlaxGPTBlock(d, heads, approximate=mistakes.get("tanh_gelu_layer") == i,
                                             eps=1e-6 if mistakes.get("eps_layer") == i else 1e-5, rngs=rngs, **attn)
                                for i in range(layers)])
        self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, idx):
        x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------------------
# A block on nn.MultiheadAttention, with a padding mask
# ----------------------------------------------------------------------------------------


class TorchMHABlock(tnn.Module):
    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.ln1 = tnn.LayerNorm(d)
        self.attn = tnn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = tnn.LayerNorm(d)
        self.ff = tnn.Sequential(tnn.Linear(d, 2 * d), tnn.GELU(), tnn.Linear(2 * d, d))

    def forward(self, x, pad):  # x (B, T, d); pad (B, T) bool, True = a padding token (torch's sense)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class FlaxMHABlock(nnx.Module):
    """mistakes: mask="inverted" (torch's padding mask used as flax's may-attend mask), eps=1e-6."""

    def __init__(self, d: int = 16, heads: int = 2, *, mask: str = "right", eps: float = 1e-5,
                 rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.mask = mask
        self.ln1 = nnx.LayerNorm(d, epsilon=eps, use_fast_variance=False, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.ff = nnx.Sequential(nnx.Linear(d, 2 * d, rngs=rngs), lambda a: jax.nn.gelu(a, approximate=False),
                                 nnx.Linear(2 * d, d, rngs=rngs))

    def __call__(self, x, pad):
        attend = pad if self.mask != "right" else ~pad
        h = self.ln1(x)
        x = x + self.attn(h, h, h, mask=attend[:, None, None, :])
        return x + self.ff(self.ln2(x))


# ----------------------------------------------------------------------------------------
# ViT with a patch Conv2d
# ----------------------------------------------------------------------------------------


class TorchViT(tnn.Module):
    def __init__(self, image: int = 8, patch: int = 4, d: int = 16, heads: int = 2, layers: int = 2, classes: int = 5):
        super().__init__()
        self.patch = tnn.Conv2d(3, d, patch, stride=patch)
        self.pos = tnn.Parameter(torch.randn(1, (image // patch) ** 2, d) * 0.02)
        self.blocks = tnn.ModuleList([TorchMHABlockNoPad(d, heads) for _ in range(layers)])
        self.norm = tnn.LayerNorm(d, eps=1e-6)
        self.head = tnn.Linear(d, classes)

    def forward(self, img):  # (B, 3, H, W) -> (B, classes)
        x = self.patch(img).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class TorchMHABlockNoPad(TorchMHABlock):
    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class FlaxMHABlockNoPad(FlaxMHABlock):
    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h)
        return x + self.ff(self.ln2(x))


class FlaxViT(nnx.Module):
    """mistakes: eps_layer=i (the block's first LayerNorm at 1e-6)."""

    def __init__(self, image: int = 8, patch: int = 4, d: int = 16, heads: int = 2, layers: int = 2, classes: int = 5,
                 *, rngs: nnx.Rngs | None = None, eps_layer: int | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.patch = nnx.Conv(3, d, (patch, patch), strides=(patch, patch), padding="VALID", rngs=rngs)
        self.pos = nnx.Param(jnp.zeros((1, (image // patch) ** 2, d)))
        self.blocks = nnx.List([FlaxMHABlockNoPad(d, heads, eps=1e-6 if eps_layer == i else 1e-5, rngs=rngs)
                                for i in range(layers)])
        self.norm = nnx.LayerNorm(d, epsilon=1e-6, use_fast_variance=False, rngs=rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, img):
        x = self.patch(img.transpose(0, 2, 3, 1))  # NCHW -> NHWC
        x = x.reshape(x.shape[0], -1, x.shape[-1]) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


# ----------------------------------------------------------------------------------------
# A T5-style encoder: relative-position bias, RMSNorm, no logit scale
# ----------------------------------------------------------------------------------------


def relative_buckets(t: int, reach: int) -> np.ndarray:
    """(t, t) bucket of key j for query i: j - i clipped to [-reach, reach], shifted to >= 0."""
    rel = np.arange(t)[None, :] - np.arange(t)[:, None]
    return np.clip(rel, -reach, reach) + reach


class TorchT5Layer(tnn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = tnn.RMSNorm(d, eps=1e-6), tnn.RMSNorm(d, eps=1e-6)
        self.q, self.k, self.v, self.o = (tnn.Linear(d, d, bias=False) for _ in range(4))
        self.wi, self.wo = tnn.Linear(d, 2 * d, bias=False), tnn.Linear(2 * d, d, bias=False)

    def forward(self, x, bias):  # bias (heads, T, T)
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = F.softmax(q @ k.transpose(-2, -1) + bias, dim=-1)  # T5: no 1/sqrt(d)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.wo(F.relu(self.wi(self.norm2(x))))


class TorchT5(tnn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, heads: int = 2, layers: int = 2, reach: int = 4):
        super().__init__()
        self.reach = reach
        self.embed = tnn.Embedding(vocab, d)
        self.rel = tnn.Embedding(2 * reach + 1, heads)
        self.layers = tnn.ModuleList([TorchT5Layer(d, heads) for _ in range(layers)])
        self.norm = tnn.RMSNorm(d, eps=1e-6)

    def forward(self, ids):
        t = ids.shape[1]
        bias = self.rel(torch.from_numpy(relative_buckets(t, self.reach))).permute(2, 0, 1)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, bias)
        return self.norm(x)


class FlaxT5Layer(nnx.Module):
    def __init__(self, d: int, heads: int, *, scale: bool = False, eps: float = 1e-6, rngs: nnx.Rngs):
        self.heads, self.scale = heads, scale
        self.norm1 = nnx.RMSNorm(d, epsilon=eps, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, epsilon=1e-6, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(4))
        self.wi, self.wo = (nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs),
                            nnx.Linear(2 * d, d, use_bias=False, rngs=rngs))

    def __call__(self, x, bias):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).reshape(b, t, self.heads, -1).transpose(0, 2, 1, 3) for p in (self.q, self.k, self.v))
        logits = q @ k.swapaxes(-2, -1)
        if self.scale:
            logits = logits / math.sqrt(d // self.heads)  # mistake: T5 does not scale
        att = jax.nn.softmax(logits + bias, axis=-1)
        x = x + self.o((att @ v).transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + self.wo(jax.nn.relu(self.wi(self.norm2(x))))


class FlaxT5(nnx.Module):
    """mistakes: scale_layer=i (a 1/sqrt(head_dim) T5 does not use), eps_layer=i (RMSNorm eps 1e-5)."""

    def __init__(self, vocab: int = 50, d: int = 16, heads: int = 2, layers: int = 2, reach: int = 4, *,
                 rngs: nnx.Rngs | None = None, scale_layer: int | None = None, eps_layer: int | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.reach = reach
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.rel = nnx.Embed(2 * reach + 1, heads, rngs=rngs)
        self.layers = nnx.List([FlaxT5Layer(d, heads, scale=scale_layer == i, eps=1e-5 if eps_layer == i else 1e-6,
                                            rngs=rngs) for i in range(layers)])
        self.norm = nnx.RMSNorm(d, epsilon=1e-6, rngs=rngs)

    def __call__(self, ids):
        bias = self.rel(jnp.asarray(relative_buckets(ids.shape[1], self.reach))).transpose(2, 0, 1)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, bias)
        return self.norm(x)


# ----------------------------------------------------------------------------------------
# A Conv1d mixer: depthwise causal conv, attention with a learned per-channel gate, GELU MLP
# ----------------------------------------------------------------------------------------


class TorchMixerLayer(tnn.Module):
    def __init__(self, d: int, heads: int, kernel: int = 3):
        super().__init__()
        self.kernel = kernel
        self.norm1, self.norm2, self.norm3 = tnn.LayerNorm(d), tnn.LayerNorm(d), tnn.LayerNorm(d)
        self.conv = tnn.Conv1d(d, d, kernel, groups=d)
        self.attn = TorchAttention(d, heads)
        self.gate = tnn.Parameter(torch.full((d,), 0.5))
        self.mlp = TorchMLP(d)

    def forward(self, x):  # (B, T, d)
        h = F.pad(self.norm1(x).transpose(1, 2), (self.kernel - 1, 0))  # causal: pad the past only
        x = x + self.conv(h).transpose(1, 2)
        x = x + torch.sigmoid(self.gate) * self.attn(self.norm2(x))
        return x + self.mlp(self.norm3(x))


class TorchMixer(tnn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = tnn.Embedding(vocab, d)
        self.blocks = tnn.ModuleList([TorchMixerLayer(d, heads) for _ in range(layers)])
        self.head = tnn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FlaxMixerLayer(nnx.Module):
    def __init__(self, d: int, heads: int, kernel: int = 3, *, approximate: bool = False, pad: str = "left",
                 rngs: nnx.Rngs):
        self.kernel, self.pad = kernel, pad
        self.norm1, self.norm2, self.norm3 = (nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
                                              for _ in range(3))
        self.conv = nnx.Conv(d, d, (kernel,), feature_group_count=d, padding="VALID", rngs=rngs)
        self.attn = FlaxAttention(d, heads, rngs=rngs)
        self.gate = nnx.Param(jnp.full((d,), 0.5))
        self.mlp = FlaxMLP(d, approximate=approximate, rngs=rngs)

    def __call__(self, x):
        side = (self.kernel - 1, 0) if self.pad == "left" else (0, self.kernel - 1)
        x = x + self.conv(jnp.pad(self.norm1(x), ((0, 0), side, (0, 0))))
        x = x + jax.nn.sigmoid(self.gate[...]) * self.attn(self.norm2(x))
        return x + self.mlp(self.norm3(x))


class FlaxMixer(nnx.Module):
    """mistakes: tanh_gelu_layer=i, pad_layer=i (the conv padded on the future's side)."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, *, rngs: nnx.Rngs | None = None,
                 tanh_gelu_layer: int | None = None, pad_layer: int | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([FlaxMixerLayer(d, heads, approximate=tanh_gelu_layer == i,
                                               pad="right" if pad_layer == i else "left", rngs=rngs)
                                for i in range(layers)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ----------------------------------------------------------------------------------------
# MLP-Mixer
# ----------------------------------------------------------------------------------------


class TorchMLPMixer(tnn.Module):
    def __init__(self, tokens: int = 8, d: int = 8, layers: int = 2):
        super().__init__()
        self.layers = tnn.ModuleList([tnn.ModuleDict(dict(
            norm1=tnn.LayerNorm(d), tokens=tnn.Sequential(tnn.Linear(tokens, 2 * tokens), tnn.GELU(),
                                                          tnn.Linear(2 * tokens, tokens)),
            norm2=tnn.LayerNorm(d), channels=tnn.Sequential(tnn.Linear(d, 2 * d), tnn.GELU(), tnn.Linear(2 * d, d))))
            for _ in range(layers)])

    def forward(self, x):  # (B, tokens, d)
        for layer in self.layers:
            x = x + layer["tokens"](layer["norm1"](x).transpose(1, 2)).transpose(1, 2)
            x = x + layer["channels"](layer["norm2"](x))
        return x


class FlaxMixerLayerMLP(nnx.Module):
    def __init__(self, tokens: int, d: int, *, eps: float, transpose: bool, rngs: nnx.Rngs):
        self.transpose = transpose
        gelu = lambda a: jax.nn.gelu(a, approximate=False)  # noqa: E731
        self.norm1 = nnx.LayerNorm(d, epsilon=eps, use_fast_variance=False, rngs=rngs)
        self.tokens = nnx.Sequential(nnx.Linear(tokens, 2 * tokens, rngs=rngs), gelu,
                                     nnx.Linear(2 * tokens, tokens, rngs=rngs))
        self.norm2 = nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.channels = nnx.Sequential(nnx.Linear(d, 2 * d, rngs=rngs), gelu, nnx.Linear(2 * d, d, rngs=rngs))

    def __call__(self, x):
        if self.transpose:
            x = x + self.tokens(self.norm1(x).swapaxes(1, 2)).swapaxes(1, 2)
        else:
            x = x + self.tokens(self.norm1(x))  # mistake: mixes channels (tokens == d, so the shapes fit)
        return x + self.channels(self.norm2(x))


class FlaxMLPMixer(nnx.Module):
    """mistakes: default_eps_layer=i (nnx.LayerNorm's default epsilon, 1e-6), untransposed_layer=i."""

    def __init__(self, tokens: int = 8, d: int = 8, layers: int = 2, *, rngs: nnx.Rngs | None = None,
                 default_eps_layer: int | None = None, untransposed_layer: int | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.layers = nnx.List([FlaxMixerLayerMLP(tokens, d, eps=1e-6 if default_eps_layer == i else 1e-5,
                                                  transpose=untransposed_layer != i, rngs=rngs)
                                for i in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# ----------------------------------------------------------------------------------------
# The zoo
# ----------------------------------------------------------------------------------------


def inputs(name: str, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Example inputs for a zoo member (numpy)."""
    rng = np.random.default_rng(seed)
    if name in ("gpt", "mixer"):
        return (rng.integers(0, 64, (2, 12)),)
    if name == "t5":
        return (rng.integers(0, 50, (2, 10)),)
    if name == "mha":
        pad = np.zeros((2, 7), bool)
        pad[0, 5:] = pad[1, 6:] = True
        return rng.standard_normal((2, 7, 16)), pad
    if name == "vit":
        return (rng.standard_normal((2, 3, 8, 8)),)
    if name == "mlpmixer":
        return (rng.standard_normal((2, 8, 8)),)
    raise KeyError(name)


ZOO = {"gpt": (TorchGPT, FlaxGPT), "mha": (TorchMHABlock, FlaxMHABlock), "vit": (TorchViT, FlaxViT),
       "t5": (TorchT5, FlaxT5), "mixer": (TorchMixer, FlaxMixer), "mlpmixer": (TorchMLPMixer, FlaxMLPMixer)}


def pair(name: str, seed: int = 0, **mistakes):
    """A zoo member's torch model (seeded) and its Flax port with `mistakes` planted and the
    weights copied across: (torch model, flax model)."""
    from parity_tests.port import copy_weights

    torch_cls, flax_cls = ZOO[name]
    torch.manual_seed(seed)
    tm = torch_cls()
    fm = flax_cls(rngs=nnx.Rngs(seed), **mistakes)
    copy_weights(tm, fm)
    return tm, fm


# Factories for the command line (`python -m parity_tests.port TORCH FLAX`) ---------------


def mlp_mixer_with_default_eps() -> FlaxMLPMixer:
    """The MLP-Mixer port with nnx.LayerNorm's default epsilon (1e-6) in layer 1's first norm."""
    return FlaxMLPMixer(default_eps_layer=1)


def torch_gpt_12x256() -> TorchGPT:
    """A GPT-2-sized stack for the timing figure: 12 layers, d_model 256, 8 heads, 256 tokens of context."""
    torch.manual_seed(0)
    return TorchGPT(vocab=512, d=256, heads=8, layers=12, ctx=256)


def flax_gpt_12x256() -> FlaxGPT:
    return FlaxGPT(vocab=512, d=256, heads=8, layers=12, ctx=256)
