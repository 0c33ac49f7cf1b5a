"""Every parameter of every block, declared once, for both frameworks.

A `Param` says, for one parameter of one component: its torch name, its Flax path, its
shape (in torch's layout), which config field each dimension is, the logical axes of
the Flax array (for sharding), its init distribution, and the `Transform` that maps
torch's tensor onto the Flax array. Components (a linear map, a norm, an attention) are
lists of Params; blocks are named components arranged in residual sublayers (`BLOCKS`).

Everything else is derived from these declarations, not kept beside them:
  - both frameworks create and initialise their parameters from them
    (flax_blocks.layers, torch_blocks.layers);
  - the converter's torch <-> Flax rules (flax_blocks.checkpoints.convert), both directions;
  - the sharding annotations (each Flax Param carries its `axes` as `out_sharding`);
  - config inference from a checkpoint's shapes (`dims`).

The block names follow torch.nn.TransformerEncoderLayer (self_attn, linear1, linear2,
norm1, norm2) so stock state dicts load with strict=True; the new options add
linear_gate (gated MLPs), norm1_out / norm2_out (Peri-LN), self_attn.q_norm / k_norm
(QK-norm), alpha in a norm (DyT). Nothing here imports a framework: the transforms use only the array
methods numpy and JAX share (reshape, transpose, indexing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from .config import BlockConfig, is_moe_layer

Spec = tuple[str, float]  # ("uniform", bound) | ("normal", std) | ("const", value), iid entries
Chunks = tuple[tuple[int, Spec], ...]  # (rows, spec) pieces along torch's dim 0

# ----------------------------------------------------------------------------------
# Transforms: torch's tensor <-> the Flax array
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transform:
    """How torch's tensor (its layout: (out, in) matrices, packed q/k/v rows) maps onto the
    Flax array, and back (numpy or JAX arrays)."""

    name: str
    to_flax: Callable[[Any, BlockConfig], Any]
    to_torch: Callable[[Any, BlockConfig], Any]


def _qkv_order(cfg: BlockConfig) -> np.ndarray:
    """Head blocks of the packed torch rows [q_0..q_{H-1}, k_0..k_{K-1}, v_0..v_{K-1}]
    reordered to the Flax grouping [q of group 0..., k_0, v_0, q of group 1..., k_1, v_1, ...]."""
    h, k = cfg.num_heads, cfg.kv_heads
    g = h // k
    return np.array([i for j in range(k) for i in (*range(j * g, (j + 1) * g), h + j, h + k + j)])


def _qkv_weight_to_flax(a, cfg: BlockConfig):  # ((H+2K)*hd, E) -> (E, K, G+2, hd)
    k, d, e = cfg.kv_heads, cfg.head_width, a.shape[-1]
    return a.reshape(-1, d, e)[_qkv_order(cfg)].reshape(k, -1, d, e).transpose(3, 0, 1, 2)


def _qkv_weight_to_torch(a, cfg: BlockConfig):  # (E, K, G+2, hd) -> ((H+2K)*hd, E)
    d, e = cfg.head_width, a.shape[0]
    return a.transpose(1, 2, 3, 0).reshape(-1, d, e)[np.argsort(_qkv_order(cfg))].reshape(-1, e)


def _qkv_bias_to_flax(a, cfg: BlockConfig):  # ((H+2K)*hd,) -> (K, G+2, hd)
    d = cfg.head_width
    return a.reshape(-1, d)[_qkv_order(cfg)].reshape(cfg.kv_heads, -1, d)


def _qkv_bias_to_torch(a, cfg: BlockConfig):  # (K, G+2, hd) -> ((H+2K)*hd,)
    return a.reshape(-1, cfg.head_width)[np.argsort(_qkv_order(cfg))].reshape(-1)


COPY = Transform("copy", lambda a, cfg: a, lambda a, cfg: a)
LINEAR = Transform("linear", lambda a, cfg: a.T, lambda a, cfg: a.T)  # nn.Linear (out, in) <-> kernel (in, out)
QKV_WEIGHT = Transform("qkv_weight", _qkv_weight_to_flax, _qkv_weight_to_torch)
QKV_BIAS = Transform("qkv_bias", _qkv_bias_to_flax, _qkv_bias_to_torch)
EXPERTS = Transform(  # per-expert (out, in) matrices (X, out, in) <-> kernels (X, in, out)
    "experts", lambda a, cfg: a.transpose(0, 2, 1), lambda a, cfg: a.transpose(0, 2, 1))
OUT_HEADS = Transform(  # out_proj.weight (E, H*hd) <-> (H, hd, E)
    "out_heads",
    lambda a, cfg: a.T.reshape(cfg.num_heads, cfg.head_width, a.shape[0]),
    lambda a, cfg: a.reshape(cfg.num_heads * cfg.head_width, a.shape[-1]).T,
)


# ----------------------------------------------------------------------------------
# Parameters and components
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One parameter of a component.

    torch: name in the torch module (dots nest submodules: "out_proj.weight").
    flax: attribute name in the Flax module.
    shape: torch's shape; dims: the BlockConfig field each dimension equals (None where
      it is a combination), read by config inference.
    axes: logical axis names of the Flax array (sharding).
    init: (rows, spec) chunks along torch's dim 0 (one chunk for most parameters).
    transform: torch array <-> Flax array.
    """

    torch: str
    flax: str
    shape: tuple[int, ...]
    dims: tuple[str | None, ...]
    axes: tuple[str | None, ...]
    init: Chunks
    transform: Transform = COPY

    def flax_shape(self, cfg: BlockConfig) -> tuple[int, ...]:
        return tuple(self.transform.to_flax(np.empty(self.shape, np.bool_), cfg).shape)


