"""One block configuration for both frameworks, plus the semantics they share.

Nothing here imports a framework: `torch_blocks` and `flax_blocks` both read this
module, so a field means the same thing on both sides. Defaults follow
`torch.nn.TransformerEncoderLayer` (d_ff 2048, dropout 0.1, relu, post-LN,
eps 1e-5), so `BlockConfig(d_model=512, num_heads=8)` describes the same layer as
`nn.TransformerEncoderLayer(512, 8, batch_first=True)`. The modern options (RMSNorm,
Peri-LN, gated MLPs, grouped-query attention, QK-norm, rotary positions) are off by
default; a LLaMA-like block is

    BlockConfig(d_model=64, num_heads=8, num_kv_heads=2, norm="pre", norm_type="rmsnorm",
                mlp="swiglu", activation="silu", rope_theta=10000.0, bias=False, causal=True)
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, replace
from typing import Any, Literal

from .rope import RopeScaling

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
NORMS = ("pre", "post", "peri", "out", "none")
FINAL_NORM_BY_DEFAULT = ("pre", "peri", "out")  # placements whose stacks end with a norm unless told
NORM_TYPES = ("layernorm", "rmsnorm", "dyt")
MLPS = ("dense", "swiglu", "geglu")
RESIDUALS = ("add", "none")
PARALLELS = ("none", "two_norms", "shared_norm")
QK_NORM_OVER = ("head", "projection")
SCALINGS = ("none", "deepnorm", "rezero", "layerscale")
INITS = ("torch", "xavier")
DTYPES = ("float32", "float64", "bfloat16", "float16")
ATTENTIONS = ("auto", "dense", "blocked", "fused")
ROUTINGS = ("softmax", "deepseek_v2", "deepseek_v3", "llama4")
ROUTING_WEIGHTS_ON = ("output", "input")
LAYER_LISTS = ("mlp_only_layers", "nope_layers", "unchunked_layers")  # layer indices from 0, as HF's lists


def _allowed(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"BlockConfig.{name} must be one of {allowed}, got {value!r}")


def dtype_name(value: Any) -> Any:
    """A dtype given as a string, a numpy / JAX / ml_dtypes type or dtype, or a torch dtype
    -> its name ("float32", "bfloat16", ...); other values are returned unchanged (and then
    rejected by the validation that names the allowed ones)."""
    if value is None or isinstance(value, str):
        return value
    name = getattr(value, "name", None)  # np.dtype('float32').name
    if not isinstance(name, str):
        name = getattr(value, "__name__", None)  # np.float32, jnp.bfloat16
    if not isinstance(name, str):
        name = str(value)  # torch.float32 -> "torch.float32"
    name = name.removeprefix("torch.")
    return name if name in DTYPES else value


@dataclass(frozen=True)
class BlockConfig:
    """Configuration of one residual transformer block (and of an Encoder's layers), the same
    in both twins: widths, the norms and their placement, the attention (heads, GQA, QK-norm,
    rotary and its scalings, soft-caps, windows), the MLP, residual scaling, init, dtypes and
    the attention's implementation. Every field, its values and what it computes:
    docs/options.md (generated from `flax_blocks.core.options`). `resolve(num_layers)` fills
    the depth-derived defaults (DeepNorm's alpha and beta, LayerScale's init); invalid
    combinations raise ValueError at construction, naming the field and what it needs.
    """

    d_model: int
    num_heads: int
    d_ff: int = 2048
    dropout: float = 0.1
    activation: Literal["relu", "gelu", "gelu_tanh", "silu"] = "relu"
    layer_norm_eps: float = 1e-5
    bias: bool = True
    norm: Literal["pre", "post", "peri", "out", "none"] = "post"
    norm_type: Literal["layernorm", "rmsnorm", "dyt"] = "layernorm"
    norm_weight_offset: float = 0.0
    dyt_alpha_init: float = 0.5
    layernorm_scaling: bool = False
    first_attn_norm: bool = True
    mlp: Literal["dense", "swiglu", "geglu"] = "dense"
    num_experts: int = 0
    num_experts_per_tok: int = 2
    expert_d_ff: int | None = None
    norm_topk_prob: bool = True
    shared_expert_d_ff: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    experts_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    qk_norm_over: Literal["head", "projection"] = "head"
    rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    rope_scaling: RopeScaling | None = None
    attn_logit_softcapping: float | None = None
    attn_sinks: bool = False
    alibi: bool = False
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    pattern_global_first: bool = False
    rope_local_theta: float | None = None
    rope_interleaved: bool = False
    rope_local_only: bool = False
    nope_layers: tuple[int, ...] = ()
    query_temperature_floor: float | None = None
    query_temperature_scale: float = 0.1
    qk_l2_norm: bool = False
    attention_chunk_size: int | None = None
    unchunked_layers: tuple[int, ...] = ()
    qkv_bias: bool | None = None
    mlp_bias: bool | None = None
    norm_bias: bool | None = None
    parallel_residual: Literal["none", "two_norms", "shared_norm"] = "none"
    residual: Literal["add", "none"] = "add"
    residual_multiplier: float = 1.0
    scaling: Literal["none", "deepnorm", "rezero", "layerscale"] = "none"
    deepnorm_alpha: float | None = None
    deepnorm_beta: float | None = None
    layerscale_init: float | None = None
    causal: bool = False
    init: Literal["torch", "xavier"] = "torch"
    dtype: str | None = None
    param_dtype: str = "float32"
    attention: Literal["auto", "dense", "blocked", "fused"] = "auto"
    attention_block: int = 512
    # multi-head latent attention (DeepSeek V2 / V3; flax_blocks/mla.py): on when kv_lora_rank is set
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    latent_norm_eps: float = 1e-6
    # DeepSeek routing of the experts (routing "deepseek_v2" / "deepseek_v3") and a shared expert without gate
    routing: Literal["softmax", "deepseek_v2", "deepseek_v3", "llama4"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True
    # Llama 4: each chosen expert's routing weight multiplies its input instead of its output
    routing_weights_on: Literal["output", "input"] = "output"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", self._scaling_from_dict(self.rope_scaling))
        for name in LAYER_LISTS:  # HF configs hold lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self._check_sizes()
        self._check_experts()
        self._check_choices()
        self._check_positions()
        self._check_combinations()
        self._check_latent()
        self._check_routing()

    def _check_sizes(self) -> None:
        """Sizes, rates and eps: positive where they must be."""
        for name in ("d_model", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockConfig.{name} must be a positive int, got {value!r}")
        hd = self.head_dim
        if hd is not None and (not isinstance(hd, int) or isinstance(hd, bool) or hd <= 0):
            raise ValueError(f"BlockConfig.head_dim must be None or a positive int, got {hd!r}")
        if hd is None and self.d_model % self.num_heads:
            raise ValueError(
                f"BlockConfig.d_model ({self.d_model}) must be divisible by "
                f"num_heads ({self.num_heads}), or head_dim given"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"BlockConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"BlockConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")

    def _check_experts(self) -> None:
        """The experts MLP's sizes (the experts and the router have biases with experts_bias alone, GPT-OSS;
        mlp_bias applies to the dense and shared MLPs)."""
        def count(name: str, low: int) -> int:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"BlockConfig.{name} must be an int >= {low}, got {value!r}")
            return value

        n_experts = count("num_experts", 0)
        if not n_experts:
            if self.swiglu_limit is not None:  # (experts_bias without experts has nothing to bias: no parameter)
                raise ValueError(f"BlockConfig.swiglu_limit={self.swiglu_limit!r} is the clamped SwiGLU of the "
                                 f"experts MLP (GPT-OSS) and needs num_experts > 0")
            return
        k = count("num_experts_per_tok", 1)
        if k > n_experts:
            raise ValueError(f"BlockConfig.num_experts_per_tok ({k}) must be at most num_experts ({n_experts})")
        if self.expert_d_ff is not None:
            count("expert_d_ff", 1)
        count("shared_expert_d_ff", 0)
        count("decoder_sparse_step", 1)
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"BlockConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        self._check_gpt_oss_experts()
        self._check_layer_list("mlp_only_layers", "HF's")

    def _check_gpt_oss_experts(self) -> None:
        """GPT-OSS's experts: biases on the router and every expert projection (experts_bias) and the
        clamped SwiGLU (swiglu_limit, swiglu_alpha), which its experts alone compute."""
        if not isinstance(self.experts_bias, bool):
            raise ValueError(f"BlockConfig.experts_bias must be a bool, got {self.experts_bias!r}")
        a = self.swiglu_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            raise ValueError(f"BlockConfig.swiglu_alpha must be a finite number (GPT-OSS: 1.702), got {a!r}")
        limit = self.swiglu_limit
        if limit is None:
            return
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"BlockConfig.swiglu_limit must be None or a number > 0 (GPT-OSS: 7.0), got {limit!r}")
        if self.mlp != "swiglu" or self.shared_expert_d_ff or self.mixed_mlp:
            raise ValueError(f"BlockConfig.swiglu_limit={limit!r} is GPT-OSS's clamped SwiGLU of the routed experts "
                             f"and needs mlp='swiglu' without a shared expert or dense layers (whose MLP it would "
                             f"leave ambiguous), got mlp={self.mlp!r}, shared_expert_d_ff={self.shared_expert_d_ff}, "
                             f"decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers={self.mlp_only_layers}")

    def _check_choices(self) -> None:
        """Each choice among its allowed values, each flag a bool, the norms' and heads' numbers."""
        _allowed("activation", self.activation, ACTIVATIONS)
        _allowed("norm", self.norm, NORMS)
        _allowed("norm_type", self.norm_type, NORM_TYPES)
        _allowed("mlp", self.mlp, MLPS)
        _allowed("residual", self.residual, RESIDUALS)
        _allowed("parallel_residual", self.parallel_residual, PARALLELS)
        _allowed("qk_norm_over", self.qk_norm_over, QK_NORM_OVER)
        if self.parallel_residual != "none" and (self.norm != "pre" or self.residual != "add"):
            raise ValueError(f"BlockConfig.parallel_residual={self.parallel_residual!r} is the pre-norm form x + "
                             f"Attn(Norm(x)) + MLP(Norm(x)) (GPT-NeoX, StableLM) and needs norm='pre' and "
                             f"residual='add', got norm={self.norm!r}, residual={self.residual!r}")
        _allowed("scaling", self.scaling, SCALINGS)
        m = self.residual_multiplier
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"BlockConfig.residual_multiplier must be a positive number, got {m!r}")
        if m != 1.0 and self.residual != "add":
            raise ValueError(f"BlockConfig.residual_multiplier={m!r} scales each sublayer's output before the skip "
                             f"adds it and needs residual='add', got residual={self.residual!r}")
        _allowed("init", self.init, INITS)
        _allowed("dtype", self.dtype, (None, *DTYPES))
        _allowed("param_dtype", self.param_dtype, DTYPES)
        _allowed("attention", self.attention, ATTENTIONS)
        block = self.attention_block
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
            raise ValueError(f"BlockConfig.attention_block must be a positive int, got {self.attention_block!r}")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"BlockConfig.qk_norm must be a bool, got {self.qk_norm!r}")
        if not isinstance(self.first_attn_norm, bool) or (not self.first_attn_norm and (
                self.norm != "pre" or self.parallel_residual != "none")):
            raise ValueError(f"BlockConfig.first_attn_norm=False (the first layer's attention reads the stream "
                             f"unnormalised, ModernBERT) must be a bool and needs norm='pre' without a parallel "
                             f"residual, got {self.first_attn_norm!r} with norm={self.norm!r}, parallel_residual="
                             f"{self.parallel_residual!r}")
        if not isinstance(self.layernorm_scaling, bool):
            raise ValueError(f"BlockConfig.layernorm_scaling must be a bool, got {self.layernorm_scaling!r}")
        if self.layernorm_scaling and self.norm != "pre":
            raise ValueError(
                f"BlockConfig.layernorm_scaling=True scales the output of each pre-norm (Sun et al. 2025 define it "
                f"for pre-LN) and needs norm='pre', got norm={self.norm!r}"
                + (": Peri-LN's output norm would re-normalise the scaled branch" if self.norm == "peri" else "")
            )
        if isinstance(self.norm_weight_offset, bool) or not isinstance(self.norm_weight_offset, (int, float)) \
                or not math.isfinite(self.norm_weight_offset):
            raise ValueError(f"BlockConfig.norm_weight_offset must be a finite number (Gemma: 1.0), "
                             f"got {self.norm_weight_offset!r}")
        if not self.dyt_alpha_init > 0:
            raise ValueError(f"BlockConfig.dyt_alpha_init must be > 0, got {self.dyt_alpha_init!r}")
        if self.norm_type == "dyt" and self.qk_norm:
            raise ValueError(
                "BlockConfig.norm_type='dyt' with qk_norm=True is ambiguous: QK-norm is a scale-only "
                "LayerNorm or RMSNorm of its own (following norm_type), and DyT says neither. "
                "Use qk_norm=False with DyT, or norm_type 'layernorm' / 'rmsnorm'"
            )
        for name in ("qkv_bias", "mlp_bias", "norm_bias"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"BlockConfig.{name} must be None or a bool, got {getattr(self, name)!r}")
        kv = self.num_kv_heads
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0 or self.num_heads % kv):
            raise ValueError(
                f"BlockConfig.num_kv_heads must be None or a positive divisor of num_heads "
                f"({self.num_heads}), got {kv!r}"
            )

    def _check_positions(self) -> None:
        """Rotary, soft-caps and sliding windows: their values and what each needs."""
        if self.rope_theta is not None:
            if not self.rope_theta > 0:
                raise ValueError(f"BlockConfig.rope_theta must be > 0 or None, got {self.rope_theta!r}")
            if self.head_width % 2:
                raise ValueError(f"BlockConfig.rope_theta needs an even head_dim, got head_dim={self.head_width}")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(f"BlockConfig.partial_rotary_factor must be in (0, 1], got {f!r}")
        if self.rope_theta is not None and f != 1.0 and (self.rotary_dim < 1 or self.rotary_width > self.head_width):
            raise ValueError(f"BlockConfig.partial_rotary_factor={f!r} gives rotary_dim = int({self.head_width} * "
                             f"{f!r}) = {self.rotary_dim}, which rotates {self.rotary_width} dims (an odd count "
                             f"rounded up, as HF): it must be at least 1 and fit head_dim={self.head_width}")
        if not isinstance(self.rope_interleaved, bool) or (self.rope_interleaved and self.rope_theta is None):
            raise ValueError(f"BlockConfig.rope_interleaved (rotary on adjacent pairs) must be a bool and needs "
                             f"rope_theta, got {self.rope_interleaved!r} with rope_theta={self.rope_theta!r}")
        if not isinstance(self.rope_local_only, bool) or (self.rope_local_only and (self.rope_theta is None or
                                                                                     self.sliding_window is None)):
            raise ValueError(f"BlockConfig.rope_local_only (rotary on the local layers alone) must be a bool and needs "
                             f"rope_theta and sliding_window, got {self.rope_local_only!r} with rope_theta="
                             f"{self.rope_theta!r}, sliding_window={self.sliding_window!r}")
        self._check_nope_layers()
        self._check_chunks()
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                raise ValueError(f"BlockConfig.rope_scaling must be None, a RopeScaling or its dict, got "
                                 f"{self.rope_scaling!r}")
            if self.rope_theta is None:
                raise ValueError("BlockConfig.rope_scaling scales rotary positions and needs rope_theta")
            try:
                self.rope_scaling.check(self.rotary_dim)
            except ValueError as e:
                raise ValueError(f"BlockConfig.rope_scaling: {e}") from None
        for name in ("attn_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"BlockConfig.{name} must be None or a number > 0, got {value!r}")
        for name in ("sliding_window", "sliding_window_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"BlockConfig.{name} must be None or a positive int, got {value!r}")
        if self.sliding_window is not None and not self.causal and self.attention in ("blocked", "fused"):
            raise ValueError(f"BlockConfig.sliding_window={self.sliding_window!r} without causal=True is the "
                             f"bidirectional window |i - j| < W (ModernBERT), which the attention={self.attention!r} "
                             "path does not compute: use attention='auto' or 'dense', or causal=True")
        if self.sliding_window is None and self.sliding_window_pattern is not None:
            raise ValueError(f"BlockConfig.sliding_window_pattern={self.sliding_window_pattern!r} says which layers "
                             "are local and needs sliding_window")
        if not isinstance(self.pattern_global_first, bool) or (self.pattern_global_first and
                                                                self.sliding_window_pattern is None):
            raise ValueError(f"BlockConfig.pattern_global_first (each period of sliding_window_pattern starts with "
                             f"its global layer) must be a bool and needs sliding_window_pattern, got "
                             f"{self.pattern_global_first!r} with sliding_window_pattern="
                             f"{self.sliding_window_pattern!r}")
        if self.rope_local_theta is not None:
            if isinstance(self.rope_local_theta, bool) or not self.rope_local_theta > 0:
                raise ValueError(f"BlockConfig.rope_local_theta must be None or > 0, got {self.rope_local_theta!r}")
            if self.rope_theta is None or self.sliding_window is None:
                raise ValueError("BlockConfig.rope_local_theta is the rotary base of the local (sliding-window) "
                                 "layers and needs rope_theta and sliding_window")

    def _check_layer_list(self, name: str, like: str) -> tuple[int, ...]:
        """One of LAYER_LISTS, checked: a tuple of layer indices >= 0 (from 0, as `like`)."""
        value = getattr(self, name)
        if not isinstance(value, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in value):
            raise ValueError(f"BlockConfig.{name} must be a tuple of layer indices >= 0 (from 0, as {like}), "
                             f"got {value!r}")
        return value

    def _check_nope_layers(self) -> None:
        """nope_layers: layer indices (from 0) without rotary, which need rotary elsewhere."""
        nope = self._check_layer_list("nope_layers", "HF's no_rope_layers")
        if nope and self.rope_theta is None:
            raise ValueError(f"BlockConfig.nope_layers={nope!r} names the layers without rotary (SmolLM3, Llama 4's "
                             f"NoPE layers) and needs rope_theta for the others")
        if not isinstance(self.qk_l2_norm, bool) or (self.qk_l2_norm and (self.rope_theta is None or self.qk_norm)):
            raise ValueError(f"BlockConfig.qk_l2_norm (Llama 4's use_qk_norm: q and k over their RMS per head, no "
                             f"weight, in the rotary layers) must be a bool and needs rope_theta, without qk_norm (the "
                             f"weighted QK-norm), got {self.qk_l2_norm!r} with rope_theta={self.rope_theta!r}, "
                             f"qk_norm={self.qk_norm!r}")
        floor, scale = self.query_temperature_floor, self.query_temperature_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"BlockConfig.query_temperature_scale must be a finite number (Llama 4: 0.1), "
                             f"got {scale!r}")
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0
                                  or not nope):
            raise ValueError(f"BlockConfig.query_temperature_floor (Llama 4's floor_scale: the queries of the layers "
                             f"without rotary tempered by their slot) must be None or a number > 0 and needs "
                             f"nope_layers, got {floor!r} with nope_layers={nope!r}")

    def _check_chunks(self) -> None:
        """attention_chunk_size (Llama 4): a positive int, causal, on the dense path, without a sliding window;
        unchunked_layers: layer indices (from 0) that attend to every earlier key, which need chunks."""
        c, full = self.attention_chunk_size, self._check_layer_list("unchunked_layers", "HF's layer_types")
        if c is None:
            if full:
                raise ValueError(f"BlockConfig.unchunked_layers={full!r} names the layers without chunks and needs "
                                 "attention_chunk_size")
            return
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"BlockConfig.attention_chunk_size must be None or a positive int, got {c!r}")
        if not self.causal or self.sliding_window is not None or self.attention == "fused":
            raise ValueError(f"BlockConfig.attention_chunk_size={c!r} (Llama 4's chunked attention: causal within "
                             f"chunks) needs causal=True, no sliding_window and a path that masks chunks (attention "
                             f"'auto', 'dense' or 'blocked': the fused kernels take no such mask), got "
                             f"causal={self.causal!r}, sliding_window={self.sliding_window!r}, "
                             f"attention={self.attention!r}")

    def _check_combinations(self) -> None:
        """Options that contradict each other (or an attention path that cannot compute them)."""
        if self.sliding_window_pattern is not None and self.attention == "fused":
            raise ValueError("BlockConfig.attention='fused' takes a sliding window only in every layer "
                             "(sliding_window_pattern=None): a stack of local and global layers scans one layer, "
                             "whose window is then not a static size. Use attention='auto', 'dense' or 'blocked'")
        if not isinstance(self.attn_sinks, bool):
            raise ValueError(f"BlockConfig.attn_sinks must be a bool, got {self.attn_sinks!r}")
        if self.attn_sinks and self.attention == "fused":
            raise ValueError("BlockConfig.attention='fused' cannot compute attention sinks (attn_sinks, GPT-OSS): "
                             "jax.nn.dot_product_attention and SDPA have no sink in the denominator. Use "
                             "attention='auto', 'dense' or 'blocked'")
        if not isinstance(self.alibi, bool):
            raise ValueError(f"BlockConfig.alibi must be a bool, got {self.alibi!r}")
        if self.alibi and self.attention in ("fused", "blocked"):
            raise ValueError(f"BlockConfig.attention={self.attention!r} cannot add ALiBi biases (alibi, Falcon-RW): "
                             "they are added on the dense path. Use attention='auto' or 'dense'")
        if self.attn_logit_softcapping is not None and self.attention == "fused":
            raise ValueError("BlockConfig.attention='fused' cannot soft-cap the logits (attn_logit_softcapping): "
                             "jax.nn.dot_product_attention and SDPA have no soft-cap. Use attention='auto', "
                             "'dense' or 'blocked'")
        if self.mlp == "swiglu" and self.activation != "silu":
            raise ValueError(f"BlockConfig.mlp='swiglu' needs activation='silu', got activation={self.activation!r}")
        if self.mlp == "geglu" and self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(
                f"BlockConfig.mlp='geglu' needs activation='gelu' or 'gelu_tanh', got activation={self.activation!r}"
            )
        if self.scaling == "deepnorm" and self.norm != "post":
            raise ValueError(f"BlockConfig.scaling='deepnorm' needs norm='post', got norm={self.norm!r}")
        if self.scaling != "none" and self.residual == "none":
            raise ValueError(
                f"BlockConfig.scaling={self.scaling!r} scales a residual branch and needs "
                "residual='add', got residual='none'"
            )
        for name in ("deepnorm_alpha", "deepnorm_beta", "layerscale_init"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"BlockConfig.{name} must be > 0 or None, got {value!r}")


    def _check_latent(self) -> None:
        """Multi-head latent attention's sizes, and the attention options it does not take."""
        if self.kv_lora_rank is None:
            return
        for name, low in (("kv_lora_rank", 1), ("qk_nope_head_dim", 0), ("qk_rope_head_dim", 2), ("v_head_dim", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"BlockConfig.{name} must be an int >= {low} with kv_lora_rank (multi-head latent "
                                 f"attention), got {value!r}")
        q = self.q_lora_rank
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q < 1):
            raise ValueError(f"BlockConfig.q_lora_rank must be None or a positive int, got {q!r}")
        if self.qk_rope_head_dim % 2 or self.rope_theta is None:
            raise ValueError(f"BlockConfig.kv_lora_rank (multi-head latent attention) rotates qk_rope_head_dim dims: "
                             f"it needs rope_theta and an even qk_rope_head_dim, got rope_theta={self.rope_theta!r}, "
                             f"qk_rope_head_dim={self.qk_rope_head_dim!r}")
        if not isinstance(self.rope_interleave, bool) or not self.latent_norm_eps > 0:
            raise ValueError(f"BlockConfig.rope_interleave must be a bool and latent_norm_eps > 0, got "
                             f"{self.rope_interleave!r}, {self.latent_norm_eps!r}")
        off = {"norm_type": self.norm_type != "rmsnorm", "num_kv_heads": self.kv_heads != self.num_heads,
               "qk_norm": self.qk_norm, "partial_rotary_factor": self.partial_rotary_factor != 1.0,
               "attn_logit_softcapping": self.attn_logit_softcapping is not None,
               "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
               "sliding_window": self.sliding_window is not None, "attention": self.attention not in ("auto", "dense"),
               "attn_sinks": self.attn_sinks, "rope_interleaved": self.rope_interleaved,
               "rope_local_only": self.rope_local_only, "alibi": self.alibi, "nope_layers": bool(self.nope_layers),
               "query_temperature_floor": self.query_temperature_floor is not None, "qk_l2_norm": self.qk_l2_norm,
               "attention_chunk_size": self.attention_chunk_size is not None}
        bad = [name for name, on in off.items() if on]
        if bad:
            raise ValueError(f"BlockConfig.kv_lora_rank (multi-head latent attention, DeepSeek) computes its latent "
                             f"norms as RMSNorm, every head its own keys, the dense softmax: it does not take "
                             f"{', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")

    def _check_routing(self) -> None:
        """DeepSeek's routing: groups that divide the experts, scores that fill the top k; where the
        weights apply (Llama 4: on the experts' input)."""
        _allowed("routing", self.routing, ROUTINGS)
        _allowed("routing_weights_on", self.routing_weights_on, ROUTING_WEIGHTS_ON)
        if not isinstance(self.shared_expert_gate, bool):
            raise ValueError(f"BlockConfig.shared_expert_gate must be a bool, got {self.shared_expert_gate!r}")
        if self.routing in ("softmax", "llama4") or not self.num_experts:  # (no experts: nothing routed)
            return
        n_experts, g, kg = self.num_experts, self.n_group, self.topk_group
        for name, value in (("n_group", g), ("topk_group", kg)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockConfig.{name} must be a positive int, got {value!r}")
        if not n_experts or n_experts % g or kg > g:
            raise ValueError(f"BlockConfig.routing={self.routing!r} needs experts (num_experts={n_experts}) in "
                             f"n_group={g} equal groups, topk_group={kg} of them kept")
        if self.routing == "deepseek_v3" and n_experts // g < 2:
            raise ValueError(f"BlockConfig.routing='deepseek_v3' ranks each group by its two best scores: "
                             f"num_experts / n_group must be >= 2, got {n_experts} / {g}")
        r = self.routed_scaling_factor
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise ValueError(f"BlockConfig.routed_scaling_factor must be a number > 0, got {r!r}")

    def _scaling_from_dict(self, params: dict[str, Any]) -> RopeScaling:
        """rope_scaling given as HF's dict: every key must be one the type reads, and a rope_theta
        or partial_rotary_factor in it must agree with the config's own fields."""
        for key, field in (("rope_theta", "rope_theta"), ("partial_rotary_factor", "partial_rotary_factor")):
            if key in params and params[key] != getattr(self, field):
                raise ValueError(f"BlockConfig.rope_scaling has {key}={params[key]!r} but the config's {field} is "
                                 f"{getattr(self, field)!r}: set {field} instead")
        try:
            scaling, ignored = RopeScaling.from_dict(params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"BlockConfig.rope_scaling: {e}") from None
        if ignored:
            raise ValueError(f"BlockConfig.rope_scaling: rope_type {scaling.rope_type!r} does not read {ignored}")
        return scaling

    @property
    def head_width(self) -> int:
        """Each head's width: head_dim, or d_model // num_heads when that is None."""
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """HF's rotary dim: int(head_width * partial_rotary_factor), the frequencies' denominator
        (multi-head latent attention: qk_rope_head_dim, DeepSeek's head_dim)."""
        if self.kv_lora_rank is not None:
            return self.qk_rope_head_dim
        return int(self.head_width * self.partial_rotary_factor)

    @property
    def latent(self) -> bool:
        """Whether the attention is multi-head latent attention (kv_lora_rank set; DeepSeek)."""
        return self.kv_lora_rank is not None

    @property
    def latent_scale(self) -> float:
        """Multi-head latent attention's factor of q.k: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times
        yarn's mscale squared, 0.1 mscale_all_dim ln(factor) + 1, when a scaled rotary sets mscale_all_dim
        (DeepSeek's yarn_apply_mscale; 1 at factor <= 1)."""
        scale = float(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim and s.factor is not None and s.factor > 1:
            m = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
            scale = scale * m * m
        return scale

    @property
    def rotary_width(self) -> int:
        """The head dims rotary rotates: rotary_dim rounded up to even (HF's cos and sin cover
        ceil(rotary_dim / 2) frequencies, twice)."""
        return self.rotary_dim + self.rotary_dim % 2

    @property
    def attention_scale(self) -> float:
        """The factor of q.k in the logits: query_pre_attn_scalar ** -0.5 (Gemma), else head_width ** -0.5."""
        a = self.head_width if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(a) ** -0.5

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads when that is None."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def has_mlp_bias(self) -> bool:
        return self.bias if self.mlp_bias is None else self.mlp_bias

    @property
    def has_norm_bias(self) -> bool:
        return self.bias if self.norm_bias is None else self.norm_bias

    @property
    def gated(self) -> bool:
        return self.mlp != "dense"

    @property
    def experts_width(self) -> int:
        """Each expert's hidden width: expert_d_ff, or d_ff when that is None."""
        return self.d_ff if self.expert_d_ff is None else self.expert_d_ff

    @property
    def mixed_mlp(self) -> bool:
        """Whether a stack mixes dense and experts layers (decoder_sparse_step > 1 or
        mlp_only_layers, Qwen2-MoE): each layer then holds and runs its own MLP only
        (`is_moe_layer`), as HF builds it (a Flax stack holds the two kinds apart, `stacks`)."""
        return self.num_experts > 0 and (self.decoder_sparse_step > 1 or bool(self.mlp_only_layers))

    def resolve(self, num_layers: int = 1) -> BlockConfig:
        """Fill the depth-dependent constants left as None, with the published formulas.

        DeepNorm, encoder-only stack of N layers: alpha = (2N)^(1/4), beta = (8N)^(-1/4).
        LayerScale (CaiT): eps = 0.1 up to 18 layers, 1e-5 up to 24, 1e-6 beyond.
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        changes: dict[str, Any] = {}  # field -> value, for dataclasses.replace
        if self.scaling == "deepnorm":
            if self.deepnorm_alpha is None:
                changes["deepnorm_alpha"] = (2 * num_layers) ** 0.25
            if self.deepnorm_beta is None:
                changes["deepnorm_beta"] = (8 * num_layers) ** -0.25
        if self.scaling == "layerscale" and self.layerscale_init is None:
            changes["layerscale_init"] = 0.1 if num_layers <= 18 else 1e-5 if num_layers <= 24 else 1e-6
        return replace(self, **changes) if changes else self

    @property
    def residual_alpha(self) -> float:
        """Weight of the skip path: DeepNorm's alpha, else 1."""
        if self.scaling == "deepnorm":
            alpha = self.resolve().deepnorm_alpha
            assert alpha is not None  # resolve fills it under deepnorm
            return alpha
        return 1.0


# ----------------------------------------------------------------------------------
# The residual update, written once for both frameworks (it only uses * and +).
# ----------------------------------------------------------------------------------


def check_parallel(cfg: BlockConfig, kind: str, sublayers: tuple) -> None:
    """Raise unless a parallel residual has what it needs: a block of one attention and one
    MLP sublayer (TransformerBlock; an Encoder's layers), as GPT-NeoX's and StableLM's layers."""
    if cfg.parallel_residual != "none" and [s.kind for s in sublayers] != ["attention", "mlp"]:
        raise ValueError(f"BlockConfig.parallel_residual={cfg.parallel_residual!r} runs an attention and an MLP "
                         f"side by side: a TransformerBlock or Encoder has them, a {kind} does not")


def is_local(cfg: BlockConfig, layer: Any) -> Any:
    """Whether layer `layer` (from 1; an int, or a traced integer in a Flax layer scan) is a
    local, sliding-window layer: a Python bool, or a boolean array when `layer` is traced.
    With sliding_window_pattern n the global layers are those n divides (Gemma 2 / 3: each
    period ends with its global layer), or with pattern_global_first those n divides l - 1
    (ModernBERT: layer_id % global_attn_every_n_layers == 0, from 0)."""
    if cfg.sliding_window is None:
        return False
    n = cfg.sliding_window_pattern
    if n is None:
        return True
    return (layer - 1 if cfg.pattern_global_first else layer) % n != 0


def _not_in(layer: Any, indices: tuple[int, ...], flag: Any) -> Any:
    """`flag` and layer `layer` (from 1; traced in a Flax layer scan) not among `indices` (from 0)."""
    for i in indices:
        flag = flag & (layer != i + 1)
    return flag


def is_chunked(cfg: BlockConfig, layer: Any) -> Any:
    """Whether layer `layer` (from 1; an int, or a traced integer in a Flax layer scan) attends in chunks
    (attention_chunk_size, Llama 4's "chunked_attention" layers): chunks set and layer - 1 not in
    unchunked_layers. A Python bool, or a boolean array when `layer` is traced."""
    if cfg.attention_chunk_size is None:
        return False
    return _not_in(layer, cfg.unchunked_layers, True)


def chunk_start(allowed: Any) -> Any:
    """Each row's first chunk's start, from `allowed` (B|1, H|1, T, S) (True: query i may attend key j;
    numpy, JAX or torch): the number of leading keys no query of the row may attend (its left padding,
    HF's create_chunked_causal_mask's left_padding_tokens) -> (B|1,) integers."""
    seen = allowed.any(-2).any(1)  # (B|1, S): keys some query may attend
    return (seen.cumsum(-1) == 0).sum(-1)


def same_chunk(size: int, query_slots: Any, key_slots: Any, start: Any) -> Any:
    """(B|1, T, S) booleans: query slot i and key slot j in the same chunk of `size`, the chunks counted
    from each row's `start` (B|1,): (j - start) // size == (i - start) // size (HF's chunked_overlay).
    query_slots (T,), key_slots (S,), start: arrays of one module (numpy, JAX or torch)."""
    s = start[:, None, None]
    return (key_slots[None, None, :] - s) // size == (query_slots[None, :, None] - s) // size


def check_cache_window(cfg: BlockConfig, window: int | None) -> None:
    """Raise if a decoding cache's window (a LanguageModel's cache_window) meets chunked attention: the keys
    it hides would count as the rows' left padding and move the chunks (`chunk_start`)."""
    if window is not None and cfg.attention_chunk_size is not None:
        raise ValueError(f"cache_window={window!r} with attention_chunk_size={cfg.attention_chunk_size!r}: a "
                         "chunked layer counts its chunks from each row's first cached key, which a window would "
                         "hide; build the model without cache_window (the chunk mask already limits what is read)")


def skips_attn_norm(cfg: BlockConfig, layer: Any, kind: str) -> Any:
    """Whether a sublayer of `kind` in layer `layer` (from 1; traced in a Flax layer scan) reads the
    stream without its norm: the first layer's self-attention under first_attn_norm=False
    (ModernBERT's layer 0 attn_norm is nn.Identity). A Python bool, or a boolean array when
    `layer` is traced."""
    if cfg.first_attn_norm or kind != "attention":
        return False
    return layer == 1


def has_rotary(cfg: BlockConfig, layer: Any, local: Any) -> Any:
    """Whether layer `layer` (from 1; an int, or a traced integer in a Flax layer scan) rotates q and k:
    rope_theta set, layer - 1 not in nope_layers (SmolLM3, Llama 4) and, with rope_local_only (Cohere 2),
    a local layer (`local`: is_local's answer). A Python bool, or a boolean array when either is traced."""
    if cfg.rope_theta is None or (cfg.rope_local_only and local is False):
        return False
    return _not_in(layer, cfg.nope_layers, local if cfg.rope_local_only else True)


def query_temperature(cfg: BlockConfig, slots: Any, xp: Any) -> Any:
    """Llama 4's temperature of the queries in a layer without rotary (attn_temperature_tuning), at
    the tokens' slots (T,) (cache index + i, HF's past_seen_tokens + i; not their position ids):
    log1p(floor((slot + 1) / query_temperature_floor)) * query_temperature_scale + 1. `xp`: numpy,
    jax.numpy or torch, whose log1p and floor it takes; `slots` a float array of that module."""
    assert cfg.query_temperature_floor is not None
    return xp.log1p(xp.floor((slots + 1.0) / cfg.query_temperature_floor)) * cfg.query_temperature_scale + 1.0


def is_moe_layer(cfg: BlockConfig, layer: Any) -> Any:
    """Whether layer `layer` (from 1; an int, or a traced integer in a Flax layer scan) runs the
    experts MLP, as HF's Qwen2-MoE decides for layer_idx = layer - 1: num_experts > 0, (layer_idx + 1)
    a multiple of decoder_sparse_step, layer_idx not in mlp_only_layers. A Python bool, or a boolean
    array when `layer` is traced."""
    if cfg.num_experts == 0:
        return False
    if not cfg.mixed_mlp:
        return True
    return _not_in(layer, cfg.mlp_only_layers, layer % cfg.decoder_sparse_step == 0)


def check_router_logits(cfg: BlockConfig, shape: tuple[int, ...]) -> None:
    """Raise unless `shape` is router logits of cfg's experts: (L, B, T, X) or (B, T, X), X = num_experts."""
    if not cfg.num_experts or len(shape) not in (3, 4) or shape[-1] != cfg.num_experts:
        raise ValueError(f"router logits of a config with num_experts={cfg.num_experts} must have shape "
                         f"(layers, batch, seq, {cfg.num_experts}) or (batch, seq, {cfg.num_experts}), "
                         f"got {tuple(shape)}"
                         + (": pass the experts config the model was built with" if not cfg.num_experts else ""))


def layer_scale(layer: Any, dtype: Any) -> Any:
    """LayerNorm Scaling's factor 1 / sqrt(layer) in `dtype` (a Python int: a Python float; a
    JAX or torch integer: an array of that dtype)."""
    if isinstance(layer, int):
        return layer ** -0.5
    return (layer.astype(dtype) if hasattr(layer, "astype") else layer.to(dtype)) ** -0.5


def check_attention_call(cfg: BlockConfig, *, need_weights: bool, explicit_mask: bool, dropout_active: bool) -> None:
    """Raise if cfg.attention forces "blocked" or "fused" on a self-attention call that such
    a path cannot honour (shared by both frameworks, so a call fails alike on both sides).
    need_weights: attention weights asked for (return_intermediates); explicit_mask: an
    attention_mask / attn_mask given (a key mask is fine); dropout_active: dropout on the
    attention weights in this call (rate > 0, training)."""
    if cfg.attention not in ("blocked", "fused"):
        return
    why, fix = (("the attention weights are asked for (return_intermediates=True)", "call without return_intermediates")
                if need_weights else
                ("an explicit attention mask is given", "pass padding as a key mask (key_mask / key_padding_mask)")
                if explicit_mask else
                ("dropout on the attention weights is active", "call with deterministic=True or in eval mode")
                if dropout_active else (None, None))
    if why:
        raise ValueError(f"BlockConfig.attention={cfg.attention!r} cannot serve this call: {why}. Build the module "
                         f"with attention='auto' (it falls back to the dense path by itself) or 'dense', or {fix}")


def check_width(cfg: BlockConfig, shape: tuple[int, ...], what: str = "input") -> None:
    """Raise if `shape` is not (batch, seq, d_model) or (seq, d_model)."""
    if len(shape) not in (2, 3) or shape[-1] != cfg.d_model:
        raise ValueError(
            f"{what} must have shape (batch, seq, {cfg.d_model}) or (seq, {cfg.d_model}) "
            f"(d_model={cfg.d_model}), got {tuple(shape)}"
        )


def check_new_cache(cfg: BlockConfig, kind: str, batch_size: Any, max_length: Any) -> None:
    """The checks of `init_cache`, shared by both frameworks."""
    if not cfg.causal:
        raise ValueError(f"{kind} is not causal (cfg.causal=False): a cache only serves causal decoding, "
                         "where a new position never changes the past")
    for name, v in (("batch_size", batch_size), ("max_length", max_length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def check_cached_call(cfg: BlockConfig, kind: str, cache: Any, shape: tuple[int, ...], *, masks: bool,
                      memory: bool) -> tuple[int, int, int]:
    """The checks of a cached call on x of `shape` (B, T, E), shared by both frameworks;
    returns (B, T, the cache's max_length). masks / memory: whether attention masks or a
    memory were passed (a cached call takes neither)."""
    if not cfg.causal:
        raise ValueError(f"{kind} is not causal (cfg.causal=False): it takes no cache")
    if not isinstance(cache, dict) or not {"index", "valid", "layers", "overflow"} <= set(cache):
        raise TypeError("cache must be what init_cache returned (a dict with index, valid, layers, overflow)")
    if masks:
        raise ValueError("a cached call is causal by construction: pass a key padding mask (batch, chunk) for "
                         "padding, not attention masks")
    if memory:
        raise ValueError("a cached call reads the memory's keys and values from the cache (init_cache took it)")
    b, t = shape[0], shape[1]
    cb, length = tuple(cache["valid"].shape)
    if b != cb:
        raise ValueError(f"the cache was made for batch size {cb}, the input has batch {b}")
    want = (cfg.kv_heads, length, cfg.head_width)
    for entry in _self_caches(cache["layers"]):
        for name in ("k", "v"):
            got = tuple(entry[name].shape)
            if got[-3:] != want:
                raise ValueError(f"the cache's self-attention {name!r} has shape {got}: a cache holds keys and values "
                                 f"head-major, (..., batch, kv_heads, max_length, head_width) = (..., {cb}, "
                                 f"{', '.join(map(str, want))}); make the cache with init_cache")
    return b, t, length


def _self_caches(tree: Any):
    """The self-attention caches {"k", "v"} in a cache's "layers" (stacked, per layer, or a
    decoding cache's entries; their weights are not walked)."""
    if isinstance(tree, dict):
        if isinstance(tree.get("self"), dict) and "k" in tree["self"]:
            yield tree["self"]
        for key, value in tree.items():
            if key not in ("self", "cross", "weights"):
                yield from _self_caches(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _self_caches(value)


def overflow_message(chunk: int, index: int, length: int) -> str | None:
    if index + chunk > length:
        return (f"cache overflow: a chunk of {chunk} position(s) at position {index} does not fit a cache of "
                f"max_length {length}")
    return None


class FullyMaskedWarning(UserWarning):
    """Attention masks left a batch element with no key to attend to at all (its attention
    output is zero). Issued by both frameworks where the masks' values are known in Python
    (eager calls, and masks that are constants under jit or grad; traced masks are not
    checked: that would need a host callback), worded by what was seen: some elements
    empty (a padded element holding no tokens) or every element (a mask in the other
    framework's convention).

    Shown once per cause per process, unless a warnings filter of yours matches it, which
    then decides as usual: silence it with
    `warnings.filterwarnings("ignore", category=FullyMaskedWarning)`, see it at every call
    with `warnings.simplefilter("always", FullyMaskedWarning)`, or make it an error."""


_SHOWN: set[str] = set()  # the texts already shown (one per cause and framework)


def fully_masked_message(every: bool, framework: str) -> str:
    """The warning's text for batch elements with no key to attend to at all: some of them
    (every=False; a padded element holding no tokens does this) or every element of the
    batch (almost always a mask written in the other framework's convention)."""
    mine, other = ("True = may attend", "True = may NOT attend") if framework == "flax" else (
        "True = may NOT attend", "True = may attend")
    if not every:
        return (f"{framework}: some batch elements have no key to attend to at all (every key masked), so their "
                f"attention output is zero and each block passes them through its residual. Expected for a padded "
                f"element that holds no tokens. If they do hold tokens, the mask is in the other framework's "
                f"convention ({other}; {framework}: {mine}): convert it with invert_mask(). "
                f"(Shown once; FullyMaskedWarning.)")
    return (f"{framework}: no batch element has any key to attend to, so every attention output is zero. "
            f"{framework} masks mean {mine}; a mask written in the other framework's convention ({other}) "
            f"does this: convert it with invert_mask(). (Shown once; FullyMaskedWarning.)")


def warn_fully_masked(empty: Any, batch: int, framework: str) -> None:
    """Issue the FullyMaskedWarning for `empty`, the batch elements (indices) that have no
    key at all, out of `batch`; nothing when there are none. It points at the first frame
    outside this library and the frameworks (the user's call). Once per text, unless a
    warnings filter matches it (its action then rules: Python's own "default" registry
    would repeat it, as every warnings.catch_warnings resets that registry)."""
    if not len(empty):
        return
    text = fully_masked_message(len(empty) >= batch, framework)
    level, frame = _outside_caller()
    if _filter_action(text, frame) in (None, "default"):
        if text in _SHOWN:
            return
        _SHOWN.add(text)
    warnings.warn(text, FullyMaskedWarning, stacklevel=level)


def _outside_caller() -> tuple[int, Any]:
    """(warnings.warn's stacklevel as called in warn_fully_masked, frame) of the first
    caller outside flax_blocks, torch_blocks, jax, flax and torch (as Python 3.12's
    skip_file_prefixes)."""
    files = [getattr(sys.modules.get(name), "__file__", None) for name in ("flax_blocks", "torch_blocks", "jax", "flax",
                                                                             "torch")]
    prefixes = tuple(os.path.dirname(f) + os.sep for f in files if f)
    frame, level = sys._getframe(2), 2  # warn_fully_masked's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return level, frame


def _filter_action(text: str, frame: Any) -> str | None:
    """The action of the first warnings filter matching a FullyMaskedWarning of `text`
    raised at `frame`, or None."""
    module, lineno = frame.f_globals.get("__name__", "<string>"), frame.f_lineno
    for action, message, category, mod, line in warnings.filters:
        if ((message is None or message.match(text)) and issubclass(FullyMaskedWarning, category)
                and (mod is None or mod.match(module)) and (line == 0 or line == lineno)):
            return action
    return None


def invert_mask(mask: Any) -> Any:
    """Convert a boolean mask between the two conventions (flax: True = may attend;
    torch: True = may NOT attend). Works on numpy, jax and torch arrays alike."""
    if mask is None:
        return None
    dtype = getattr(mask, "dtype", None)  # a Python bool has none (and ~True == -2)
    if dtype is None or "bool" not in str(dtype):
        raise TypeError(f"mask must be a boolean array, got {type(mask).__name__} of dtype {dtype}")
    return ~mask


# jax.checkpoint_policies that are policies themselves (the others are factories taking names)
REMAT_POLICIES = ("checkpoint_dots", "checkpoint_dots_with_no_batch_dims", "dots_saveable",
                  "dots_with_no_batch_dims_saveable", "everything_saveable", "nothing_saveable")


def check_remat(remat: Any) -> None:
    """A stack's remat: None, "full" (recompute each layer) or a name in REMAT_POLICIES."""
    if remat is not None and remat != "full" and remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be None, 'full' or a jax.checkpoint_policies name such as "
                         f"{list(REMAT_POLICIES)}, got {remat!r}")
