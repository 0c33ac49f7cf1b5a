"""The experts MLP (a mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) in PyTorch, the
twin of `flax_blocks.experts`, computed as HF's eager experts: a loop over the experts that have
tokens, each on its tokens alone; and HF's load-balancing loss.

Routing: logits = t @ router^T (N, X); softmax over all experts in float32 at least; the top k
(ties: the lowest index, as the Flax twin's jax.lax.top_k; torch.topk's order among equal values
is implementation-defined, e.g. top-2 of 8 equal values gives experts [6, 5] on CPU, so the twin
takes a stable sort instead); the k weights renormalised when cfg.norm_topk_prob.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flax_blocks.core.config import BlockConfig, check_router_logits, is_moe_layer
from flax_blocks.core.declarations import Component

from .layers import ACTIVATION_FNS, Linear, create_params


def route(cfg: BlockConfig, logits: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Router logits (N, X) -> (weights (N, k) in float32 at least, experts (N, k)): the top k of
    the softmax over all experts (cfg.routing "llama4": the top k logits, weighted by their sigmoid;
    ties: the lower index first), renormalised when cfg.norm_topk_prob;
    DeepSeek's routings (cfg.routing; bias: V3's e_score_correction_bias) in `deepseek_route`."""
    if cfg.routing == "llama4":  # the top k logits, each weight their sigmoid (HF Llama4Router)
        experts = _top(logits, cfg.num_experts_per_tok)
        weights = torch.sigmoid(logits.gather(1, experts).to(torch.promote_types(logits.dtype, torch.float32)))
    elif cfg.routing != "softmax":
        return deepseek_route(cfg, logits, bias)
    else:
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, experts = weights[:, :cfg.num_experts_per_tok], experts[:, :cfg.num_experts_per_tok]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _top(a: Tensor, k: int) -> Tensor:
    """The indices of the k largest entries of a's last axis, ties to the lower index (as jax.lax.top_k)."""
    return torch.sort(a, dim=-1, descending=True, stable=True)[1][..., :k]


