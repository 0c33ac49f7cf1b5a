"""Every BlockConfig field, declared once with what the rest of the project needs to know
about it: its help text, whether it adds parameters, and where it is exempt from the parity
matrix. Framework-free. (Which Hugging Face config key carries a field is each family's
business, read as transformers reads it: flax_blocks.checkpoints.families.)

Derived from this table, not kept beside it:
  - the converter CLI's flags and their help (flax_blocks.checkpoints.convert.cli);
  - the probe configs whose parameter names cover every option (`PROBE`, `PROBES`: config
    inference in flax_blocks.checkpoints.convert.infer and the dialects' name checks);
  - docs/options.md (`python -m flax_blocks.core.options > docs/options.md`, checked by the tests).
A guard test (tests/test_options.py) fails when a field is missing here, or an option is
missing from a place that must know it: the numpy reference, the parity matrix, each
Hugging Face dialect's settings, the CLI. docs/adding-an-option.md is the checklist.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .config import BlockConfig

Kind = Literal["size", "compute", "init", "dtype", "implementation"]


@dataclass(frozen=True)
class Option:
    """One BlockConfig field.

    kind: "size" (a width), "compute" (changes what a block computes), "init" (changes only
      the initial weights or training noise), "dtype", "implementation" (how, not what: the
      attention path; the same function up to rounding, so no checkpoint records it).
    help: one line, for the CLI and docs/options.md.
    adds: the value under which the option has the most parameters (None: no value adds any); the probe
      config takes every such value, so its parameter names are all the names there are.
    cli: the converter CLI takes it as a --flag (sizes are read from the tensors).
    not_in_matrix: why the parity matrix need not reach every value ("" = it must).
    only_with: (field, value): the option means something only when that field has that
      value (DeepNorm's alpha with scaling="deepnorm").
    """

    name: str
    kind: Kind
    help: str
    adds: Any = None
    cli: bool = True
    not_in_matrix: str = ""
    only_with: tuple[str, Any] | None = None


_RESOLVED = "left None in the matrix: resolve(num_layers) fills it with the published formula"

OPTIONS: tuple[Option, ...] = (
    Option("d_model", "size", "model width E", cli=False),
    Option("num_heads", "size", "attention (query) heads H; head_dim = d_model / num_heads unless given", cli=False),
    Option("d_ff", "size", "feed-forward width", cli=False),
    Option("dropout", "init", "dropout after each sublayer, after the FFN activation and on the attention weights",
           cli=False, not_in_matrix="dropout has its own tests (masks drawn alike, statistics); the matrix runs eval"),
    Option("activation", "compute", "feed-forward activation: 'gelu' is exact (erf), as torch's "
           "activation='gelu'; 'gelu_tanh' is the tanh approximation"),
    Option("layer_norm_eps", "compute", "LayerNorm / RMSNorm epsilon on both sides (torch's layer_norm_eps; "
           "its default is 1e-5)"),
    Option("bias", "compute", "biases in the linear maps and the LayerNorms", adds=True, cli=False),
    Option("norm", "compute", "norm placement: 'post' Norm(x + F(x)) (torch's norm_first=False), 'pre' "
           "x + F(Norm(x)) (norm_first=True), 'peri' x + Norm(F(Norm(x))), 'out' x + Norm(F(x)) (OLMo 2), 'none'",
           adds="peri"),
    Option("norm_type", "compute", "'layernorm' (mean, variance, weight and bias), 'rmsnorm' (weight only) or "
           "'dyt', Dynamic Tanh weight * tanh(alpha * x) + bias (Zhu et al. 2025; not with qk_norm)", adds="dyt"),
    Option("norm_weight_offset", "compute", "every norm (QK-norm and final norm too) scales by offset + w, w "
           "starting at 1 - offset: Gemma's RMSNorm (1 + w) is 1.0"),
    Option("dyt_alpha_init", "init", "DyT's initial alpha (the paper's default 0.5)", cli=False,
           not_in_matrix="an initial value: the matrix loads one side's weights into the other",
           only_with=("norm_type", "dyt")),
    Option("layernorm_scaling", "compute", "LayerNorm Scaling (Sun et al. 2025): layer l's pre-norm outputs times "
           "1 / sqrt(l), l from 1 (needs norm='pre'; a block alone is layer 1)"),
    Option("mlp", "compute", "feed-forward kind: 'dense', or gated 'swiglu' / 'geglu'", adds="swiglu"),
    Option("num_kv_heads", "compute", "key/value heads for grouped-query attention (default: as many as "
           "query heads)"),
    Option("head_dim", "size", "each attention head's width when not d_model / num_heads (Qwen3, Gemma): q/k/v "
           "project to num_heads * head_dim, the output projection back to d_model", cli=False),
    Option("qk_norm", "compute", "a scale-only norm over head_dim on each head of q and k, before rotary",
           adds=True),
    Option("qk_norm_over", "compute", "QK-norm over each head ('head': Qwen3, Gemma 3) or over the whole q / k "
           "projection before the split into heads ('projection': OLMo 2)", only_with=("qk_norm", True)),
    Option("rope_theta", "compute", "rotary position embedding base, rotate-half convention (not given: no "
           "positions)"),
    Option("partial_rotary_factor", "compute", "rotary on the first int(head_dim * factor) dims of each head, "
           "the rest passed through (GPT-NeoX rotary_pct, StableLM 0.25)"),
    Option("rope_scaling", "compute", "scaled rotary as transformers computes it: a RopeScaling or its dict "
           "(rope_type linear, dynamic, yarn, longrope or llama3, with its factors); with rope_local_theta the local "
           "layers stay plain"),
    Option("attn_logit_softcapping", "compute", "attention logits s become c * tanh(s / c) before the mask "
           "(Gemma 2: 50); not on the fused path"),
    Option("query_pre_attn_scalar", "compute", "logits scaled by this ** -0.5 instead of head_dim ** -0.5 "
           "(Gemma 2 / 3)"),
    Option("sliding_window", "compute", "local layers' causal window: query i sees keys i - W < j <= i "
           "(Mistral, Gemma 2 / 3)"),
    Option("sliding_window_pattern", "compute", "layer l (from 1) is global iff n divides l, the others local "
           "(Gemma 2: 2, Gemma 3: 6; default: every layer local)"),
    Option("rope_local_theta", "compute", "the rotary base of the local layers (Gemma 3 rope_local_base_freq; "
           "default rope_theta)"),
    Option("qkv_bias", "compute", "biases on the q/k/v projection alone (default: follow the biases)", adds=True),
    Option("mlp_bias", "compute", "biases on the MLP's linear maps alone (default: follow the biases)", adds=True),
    Option("norm_bias", "compute", "biases of the LayerNorms alone (default: follow the biases; StableLM: True with "
           "bias=False)", adds=True),
    Option("parallel_residual", "compute", "'two_norms' x + Attn(Norm1(x)) + MLP(Norm2(x)) (GPT-NeoX), "
           "'shared_norm' one norm for both (StableLM, GPT-J), 'none' sequential (needs norm='pre')"),
    Option("residual", "compute", "'add' keeps the skip path; 'none' is the skip ablation"),
    Option("scaling", "compute", "residual scaling: 'deepnorm', 'rezero', 'layerscale' or 'none' (DeepNorm has "
           "post-LN's tensors, so it cannot be read from a file)", adds="layerscale"),
    Option("deepnorm_alpha", "compute", "DeepNorm's alpha (default: from the depth)", not_in_matrix=_RESOLVED,
           only_with=("scaling", "deepnorm")),
    Option("deepnorm_beta", "init", "DeepNorm's init gain beta (default: from the depth)", not_in_matrix=_RESOLVED),
    Option("layerscale_init", "init", "LayerScale's initial scale (default: from the depth)",
           not_in_matrix=_RESOLVED),
    Option("causal", "compute", "every query attends only to keys at or before its position"),
    Option("init", "init", "initial weights: 'torch' (torch's own layer) or 'xavier'", cli=False,
           not_in_matrix="the matrix loads one side's weights into the other; init is tested on its own"),
    Option("dtype", "dtype", "computation dtype (None: promote inputs and parameters, the flax rule)", cli=False,
           not_in_matrix="the matrix runs every case in float32 and float64 parameters and inputs"),
    Option("param_dtype", "dtype", "parameter dtype on both sides", cli=False,
           not_in_matrix="the matrix runs every case in float32 and float64 parameters and inputs"),
    Option("attention", "implementation", "attention implementation: 'auto' (dense; the blocked path from 1024 keys, "
           "or the fused kernel on a GPU, where no weights, explicit mask or attention dropout are asked for), "
           "'dense', 'blocked' (memory-efficient, in blocks) or 'fused' (jax.nn.dot_product_attention; torch: SDPA)",
           cli=False),
    Option("attention_block", "implementation", "query and key block size of the blocked path (Flax)", cli=False),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# Every parameter name any option can add exists in a block of one of PROBES (silu: the
# gated MLP that `mlp` adds needs a matching activation). PROBE takes every option's `adds`
# value that BlockConfig allows together; an `adds` value refused beside another's
# (norm_type="dyt" with qk_norm=True) is in a second probe, the first with the option at
# that value and what refuses it switched off (PROBE_EXCLUDED). Code that needs every name
# reads the union over PROBES; set differences against PROBE (config inference) stay within one.
# option: (value in PROBE, what its adds refuses)
PROBE_EXCLUDED: dict[str, tuple[Any, dict[str, Any]]] = {"norm_type": ("layernorm", {"qk_norm": False})}
_PROBE_VALUES: dict[str, Any] = {o.name: PROBE_EXCLUDED[o.name][0] if o.name in PROBE_EXCLUDED else o.adds
                                 for o in OPTIONS if o.adds is not None}
PROBE = BlockConfig(d_model=8, num_heads=2, d_ff=8, activation="silu", **_PROBE_VALUES)
PROBES = (PROBE, *(dataclasses.replace(PROBE, **{name: BY_NAME[name].adds}, **off)
                   for name, (_, off) in PROBE_EXCLUDED.items()))


def values(name: str) -> str:
    """The values a field takes, as text: Literal choices, or its type."""
    hint = typing.get_type_hints(BlockConfig)[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return " / ".join(repr(a) for a in args)
    if type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return " or ".join([*(getattr(a, "__name__", str(a)) for a in inner), "None"])
    return getattr(hint, "__name__", str(hint))


def table() -> str:
    """docs/options.md: one row per option, from OPTIONS and BlockConfig's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(BlockConfig)}
    lines = [
        "# BlockConfig options",
        "",
        "Generated by `python -m flax_blocks.core.options > docs/options.md` from `flax_blocks/core/options.py`",
        "(tests/test_options.py fails when this file is stale). Every option means the same in",
        "`flax_blocks` and `torch_blocks`.",
        "",
        "| option | values | default | what | adds parameters |",
        "|---|---|---|---|---|",
    ]
    for o in OPTIONS:
        default = defaults[o.name]
        default = "required" if default is dataclasses.MISSING else f"`{default!r}`"
        adds = f"with `{o.adds!r}`" if o.adds is not None else ""
        lines.append(f"| `{o.name}` | {values(o.name)} | {default} | {o.help} | {adds} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
