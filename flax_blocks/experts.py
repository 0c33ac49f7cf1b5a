"""The experts MLP (a mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) in Flax NNX,
the twin of `torch_blocks.experts`; the load-balancing loss HF's models add in training.

Routing (`route`): logits = t @ router (N, X); probabilities = softmax over all X experts in
float32 at least; the top k pick each token's experts (ties: the lowest index); the k weights
renormalised when cfg.norm_topk_prob. Dispatch costs what the active experts cost: the N * k
(token, expert) rows are sorted by expert into blocks of one expert each (`block_rows`), and each
projection is one grouped matmul over those blocks (`grouped_matmul`), a scan whose iterations
skip the empty tail; its backward (a custom VJP) accumulates each expert's weight gradient in
place. No capacity, no token dropped: static shapes bound the blocks by N * k / block + X.

`jax.lax.ragged_dot` is the obvious tool, but XLA:CPU (jax 0.10) computes it densely, every row
through every expert: 0.36 s for 8 experts and 1.9 s for 64 where one expert's matmul takes 0.03 s
(4096 x 2 rows, 256 -> 512); the blocks cost ~1.1x from 8 to 64 experts
(experiments/bench/moe.py measures it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .core.config import BlockConfig, is_moe_layer
from .core.declarations import Component
from .layers import ACTIVATION_FNS, Linear, compute_dtype, create_params, initial_values


def route(cfg: BlockConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Router logits (N, X) -> (weights (N, k) in float32 at least, experts (N, k) int32): the top k
    of the softmax over all experts, renormalised when cfg.norm_topk_prob. jax.lax.top_k puts the
    lower index first among equal values."""
    probs = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def block_size(rows: int, num_experts: int) -> int:
    """Rows per block for `rows` (token, expert) pairs over `num_experts`: a power of two near
    rows / (2 X), from 8 to 256: padding (at most X blocks' worth, on average half) stays a fraction
    of the rows, and a block stays a matmul XLA runs well."""
    b = max(rows // (2 * num_experts), 1)
    return int(min(max(1 << (b.bit_length() - 1), 8), 256))


def block_rows(experts: jax.Array, num_experts: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """The layout of A rows, row a going to expert experts[a] (A,), in blocks of `block` rows, each
    block one expert's: -> (slot (A,): row a's place in the blocks, block_expert (nb,), used (nb,):
    the blocks that hold rows, nb = ceil(A / block) + X, a static bound). Experts in order; each
    expert's rows in their order, padded to a multiple of `block`."""
    a = experts.shape[0]
    order = jnp.argsort(experts, stable=True)
    counts = jnp.bincount(experts, length=num_experts)
    padded = (counts + block - 1) // block * block
    ends = jnp.cumsum(padded)
    rank = jnp.zeros(a, jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[
        experts[order]].astype(jnp.int32))
    slot = (ends - padded)[experts].astype(jnp.int32) + rank
    nb = -(-a // block) + num_experts
    starts = jnp.arange(nb) * block
    block_expert = jnp.minimum(jnp.searchsorted(ends, starts, side="right"), num_experts - 1).astype(jnp.int32)
    return slot, block_expert, starts < ends[-1], nb


@jax.custom_vjp
def grouped_matmul(rows: jax.Array, w: jax.Array, block_expert: jax.Array, used: jax.Array) -> jax.Array:
    """rows (nb, b, I) @ w[block_expert] (X, I, O) block by block -> (nb, b, O); unused blocks give zeros."""
    def one(_, xs):
        r, e, u = xs
        return None, jax.lax.cond(u, lambda r: r @ w[e], lambda r: jnp.zeros((r.shape[0], w.shape[2]), r.dtype), r)
    return jax.lax.scan(one, None, (rows, block_expert, used))[1]


def _grouped_matmul_fwd(rows, w, block_expert, used):
    return grouped_matmul(rows, w, block_expert, used), (rows, w, block_expert, used)


def _grouped_matmul_bwd(res, g):
    """d rows = g @ w[e]^T per block; d w[e] += rows^T @ g, accumulated in place in the scan's carry."""
    rows, w, block_expert, used = res

    def one(dw, xs):
        r, gb, e, u = xs
        return jax.lax.cond(u, lambda dw: (dw.at[e].add(r.T @ gb), gb @ w[e].T),
                            lambda dw: (dw, jnp.zeros_like(r)), dw)

    dw, drows = jax.lax.scan(one, jnp.zeros_like(w), (rows, g, block_expert, used))
    return drows, dw, None, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_mlp(x: jax.Array, experts: jax.Array, up: jax.Array, gate: jax.Array | None, down: jax.Array,
                act) -> jax.Array:
    """Row a of x (A, E) through expert experts[a]'s MLP: down(act(gate(x)) * up(x)) (gated) or
    down(act(up(x))) -> (A, E). up, gate (X, E, F), down (X, F, E)."""
    a, n = x.shape[0], up.shape[0]
    slot, block_expert, used, nb = block_rows(experts, n, block_size(a, n))
    b = block_size(a, n)
    rows = jnp.zeros((nb * b, x.shape[1]), x.dtype).at[slot].set(x).reshape(nb, b, -1)
    h = grouped_matmul(rows, up, block_expert, used)
    h = act(h) if gate is None else act(grouped_matmul(rows, gate, block_expert, used)) * h
    return grouped_matmul(h, down, block_expert, used).reshape(nb * b, -1)[slot]


class Experts(nnx.Module):
    """The experts MLP on a token matrix t (N, E) -> (y (N, E), router logits (N, X)).
    Params: router (E, X), up / gate (X, E, F), down (X, F, E); shared_up / shared_gate /
    shared_down (Linear) and shared_expert_gate (E, 1) with a shared expert. The twin of
    `torch_blocks.experts.Experts`; declared in `declarations.experts`."""

    router: nnx.Param[jax.Array]
    up: nnx.Param[jax.Array]
    gate: nnx.Param[jax.Array] | None
    down: nnx.Param[jax.Array]
    shared_expert_gate: nnx.Param[jax.Array] | None
    shared_up: Linear | None
    shared_gate: Linear | None
    shared_down: Linear | None

    def __init__(self, cfg: BlockConfig, component: Component, *, rngs: nnx.Rngs,
                 values: dict[str, Any] | None = None):
        self.cfg = cfg
        self.act = ACTIVATION_FNS[cfg.activation]
        self.dtype = compute_dtype(cfg)
        if values is None:
            values = initial_values(rngs.params(), component, cfg)
        create_params(self, component, cfg, rngs, values)
        for name, child in component.children:
            setattr(self, name, Linear(cfg, child, rngs=rngs, values=values[name]))
        for name in ("gate", "shared_expert_gate", "shared_up", "shared_gate", "shared_down"):
            if not hasattr(self, name):
                setattr(self, name, None)

    def __call__(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """t (N, E) -> (y (N, E), router logits (N, X) in t's dtype)."""
        gate = None if self.gate is None else self.gate[...]
        t, router, up, gate, down = nnx.nn.dtypes.promote_dtype(
            (t, self.router[...], self.up[...], gate, self.down[...]), dtype=self.dtype)
        logits = t @ router
        weights, experts = self.route(logits)
        n, k = experts.shape
        y = grouped_mlp(jnp.repeat(t, k, axis=0), experts.reshape(-1), up, gate, down, self.act)
        y = jnp.sum(y.reshape(n, k, -1) * weights[..., None].astype(y.dtype), axis=1)
        if self.shared_up is not None:
            y = y + self.shared(t)
        return y, logits

    def route(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Router logits (N, X) -> (weights (N, k), experts (N, k)): `route`."""
        return route(self.cfg, logits)

    def shared(self, t: jax.Array) -> jax.Array:
        """The shared expert on t (N, E), times its gate sigmoid(t . w) -> (N, E)."""
        assert self.shared_up is not None and self.shared_down is not None and self.shared_expert_gate is not None
        h = self.shared_up(t)
        h = self.act(h) if self.shared_gate is None else self.act(self.shared_gate(t)) * h
        return jax.nn.sigmoid(t @ self.shared_expert_gate[...].astype(t.dtype)) * self.shared_down(h)


def load_balancing_loss(cfg: BlockConfig, router_logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """HF's auxiliary load-balancing loss (Switch Transformer's; transformers'
    `load_balancing_loss_func`) from a stack's router logits (L, B, T, X) (or one layer's (B, T, X)):
    X * sum_x f_x * P_x, f_x the fraction of (token, slot) picks of expert x over the k slots, P_x the
    mean router probability, over the tokens of every experts layer (mask (B, T): True where a token
    counts, HF's attention_mask). Layers that run a dense MLP (`is_moe_layer`) are left out, as HF
    returns no logits for them. Multiply by router_aux_loss_coef and add to the loss to train."""
    logits = router_logits if router_logits.ndim == 4 else router_logits[None]
    moe = [i for i in range(logits.shape[0]) if is_moe_layer(cfg, i + 1)]
    logits = logits[jnp.asarray(moe)] if len(moe) < logits.shape[0] else logits
    x, k = cfg.num_experts, cfg.num_experts_per_tok
    probs = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)  # (L, B, T, X)
    _, chosen = jax.lax.top_k(probs, k)
    picked = jax.nn.one_hot(chosen, x, dtype=probs.dtype)  # (L, B, T, k, X)
    if mask is None:
        f = jnp.mean(picked, axis=(0, 1, 2))  # (k, X)
        p = jnp.mean(probs, axis=(0, 1, 2))  # (X,)
    else:
        m = jnp.broadcast_to(jnp.asarray(mask, probs.dtype)[None], logits.shape[:3])
        f = jnp.sum(picked * m[..., None, None], axis=(0, 1, 2)) / jnp.sum(m)
        p = jnp.sum(probs * m[..., None], axis=(0, 1, 2)) / jnp.sum(m)
    return jnp.sum(f * p[None]) * x
