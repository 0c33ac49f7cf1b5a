"""The experts MLP (a mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek, GPT-OSS, Llama 4) in Flax NNX,
the twin of `torch_blocks.experts`; the load-balancing loss HF's models add in training.

Routing (`route`): logits = t @ router (N, X); probabilities = softmax over all X experts in
float32 at least; the top k pick each token's experts (ties: the lowest index); the k weights
renormalised when cfg.norm_topk_prob. Dispatch costs what the active experts cost: the N * k
(token, expert) rows are sorted by expert into blocks of one expert each (`block_rows`), and
`grouped_mlp` runs a loop over the experts that have rows, each expert's weights sliced once, with
an inner loop over its blocks running each block's whole MLP; its backward (a custom VJP) runs the
same loops, each expert's weight gradients started from its first block's products, summed over
its other blocks in the inner loop's carry and written once. Blocks hold the mean rows per expert
plus two standard deviations (`block_size`), so most experts run one block. Experts without rows
cost nothing; no capacity, no token dropped: static shapes bound the blocks by N * k / block + X.

`jax.lax.ragged_dot` is the obvious tool, but XLA:CPU (jax 0.10) computes it densely, every row
through every expert: 0.36 s for 8 experts and 1.9 s for 64 where one expert's matmul takes 0.03 s
(4096 x 2 rows, 256 -> 512). A batched product over every expert's first block (an einsum with a
batch dimension: each weight read once, no loop) was measured too and costs more on XLA:CPU than
the loop (1.40x against 1.09x the 8-experts forward at 64 experts). experiments/bench/moe.py
measures the loops at 8 and 64 experts top-2 and 32 and 256 top-8 against a dense MLP of the
active width, with an op profile (results in experiments/bench/results/moe/summary.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .core.config import BlockConfig, check_router_logits, is_moe_layer
from .core.declarations import Component
from .layers import ACTIVATION_FNS, Linear, compute_dtype, create_params, initial_values


def route(cfg: BlockConfig, logits: jax.Array, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits (N, X) -> (weights (N, k) in float32 at least, experts (N, k) int32): the top k
    of the softmax over all experts (cfg.routing "llama4": the top k logits, weighted by their
    sigmoid), renormalised when cfg.norm_topk_prob; DeepSeek's routings (cfg.routing, bias: V3's
    e_score_correction_bias (X,)) in `deepseek_route`. jax.lax.top_k puts the lower index first
    among equal values."""
    if cfg.routing == "llama4":  # the top k logits, each weight their sigmoid (HF Llama4Router)
        top, experts = jax.lax.top_k(logits, cfg.num_experts_per_tok)
        weights = jax.nn.sigmoid(top.astype(jnp.promote_types(logits.dtype, jnp.float32)))
    elif cfg.routing != "softmax":
        return deepseek_route(cfg, logits, bias)
    else:
        probs = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
        weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def deepseek_route(cfg: BlockConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's routing of router logits (N, X) -> (weights (N, k), experts (N, k) int32), in float32
    at least. V2 (cfg.routing "deepseek_v2"): scores = softmax, each of the n_group groups ranked by
    its best score. V3 ("deepseek_v3"): scores = sigmoid, choice = scores + bias (the
    e_score_correction_bias, for choosing only), each group ranked by the sum of its two best choices.
    The topk_group best groups kept (the others' choices 0 in V2, -inf in V3, as HF), the top k
    choices taken; weights = the unbiased scores of those k, divided by their sum (+ 1e-20) with
    norm_topk_prob, times routed_scaling_factor."""
    n_experts, g = cfg.num_experts, cfg.n_group
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if cfg.routing == "deepseek_v2":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        groups = jnp.max(choice.reshape(-1, g, n_experts // g), axis=-1)  # (N, n_group)
    else:
        assert bias is not None  # declared with the routing
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias.astype(scores.dtype)
        groups = jnp.sum(jax.lax.top_k(choice.reshape(-1, g, n_experts // g), 2)[0], axis=-1)
    kept = jax.lax.top_k(groups, cfg.topk_group)[1]  # (N, topk_group)
    in_kept = jnp.any(kept[:, :, None] == jnp.arange(g), axis=1)  # (N, n_group)
    in_kept = jnp.repeat(in_kept, n_experts // g, axis=-1)  # (N, X)
    choice = jnp.where(in_kept, choice, 0.0 if cfg.routing == "deepseek_v2" else -jnp.inf)
    experts = jax.lax.top_k(jax.lax.stop_gradient(choice), cfg.num_experts_per_tok)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)


def block_size(rows: int, num_experts: int) -> int:
    """Rows per block for `rows` (token, expert) pairs over `num_experts`: the mean rows per expert
    m = rows / X plus two of its standard deviations under balanced routing (m + 2 sqrt(m)), a
    multiple of 8 from 8 to 256: most experts then run one block (one product per weight and no
    gradient summed over blocks), padding stays near what blocks of m / 2 pad, and a block stays a
    matmul XLA runs well (experiments/bench/moe.py's profile: blocks of m / 2 cost 1.1-1.2x more)."""
    m = rows / num_experts
    return int(min(max(8 * math.ceil((m + 2 * math.sqrt(m)) / 8), 8), 256))


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


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's gated hidden layer, taken as `act` by `grouped_mlp` (cfg.swiglu_limit): gate clamped
    above at limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), in HF
    GptOssExperts._apply_gate's order of operations."""

    limit: float
    alpha: float

    def glu(self, hu: jax.Array, hg: jax.Array) -> jax.Array:
        g = jnp.minimum(hg, self.limit)
        return (jnp.clip(hu, -self.limit, self.limit) + 1) * (g * jax.nn.sigmoid(g * self.alpha))


def _hidden(act, hu: jax.Array, hg: jax.Array | None) -> jax.Array:
    if hg is None:
        return act(hu)
    return act.glu(hu, hg) if isinstance(act, ClampedSwiGLU) else act(hg) * hu


def expert_blocks(experts: jax.Array, num_experts: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each expert's blocks lie in `block_rows`' layout: -> (first (X,): its first block,
    count (X,): its number of blocks, order (X,): the experts that have rows first, in order, then
    the others); the number of experts with rows is the number of nonzero counts."""
    counts = jnp.bincount(experts, length=num_experts)
    blocks = ((counts + block - 1) // block).astype(jnp.int32)
    first = (jnp.cumsum(blocks) - blocks).astype(jnp.int32)
    order = jnp.argsort(blocks == 0, stable=True).astype(jnp.int32)
    return first, blocks, order


def _per_expert(layout, weights, per_expert, init):
    """For each expert with rows (a loop over those alone): w = its slices of `weights`, carry =
    per_expert(e, w, first, stop, carry), its blocks being first .. stop - 1 (at least one)."""
    first, count, order = layout

    def one(j, c):
        e = order[j]
        w = tuple(None if a is None else a[e] for a in weights)
        return per_expert(e, w, first[e], first[e] + count[e], c)

    return jax.lax.fori_loop(0, jnp.sum((count > 0).astype(jnp.int32)), one, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blocks_mlp(rows, up, gate, down, layout, act):
    return _blocks_mlp_fwd(rows, up, gate, down, layout, act)[0]


def _blocks_mlp_fwd(rows, up, gate, down, layout, act):
    """A loop over the experts with rows, each expert's weights sliced once, and an inner loop over
    its blocks, each block's whole MLP (up, gate, act, down) in turn; saves each block's up and
    gate products for the backward."""
    f = up.shape[2]

    def body(i, w, c):
        wu, wg, wd = w
        y, hus, hgs = c
        hu = rows[i] @ wu
        hg = None if wg is None else rows[i] @ wg
        y = jax.lax.dynamic_update_index_in_dim(y, _hidden(act, hu, hg) @ wd, i, 0)
        hus = jax.lax.dynamic_update_index_in_dim(hus, hu, i, 0)
        hgs = hgs if hg is None else jax.lax.dynamic_update_index_in_dim(hgs, hg, i, 0)
        return y, hus, hgs

    nb, b = rows.shape[:2]
    dt = jnp.result_type(rows, up)
    init = (jnp.zeros((nb, b, down.shape[2]), dt), jnp.zeros((nb, b, f), dt),
            None if gate is None else jnp.zeros((nb, b, f), dt))
    y, hus, hgs = _per_expert(layout, (up, gate, down), lambda e, w, first, stop, c: jax.lax.fori_loop(
        first, stop, lambda i, c: body(i, w, c), c), init)
    return y, (rows, up, gate, down, layout, hus, hgs)


def _blocks_mlp_bwd(act, res, g):
    """The same loops: each block's d rows; each expert's weight gradients (d down[e] = sum h^T g,
    d up[e] = sum rows^T d hu, ...) start from its first block's products and sum its other blocks'
    in the inner loop's carry, then are written once (no zeros summed into, no sum for an expert of
    one block: `block_size` makes that the common case)."""
    rows, up, gate, down, layout, hus, hgs = res

    def block(i, w):
        """Block i's (d up, d gate, d down) products and its d rows."""
        wu, wg, wd = w
        hg = None if hgs is None else hgs[i]
        h, pull = jax.vjp(lambda hu, hg: _hidden(act, hu, hg), hus[i], hg)
        dhu, dhg = pull(g[i] @ wd.T)
        dr = dhu @ wu.T
        if wg is not None:
            dr = dr + dhg @ wg.T
        return (rows[i].T @ dhu, None if wg is None else rows[i].T @ dhg, h.T @ g[i]), dr

    def body(i, w, c):
        dw, drows = c
        d, dr = block(i, w)
        return (tuple(None if a is None else a + b for a, b in zip(dw, d, strict=True)),
                jax.lax.dynamic_update_index_in_dim(drows, dr, i, 0))

    def per_expert(e, w, first, stop, c):
        dup, dgate, ddown, drows = c
        put = jax.lax.dynamic_update_index_in_dim
        dw, dr = block(first, w)
        dw, drows = jax.lax.fori_loop(first + 1, stop, lambda i, c: body(i, w, c), (dw, put(drows, dr, first, 0)))
        return (put(dup, dw[0], e, 0), None if dgate is None else put(dgate, dw[1], e, 0), put(ddown, dw[2], e, 0),
                drows)

    init = (jnp.zeros_like(up), None if gate is None else jnp.zeros_like(gate), jnp.zeros_like(down),
            jnp.zeros_like(rows))
    dup, dgate, ddown, drows = _per_expert(layout, (up, gate, down), per_expert, init)
    return drows, dup, dgate, ddown, None


_blocks_mlp.defvjp(_blocks_mlp_fwd, _blocks_mlp_bwd)


def grouped_mlp(x: jax.Array, experts: jax.Array, up: jax.Array, gate: jax.Array | None, down: jax.Array,
                act, block: int | None = None) -> jax.Array:
    """Row a of x (A, E) through expert experts[a]'s MLP: down(act(gate(x)) * up(x)) (gated) or
    down(act(up(x))) -> (A, E). up, gate (X, E, F), down (X, F, E). The rows are sorted into blocks
    of one expert each (`block_rows`; `block` rows, `block_size` unless given); a loop over the
    experts that have rows slices each one's weights once and runs its blocks' whole MLP in an inner
    loop; the backward (a custom VJP) runs the same loops, each expert's weight gradients summed in
    the inner loop's carry. Experts without rows cost nothing."""
    a, n = x.shape[0], up.shape[0]
    b = block or block_size(a, n)
    slot, _, _, nb = block_rows(experts, n, b)
    rows = jnp.zeros((nb * b, x.shape[1]), x.dtype).at[slot].set(x, unique_indices=True).reshape(nb, b, -1)
    y = _blocks_mlp(rows, up, gate, down, expert_blocks(experts, n, b), act).reshape(nb * b, -1)
    return y.at[slot].get(unique_indices=True)


class Experts(nnx.Module):
    """The experts MLP on a token matrix t (N, E) -> (y (N, E), router logits (N, X)).
    Params: router (E, X), up / gate (X, E, F), down (X, F, E); with experts_bias (GPT-OSS)
    router_bias (X,), up_bias / gate_bias (X, F), down_bias (X, E); shared_up / shared_gate /
    shared_down (Linear) and shared_expert_gate (E, 1) with a shared expert. The twin of
    `torch_blocks.experts.Experts`; declared in `declarations.experts`."""

    router: nnx.Param[jax.Array]
    up: nnx.Param[jax.Array]
    gate: nnx.Param[jax.Array] | None
    down: nnx.Param[jax.Array]
    router_bias: nnx.Param[jax.Array] | None
    up_bias: nnx.Param[jax.Array] | None
    gate_bias: nnx.Param[jax.Array] | None
    down_bias: nnx.Param[jax.Array] | None
    shared_expert_gate: nnx.Param[jax.Array] | None
    shared_up: Linear | None
    shared_gate: Linear | None
    shared_down: Linear | None
    e_score_correction_bias: nnx.Param[jax.Array] | None

    def __init__(self, cfg: BlockConfig, component: Component, *, rngs: nnx.Rngs,
                 values: dict[str, Any] | None = None):
        self.cfg = cfg
        self.act = ACTIVATION_FNS[cfg.activation]
        self.glu = self.act if cfg.swiglu_limit is None else ClampedSwiGLU(cfg.swiglu_limit, cfg.swiglu_alpha)
        self.dtype = compute_dtype(cfg)
        if values is None:
            values = initial_values(rngs.params(), component, cfg)
        create_params(self, component, cfg, rngs, values)
        for name, child in component.children:
            setattr(self, name, Linear(cfg, child, rngs=rngs, values=values[name]))
        for name in ("gate", "router_bias", "up_bias", "gate_bias", "down_bias", "shared_expert_gate", "shared_up",
                     "shared_gate", "shared_down", "e_score_correction_bias"):
            if not hasattr(self, name):
                setattr(self, name, None)

    def __call__(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """t (N, E) -> (y (N, E), router logits (N, X) in t's dtype): y = sum over the k chosen experts
        of w MLP(t), or MLP(w t) with cfg.routing_weights_on "input" (Llama 4), plus the shared expert."""
        def get(p):
            return None if p is None else p[...]

        t, router, up, gate, down, rb, ub, gb, db = nnx.nn.dtypes.promote_dtype(
            (t, self.router[...], self.up[...], get(self.gate), self.down[...], get(self.router_bias),
             get(self.up_bias), get(self.gate_bias), get(self.down_bias)), dtype=self.dtype)
        logits = t @ router if rb is None else t @ router + rb
        weights, experts = self.route(logits)
        n, k = experts.shape
        rows = jnp.repeat(t, k, axis=0)  # (N k, E)
        on_input = self.cfg.routing_weights_on == "input"
        if on_input:  # Llama 4: each expert runs on its weight times the token
            rows = rows * weights.reshape(-1, 1).astype(rows.dtype)
        if ub is not None:  # the up / gate biases as one more input row of ones (grouped_mlp's padding stays 0)
            rows = jnp.concatenate([rows, jnp.ones((n * k, 1), rows.dtype)], axis=1)
            up = jnp.concatenate([up, ub[:, None]], axis=1)  # (X, E + 1, F)
            gate = None if gate is None or gb is None else jnp.concatenate([gate, gb[:, None]], axis=1)
        y = grouped_mlp(rows, experts.reshape(-1), up, gate, down, self.glu)
        if db is not None:
            y = y + db[experts.reshape(-1)]
        y = y.reshape(n, k, -1)
        y = jnp.sum(y if on_input else y * weights[..., None].astype(y.dtype), axis=1)
        if self.shared_up is not None:
            y = y + self.shared(t)
        return y, logits

    def route(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Router logits (N, X) -> (weights (N, k), experts (N, k)): `route`."""
        bias = getattr(self, "e_score_correction_bias", None)
        return route(self.cfg, logits, None if bias is None else bias[...])

    def shared(self, t: jax.Array) -> jax.Array:
        """The shared expert on t (N, E), times its gate sigmoid(t . w) (Qwen2-MoE; DeepSeek's has none) -> (N, E)."""
        assert self.shared_up is not None and self.shared_down is not None
        h = _hidden(self.act, self.shared_up(t), None if self.shared_gate is None else self.shared_gate(t))
        if self.shared_expert_gate is None:
            return self.shared_down(h)
        return jax.nn.sigmoid(t @ self.shared_expert_gate[...].astype(t.dtype)) * self.shared_down(h)


def load_balancing_loss(cfg: BlockConfig, router_logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """HF's auxiliary load-balancing loss (Switch Transformer's; transformers'
    `load_balancing_loss_func`) from a stack's router logits (L, B, T, X) (or one layer's (B, T, X)):
    X * sum_x f_x * P_x, f_x the fraction of (token, slot) picks of expert x over the k slots, P_x the
    mean router probability, over the tokens of every experts layer (mask (B, T): True where a token
    counts, HF's attention_mask). Layers that run a dense MLP (`is_moe_layer`) are left out, as HF
    returns no logits for them. Multiply by router_aux_loss_coef and add to the loss to train."""
    check_router_logits(cfg, router_logits.shape)
    logits = router_logits if router_logits.ndim == 4 else router_logits[None]
    moe = [i for i in range(logits.shape[0]) if is_moe_layer(cfg, i + 1)]
    logits = logits[jnp.asarray(moe)] if len(moe) < logits.shape[0] else logits
    n_experts, k = cfg.num_experts, cfg.num_experts_per_tok
    probs = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)  # (L, B, T, X)
    _, chosen = jax.lax.top_k(probs, k)
    picked = jax.nn.one_hot(chosen, n_experts, dtype=probs.dtype)  # (L, B, T, k, X)
    if mask is None:
        f = jnp.mean(picked, axis=(0, 1, 2))  # (k, X)
        p = jnp.mean(probs, axis=(0, 1, 2))  # (X,)
    else:
        m = jnp.broadcast_to(jnp.asarray(mask, probs.dtype)[None], logits.shape[:3])
        f = jnp.sum(picked * m[..., None, None], axis=(0, 1, 2)) / jnp.sum(m)
        p = jnp.sum(probs * m[..., None], axis=(0, 1, 2)) / jnp.sum(m)
    return jnp.sum(f * p[None]) * n_experts