@dataclass(frozen=True)
class Component:
    """A module's own parameters. kind: which module class each framework builds for it."""

    # embedding: lm_config's tables; latent_attention: DeepSeek's multi-head latent attention
    kind: Literal["linear", "norm", "attention", "latent_attention", "experts", "block", "embedding"]
    params: tuple[Param, ...]
    width: int = 0  # a norm's normalised width
    children: tuple[tuple[str, Component], ...] = ()


def _one(spec: Spec, rows: int = 1) -> Chunks:
    return ((rows, spec),)


def xavier_uniform(fan_in: int, fan_out: int, gain: float = 1.0) -> Spec:
    """Glorot's uniform init of a (fan_in, fan_out) matrix as a Spec: U(-b, b), b = gain sqrt(6 / (in + out))."""
    return ("uniform", gain * math.sqrt(6.0 / (fan_in + fan_out)))


def xavier_normal(fan_in: int, fan_out: int, gain: float = 1.0) -> Spec:
    """Glorot's normal init as a Spec: N(0, std^2), std = gain sqrt(2 / (in + out))."""
    return ("normal", gain * math.sqrt(2.0 / (fan_in + fan_out)))


ZERO: Spec = ("const", 0.0)
ONE: Spec = ("const", 1.0)

# An MLP projection's role: its logical sharding axes and named dims (up and gate: E -> F; down: F -> E).
LinearRole = Literal["up", "gate", "down"]
_LINEAR_AXES = {"up": ("embed", "mlp"), "gate": ("embed", "mlp"), "down": ("mlp", "embed")}
_LINEAR_DIMS = {"up": ("d_ff", "d_model"), "gate": ("d_ff", "d_model"), "down": ("d_model", "d_ff")}


