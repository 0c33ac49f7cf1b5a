"""Multi-head latent attention (MLA; DeepSeek V2 / V3) in Flax NNX, the twin of `torch_blocks.mla`.

Queries direct (q_proj) or low-rank (q_a_proj -> RMSNorm -> q_b_proj); kv_a_proj_with_mqa gives
the compressed latent (kv_lora_rank) and one rotary key part shared by the heads
(qk_rope_head_dim); the latent, normed, goes through kv_b_proj to each head's non-rotary key
(qk_nope_head_dim) and value (v_head_dim). Rotary acts on the rotary parts only (rope_interleave:
adjacent pairs); logits scaled by cfg.latent_scale (qk_head_dim ** -0.5 times yarn's mscale
squared). A decoding cache holds the normed latent and the rotated key part, {"latent": (B, L, r),
"k_rot": (B, L, dr)}: (r + dr) numbers a token and layer where a plain cache holds 2 H (dn + dr)
(HF 5.24's DynamicCache holds the same latent: docs/generate.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import rotary
from .core import declarations
from .core.config import BlockConfig
from .core.context import AttentionCall
from .core.rope import interleave_order
from .layers import Linear, Norm, compute_dtype, dropout, initial_values


class LatentAttention(nnx.Module):
    """Multi-head latent attention (see `declarations.latent_attention`; HF's names): q_proj or
    q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    (Linear: kernels (in, out)). Called as `attention.Attention` (self-attention, the dense path)."""

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_layernorm: Norm | None
    q_b_proj: Linear | None
    kv_a_proj_with_mqa: Linear
    kv_a_layernorm: Norm
    kv_b_proj: Linear
    o_proj: Linear

    def __init__(self, cfg: BlockConfig, component: declarations.Component | None = None, *, rngs: nnx.Rngs,
                 values: dict[str, Any] | None = None):
        component = component or declarations.latent_attention(cfg)
        self.cfg = cfg
        if values is None:
            values = initial_values(rngs.params(), component, cfg)
        norm_cfg = replace(cfg, layer_norm_eps=cfg.latent_norm_eps)  # HF's DeepseekV3RMSNorm(r): eps 1e-6
        for name, child in component.children:
            setattr(self, name, Norm(norm_cfg, child, rngs=rngs, values=values[name]) if child.kind == "norm"
                    else Linear(cfg, child, rngs=rngs, values=values[name]))
        for name in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"):
            if not hasattr(self, name):
                setattr(self, name, None)
        self.dropout = dropout(cfg, rngs)
        self.dtype = compute_dtype(cfg)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x (B, T, E) -> (q (B, T, H, dn + dr), the normed latent (B, T, r), the rotary key (B, T, dr)),
        rotary applied at positions ((T,) or (B, T)) to the rotary parts."""
        cfg = self.cfg
        b, t, _ = x.shape
        dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, cfg.num_heads, -1)
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_rot = kv[..., :r], kv[..., r:]
        q = jnp.concatenate([q[..., :dn], self.rotate(q[..., dn:], positions)], axis=-1)
        return q, self.kv_a_layernorm(latent), self.rotate(k_rot[:, :, None], positions)[:, :, 0]

    def rotate(self, a: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotary on a (B, T, heads, dr): rotate-half, on the dims ordered evens first under rope_interleave."""
        cfg = self.cfg
        if cfg.rope_interleave:
            a = a[..., jnp.asarray(interleave_order(a.shape[-1])[0])]
        assert cfg.rope_theta is not None  # the config checks it
        return rotary(a, positions, cfg.rope_theta, None, cfg.rope_scaling)

    def expand(self, latent: jax.Array, k_rot: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The heads' keys (B, S, H, dn + dr) and values (B, S, H, dv) of the latent (B, S, r) and
        the rotary key (B, S, dr) shared by the heads."""
        cfg = self.cfg
        b, s, _ = latent.shape
        kv = self.kv_b_proj(latent).reshape(b, s, cfg.num_heads, -1)
        k_nope, v = kv[..., :cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]
        rot = jnp.broadcast_to(k_rot[:, :, None], (b, s, cfg.num_heads, k_rot.shape[-1])).astype(k_nope.dtype)
        return jnp.concatenate([k_nope, rot], axis=-1), v

    def __call__(self, x: jax.Array, call: AttentionCall | None = None, key: jax.Array | None = None,
                 deterministic: bool | None = None,
                 ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, dict[str, jax.Array] | None]:
        """Self-attention of x (B, T, E), called and returning as `Attention.__call__` (dense path:
        mask (B|1, H|1, T, S), rows (B|1, H|1, T, 1)). cache {"latent": (B, L, r), "k_rot": (B, L, dr)}:
        the chunk's latent and rotary key written at index .. index+T-1, the keys and values of all L
        positions expanded from it."""
        call = call or AttentionCall()
        if call.cross or call.path not in (None, "dense"):
            raise ValueError(f"multi-head latent attention is a self-attention on the dense path, got "
                             f"cross={call.cross!r}, path={call.path!r}")
        mask, rows = (None, None) if call.mask is None else call.mask
        cache, index, positions = call.cache, call.index, call.positions
        (x,) = nnx.nn.dtypes.promote_dtype((x,), dtype=self.dtype)
        b, t, _ = x.shape
        q, latent, k_rot = self.project(x, index + jnp.arange(t) if positions is None else positions)
        if cache is not None:
            start = (0 * index, index, 0 * index)  # one integer dtype (int64 under x64 too)
            latent = jax.lax.dynamic_update_slice(cache["latent"], latent.astype(cache["latent"].dtype), start)
            k_rot = jax.lax.dynamic_update_slice(cache["k_rot"], k_rot.astype(cache["k_rot"].dtype), start)
            cache = {"latent": latent, "k_rot": k_rot}
        k, v = self.expand(latent, k_rot)
        logits = jnp.einsum("bthd,bshd->bhts", q, k.astype(q.dtype)) * self.cfg.latent_scale
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # never softmax in bf16
        if mask is not None:
            logits = jnp.where(mask, logits, -jnp.inf)
        logit_max = jnp.max(logits) if rows is None else jnp.max(jnp.where(rows, logits, -jnp.inf))
        weights = jax.nn.softmax(logits, axis=-1)
        if rows is not None:
            weights = jnp.where(rows, weights, 0.0)
        weights = weights.astype(v.dtype)
        dropped = self.dropout(weights, deterministic=deterministic, rngs=key)
        out = self.o_proj(jnp.einsum("bhts,bshd->bthd", dropped, v).reshape(b, t, -1))
        if rows is not None:  # a query with no key (in any head) gets no attention output, bias included
            out = jnp.where(jnp.any(rows, axis=1), out, 0.0)
        return out, weights, logit_max, cache


def latent_cache(cfg: BlockConfig, batch: int, length: int, dtype: Any) -> dict[str, jax.Array]:
    """An empty decoding cache of one latent attention: {"latent": (B, L, r), "k_rot": (B, L, dr)}."""
    assert cfg.kv_lora_rank is not None
    return {"latent": jnp.zeros((batch, length, cfg.kv_lora_rank), dtype),
            "k_rot": jnp.zeros((batch, length, cfg.qk_rope_head_dim), dtype)}
