"""A small causal language model built from `flax_blocks`, and the variant axis.

    tokens (B, T) -> token embedding + learned positions (B, T, E)
                  -> flax_blocks.Encoder, causal, L layers stacked and scanned (B, T, E)
                  -> linear head (B, T, V) logits

Variants (the residual placement and scaling being compared):

    post        LN(x + F(x))                       the original Transformer
    pre         x + F(LN(x)), final LN              GPT-2 style
    noskip      LN(F(x))                            post-LN without the identity path
    deepnorm    LN(alpha x + F(x)), F init * beta   Wang et al. 2022, alpha=(2L)^1/4, beta=(8L)^-1/4
    rezero      x + a F(x), a = 0, no LayerNorm     Bachlechner et al. 2020
    layerscale  x + diag(g) F(LN(x)), g = eps       Touvron et al. 2021 (CaiT), on pre-LN
    peri        x + LN_out(F(LN_in(x))), final LN   Peri-LN (Kim et al. 2025) / sandwich norm (Gemma 2/3)
    pre-rms     x + F(RMSNorm(x)), final RMSNorm    pre-LN with RMSNorm, as LLaMA
    pre-qknorm  pre-LN + LayerNorm on each head's q and k (over head_dim) before the logits
                                                    Dehghani et al. 2023, Wortsman et al. 2023
    pre-dyt     x + F(DyT(x)), final DyT            DyT(x) = w tanh(alpha x) + b in place of every
                                                    norm (Zhu et al. 2025, "Transformers without
                                                    Normalization"), alpha = 0.5 at init
    pre-lns     x + F(LN(x) / sqrt(l)), final LN    LayerNorm Scaling, l the layer index from 1
                                                    (Sun et al. 2025, "The Curse of Depth")
    post-moe    post-LN, its MLP a mixture of       MOE_EXPERTS = 8 experts, each token to the top
                experts                             MOE_TOP_K = 2 of the router's softmax, the two
    pre-moe     pre-LN, the same experts MLP        weights renormalised (Mixtral); each expert the
                                                    lab's MLP (ReLU) of width d_ff / 2, so a token's
                                                    active width is the dense variant's d_ff
Mix-LN (post-LN in the first layers, pre-LN in the rest) is not here: the Encoder scans one
stacked layer type, so it would need two Encoders back to back.

No q/k/v biases (as Wortsman et al. 2023's setup): the key bias cannot change any output
(each query's logits all shift by q.b_k, and softmax ignores a shift), so its gradient is
pure rounding noise, which Adam (eps 1e-9) turns into lr-sized steps: it drifts, and with
it the raw attention logits the lab measures (seen: a 1% difference in the largest logit
between 1 and 4 devices after two steps, where every loss agreed to 1e-6).

The model is the library's `flax_blocks.LanguageModel` (its torch twin
`torch_blocks.LanguageModel` loads it by `fb.torch_state_dict`): token embedding + learned
positions, the causal Encoder with its default final norm, an untied head with a bias. This
module holds only what is the lab's: the variants and the shapes and init of `ModelConfig`.

Initialisation, the same for every variant (DESIGN notes: the scheme changes the picture):
every block matrix xavier-uniform with zero biases (`BlockConfig(init="xavier")`); DeepNorm
replaces the v / out / FFN matrices with its xavier-normal * beta, which is part of the
method. Token embedding and positions N(0, 1/2) each (`LMConfig.init_std`), so the embedded
input x_0 has unit variance per coordinate (||x_0||^2 / d ~ 1); head xavier-uniform, zero
bias (`LMConfig(head_init="xavier", head_bias=True)`). No dropout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from flax_blocks import BlockConfig, LMConfig

if TYPE_CHECKING:
    from flax import nnx

    from flax_blocks import LanguageModel

# The experts variants (`MOE_VARIANTS`): the same blocks with a mixture-of-experts MLP of
# MOE_EXPERTS experts, top MOE_TOP_K, expert width d_ff / MOE_TOP_K (`ModelConfig.block_config`).
MOE_EXPERTS, MOE_TOP_K = 8, 2
_MOE: dict[str, str | bool | int] = dict(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, norm_topk_prob=True)

VARIANTS: dict[str, dict[str, str | bool | int]] = {
    "post": dict(norm="post"),
    "pre": dict(norm="pre"),
    "noskip": dict(norm="post", residual="none"),
    "deepnorm": dict(norm="post", scaling="deepnorm"),
    "rezero": dict(norm="none", scaling="rezero"),
    "layerscale": dict(norm="pre", scaling="layerscale"),
    "peri": dict(norm="peri"),
    "pre-rms": dict(norm="pre", norm_type="rmsnorm"),
    "pre-qknorm": dict(norm="pre", qk_norm=True),
    "pre-dyt": dict(norm="pre", norm_type="dyt"),
    "pre-lns": dict(norm="pre", layernorm_scaling=True),
    "post-moe": dict(norm="post", **_MOE),
    "pre-moe": dict(norm="pre", **_MOE),
}
MOE_VARIANTS = tuple(v for v, kw in VARIANTS.items() if kw.get("num_experts"))
DENSE_TWIN = {"post-moe": "post", "pre-moe": "pre"}  # each experts variant's dense variant

# One line per variant for reports: the residual update of each sublayer F.
VARIANT_NOTES: dict[str, str] = {
    "post": "LN(x + F(x))", "pre": "x + F(LN(x)), final LN", "noskip": "LN(F(x))",
    "deepnorm": "LN(alpha x + F(x)), F's init scaled by beta", "rezero": "x + a F(x), a = 0 at init, no norm",
    "layerscale": "x + diag(g) F(LN(x)), g small at init (CaiT)", "peri": "x + LN(F(LN(x))), final LN",
    "pre-rms": "x + F(RMSNorm(x)), final RMSNorm", "pre-qknorm": "pre-LN with LayerNorm on each head's q and k",
    "pre-dyt": "x + F(DyT(x)), DyT = w tanh(alpha x) + b, final DyT", "pre-lns": "x + F(LN(x) / sqrt(l)), final LN",
    "post-moe": f"post-LN, MLP = {MOE_EXPERTS} experts of width d_ff / {MOE_TOP_K}, top-{MOE_TOP_K} routing",
    "pre-moe": f"pre-LN, MLP = {MOE_EXPERTS} experts of width d_ff / {MOE_TOP_K}, top-{MOE_TOP_K} routing",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and variant of one language model. Hashable: it keys compiled functions."""

    variant: str
    num_layers: int
    vocab: int = 32
    seq_len: int = 32
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256
    activation: str = "relu"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose from {tuple(VARIANTS)}")

    @property
    def experts(self) -> bool:
        """True for the mixture-of-experts variants (`MOE_VARIANTS`)."""
        return self.variant in MOE_VARIANTS

    def block_config(self) -> BlockConfig:
        """The flax_blocks config of every layer (resolved for this depth by the Encoder). The
        experts variants: each expert d_ff / MOE_TOP_K wide, so the width a token passes through
        (its MOE_TOP_K experts) is the dense variant's d_ff."""
        extra: dict[str, str | bool | int] = {}
        if self.experts:
            if self.d_ff % MOE_TOP_K:
                raise ValueError(f"{self.variant}: d_ff ({self.d_ff}) must be a multiple of {MOE_TOP_K}")
            extra["expert_d_ff"] = self.d_ff // MOE_TOP_K
        return BlockConfig(
            d_model=self.d_model, num_heads=self.num_heads, d_ff=self.d_ff, dropout=0.0,
            activation=self.activation, causal=True, init="xavier", qkv_bias=False, **VARIANTS[self.variant],
            **extra,
        )

    def lm_config(self) -> LMConfig:
        """The parts around the stack: embeddings N(0, 1/2), seq_len learned positions, an
        untied xavier-uniform head with a zero bias."""
        return LMConfig(vocab_size=self.vocab, num_layers=self.num_layers, max_positions=self.seq_len,
                        init_std=math.sqrt(0.5), head="untied", head_bias=True, head_init="xavier")

    def build(self, rngs: nnx.Rngs) -> LanguageModel:
        """The library's LanguageModel of this config (params: embed, pos, encoder, head)."""
        from flax_blocks import LanguageModel  # Flax on first use (below)

        return LanguageModel(self.block_config(), self.lm_config(), rngs=rngs)