def linear(cfg: BlockConfig, n_in: int, n_out: int, role: LinearRole) -> Component:
    """An MLP projection: torch weight (out, in) and bias (out,) (cfg.has_mlp_bias); Flax kernel (in, out), bias."""
    if cfg.scaling == "deepnorm":
        beta = cfg.resolve().deepnorm_beta
        assert beta is not None  # resolve fills it under deepnorm
        w, b = xavier_normal(n_in, n_out, float(beta)), ZERO
    elif cfg.init == "xavier":
        w, b = xavier_uniform(n_in, n_out), ZERO
    else:  # nn.Linear: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)), bias the same
        w = b = ("uniform", 1 / math.sqrt(n_in))
    axes, dims = _LINEAR_AXES[role], _LINEAR_DIMS[role]
    params = [Param("weight", "kernel", (n_out, n_in), dims, axes, _one(w, n_out), LINEAR)]
    if cfg.has_mlp_bias:
        params.append(Param("bias", "bias", (n_out,), dims[:1], axes[1:], _one(b, n_out)))
    return Component("linear", tuple(params))


def norm(cfg: BlockConfig, width: int, *, dim: str | None = "d_model", axis: str | None = "embed",
         bias: bool = True) -> Component:
    """LayerNorm (weight, bias when cfg.has_norm_bias and `bias`), RMSNorm (weight) or DyT (weight,
    bias as LayerNorm's, and the scalar alpha, initialised to cfg.dyt_alpha_init) over `width`.
    The weight w starts at 1 - cfg.norm_weight_offset (Gemma's norms, which scale by 1 + w, at 0)."""
    w0 = ("const", 1.0 - cfg.norm_weight_offset) if cfg.norm_weight_offset else ONE
    params = [Param("weight", "scale", (width,), (dim,), (axis,), _one(w0, width))]
    if cfg.norm_type in ("layernorm", "dyt") and cfg.has_norm_bias and bias:
        params.append(Param("bias", "bias", (width,), (dim,), (axis,), _one(ZERO, width)))
    if cfg.norm_type == "dyt":
        params.append(Param("alpha", "alpha", (), (), (), ((1, ("const", float(cfg.dyt_alpha_init))),)))
    return Component("norm", tuple(params), width=width)


def attention(cfg: BlockConfig) -> Component:
    """Multi-head attention with one packed q/k/v projection (torch's in_proj_weight, rows
    [q heads; k heads; v heads]); grouped-query when kv_heads < num_heads; q_norm / k_norm
    over head_dim when qk_norm (over num_heads * head_dim and num_kv_heads * head_dim with
    qk_norm_over="projection", OLMo 2), scale-only (as OLMo 2, Gemma 3, ViT-22B): a bias on k's
    norm would shift every logit of a row equally, which softmax ignores (its gradient is
    exactly zero), so neither norm has one. Flax: in_kernel (E, K, G+2, hd) groups each KV head with
    its G = H/K query heads (slots 0..G-1 q, G k, G+1 v), out_kernel (H, hd, E)."""
    e, h, k, d = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_width
    rows = (h * d, k * d, k * d)
    w_qkv: tuple[Spec, ...]  # the q, k and v rows' init specs
    if cfg.scaling == "deepnorm":
        resolved = cfg.resolve().deepnorm_beta
        assert resolved is not None  # resolve fills it under deepnorm
        beta = float(resolved)
        w_qkv = (xavier_normal(e, rows[0]), xavier_normal(e, rows[1]), xavier_normal(e, rows[2], beta))
        w_out, b_in, b_out = xavier_normal(h * d, e, beta), ZERO, ZERO
    elif cfg.init == "xavier":
        w_qkv = tuple(xavier_uniform(e, r) for r in rows)
        w_out, b_in, b_out = xavier_uniform(h * d, e), ZERO, ZERO
    else:  # nn.MultiheadAttention: xavier-uniform over the packed matrix, zero biases,
        # out_proj with nn.Linear's U(+-1/sqrt(fan_in))
        w_qkv = (xavier_uniform(e, sum(rows)),) * 3
        w_out, b_in, b_out = ("uniform", 1 / math.sqrt(h * d)), ZERO, ZERO
    params = [
        Param("in_proj_weight", "in_kernel", (sum(rows), e), (None, "d_model"),
              ("embed", "kv_heads", "qkv", "head_dim"), tuple(zip(rows, w_qkv, strict=True)), QKV_WEIGHT),
        Param("out_proj.weight", "out_kernel", (e, h * d), ("d_model", None),
              ("heads", "head_dim", "embed"), _one(w_out, e), OUT_HEADS),
    ]
    if cfg.has_qkv_bias:
        params.insert(1, Param("in_proj_bias", "in_bias", (sum(rows),), (None,),
                               ("kv_heads", "qkv", "head_dim"), _one(b_in, sum(rows)), QKV_BIAS))
    if cfg.bias:
        params.append(Param("out_proj.bias", "out_bias", (e,), ("d_model",), ("embed",), _one(b_out, e)))
    if cfg.attn_sinks:  # GPT-OSS: one logit per head in the softmax's denominator (HF inits N(0, 0.02))
        params.append(Param("sinks", "sinks", (h,), ("num_heads",), ("heads",), _one(("normal", 0.02), h)))
    children: tuple[tuple[str, Component], ...] = ()
    if cfg.qk_norm and cfg.qk_norm_over == "projection":  # OLMo 2: over H * hd and K * hd
        children = (("q_norm", norm(cfg, h * d, dim=None, axis=None, bias=False)),
                    ("k_norm", norm(cfg, k * d, dim=None, axis=None, bias=False)))
    elif cfg.qk_norm:
        qk = norm(cfg, d, dim="head_dim", axis="head_dim", bias=False)
        children = (("q_norm", qk), ("k_norm", qk))
    return Component("attention", tuple(params), children=children)