def deepseek_route(cfg: BlockConfig, logits: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """DeepSeek V2's / V3's routing of logits (N, X) -> (weights (N, k), experts (N, k)): the twin of
    `flax_blocks.experts.deepseek_route` (its docstring has the rules)."""
    n_experts, g = cfg.num_experts, cfg.n_group
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if cfg.routing == "deepseek_v2":
        scores = torch.softmax(logits, dim=-1)
        choice = scores
        groups = choice.view(-1, g, n_experts // g).amax(dim=-1)  # (N, n_group)
    else:
        assert bias is not None  # declared with the routing
        scores = torch.sigmoid(logits)
        choice = scores + bias.to(scores.dtype)
        groups = choice.view(-1, g, n_experts // g).topk(2, dim=-1)[0].sum(dim=-1)
    in_kept = torch.zeros_like(groups, dtype=torch.bool).scatter(1, _top(groups, cfg.topk_group), True)
    in_kept = in_kept.repeat_interleave(n_experts // g, dim=-1)  # (N, X)
    choice = choice.masked_fill(~in_kept, 0.0 if cfg.routing == "deepseek_v2" else float("-inf"))
    experts = _top(choice.detach(), cfg.num_experts_per_tok)
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


class Experts(nn.Module):
    """The experts MLP on a token matrix t (N, E) -> (y (N, E), router logits (N, X)).
    Params: router (X, E), up / gate (X, F, E), down (X, E, F) (each expert's matrices as
    nn.Linear holds them); with experts_bias (GPT-OSS) router_bias (X,), up_bias / gate_bias (X, F),
    down_bias (X, E); shared_up / shared_gate / shared_down (Linear) and shared_expert_gate
    (1, E) with a shared expert. Declared in `declarations.experts`."""

    router: nn.Parameter
    up: nn.Parameter
    gate: nn.Parameter | None
    down: nn.Parameter
    router_bias: nn.Parameter | None
    up_bias: nn.Parameter | None
    gate_bias: nn.Parameter | None
    down_bias: nn.Parameter | None
    shared_expert_gate: nn.Parameter | None
    shared_up: Linear | None
    shared_gate: Linear | None
    shared_down: Linear | None
    e_score_correction_bias: nn.Parameter | None

    def __init__(self, cfg: BlockConfig, component: Component, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.act = ACTIVATION_FNS[cfg.activation]
        create_params(self, component, cfg, generator)
        for name, child in component.children:
            setattr(self, name, Linear(cfg, child, generator=generator))
        for name in ("gate", "router_bias", "up_bias", "gate_bias", "down_bias", "shared_expert_gate", "shared_up",
                     "shared_gate", "shared_down", "e_score_correction_bias"):
            if not hasattr(self, name):
                setattr(self, name, None)

    def hidden(self, up: Tensor, gate: Tensor | None) -> Tensor:
        """An expert's hidden layer from its up and gate products (N, F): act(up), act(gate) * up, or
        GPT-OSS's clamped SwiGLU (cfg.swiglu_limit) in HF GptOssExperts._apply_gate's order."""
        limit = self.cfg.swiglu_limit
        if gate is None:
            return self.act(up)
        if limit is None:
            return self.act(gate) * up
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * self.cfg.swiglu_alpha))

    def forward(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """t (N, E) -> (y (N, E), router logits (N, X)): y = sum over the k chosen experts of w MLP(t),
        or MLP(w t) with cfg.routing_weights_on "input" (Llama 4), plus the shared expert."""
        def bias(p: nn.Parameter | None, i: int) -> Tensor | None:
            return None if p is None else p[i]

        logits = F.linear(t, self.router, self.router_bias)
        weights, experts = route(self.cfg, logits, self.e_score_correction_bias)
        y = torch.zeros_like(t)
        on_input = self.cfg.routing_weights_on == "input"
        hit = torch.zeros(self.cfg.num_experts, dtype=torch.bool, device=t.device)
        hit[experts.reshape(-1)] = True
        for i in hit.nonzero().flatten().tolist():  # the experts that have tokens
            token, slot = torch.where(experts == i)
            w = weights[token, slot, None].to(t.dtype)
            h = t[token] * w if on_input else t[token]  # Llama 4: the expert runs on its weight times the token
            g = None if self.gate is None else F.linear(h, self.gate[i], bias(self.gate_bias, i))
            a = self.hidden(F.linear(h, self.up[i], bias(self.up_bias, i)), g)
            out = F.linear(a, self.down[i], bias(self.down_bias, i))
            out = out if on_input else out * w
            y = y.index_add(0, token, out)
        if self.shared_up is not None:
            assert self.shared_down is not None
            a = self.shared_up(t)
            a = self.act(a) if self.shared_gate is None else self.act(self.shared_gate(t)) * a
            gate = 1.0 if self.shared_expert_gate is None else torch.sigmoid(F.linear(t, self.shared_expert_gate))
            y = y + gate * self.shared_down(a)
        return y, logits


def load_balancing_loss(cfg: BlockConfig, router_logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """HF's auxiliary load-balancing loss from a stack's router logits (L, B, T, X) (or one layer's
    (B, T, X)), mask (B, T) True where a token counts; layers that run a dense MLP left out. The twin
    of `flax_blocks.experts.load_balancing_loss` (its docstring has the formula)."""
    check_router_logits(cfg, tuple(router_logits.shape))
    logits = router_logits if router_logits.dim() == 4 else router_logits[None]
    moe = [i for i in range(logits.shape[0]) if is_moe_layer(cfg, i + 1)]
    logits = logits[moe]
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (L, B, T, X)
    chosen = torch.sort(probs, dim=-1, descending=True, stable=True)[1][..., :cfg.num_experts_per_tok]
    picked = F.one_hot(chosen, cfg.num_experts).to(probs.dtype)  # (L, B, T, k, X)
    if mask is None:
        f, p = picked.mean(dim=(0, 1, 2)), probs.mean(dim=(0, 1, 2))
    else:
        m = mask.to(probs.dtype)[None].expand(logits.shape[:3])
        f = (picked * m[..., None, None]).sum(dim=(0, 1, 2)) / m.sum()
        p = (probs * m[..., None]).sum(dim=(0, 1, 2)) / m.sum()
    return (f * p[None]).sum() * cfg.num_experts
