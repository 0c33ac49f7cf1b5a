"""Multi-head latent attention (MLA; DeepSeek V2 / V3) in PyTorch, the twin of `flax_blocks.mla`.

Queries direct (q_proj) or low-rank (q_a_proj -> RMSNorm -> q_b_proj); kv_a_proj_with_mqa gives
the compressed latent (kv_lora_rank) and one rotary key part shared by the heads
(qk_rope_head_dim); the latent, normed, goes through kv_b_proj to each head's non-rotary key
(qk_nope_head_dim) and value (v_head_dim). Rotary acts on the rotary parts only (rope_interleave:
adjacent pairs); logits scaled by cfg.latent_scale. A decoding cache holds the normed latent and the
rotated key part, {"latent": (B, L, r), "k_rot": (B, L, dr)}: the memory MLA exists for.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from flax_blocks.core import declarations
from flax_blocks.core.config import BlockConfig
from flax_blocks.core.context import AttentionCall
from flax_blocks.core.rope import interleave_order

from .attention import Attention, rotary
from .layers import Linear, Norm


class LatentAttention(Attention):
    """Multi-head latent attention (see `declarations.latent_attention`; HF's parameter names):
    q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj. Called as `Attention` (self-attention only); the explicit softmax always."""

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_layernorm: Norm | None
    q_b_proj: Linear | None
    kv_a_proj_with_mqa: Linear
    kv_a_layernorm: Norm
    kv_b_proj: Linear
    o_proj: Linear

    def __init__(self, cfg: BlockConfig, component: declarations.Component | None = None, *,
                 generator: torch.Generator | None = None):
        torch.nn.Module.__init__(self)
        component = component or declarations.latent_attention(cfg)
        self.cfg = cfg
        norm_cfg = replace(cfg, layer_norm_eps=cfg.latent_norm_eps)  # HF's DeepseekV3RMSNorm(r): eps 1e-6
        for name, child in component.children:
            setattr(self, name, Norm(norm_cfg, child, generator=generator) if child.kind == "norm"
                    else Linear(cfg, child, generator=generator))
        for name in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"):
            if not hasattr(self, name):
                setattr(self, name, None)
        self.sinks = None  # Attention's dense softmax takes no sinks here (BlockConfig refuses them with MLA)

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, E) -> (q (B, H, T, dn + dr), the normed latent (B, T, r), the rotary key (B, T, dr)),
        rotary applied at positions ((T,) or (B, T)) to the rotary parts."""
        cfg = self.cfg
        b, t, _ = x.shape
        dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, cfg.num_heads, dn + dr)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, dr], dim=-1)
        q_rot, k_rot = self.rotate(q[..., dn:], positions), self.rotate(k_rot[:, :, None], positions)[:, :, 0]
        q = torch.cat([q[..., :dn], q_rot], dim=-1).transpose(1, 2)
        return q, self.kv_a_layernorm(latent), k_rot

    def rotate(self, a: Tensor, positions: Tensor) -> Tensor:
        """Rotary on a (B, T, heads, dr): rotate-half, on the dims ordered evens first under rope_interleave."""
        cfg = self.cfg
        if cfg.rope_interleave:
            a = a[..., torch.as_tensor(interleave_order(a.shape[-1])[0])]
        assert cfg.rope_theta is not None  # the config checks it
        return rotary(a, positions, cfg.rope_theta, None, cfg.rope_scaling)

    def expand(self, latent: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
        """The heads' keys (B, H, S, dn + dr) and values (B, H, S, dv) of the latent (B, S, r) and
        the rotary key (B, S, dr) shared by the heads."""
        cfg = self.cfg
        b, s, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, :, None].expand(-1, -1, cfg.num_heads, -1)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: Tensor, call: AttentionCall | None = None, need_weights: bool = False,
                ) -> tuple[Tensor, Tensor | None, Tensor | None, dict[str, Tensor] | None]:
        """Self-attention of x (B, T, E) as `Attention.forward` (mask, positions, index, its returns);
        cache {"latent": (B, L, r), "k_rot": (B, L, dr)}: the chunk's latent and rotary key written at
        index .. index+T-1, the keys and values of all L positions expanded from it."""
        call = call or AttentionCall()
        if call.cross:
            raise ValueError("multi-head latent attention is a self-attention: it takes no memory")
        b, t, _ = x.shape
        masked, rows, bias, _ = (None, None, None, False) if call.mask is None else call.mask
        cache, index = call.cache, call.index
        positions = index + torch.arange(t, device=x.device) if call.positions is None else call.positions
        q, latent, k_rot = self.project(x, positions)
        if cache is not None:
            lat, rot = cache["latent"].clone(), cache["k_rot"].clone()
            lat[:, index:index + t], rot[:, index:index + t] = latent, k_rot
            cache = {"latent": lat, "k_rot": rot}
            latent, k_rot = lat, rot
        k, v = self.expand(latent, k_rot)
        out, weights, logit_max = self._dense(q, k, v, masked, rows, bias, self.cfg.dropout if self.training else 0.0)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        if rows is not None:  # a query with no key gets no attention output, bias included
            out = torch.where(rows.any(dim=1), out, 0.0)
        return out, (weights if need_weights else None), (logit_max if need_weights else None), cache

    def logits(self, qk: Tensor, masked: Tensor | None, bias: Tensor | None) -> Tensor:
        """q.k (B, H, T, S) times cfg.latent_scale, in float32 at least; a float mask added, masked pairs -inf."""
        logits = qk * self.cfg.latent_scale
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if bias is not None:
            logits = logits + bias
        return logits if masked is None else logits.masked_fill(masked, float("-inf"))


def latent_cache(cfg: BlockConfig, batch: int, length: int, dtype: torch.dtype, device=None) -> dict[str, Tensor]:
    """An empty decoding cache of one latent attention: {"latent": (B, L, r), "k_rot": (B, L, dr)}."""
    assert cfg.kv_lora_rank is not None
    return {"latent": torch.zeros(batch, length, cfg.kv_lora_rank, dtype=dtype, device=device),
            "k_rot": torch.zeros(batch, length, cfg.qk_rope_head_dim, dtype=dtype, device=device)}