def _projection(cfg: BlockConfig, n_in: int, n_out: int, bias: bool, axes: tuple[str | None, str | None]) -> Component:
    """A linear map of multi-head latent attention: torch weight (out, in), bias (out,) when `bias`;
    Flax kernel (in, out). nn.Linear's init (or xavier's)."""
    w = xavier_uniform(n_in, n_out) if cfg.init == "xavier" else ("uniform", 1 / math.sqrt(n_in))
    b = ZERO if cfg.init == "xavier" else ("uniform", 1 / math.sqrt(n_in))
    params = [Param("weight", "kernel", (n_out, n_in), (None, None), axes, _one(w, n_out), LINEAR)]
    if bias:
        params.append(Param("bias", "bias", (n_out,), (None,), axes[1:], _one(b, n_out)))
    return Component("linear", tuple(params))


def latent_attention(cfg: BlockConfig) -> Component:
    """Multi-head latent attention (DeepSeek V2 / V3; cfg.kv_lora_rank), HF's names: queries
    q_proj (E -> H * dqk) or, with q_lora_rank rq, q_a_proj (E -> rq) -> q_a_layernorm -> q_b_proj
    (rq -> H * dqk), dqk = qk_nope_head_dim + qk_rope_head_dim; kv_a_proj_with_mqa (E -> r + dr: the
    latent, r = kv_lora_rank, and the rotary key shared by the heads, dr = qk_rope_head_dim) ->
    kv_a_layernorm (over r) -> kv_b_proj (r -> H * (dn + dv): each head's non-rotary key and value);
    o_proj (H * dv -> E). Biases (cfg.has_qkv_bias, HF's attention_bias) on q_a_proj,
    kv_a_proj_with_mqa and o_proj only; the norms are RMSNorms of eps cfg.latent_norm_eps."""
    assert cfg.kv_lora_rank is not None
    e, h, r, dr = cfg.d_model, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dqk, dn, dv, bias = cfg.qk_nope_head_dim + dr, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.has_qkv_bias
    children: list[tuple[str, Component]] = []
    if cfg.q_lora_rank is None:
        children.append(("q_proj", _projection(cfg, e, h * dqk, False, ("embed", "heads"))))
    else:
        rq = cfg.q_lora_rank
        children += [("q_a_proj", _projection(cfg, e, rq, bias, ("embed", None))),
                     ("q_a_layernorm", norm(cfg, rq, dim=None, axis=None, bias=False)),
                     ("q_b_proj", _projection(cfg, rq, h * dqk, False, (None, "heads")))]
    children += [("kv_a_proj_with_mqa", _projection(cfg, e, r + dr, bias, ("embed", None))),
                 ("kv_a_layernorm", norm(cfg, r, dim=None, axis=None, bias=False)),
                 ("kv_b_proj", _projection(cfg, r, h * (dn + dv), False, (None, "heads"))),
                 ("o_proj", _projection(cfg, h * dv, e, bias, ("heads", "embed")))]
    return Component("latent_attention", (), children=tuple(children))


