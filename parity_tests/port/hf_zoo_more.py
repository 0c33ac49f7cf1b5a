"""More transformers models ported by hand to Flax NNX, written the way a porter writes them
and not tuned to the checker (parity_tests/port/test_port_zoo.py runs them): each port is
correct by default and has switches that plant one mistake.

    transformers model   port              mistakes it can plant
    GPTJModel            FlaxGPTJModel     rotary="halves" (GPT-J pairs neighbours), sequential (its parallel
                                           block run sequentially), pos_offset=1 (rotary positions from 1),
                                           eps

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
# The models, tiny
# ----------------------------------------------------------------------------------------


def config(name: str):
    """A tiny transformers config: d_model 32, 4 heads of 8, 2 layers."""
    import transformers as tr

    if name == "gptj":
        return tr.GPTJConfig(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                             bos_token_id=1, eos_token_id=2)
    raise KeyError(f"no tiny config for {name!r}; expected one of {sorted(PORTS)}")


PORTS = {"gptj": ("GPTJModel", FlaxGPTJModel)}


def torch_model(name: str, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    """The transformers model `name` with random weights (seeded), in eval mode."""
    import transformers as tr

    cfg = config(name)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return getattr(tr, PORTS[name][0])(cfg).eval()


def port(name: str, cfg, seed: int = 0, **mistakes) -> nnx.Module:
    """The port of `name` for `cfg`, with `mistakes` planted, in eval mode."""
    model = PORTS[name][1](cfg, rngs=nnx.Rngs(seed), **mistakes)
    model.eval()
    return model


def inputs(name: str, seed: int = 0, batch: int = 2, length: int = 9) -> dict[str, np.ndarray]:
    """input_ids (B, T) and attention_mask (B, T), the second sequence's last 3 tokens padding."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), np.int64)
    mask[-1, -3:] = 0
    return {"input_ids": rng.integers(3, 96, (batch, length)), "attention_mask": mask}
