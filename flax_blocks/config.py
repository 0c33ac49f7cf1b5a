"""One block configuration for both frameworks, plus the semantics they share.

Nothing here imports a framework: `torch_blocks` and `flax_blocks` both read this
module, so a field means the same thing on both sides. Defaults follow
`torch.nn.TransformerEncoderLayer` (d_ff 2048, dropout 0.1, relu, post-LN,
eps 1e-5), so `BlockConfig(d_model=512, num_heads=8)` describes the same layer as
`nn.TransformerEncoderLayer(512, 8, batch_first=True)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
NORMS = ("pre", "post", "none")
RESIDUALS = ("add", "none")
SCALINGS = ("none", "deepnorm", "rezero", "layerscale")
INITS = ("torch", "xavier")
DTYPES = ("float32", "float64", "bfloat16", "float16")


def _allowed(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"BlockConfig.{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class BlockConfig:
    """Configuration of one residual transformer block (and of an Encoder's layers).

    Fields:
      d_model, num_heads, d_ff: widths; head_dim = d_model // num_heads.
      dropout: rate used after each sublayer, after the FFN activation and on the
        attention weights (as in torch's TransformerEncoderLayer).
      activation: "relu", "gelu" (exact, erf) or "gelu_tanh" (tanh approximation).
      layer_norm_eps: LayerNorm epsilon (torch's 1e-5, not flax's 1e-6).
      bias: biases in the linear maps and the LayerNorms.
      norm: "post" LN(x + F(x)), "pre" x + F(LN(x)), or "none" (no LayerNorm, as ReZero).
      residual: "add" keeps the identity path; "none" is the skip ablation y = F(.).
      scaling: residual scaling scheme:
        "none";
        "deepnorm" (Wang et al. 2022): x <- LN(alpha * x + F(x)), with F's v/out/FFN
          weights drawn xavier-normal with gain beta; needs norm="post";
        "rezero" (Bachlechner et al. 2020): x <- x + a * F(x), scalar a = 0 at init;
        "layerscale" (Touvron et al. 2021, CaiT): x <- x + diag(g) F(x), g = eps at init.
      deepnorm_alpha, deepnorm_beta, layerscale_init: None means "from the depth",
        filled in by `resolve(num_layers)` with the published formulas.
      causal: every query attends only to keys at or before its position.
      init: "torch" (the distributions of torch's own layer) or "xavier"
        (xavier-uniform matrices, zero biases).
      dtype: computation dtype (None: promote inputs and parameters, the flax rule).
      param_dtype: parameter dtype on both sides.
    """

    d_model: int
    num_heads: int
    d_ff: int = 2048
    dropout: float = 0.1
    activation: Literal["relu", "gelu", "gelu_tanh"] = "relu"
    layer_norm_eps: float = 1e-5
    bias: bool = True
    norm: Literal["pre", "post", "none"] = "post"
    residual: Literal["add", "none"] = "add"
    scaling: Literal["none", "deepnorm", "rezero", "layerscale"] = "none"
    deepnorm_alpha: float | None = None
    deepnorm_beta: float | None = None
    layerscale_init: float | None = None
    causal: bool = False
    init: Literal["torch", "xavier"] = "torch"
    dtype: str | None = None
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"BlockConfig.d_model ({self.d_model}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"BlockConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"BlockConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        _allowed("activation", self.activation, ACTIVATIONS)
        _allowed("norm", self.norm, NORMS)
        _allowed("residual", self.residual, RESIDUALS)
        _allowed("scaling", self.scaling, SCALINGS)
        _allowed("init", self.init, INITS)
        _allowed("dtype", self.dtype, (None, *DTYPES))
        _allowed("param_dtype", self.param_dtype, DTYPES)
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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def resolve(self, num_layers: int = 1) -> "BlockConfig":
        """Fill the depth-dependent constants left as None, with the published formulas.

        DeepNorm, encoder-only stack of N layers: alpha = (2N)^(1/4), beta = (8N)^(-1/4).
        LayerScale (CaiT): eps = 0.1 up to 18 layers, 1e-5 up to 24, 1e-6 beyond.
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        changes: dict[str, float] = {}
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
            return self.resolve().deepnorm_alpha  # type: ignore[return-value]
        return 1.0


# ----------------------------------------------------------------------------------
# Initialisation: one table of distributions, sampled by each framework.
# Roles name parameters by what they are, independent of either framework's layout.
# A spec is ("uniform", bound), ("normal", std) or ("const", value); iid entries.
# ----------------------------------------------------------------------------------

Spec = tuple[str, float]


def _xavier_uniform(fan_in: int, fan_out: int, gain: float = 1.0) -> Spec:
    return ("uniform", gain * math.sqrt(6.0 / (fan_in + fan_out)))


def _xavier_normal(fan_in: int, fan_out: int, gain: float = 1.0) -> Spec:
    return ("normal", gain * math.sqrt(2.0 / (fan_in + fan_out)))


def init_spec(cfg: BlockConfig, role: str) -> Spec | tuple[Spec, Spec, Spec]:
    """Distribution of the parameter `role` under `cfg.init` (and DeepNorm's gains).

    Roles: qkv_weight (returns one spec per q, k, v chunk), qkv_bias, out_weight,
    out_bias, linear1_weight, linear1_bias, linear2_weight, linear2_bias, norm_weight,
    norm_bias, scale (the ReZero / LayerScale gate).
    """
    cfg = cfg.resolve()
    e, f = cfg.d_model, cfg.d_ff
    zero: Spec = ("const", 0.0)
    if role == "norm_weight":
        return ("const", 1.0)
    if role == "norm_bias":
        return zero
    if role == "scale":
        return ("const", 0.0 if cfg.scaling == "rezero" else float(cfg.layerscale_init or 0.0))
    if role.endswith("_bias") and (cfg.init == "xavier" or cfg.scaling == "deepnorm"):
        return zero
    if cfg.scaling == "deepnorm":
        beta = float(cfg.deepnorm_beta)  # type: ignore[arg-type]
        return {
            "qkv_weight": (_xavier_normal(e, e), _xavier_normal(e, e), _xavier_normal(e, e, beta)),
            "out_weight": _xavier_normal(e, e, beta),
            "linear1_weight": _xavier_normal(e, f, beta),
            "linear2_weight": _xavier_normal(f, e, beta),
        }[role]
    if cfg.init == "xavier":
        return {
            "qkv_weight": (_xavier_uniform(e, e),) * 3,
            "out_weight": _xavier_uniform(e, e),
            "linear1_weight": _xavier_uniform(e, f),
            "linear2_weight": _xavier_uniform(f, e),
        }[role]
    # torch: MultiheadAttention xavier-uniform over the packed (3E, E) matrix and zero
    # biases; nn.Linear's kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(fan_in)).
    return {
        "qkv_weight": (_xavier_uniform(e, 3 * e),) * 3,
        "qkv_bias": zero,
        "out_weight": ("uniform", 1 / math.sqrt(e)),
        "out_bias": zero,
        "linear1_weight": ("uniform", 1 / math.sqrt(e)),
        "linear1_bias": ("uniform", 1 / math.sqrt(e)),
        "linear2_weight": ("uniform", 1 / math.sqrt(f)),
        "linear2_bias": ("uniform", 1 / math.sqrt(f)),
    }[role]


# ----------------------------------------------------------------------------------
# The residual update, written once for both frameworks (it only uses * and +).
# ----------------------------------------------------------------------------------


def residual_update(
    cfg: BlockConfig,
    x: Any,
    sublayer: Callable[[Any], tuple[Any, Any]],
    norm: Callable[[Any], Any],
    dropout: Callable[[Any], Any],
    scale: Any = None,
) -> tuple[Any, Any]:
    """One residual sublayer; returns (y, whatever `sublayer` returned beside its output).

    post: y = LN(alpha * x + s * Dropout(F(x)))     pre: y = x + s * Dropout(F(LN(x)))
    none: y = x + s * Dropout(F(x))
    with alpha = DeepNorm's alpha (else 1), s = the ReZero / LayerScale gate (else 1);
    residual="none" drops the skip term (alpha * x).
    """
    h, aux = sublayer(norm(x) if cfg.norm == "pre" else x)
    h = dropout(h)
    if scale is not None:
        h = scale * h
    if cfg.residual == "add":
        alpha = cfg.residual_alpha
        h = (x * alpha if alpha != 1.0 else x) + h
    return (norm(h) if cfg.norm == "post" else h), aux


def check_width(cfg: BlockConfig, shape: tuple[int, ...], what: str = "input") -> None:
    """Raise if `shape` is not (batch, seq, d_model) or (seq, d_model)."""
    if len(shape) not in (2, 3) or shape[-1] != cfg.d_model:
        raise ValueError(
            f"{what} must have shape (batch, seq, {cfg.d_model}) or (seq, {cfg.d_model}) "
            f"(d_model={cfg.d_model}), got {tuple(shape)}"
        )


def invert_mask(mask: Any) -> Any:
    """Convert a boolean mask between the two conventions (flax: True = may attend;
    torch: True = may NOT attend). Works on numpy, jax and torch arrays alike."""
    if mask is None:
        return None
    dtype = getattr(mask, "dtype", None)  # a Python bool has none (and ~True == -2)
    if dtype is None or "bool" not in str(dtype):
        raise TypeError(f"mask must be a boolean array, got {type(mask).__name__} of dtype {dtype}")
    return ~mask