def experts(cfg: BlockConfig) -> Component:
    """The experts MLP (cfg.num_experts > 0): the router, a bias-free map d_model -> X (torch
    router (X, E), Flax kernel (E, X)); the X experts' stacked projections, torch (X, out, in) as
    X nn.Linear weights, Flax (X, in, out): up (X, F, E), gate (gated MLPs), down (X, E, F), F =
    cfg.experts_width, no biases (with cfg.experts_bias, GPT-OSS: router_bias (X,), up_bias / gate_bias
    (X, F), down_bias (X, E)); with cfg.shared_expert_d_ff = S, a shared expert (shared_up,
    shared_gate, shared_down: linear maps of width S, biases as cfg.has_mlp_bias) and its gate
    shared_expert_gate (1, E), Flax (E, 1) (cfg.shared_expert_gate; DeepSeek's shared experts have
    none); e_score_correction_bias (X,) under DeepSeek V3's routing. Each expert matrix is
    initialised as one nn.Linear (or xavier) of its own shape."""
    e, n, f, s = cfg.d_model, cfg.num_experts, cfg.experts_width, cfg.shared_expert_d_ff  # n: the expert count

    def spec(n_in: int, n_out: int, gain: bool = False) -> Spec:
        if cfg.scaling == "deepnorm":
            beta = cfg.resolve().deepnorm_beta
            assert beta is not None  # resolve fills it under deepnorm
            return xavier_normal(n_in, n_out, float(beta) if gain else 1.0)
        return xavier_uniform(n_in, n_out) if cfg.init == "xavier" else ("uniform", 1 / math.sqrt(n_in))

    params = [Param("router", "router", (n, e), ("num_experts", "d_model"), ("embed", None), _one(spec(e, n), n),
                    LINEAR),
              Param("up", "up", (n, f, e), ("num_experts", "expert_d_ff", "d_model"), ("expert", "embed", "mlp"),
                    _one(spec(e, f), n), EXPERTS)]
    if cfg.gated:
        params.append(Param("gate", "gate", (n, f, e), ("num_experts", "expert_d_ff", "d_model"),
                            ("expert", "embed", "mlp"), _one(spec(e, f), n), EXPERTS))
    params.append(Param("down", "down", (n, e, f), ("num_experts", "d_model", "expert_d_ff"),
                        ("expert", "mlp", "embed"), _one(spec(f, e, True), n), EXPERTS))
    if cfg.routing == "deepseek_v3":  # added to the scores for choosing only (HF's buffer, zeros at init)
        params.append(Param("e_score_correction_bias", "e_score_correction_bias", (n,), ("num_experts",), (None,),
                            _one(ZERO, n)))
    if cfg.experts_bias:  # GPT-OSS: the router's and every expert projection's biases (zeros, as HF's)
        params += [Param("router_bias", "router_bias", (n,), ("num_experts",), (None,), _one(ZERO, n)),
                   Param("up_bias", "up_bias", (n, f), ("num_experts", "expert_d_ff"), ("expert", "mlp"),
                         _one(ZERO, n))]
        if cfg.gated:
            params.append(Param("gate_bias", "gate_bias", (n, f), ("num_experts", "expert_d_ff"), ("expert", "mlp"),
                                _one(ZERO, n)))
        params.append(Param("down_bias", "down_bias", (n, e), ("num_experts", "d_model"), ("expert", "embed"),
                            _one(ZERO, n)))
    children: tuple[tuple[str, Component], ...] = ()
    if s and cfg.shared_expert_gate:
        params.append(Param("shared_expert_gate", "shared_expert_gate", (1, e), (None, "d_model"), ("embed", None),
                            _one(spec(e, 1), 1), LINEAR))
    if s:
        def width_s(c: Component) -> Component:  # its width is shared_expert_d_ff, not the dense MLP's d_ff
            return replace(c, params=tuple(replace(p, dims=tuple("shared_expert_d_ff" if d == "d_ff" else d
                                                                 for d in p.dims)) for p in c.params))

        shared = [("shared_up", width_s(linear(cfg, e, s, "up")))]
        if cfg.gated:
            shared.append(("shared_gate", width_s(linear(cfg, e, s, "gate"))))
        children = (*shared, ("shared_down", width_s(linear(cfg, s, e, "down"))))
    return Component("experts", tuple(params), children=children)


