"""Twin construction and comparison: weights made once in torch, moved with the converter,
each framework then runs its own code on the same inputs.

Errors are relative to the output's scale: max|a - b| / max|b|.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import flax_blocks as fb
import torch_blocks as tb
from flax_blocks.checkpoints.convert import from_torch, torch_state_dict
from flax_blocks.core.config import invert_mask

from ..port.errors import rel_err  # one definition: the port checker and the twins measure alike

KINDS = ("ResidualMHA", "FeedForward", "TransformerBlock", "Encoder")
DECODERS = ("DecoderBlock", "Decoder")  # take a memory (B, S, E) besides x
STACKS = ("Encoder", "Decoder")
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}

# The tolerances; each has a negative test (a wrong twin must exceed it).
TOL = {
    ("forward", "float32"): 2e-6,
    ("forward", "float64"): 1e-12,
    ("grad", "float32"): 1e-5,
    ("grad", "float64"): 1e-11,
}


@contextlib.contextmanager
def precision(dtype: str) -> Iterator[None]:
    """float64 on in JAX when asked; full-precision matmuls on both sides (no TF32 / bf16 passes)."""
    old_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with jax.enable_x64(dtype == "float64"), jax.default_matmul_precision("highest"):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old_tf32


# ----------------------------------------------------------------------------------------
# Twins
# ----------------------------------------------------------------------------------------


@dataclass
class Case:
    """One parity case: a block kind and config, input shapes and which masks to use."""

    kind: str
    cfg: fb.BlockConfig
    num_layers: int = 2
    batch: int = 2
    seq: int = 5
    attention_mask: bool = False
    key_mask: bool = False
    left_pad: int = 0  # with key_mask: the first sequence's first keys padded too (left padding)
    final_norm: bool | None = None
    seed: int = 0
    input_scale: float = 1.0  # small inputs make a norm's eps matter (RMS ~ sqrt(eps))
    memory_seq: int = 4  # decoders: the memory's length S (!= seq, so a swapped axis cannot pass)
    memory_key_mask: bool = False  # decoders: pad the memory of the last sequence
    remat: str | None = None  # stacks: rematerialise each layer ("full" or a jax.checkpoint_policies name)
    scan_layers: bool = True  # Flax stacks: False unrolls the layers (torch has no such option)

    @property
    def intermediates(self) -> bool:
        """Whether the run asks for a stack's intermediates (the residual stream per layer):
        not under a forced "blocked" / "fused" attention, which returns no weights."""
        return self.kind in STACKS and self.cfg.attention not in ("blocked", "fused")

    @property
    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments beyond the config (an Encoder's depth and final norm)."""
        if self.kind not in STACKS:
            return {}
        return ({"num_layers": self.num_layers, "final_norm": self.final_norm}
                | ({"remat": self.remat} if self.remat else {}))

    @property
    def name(self) -> str:
        c = self.cfg
        bits = [self.kind, f"{c.norm}-LN" if c.norm != "none" else "no-LN", c.activation]
        bits += [f"L{self.num_layers}"] if self.kind in STACKS else []
        bits += [c.scaling] if c.scaling != "none" else []
        bits += ["no-skip"] if c.residual == "none" else []
        bits += [f"parallel-{c.parallel_residual}"] if c.parallel_residual != "none" else []
        bits += ["no-bias"] if not c.bias else []
        bits += ["causal"] if c.causal else []
        bits += [c.norm_type] if c.norm_type != "layernorm" else []
        bits += [f"norm-w+{c.norm_weight_offset:g}"] if c.norm_weight_offset else []
        bits += ["ln-scaling"] if c.layernorm_scaling else []
        bits += [f"resid-x{c.residual_multiplier:g}"] if c.residual_multiplier != 1.0 else []
        bits += [c.mlp] if c.mlp != "dense" else []
        bits += [f"experts{c.num_experts}top{c.num_experts_per_tok}" + ("" if c.norm_topk_prob else "-unnormed")
                 + (f"-shared{c.shared_expert_d_ff}" if c.shared_expert_d_ff else "")
                 + (f"-sparse-step{c.decoder_sparse_step}" if c.decoder_sparse_step != 1 else "")
                 + (f"-dense{list(c.mlp_only_layers)}" if c.mlp_only_layers else "")
                 + ("-biased" if c.experts_bias else "")
                 + (f"-clamp{c.swiglu_limit:g}-alpha{c.swiglu_alpha:g}" if c.swiglu_limit is not None else "")
                 ] if c.num_experts else []
        bits += [f"{c.routing}-groups{c.topk_group}of{c.n_group}-x{c.routed_scaling_factor:g}"] \
            if c.routing.startswith("deepseek") else [c.routing] if c.routing != "softmax" else []
        bits += ["shared-ungated"] if c.shared_expert_d_ff and not c.shared_expert_gate else []
        bits += ["weights-on-input"] if c.num_experts and c.routing_weights_on == "input" else []
        bits += [f"mla{c.kv_lora_rank}" + (f"-q{c.q_lora_rank}" if c.q_lora_rank else "")
                 + f"-nope{c.qk_nope_head_dim}-rope{c.qk_rope_head_dim}-v{c.v_head_dim}"
                 + ("-interleave" if c.rope_interleave else "")
                 + (f"-eps{c.latent_norm_eps:g}" if c.latent_norm_eps != 1e-6 else "")] if c.latent else []
        bits += [f"kv{c.num_kv_heads}"] if c.num_kv_heads is not None else []
        bits += [f"hd{c.head_dim}"] if c.head_dim is not None else []
        bits += [("qk-norm" if c.qk_norm_over == "head" else "qk-norm-projection")] if c.qk_norm else []
        bits += [f"rope{c.rope_theta:g}"] if c.rope_theta is not None else []
        bits += [f"rotary{c.rotary_dim}of{c.head_width}"] if c.partial_rotary_factor != 1.0 else []
        bits += [f"rope-{c.rope_scaling.rope_type}"] if c.rope_scaling is not None else []
        bits += [f"softcap{c.attn_logit_softcapping:g}"] if c.attn_logit_softcapping is not None else []
        bits += ["sinks"] if c.attn_sinks else []
        bits += ["alibi"] if c.alibi else []
        bits += [f"qscale{c.query_pre_attn_scalar:g}"] if c.query_pre_attn_scalar is not None else []
        bits += [f"window{c.sliding_window}"] if c.sliding_window is not None else []
        bits += [f"global-every-{c.sliding_window_pattern}" + ("-first" if c.pattern_global_first else "")
                 ] if c.sliding_window_pattern is not None else []
        bits += ["first-attn-unnormed"] if not c.first_attn_norm else []
        bits += [f"local-rope{c.rope_local_theta:g}"] if c.rope_local_theta is not None else []
        bits += ["rope-pairs"] if c.rope_interleaved else []
        bits += ["rope-local-only"] if c.rope_local_only else []
        bits += [f"nope-{'-'.join(map(str, c.nope_layers))}"] if c.nope_layers else []
        bits += [f"temperature-{c.query_temperature_floor:g}"] if c.query_temperature_floor is not None else []
        bits += ["qk-l2"] if c.qk_l2_norm else []
        bits += [f"chunks-{c.attention_chunk_size}"] if c.attention_chunk_size is not None else []
        bits += [f"unchunked-{'-'.join(map(str, c.unchunked_layers))}"] if c.unchunked_layers else []
        bits += [f"qkv-bias-{c.qkv_bias}"] if c.qkv_bias is not None else []
        bits += [f"mlp-bias-{c.mlp_bias}"] if c.mlp_bias is not None else []
        bits += [f"norm-bias-{c.norm_bias}"] if c.norm_bias is not None else []
        bits += [f"eps{c.layer_norm_eps:g}"] if c.layer_norm_eps != 1e-5 else []
        bits += ["attn-mask"] if self.attention_mask else []
        bits += ["key-mask"] if self.key_mask else []
        bits += [f"left-pad{self.left_pad}"] if self.left_pad else []
        bits += [f"memory{self.memory_seq}"] if self.kind in DECODERS else []
        bits += ["memory-key-mask"] if self.memory_key_mask else []
        bits += [f"remat-{self.remat}"] if self.remat else []
        bits += ["unrolled"] if not self.scan_layers else []
        bits += [f"attention-{c.attention}" + (f"{c.attention_block}" if c.attention == "blocked" else "")
                 ] if c.attention != "auto" else []
        bits += [f"B{self.batch}T{self.seq}"]
        bits += [f"x*{self.input_scale:g}"] if self.input_scale != 1.0 else []
        return "/".join(bits)