def create_params(cfg: ModelConfig, key: jax.Array) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """Build a model from `key` and split it into (graphdef, params, other state).

    Pure function of `key` (jax.vmap it over seeds). "other state" holds the Dropout
    layers' RNG streams, unused here (dropout is 0) but needed to merge the model back.
    """
    from flax import nnx

    model = cfg.build(nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1)))
    return nnx.split(model, nnx.Param, ...)


# The lab's programs take and return a model's states as nested dicts of arrays (`nnx.to_pure_dict`),
# so the trees of a program loaded from the program cache name no Flax class, and Flax is
# imported only where a model is built or traced: a warm lab run loads its programs without it
# (Flax's import is ~0.6 s of the ~1.5 s a run's imports take).


def pure_params(cfg: ModelConfig, key: jax.Array) -> tuple[dict, dict]:
    """`create_params`' two states (params, other state) as nested dicts of arrays."""
    from flax import nnx

    _, params, rest = create_params(cfg, key)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def model_binder(cfg: ModelConfig) -> Callable[[dict, dict], LanguageModel]:
    """A function (params, rest) -> the LanguageModel holding those arrays, the inverse of
    `pure_params` (each array put at its path; the structure is built once, abstractly)."""
    from flax import nnx

    graphdef, params0, rest0 = nnx.eval_shape(lambda: create_params(cfg, jax.random.key(0)))

    def filled(template: nnx.State, pure: dict) -> nnx.State:
        state = jax.tree.map(lambda x: x, template)  # new Variables: replace_by_pure_dict writes in place
        nnx.replace_by_pure_dict(state, pure)
        return state

    return lambda params, rest: nnx.merge(graphdef, filled(params0, params), filled(rest0, rest))