def residual_scale(cfg: BlockConfig, name: str) -> Param | None:
    """ReZero's scalar (0 at init) or LayerScale's per-channel scale (eps) on a sublayer's
    output; else None."""
    if cfg.scaling == "rezero":
        return Param(name, name, (), (), (), ((1, ZERO),))
    if cfg.scaling == "layerscale":
        e = cfg.d_model
        eps = cfg.resolve().layerscale_init
        assert eps is not None  # resolve fills it under layerscale
        return Param(name, name, (e,), ("d_model",), ("embed",), _one(("const", float(eps)), e))
    return None


# ----------------------------------------------------------------------------------
# Blocks: named components arranged in residual sublayers
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sublayer:
    """One residual sublayer: its function's modules, its norms and its residual scale, by name.

    kind "attention" (self-attention) or "cross_attention" (queries from the block's input,
    keys and values from a memory): modules = (attention,); kind "mlp": modules = (up, gate, down)."""

    kind: Literal["attention", "cross_attention", "mlp"]
    modules: tuple[str, ...]
    norm: str
    norm_out: str
    scale: str


MLP_MODULES = ("linear1", "linear_gate", "linear2")  # up, gate, down (torch's linear1/linear2 names)
EXPERTS_MODULE = "experts"  # an MLP sublayer's experts (cfg.num_experts > 0), beside or instead of the dense MLP

BLOCKS: dict[str, tuple[Sublayer, ...]] = {
    "ResidualMHA": (Sublayer("attention", ("mha",), "norm", "norm_out", "scale"),),
    "FeedForward": (Sublayer("mlp", MLP_MODULES, "norm", "norm_out", "scale"),),
    "TransformerBlock": (
        Sublayer("attention", ("self_attn",), "norm1", "norm1_out", "scale1"),
        Sublayer("mlp", MLP_MODULES, "norm2", "norm2_out", "scale2"),
    ),
    "DecoderBlock": (  # torch's TransformerDecoderLayer
        Sublayer("attention", ("self_attn",), "norm1", "norm1_out", "scale1"),
        Sublayer("cross_attention", ("multihead_attn",), "norm2", "norm2_out", "scale2"),
        Sublayer("mlp", MLP_MODULES, "norm3", "norm3_out", "scale3"),
    ),
}

# The stacks: blocks under LAYERS (torch: LAYERS.{i}.; Flax: one module whose parameters
# have a leading layer axis) and an optional final norm; the Transformer holds one of each.
LAYERS = "layers"
LAYER_AXIS = "layers"  # the logical name of that leading axis (sharding annotations)
FINAL_NORM = "norm"
# A Flax mixed stack (layers of both MLP kinds, cfg.mixed_mlp): its blocks under LAYERS hold no MLP;
# each kind's MLPs are stacked apart, one entry per layer of that kind in order (torch: LAYERS.{i}.).
LAYER_MLPS = {"dense": "dense_mlps", "experts": "experts_mlps"}
STACKS = {"Encoder": "TransformerBlock", "Decoder": "DecoderBlock"}
TRANSFORMER = {"encoder": "Encoder", "decoder": "Decoder"}  # torch's nn.Transformer