def torch_twin(case: Case, dtype: str, perturb: float = 0.05) -> torch.nn.Module:
    """The torch module of `case`, its weights drawn from a seeded generator and perturbed
    so that every tensor is distinct (ReZero gates non-zero, LayerNorms not at 1/0)."""
    cfg = replace(case.cfg, param_dtype=dtype)
    g = torch.Generator().manual_seed(case.seed)
    cls = getattr(tb, case.kind)
    module = cls(cfg, generator=g, **case.kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(perturb * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return module.train()  # dropout is 0 in parity cases; train mode avoids torch's fast paths


def flax_twin(case: Case, tmodule: torch.nn.Module, dtype: str, cfg: fb.BlockConfig | None = None):
    """A flax_blocks module loaded from `tmodule` with the converter.
    `cfg` overrides the Flax config (for wrong twins)."""
    source = tmodule if cfg is None else tmodule.state_dict()  # a module object refuses a contradicting config
    cfg = replace(cfg or case.cfg, param_dtype=dtype)
    cls = getattr(fb, case.kind)
    unrolled = {} if case.scan_layers else {"scan_layers": False}
    return from_torch(cls, cfg, source, seed=case.seed + 1, **case.kwargs, **unrolled)


@dataclass
class Inputs:
    """x (B, T, E), cotangent r (B, T, E), masks in flax's convention (True = may attend;
    attention_mask (B, T, T), or per head (B, H, T, T)); for decoders a memory (B, S, E)
    and its key mask (B, S)."""

    x: np.ndarray
    r: np.ndarray
    attention_mask: np.ndarray | None = None
    key_mask: np.ndarray | None = None
    memory: np.ndarray | None = None
    memory_key_mask: np.ndarray | None = None


def make_inputs(case: Case, seed: int = 1) -> Inputs:
    rng = np.random.default_rng(seed)
    b, t, e = case.batch, case.seq, case.cfg.d_model
    x = case.input_scale * rng.normal(size=(b, t, e))
    r = rng.normal(size=(b, t, e))
    attn = keys = None
    if case.attention_mask:
        attn = rng.random((b, t, t)) < 0.7
        attn[..., 0] = True  # most rows keep a key; fully masked rows come from key_mask below
    if case.key_mask:
        keys = np.ones((b, t), bool)
        keys[-1, max(1, t - 2):] = False  # the last sequence is padded
        keys[0, :case.left_pad] = False  # and the first on the left (chunks start at its first real key)
        if case.attention_mask and t > 1:
            keys[0, 0] = False  # with attn[..., 0] only, some rows of sequence 0 lose every key
    memory = memory_keys = None
    if case.kind in DECODERS:
        memory = case.input_scale * rng.normal(size=(b, case.memory_seq, e))
        if case.memory_key_mask:
            memory_keys = np.ones((b, case.memory_seq), bool)
            memory_keys[-1, max(1, case.memory_seq - 2):] = False
    return Inputs(x, r, attn, keys, memory, memory_keys)


@dataclass
class Result:
    """Outputs and gradients of one side: y (B, T, E), grads by torch name, dx (B, T, E),
    and the residual stream after each layer for Encoders (L, B, T, E)."""

    y: np.ndarray
    grads: dict[str, np.ndarray]
    dx: np.ndarray
    per_layer: np.ndarray | None = None
    dmemory: np.ndarray | None = None


def run_torch(case: Case, module: torch.nn.Module, inp: Inputs, dtype: str) -> Result:
    tdt = TORCH_DTYPES[dtype]
    x = torch.tensor(inp.x, dtype=tdt, requires_grad=True)
    # torch's convention; a per-head mask (B, H, T, S) as nn.MultiheadAttention takes it, (B * H, T, S)
    to_t = lambda m: None if m is None else invert_mask(torch.from_numpy(m)).flatten(0, max(m.ndim - 3, 0))  # noqa
    args = []
    memory = None
    if case.kind in DECODERS:
        memory = torch.tensor(inp.memory, dtype=tdt, requires_grad=True)
        args = [memory, to_t(inp.attention_mask), None, to_t(inp.key_mask), to_t(inp.memory_key_mask)]
    elif case.kind != "FeedForward":
        args = [to_t(inp.attention_mask), to_t(inp.key_mask)]
    module.zero_grad(set_to_none=True)
    per_layer = None
    if case.intermediates:
        y, inter = module(x, *args, return_intermediates=True)
        per_layer = inter["residual"].detach().numpy()
    else:
        y = module(x, *args)
    (y * torch.tensor(inp.r, dtype=tdt)).sum().backward()
    # a parameter the call never read has no gradient: zeros, which Flax's must equal
    grads = {n: p.grad.numpy().copy() if p.grad is not None else np.zeros(p.shape, p.detach().numpy().dtype)
             for n, p in module.named_parameters()}
    dmem = None if memory is None else memory.grad.numpy()
    return Result(y.detach().numpy(), grads, x.grad.numpy(), per_layer, dmem)


def run_flax(case: Case, module, inp: Inputs, dtype: str) -> Result:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    opt = lambda m: None if m is None else jnp.asarray(m)  # noqa: E731
    masks = {} if case.kind == "FeedForward" else {"attention_mask": opt(inp.attention_mask),
                                                   "key_mask": opt(inp.key_mask)}
    if case.kind in DECODERS:
        masks["memory_key_mask"] = opt(inp.memory_key_mask)

    def loss(params, x, memory, r, rest):
        m = nnx.merge(graphdef, params, rest)
        args = (x, memory) if case.kind in DECODERS else (x,)
        if case.intermediates:
            y, inter = m(*args, return_intermediates=True, **masks)
            return jnp.sum(y * r), (y, inter["residual"])
        y = m(*args, **masks)
        return jnp.sum(y * r), (y, None)

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    jdt = jnp.dtype(dtype)
    memory = None if inp.memory is None else jnp.asarray(inp.memory, jdt)
    (gp, gx, gm), (y, per_layer) = grad_fn(params, jnp.asarray(inp.x, jdt), memory, jnp.asarray(inp.r, jdt), rest)
    grads = torch_state_dict(nnx.merge(graphdef, gp, rest))
    return Result(np.asarray(y), grads, np.asarray(gx), None if per_layer is None else np.asarray(per_layer),
                  None if gm is None else np.asarray(gm))


@dataclass
class Errors:
    forward: float
    grad: float  # worst parameter, relative to that parameter's gradient scale
    dx: float
    grad_by_param: dict[str, float] = field(default_factory=dict)

    def ok(self, dtype: str) -> bool:
        return self.forward <= TOL["forward", dtype] and max(self.grad, self.dx) <= TOL["grad", dtype]


def compare(a: Result, b: Result) -> Errors:
    """Errors of `a` (Flax) against `b` (torch)."""
    by_param = {k: rel_err(a.grads.get(k, np.full(v.shape, np.nan)), v) for k, v in b.grads.items()}
    missing = set(a.grads) ^ set(b.grads)
    worst = float("inf") if missing else max(by_param.values(), default=0.0)
    dx = rel_err(a.dx, b.dx)
    if b.dmemory is not None:  # a decoder's memory gradient counts with the input's
        dx = max(dx, rel_err(a.dmemory, b.dmemory))
    return Errors(rel_err(a.y, b.y), worst, dx, by_param)


Mutation = Callable[[Case, Any, Inputs], tuple[Any, Inputs]]


def parity(case: Case, dtype: str, *, flax_cfg: fb.BlockConfig | None = None,
           mutate: Mutation | None = None) -> Errors:
    """Build both twins of `case` in `dtype`, run them, return the Flax-vs-torch errors.
    `flax_cfg` and `mutate` make a deliberately wrong Flax twin (negative tests)."""
    with precision(dtype):
        tmod = torch_twin(case, dtype)
        fmod = flax_twin(case, tmod, dtype, flax_cfg)
        inp = make_inputs(case)
        finp = inp
        if mutate is not None:
            fmod, finp = mutate(case, fmod, inp)
        return compare(run_flax(case, fmod, finp, dtype), run_torch(case, tmod, inp, dtype))