MLP_KINDS = ("dense", "experts", "none")  # what a block's MLP sublayer holds (`block`'s mlp=)


def layer_mlp(cfg: BlockConfig, layer: int) -> str:
    """The MLP layer `layer` (from 1) of a stack holds: "experts" where `is_moe_layer`, else "dense".
    A mixed stack's layers (cfg.mixed_mlp) each hold their own only, as HF builds them."""
    return "experts" if is_moe_layer(cfg, layer) else "dense"


def block(cfg: BlockConfig, kind: str, mlp: str | None = None) -> Component:
    """The component tree of block `kind` (a key of BLOCKS):
    its residual scales as own params, every sublayer's modules and norms as named children.
    mlp: what the MLP sublayer holds, "dense" (linear1, linear_gate, linear2), "experts" or
    "none" (a Flax mixed stack's blocks, whose MLPs are stacked apart), as a block of both twins
    holds it (`layer_mlp`); None: every name a layer of cfg's stacks may hold (a mixed stack's
    cfg: both MLPs; what the probes and name checks read, never what a block holds)."""
    if kind not in BLOCKS:
        raise ValueError(f"unknown block kind {kind!r}; expected one of {tuple(BLOCKS)}")
    if mlp is not None and (mlp not in MLP_KINDS or (mlp == "experts" and not cfg.num_experts)):
        raise ValueError(f"mlp must be one of {MLP_KINDS} (experts only with num_experts > 0), got {mlp!r}")
    mlps = (mlp,) if mlp is not None else ("dense", "experts") if cfg.mixed_mlp else (layer_mlp(cfg, 1),)
    modules: list[tuple[str, Component]] = []  # torch's order: functions, then norms
    norms: list[tuple[str, Component]] = []
    out_norms: list[tuple[str, Component]] = []
    params: list[Param] = []
    e, f = cfg.d_model, cfg.d_ff
    for sub in BLOCKS[kind]:
        if sub.kind == "attention" and cfg.latent:  # DeepSeek's multi-head latent attention
            modules.append((sub.modules[0], latent_attention(cfg)))
        elif sub.kind in ("attention", "cross_attention"):  # (a cross-attention stays a packed one)
            modules.append((sub.modules[0], attention(cfg)))
        else:
            up, gate_name, down = sub.modules
            if "dense" in mlps:
                modules.append((up, linear(cfg, e, f, "up")))
                if cfg.gated:
                    modules.append((gate_name, linear(cfg, e, f, "gate")))
                modules.append((down, linear(cfg, f, e, "down")))
            if "experts" in mlps:
                modules.append((EXPERTS_MODULE, experts(cfg)))
        if cfg.norm != "none" and not (cfg.parallel_residual == "shared_norm" and norms):
            norms.append((sub.norm, norm(cfg, e)))  # a shared-norm parallel block: norm1 alone
        if cfg.norm == "peri":
            out_norms.append((sub.norm_out, norm(cfg, e)))
        scale = residual_scale(cfg, sub.scale)
        if scale is not None:
            params.append(scale)
    children = modules + norms + out_norms
    return Component("block", tuple(params), children=tuple(children))


def flatten(component: Component, prefix: str = "") -> list[tuple[str, str, Param]]:
    """(torch name, Flax path, Param) of every parameter of `component` and its children,
    names dotted from `prefix`. The module tree is the same in both frameworks, so the
    two names differ only in each Param's own part."""
    out = [(prefix + p.torch, prefix + p.flax, p) for p in component.params]
    for name, child in component.children:
        out += flatten(child, f"{prefix}{name}.")
    return out
