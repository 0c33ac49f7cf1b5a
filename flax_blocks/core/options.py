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
    Option("first_attn_norm", "compute", "False: the first layer's attention reads the stream unnormalised, its norm "
           "the identity (ModernBERT's layer 0 attn_norm; needs norm='pre')"),
    Option("mlp", "compute", "feed-forward kind: 'dense', or gated 'swiglu' / 'geglu'", adds="swiglu"),
    Option("num_experts", "compute", "experts in the MLP sublayer, a router sending each token to "
           "num_experts_per_tok of them (Mixtral, Qwen-MoE, OLMoE); 0: one dense MLP", adds=4),
    Option("num_experts_per_tok", "compute", "experts each token goes to: the top k of the router's softmax",
           not_in_matrix="a count: the matrix runs top-1 and top-2 (parity_tests/twins/test_experts.py)"),
    Option("expert_d_ff", "size", "each expert's hidden width (default d_ff; HF moe_intermediate_size)", cli=False),
    Option("norm_topk_prob", "compute", "the k routing weights renormalised to sum to 1 (Mixtral, Qwen3-MoE; "
           "Qwen2-MoE and OLMoE: False)"),
    Option("shared_expert_d_ff", "size", "a shared expert of this width every token goes through, times "
           "sigmoid(a gate) (Qwen2-MoE); 0: none", adds=8, cli=False),
    Option("decoder_sparse_step", "compute", "layer l (from 1) runs the experts iff step divides l, the others "
           "a dense MLP of width d_ff (Qwen2-MoE's decoder_sparse_step)", adds=2,
           not_in_matrix="a per-layer choice: a stack's test (parity_tests/twins/test_experts.py)"),
    Option("mlp_only_layers", "compute", "layers (from 0, as HF's mlp_only_layers) that run a dense MLP "
           "instead of the experts", cli=False,
           not_in_matrix="a per-layer choice: a stack's test (parity_tests/twins/test_experts.py)"),
    Option("experts_bias", "compute", "biases on the router and on every expert's projections (GPT-OSS)",
           adds=True),
    Option("swiglu_limit", "compute", "the experts' clamped SwiGLU (GPT-OSS): gate clamped above at the limit, up to "
           "[-limit, limit], (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: plain SwiGLU"),
    Option("swiglu_alpha", "compute", "the clamped SwiGLU's sigmoid gain (GPT-OSS 1.702; read with swiglu_limit)"),
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
    Option("attn_sinks", "compute", "a learned logit per head joining each softmax's denominator, then dropped "
           "(GPT-OSS sinks); not on the fused path", adds=True),
    Option("alibi", "compute", "ALiBi: head h adds slope_h * (the key's position among the real keys) to its "
           "logits before the 1 / sqrt(head_dim) scale, bfloat16-rounded as Falcon's build_alibi_tensor; not on the "
           "fused or blocked path"),
    Option("query_pre_attn_scalar", "compute", "logits scaled by this ** -0.5 instead of head_dim ** -0.5 "
           "(Gemma 2 / 3)"),
    Option("sliding_window", "compute", "local layers' window: query i sees keys i - W < j <= i (causal: Mistral, "
           "Gemma 2 / 3), or |i - j| < W without causal (ModernBERT)"),
    Option("sliding_window_pattern", "compute", "layer l (from 1) is global iff n divides l, the others local "
           "(Gemma 2: 2, Gemma 3: 6; default: every layer local)"),
    Option("pattern_global_first", "compute", "each period of sliding_window_pattern starts with its global layer: "
           "layer l global iff n divides l - 1 (ModernBERT's global_attn_every_n_layers)"),
    Option("rope_local_theta", "compute", "the rotary base of the local layers (Gemma 3 rope_local_base_freq; "
           "default rope_theta)"),
    Option("rope_interleaved", "compute", "rotary pairs adjacent dims (2i, 2i + 1) instead of halves (i, i + "
           "rotary_dim / 2): GPT-J's rotate_every_two, Cohere's repeat-interleave"),
    Option("rope_local_only", "compute", "rotary on the local (sliding-window) layers alone, the global layers "
           "without positions (Cohere 2)"),
    Option("nope_layers", "compute", "layers (from 0, HF no_rope_layers' zeros) that attend without rotary "
           "positions (SmolLM3, Llama 4's NoPE layers)", cli=False),
    Option("query_temperature_floor", "compute", "Llama 4's attn_temperature_tuning: the queries of the layers "
           "without rotary times log1p(floor((slot + 1) / floor)) * query_temperature_scale + 1 (floor_scale 8192); "
           "None: off", cli=False),
    Option("query_temperature_scale", "compute", "the query temperature's gain (Llama 4's attn_scale 0.1)", cli=False,
           only_with=("query_temperature_floor", 2.0)),
    Option("qk_l2_norm", "compute", "Llama 4's use_qk_norm: q and k divided by their RMS over each head (no weight, "
           "eps layer_norm_eps) in the layers that rotate, after rotary; not with qk_norm"),
    Option("attention_chunk_size", "compute", "Llama 4's chunked attention: a query sees the earlier keys of its own "
           "chunk of C tokens, the chunks counted from each row's first real token; None: off; not on the fused path",
           cli=False),
    Option("unchunked_layers", "compute", "layers (from 0, HF layer_types 'full_attention') that attend to every "
           "earlier key beside the chunked ones (Llama 4: its NoPE layers)", cli=False,
           only_with=("attention_chunk_size", 2)),
    Option("qkv_bias", "compute", "biases on the q/k/v projection alone (default: follow the biases)", adds=True),
    Option("mlp_bias", "compute", "biases on the MLP's linear maps alone (default: follow the biases)", adds=True),
    Option("norm_bias", "compute", "biases of the LayerNorms alone (default: follow the biases; StableLM: True with "
           "bias=False)", adds=True),
    Option("parallel_residual", "compute", "'two_norms' x + Attn(Norm1(x)) + MLP(Norm2(x)) (GPT-NeoX), "
           "'shared_norm' one norm for both (StableLM, GPT-J), 'none' sequential (needs norm='pre')"),
    Option("residual", "compute", "'add' keeps the skip path; 'none' is the skip ablation"),
    Option("residual_multiplier", "compute", "each sublayer's output times m before the skip adds it, "
           "x + m * F(x) (Granite's residual_multiplier); 1.0: none"),
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
    Option("attention", "implementation", "attention implementation: 'auto' (one rule in both twins: the fused "
           "kernel on a GPU, the memory-efficient one from 1024 keys, where it computes the call; else dense), "
           "'dense', 'blocked' (memory-efficient, in blocks) or 'fused' (jax.nn.dot_product_attention; torch: SDPA)",
           cli=False),
    Option("attention_block", "implementation", "query and key block size of the blocked path (Flax)", cli=False),
    Option("kv_lora_rank", "size", "multi-head latent attention (DeepSeek V2 / V3) with a latent of this width "
           "(kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj); None: the packed q/k/v attention", adds=6, cli=False),
    Option("q_lora_rank", "size", "MLA's low-rank queries (q_a_proj -> RMSNorm -> q_b_proj) of this rank; None: "
           "q_proj", adds=4, cli=False),
    Option("qk_nope_head_dim", "size", "MLA: each head's non-rotary query / key width", cli=False),
    Option("qk_rope_head_dim", "size", "MLA: the rotary query / key width (the rotary key shared by the heads)",
           cli=False),
    Option("v_head_dim", "size", "MLA: each head's value width", cli=False),
    Option("rope_interleave", "compute", "MLA's rotary on adjacent pairs (DeepSeek V2; V3's rope_interleave) "
           "instead of rotate-half", cli=False, only_with=("kv_lora_rank", 6)),
    Option("latent_norm_eps", "compute", "the eps of MLA's latent RMSNorms (HF: 1e-6 whatever rms_norm_eps)",
           cli=False, only_with=("kv_lora_rank", 6)),
    Option("routing", "compute", "'softmax' (top k of the softmax), 'deepseek_v2' (softmax, groups by their best "
           "score), 'deepseek_v3' (sigmoid, e_score_correction_bias for the choice, groups by their top-2 sums), "
           "'llama4' (the top k logits, each weight their sigmoid)", adds="deepseek_v3", cli=False),
    Option("n_group", "compute", "DeepSeek routing: the experts in this many equal groups", cli=False),
    Option("topk_group", "compute", "DeepSeek routing: the groups kept for the top k", cli=False),
    Option("routed_scaling_factor", "compute", "DeepSeek routing: the k weights times this", cli=False),
    Option("shared_expert_gate", "compute", "the shared expert times sigmoid(a gate) (Qwen2-MoE); False: ungated "
           "(DeepSeek's shared experts)", adds=True, cli=False),
    Option("routing_weights_on", "compute", "where each chosen expert's routing weight multiplies: its 'output' "
           "(Mixtral, DeepSeek ...) or its 'input' (Llama 4: the expert runs on w * x)", cli=False),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# Every parameter name any option can add exists in a block of one of PROBES (silu: the
# gated MLP that `mlp` adds needs a matching activation). PROBE takes every option's `adds`
# value that BlockConfig allows together; an `adds` value refused beside another's
# (norm_type="dyt" with qk_norm=True) is in a second probe, the first with the option at
# that value and what refuses it switched off (PROBE_EXCLUDED). Code that needs every name
# reads the union over PROBES; set differences against PROBE (config inference) stay within one.
# option: (value in PROBE, what its adds refuses)
PROBE_EXCLUDED: dict[str, tuple[Any, dict[str, Any]]] = {
    "norm_type": ("layernorm", {"qk_norm": False}),
    "kv_lora_rank": (None, {"qk_norm": False, "norm_type": "rmsnorm", "rope_theta": 100.0, "qk_rope_head_dim": 2,
                            "v_head_dim": 2, "attn_sinks": False, "rope_interleaved": False,
                            "rope_local_only": False}),  # MLA: its RMSNorms, its rotary, no QK-norm or sinks
}
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


# What each field computes, beyond its one line: conventions, references, what it needs.
DETAILS = """\
- `d_model`, `num_heads`, `d_ff`: widths; each head's width is head_dim, or d_model // num_heads
  (`head_width`, the width every part of the blocks uses).
- `dropout`: rate used after each sublayer, after the FFN activation and on the attention weights (as in
  torch's TransformerEncoderLayer).
- `activation`: "relu", "gelu" (exact, erf), "gelu_tanh" (tanh approximation) or "silu".
- `layer_norm_eps`: epsilon of every norm, LayerNorm or RMSNorm, on both sides (torch's 1e-5; neither flax's
  1e-6 nor torch RMSNorm's machine epsilon).
- `bias`: biases in the linear maps and the LayerNorms.
- `norm`: where the norms sit around each sublayer F: "post" Norm(x + F(x)), "pre" x + F(Norm(x)), "peri" x +
  Norm_out(F(Norm_in(x))) (Peri-LN / sandwich norm), "out" x + Norm(F(x)): a norm on the sublayer's output and
  none on its input (OLMo 2, HF Olmo2's post_attention / post_feedforward_layernorm; the Swin V2
  "res-post-norm"; Peri-LN's output norm alone), or "none" (no norm, as ReZero).
- `norm_type`: "layernorm" (mean and variance, weight and bias), "rmsnorm" (x / sqrt(mean(x^2) + eps) *
  weight, no bias) or "dyt", Dynamic Tanh (Zhu, Chen, He, LeCun, Liu 2025, "Transformers without
  Normalization"): weight * tanh(alpha * x) + bias, no statistics, alpha a learned scalar per norm
  (initialised to dyt_alpha_init), weight ones, bias zeros (with `bias`, as LayerNorm's). It replaces every
  norm of the blocks and the stacks' final norm; layer_norm_eps is unused. QK-norm has no DyT form here (which
  normalisation it would keep is ambiguous): dyt with qk_norm=True is refused.
- `norm_weight_offset`: every norm multiplies by (norm_weight_offset + w) where it would by w, and w starts at
  1 - norm_weight_offset (so a fresh norm still scales by 1). Gemma's RMSNorm (Gemma 1/2/3, HF GemmaRMSNorm)
  is 1.0: x.float() normalised, times (1 + w.float()), then cast to the input dtype; the parameters hold w
  (zeros at init), as Gemma's checkpoints do, so conversions stay bit-exact. It holds for every norm of a
  block and a stack: QK-norm and the final norm included. 0.0 (default): times w.
- `dyt_alpha_init`: DyT's initial alpha, the paper's default 0.5 (it tunes alpha0 only for LLMs, smaller for
  wider models).
- `layernorm_scaling`: LayerNorm Scaling (Sun et al. 2025, "The Curse of Depth in Large Language Models"): in
  layer l of a stack (counted from 1) each pre-norm's output is multiplied by 1 / sqrt(l), so deep layers'
  sublayers stay off the identity. No parameter; needs norm="pre" (the paper's placement). A block called
  alone is layer 1 (scale 1); the stacks pass each layer its index.
- `first_attn_norm`: True, every layer's attention reads its pre-norm's output; False, the first layer's
  attention reads the stream itself (ModernBERT builds layer 0's attn_norm as nn.Identity: its embeddings end
  with a LayerNorm). The first layer still holds its norm1 (the stacks' layers are alike), unused: a
  checkpoint without it loads with ones there and is written back without it. A block called alone is layer
  1. Needs norm="pre".
- `residual_multiplier`: m: every sublayer's output (after its dropout and any ReZero / LayerScale gate) is
  multiplied by m before the skip adds it, x + m * F(x), in the parallel block too (Granite's
  `residual_multiplier`, HF `residual + hidden_states * residual_multiplier`). No parameter; needs
  residual="add". 1.0 (default): x + F(x).
- `mlp`: "dense" W2 act(W1 x), or gated "swiglu" / "geglu": W2 (act(Wg x) * W1 x), with activation "silu"
  (swiglu) or "gelu" / "gelu_tanh" (geglu).
- `num_experts`: 0 (a dense MLP), or a mixture of experts in the MLP sublayer (Mixtral, Qwen2-MoE, Qwen3-MoE,
  OLMoE): a router (a bias-free linear map d_model -> num_experts) gives each token logits, softmax over all
  experts (in float32 at least), the top num_experts_per_tok probabilities pick the experts (ties: the lowest
  index), renormalised to sum to 1 when norm_topk_prob; each picked expert, an MLP of kind `mlp` and width
  expert_d_ff (no biases: no HF family has them; `mlp_bias` applies to the dense and shared MLPs), runs on
  that token, and the outputs are summed with those weights. No capacity, no token dropped (as HF). The
  router's logits (B, T, num_experts) are an intermediate (`return_intermediates`: "router_logits"), and
  `flax_blocks.experts.load_balancing_loss` / `torch_blocks.experts.load_balancing_loss` compute HF's
  auxiliary loss from them (times router_aux_loss_coef, the caller's). No dropout inside the experts.
  Flax dispatches tokens grouped by expert (sorted, one grouped matmul per projection: the cost of the
  active experts); torch loops over the experts that have tokens, as HF's eager experts.
- `num_experts_per_tok`: the k of the top-k.
- `expert_d_ff`: each expert's hidden width (HF moe_intermediate_size); None: d_ff.
- `norm_topk_prob`: the top-k weights divided by their sum (Mixtral always; Qwen2-MoE / Qwen3-MoE / OLMoE's
  `norm_topk_prob`); False: the softmax probabilities as they are.
- `shared_expert_d_ff`: 0, or the width of a shared expert (an MLP of kind `mlp`) that every token goes
  through, its output times sigmoid(x . w_gate) (Qwen2-MoE's shared_expert and shared_expert_gate), added to
  the experts'.
- `decoder_sparse_step`, `mlp_only_layers`: which layers of a stack run the experts (HF Qwen2-MoE / Qwen3-MoE):
  layer l (from 1) does iff l % decoder_sparse_step == 0 and l - 1 is not in mlp_only_layers; the others run
  a dense MLP of kind `mlp` and width d_ff. Where the two kinds mix, each layer holds its own MLP only, as
  HF builds it (`is_moe_layer`; a Flax stack scans segments of layers, the two MLP kinds stacked apart).
- `experts_bias`: biases on the router (logits = x R^T + b) and on each expert's up, gate and down
  projections (GPT-OSS's router.bias, gate_up_proj_bias, down_proj_bias); nothing without experts.
- `swiglu_limit`, `swiglu_alpha`: GPT-OSS's clamped SwiGLU in each routed expert: g = min(gate, limit),
  u = clip(up, -limit, limit), hidden (u + 1) * g * sigmoid(alpha * g) (HF GptOssExperts._apply_gate, limit 7.0,
  alpha 1.702). None: the plain SwiGLU silu(gate) * up. Needs mlp="swiglu" and no shared expert or dense
  layers. (GPT-OSS's router, a softmax over the top k logits, is the top k of the softmax renormalised:
  norm_topk_prob=True.)
- `num_kv_heads`: key/value heads for grouped-query attention (None: num_heads; 1: multi-query); query head h
  uses key/value head h // (num_heads // num_kv_heads).
- `head_dim`: each attention head's width, given explicitly (Qwen3, Gemma: HF's `head_dim`): q, k and v
  project d_model to num_heads * head_dim (k and v: num_kv_heads * head_dim), the output projection maps
  num_heads * head_dim back to d_model; d_model need not be divisible by num_heads then. None: d_model //
  num_heads.
- `qk_norm`: a norm of norm_type on q and k (before rotary), with its own learned weight.
- `qk_norm_over`: what QK-norm normalises: "head", each head of q and k over head_dim (Qwen3, Gemma 3, HF's
  q_norm / k_norm of width head_dim), or "projection", the whole q projection over num_heads * head_dim and k
  over num_kv_heads * head_dim, before the split into heads (OLMo 2: weights of those widths).
- `rope_theta`: None (no positions) or the base of rotary position embeddings, applied to q and k in the
  rotate-half convention of HF LLaMA / GPT-NeoX.
- `partial_rotary_factor`: the fraction of each head's dims that rotary rotates (GPT-NeoX `rotary_pct`,
  StableLM / Phi `partial_rotary_factor`): rotary_dim = int(head_width * factor) first dims of every q and k
  head rotate in the rotate-half convention within them (dims i and i + rotary_dim/2, angle pos *
  theta^(-2i/rotary_dim)), the rest pass unchanged (HF GPT-NeoX's apply_rotary_pos_emb); an odd rotary_dim
  rotates rotary_dim + 1 dims at the same frequencies, as HF does. 1.0: every dim (LLaMA).
- `rope_scaling`: None (plain rotary), or a scaled rotary as transformers computes it: a
  `flax_blocks.core.rope.RopeScaling` (or its HF dict, e.g. {"rope_type": "llama3", "factor": 8.0,
  "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}): linear, dynamic
  (NTK), yarn, longrope or llama3, with yarn's and longrope's scale of cos and sin. With rope_local_theta set,
  the local layers take plain rotary at rope_local_theta (Gemma 3's sliding layers).
- `attn_logit_softcapping`: None, or c: every attention logit s (already scaled) becomes c * tanh(s / c)
  before the mask is applied and before the softmax (Gemma 2 `attn_logit_softcapping`, c = 50; HF Gemma2's
  eager attention). Every attention path computes it but "fused" (jax.nn.dot_product_attention and SDPA have
  no soft-cap): that choice is refused, and "auto" never takes it (torch serves it with the explicit softmax).
- `attn_sinks`: a learned logit s_h per head (GPT-OSS `sinks`, torch `self_attn.sinks` (H,)) joins every
  query row's softmax as one more column and is dropped after it: weights exp(l_j) / (sum_j exp(l_j) +
  exp(s_h)), so a row may give less than all its weight to the keys. On local and global layers alike, in
  cached decoding too. The dense and blocked paths compute it (the blocked one adds exp(s_h) at the end of
  its online softmax and takes d s_h from the log-sum-exp); "fused" is refused and "auto" never takes it;
  torch serves it with the explicit softmax.
- `alibi`: ALiBi position biases (Press et al. 2022) as transformers' Falcon computes them
  (`build_alibi_tensor`, falcon-rw-1b): head h's logit for key j is (q.k + b_hj) / sqrt(head_dim), b_hj =
  slope_h * p_j, p_j the key's position among its row's real keys (cumsum of the key mask - 1: padding
  and, in cached decoding, unwritten slots not counted), the slopes 2 ** (-8 (h + 1) / n) of the largest
  power of two n <= H then every other slope of 2n for the rest (`flax_blocks.core.alibi`). As transformers
  does, the slopes, the positions and each product are rounded to bfloat16 (also in a float32 or float64
  model). Self-attention only; no parameter; the dense path computes it ("auto" takes it, "fused" and
  "blocked" are refused). Usually without rotary (rope_theta None).
- `query_pre_attn_scalar`: None, or a: logits are q.k * a ** -0.5 instead of q.k / sqrt(head_dim) (Gemma 2 / 3
  `query_pre_attn_scalar`).
- `sliding_window`: None, or W: in a local layer, query i sees key j iff i - W < j <= i (causal; HF's
  sliding_window_overlay `kv_idx > q_idx - sliding_window` over the causal mask: Mistral, Qwen2, Starcoder2,
  Gemma 2 / 3), cached decoding included; without causal iff |i - j| < W (ModernBERT: HF's
  sliding_window_bidirectional_overlay `abs(q_idx - kv_idx) <= local_attention // 2`, so W = local_attention
  // 2 + 1, the window HF hands flash attention), on the dense path only ("blocked" and "fused" refuse it,
  "auto" takes dense).
- `sliding_window_pattern`: which layers are local: None, every layer (Mistral, Qwen2, Starcoder2); n, layer l
  (counted from 1) is global iff l % n == 0, the others local (HF `layer_types`: layer i from 0
  "sliding_attention" iff (i + 1) % n; Gemma 2: 2, layers 1, 3, ... local; Gemma 3: 6, five local then one
  global). A block called alone is layer 1. The stacks compute each layer's kind from its scanned index (one
  compiled layer for both kinds).
- `pattern_global_first`: False, the global layers of a `sliding_window_pattern` n are those with l % n == 0
  (each period ends global: Gemma 2 / 3); True, those with (l - 1) % n == 0, layer 1 global (ModernBERT's
  `global_attn_every_n_layers`: layer_id % n == 0 from 0 is full attention).
- `rope_local_theta`: the rotary base of local layers (Gemma 3 `rope_local_base_freq`, 10000 beside a global
  1e6); None: rope_theta in every layer.
- `rope_interleaved`: False, rotary pairs dim i with i + w/2 (rotate-half, HF LLaMA / GPT-NeoX; w the rotated
  width); True, it pairs dims 2i and 2i + 1 at the same angle pos * theta^(-2i/rotary_dim) (GPT-J's
  `rotate_every_two` with its sin / cos repeat-interleaved, Cohere's `repeat_interleave` of the frequencies).
  The same as rotate-half on the rotated dims reordered evens first (`flax_blocks.core.rope.interleave_order`),
  which both twins compute.
- `rope_local_only`: False, rotary in every layer; True, only the local layers (`sliding_window`,
  `sliding_window_pattern`) rotate q and k, the global layers attend without positions (Cohere 2's
  `Cohere2Attention` applies rotary only where its layer has a sliding window).
- `nope_layers`: (), rotary in every layer; layer indices from 0, the layers that attend without rotary
  positions (SmolLM3's and Llama 4's `no_rope_layers` hold 1 = rotary, 0 = NoPE per layer: these are its
  zeros). With `rope_local_only` a layer rotates when it is local and not among them.
- `query_temperature_floor`, `query_temperature_scale`: Llama 4's temperature tuning of the NoPE layers
  (Llama4TextAttention with `attn_temperature_tuning`, from arXiv 2501.19399): in a layer without rotary
  (`nope_layers`) the queries are multiplied by log1p(floor((s + 1) / floor)) * scale + 1, s the token's slot in
  the sequence or cache (0 .. T - 1 from the cache index; HF's past_seen_tokens + i, not the position ids a
  left-padded row carries), after QK-norm; the rotary layers' queries are untouched.
- `qk_l2_norm`: Llama 4's `Llama4TextL2Norm` (`use_qk_norm`): in a layer that rotates (not in `nope_layers`), q
  and k times rsqrt(mean over head_dim of x^2 + eps) after rotary, no parameter; rotary being a rotation of
  the head's dims, the order against it changes nothing but rounding. The NoPE layers' q and k stay as they are.
- `attention_chunk_size`: None, or C: in a chunked layer (Llama 4's "chunked_attention" layers) query i sees key
  j iff j <= i and (j - p) // C == (i - p) // C, p the row's left padding (transformers 5.24's
  create_chunked_causal_mask: chunked_overlay with left_padding_tokens, the leading zeros of the attention
  mask), so the chunks start at each row's first real token. The twins count p as the leading keys no query
  of the row may attend (`config.chunk_start`: from the key mask, or in cached decoding from the cache's
  written, unpadded slots), on the slots (cache index + i), not on the position ids: HF's rule, with or without
  position_ids, prefill and decoding alike (a decoding cache keeps every key; HF's chunked layers keep the
  last C - 1, all a chunk reads). Needs causal=True and no sliding_window. The dense path and Flax's
  "blocked" kernel compute it (the blocked one masks every key block by each row's chunks, from the key
  mask); jax.nn.dot_product_attention and SDPA take no such mask: "fused" is refused, and "auto" takes the
  dense path in torch and the blocked one in Flax from 1024 keys (on a GPU too). A LanguageModel's
  cache_window is refused beside it (its hidden keys would move the chunks).
- `unchunked_layers`: (), every layer chunked (with attention_chunk_size); layer indices from 0 that attend to
  every earlier key (HF layer_types "full_attention"; Llama4TextConfig's default: the NoPE layers, those its
  no_rope_layers marks 0). A block called alone is layer 1 (index 0); a Flax stack computes each layer's kind
  from its scanned index (one compiled layer for both kinds).
- `qkv_bias`: biases of the q/k/v projection alone (None: follow `bias`; Qwen2: True with bias=False).
- `mlp_bias`: biases of the MLP's linear maps alone (None: follow `bias`; HF LLaMA's `mlp_bias` beside
  `attention_bias`).
- `norm_bias`: biases of the LayerNorms (and DyT) alone (None: follow `bias`; StableLM: LayerNorms with
  biases, linear maps without). QK-norm never has one.
- (A key projection without a bias, Whisper's k_proj, needs no option: a key bias adds
- q . b_k to every logit of a row, which softmax ignores, so the function is the same with
- any key bias and a checkpoint without one reads as zeros.)
- `parallel_residual`: "none" (each sublayer reads the previous one's output), or the parallel form y = x +
  Attn(Norm1(x)) + MLP(Norm2(x)) (GPT-J, GPT-NeoX `use_parallel_residual`, PaLM): "two_norms" with a norm per
  branch (GPT-NeoX) or "shared_norm" with one norm for both, y = x + Attn(Norm1(x)) + MLP(Norm1(x)) (StableLM
  `use_parallel_residual`, GPT-J, Phi-2; no norm2). Needs norm="pre" and residual="add"; a TransformerBlock's
  (and an Encoder's) two sublayers only (`check_parallel`); ReZero / LayerScale gates and LayerNorm Scaling
  apply per branch.
- `residual`: "add" keeps the identity path; "none" is the skip ablation y = F(.).
- `scaling`: residual scaling scheme: "none"; "deepnorm" (Wang et al. 2022): x <- LN(alpha * x + F(x)), with
  F's v/out/FFN weights drawn xavier-normal with gain beta; needs norm="post"; "rezero" (Bachlechner et al.
  2020): x <- x + a * F(x), scalar a = 0 at init; "layerscale" (Touvron et al. 2021, CaiT): x <- x + diag(g)
  F(x), g = eps at init.
- `deepnorm_alpha`, `deepnorm_beta`, `layerscale_init`: None means "from the depth", filled in by
  `resolve(num_layers)` with the published formulas.
- `causal`: every query attends only to keys at or before its position.
- `init`: "torch" (the distributions of torch's own layer) or "xavier" (xavier-uniform matrices, zero biases).
- `dtype`: computation dtype (None: promote inputs and parameters, the flax rule).
- `param_dtype`: parameter dtype on both sides.
- dtype and param_dtype take a name or a numpy / JAX / torch dtype object.
- `attention`: the attention's implementation, a static choice (it changes the compiled program; nothing
  read from global state). "auto" (default) follows one rule in both twins
  (`flax_blocks.core.attention_paths.choose_path`): (1) "dense" when the call asks for the attention weights,
  its key count is symbolic (jax.export) or the attention is latent (MLA); (2) on a GPU, "fused" where the
  twin's fused kernel computes the call; (3) from 1024 keys on (AUTO_MIN_KEYS), "blocked" where the twin's
  memory-efficient kernel computes it; (4) else "dense": on a CPU below 1024 keys both twins run the explicit
  softmax. The twins differ only where their kernels do: Flax's "blocked" and "fused" serve an uncached
  self-attention with causal and key masks (no attention_mask, no dropout on the weights; "fused" no
  soft-capping, sinks or alternating windows either); torch serves both with SDPA, which takes masks, dropout,
  caches and memories but no soft-capping, sliding windows, sinks or chunks; ALiBi's biases and a window
  without causal take the dense path in both, chunked attention (attention_chunk_size) the dense path or
  Flax's blocked kernel. "dense": the explicit softmax (float64
  exact; returns the attention weights); "blocked": Flax: queries and keys in blocks of `attention_block`,
  online softmax with a FlashAttention-2 backward (custom VJP; causal skips the blocks above the diagonal),
  O(T * hd + block^2) memory; torch: SDPA; "fused": Flax: jax.nn.dot_product_attention (cuDNN on a GPU; its
  softmax is float32); torch: SDPA. A forced "blocked" or "fused" returns no attention weights, takes no
  attention_mask (key masks are fine) and applies no dropout to the weights: a call that needs one of those
  raises alike in both twins (`check_attention_call`); torch runs a forced path that SDPA cannot compute
  densely. Flax's cached decoding and cross-attention are always dense.
- `attention_block`: query and key block size of the "blocked" path (Flax only).
- `kv_lora_rank` (DeepSeek V2 / V3, `flax_blocks/mla.py`, `torch_blocks/mla.py`): multi-head latent attention
  replaces the self-attention. Queries: q_proj (E -> H (dn + dr)), or with `q_lora_rank` q_a_proj -> RMSNorm ->
  q_b_proj. kv_a_proj_with_mqa (E -> r + dr) gives the latent c (r = kv_lora_rank) and one rotary key part
  shared by the heads (dr = `qk_rope_head_dim`); RMSNorm(c) -> kv_b_proj gives each head's non-rotary key
  (dn = `qk_nope_head_dim`) and value (`v_head_dim`). Rotary (rope_theta, rope_scaling over dr dims) acts on the
  queries' last dr dims and the shared key part only; `rope_interleave` pairs adjacent dims (DeepSeek V2's
  complex rotation, V3's rope_interleave) instead of rotate-half. Logits scaled by (dn + dr) ** -0.5, times
  (0.1 mscale_all_dim ln(factor) + 1) ** 2 when rope_scaling sets mscale_all_dim (DeepSeek's yarn). The
  latent norms' eps is `latent_norm_eps` (HF: 1e-6, whatever rms_norm_eps says). Biases (qkv_bias) on
  q_a_proj, kv_a_proj_with_mqa and o_proj. Always the dense softmax; a decoding cache holds the latent and the
  rotated key part, (r + dr) numbers a token and layer. Needs rmsnorm and takes no QK-norm, GQA, partial rotary,
  soft-cap, query scalar or window.
- `routing`: "softmax" (Mixtral, Qwen-MoE, OLMoE); "deepseek_v2": softmax scores, the experts in `n_group`
  groups ranked by their best score, `topk_group` kept (the others' scores 0), the top k there; "deepseek_v3":
  sigmoid scores, a learned `e_score_correction_bias` (X,) added for choosing only, groups ranked by the sum of
  their two best biased scores, `topk_group` kept (others -inf), the top k there. Weights: the chosen unbiased
  scores, divided by their sum (+ 1e-20) with norm_topk_prob, times `routed_scaling_factor`.
  "llama4": the top k router logits (ties: the lowest index), each weight the sigmoid of its logit, computed in
  float32 at least (HF Llama4Router; renormalised with norm_topk_prob, which Llama 4 leaves False).
  `shared_expert_gate=False`: the shared expert (shared_expert_d_ff wide) is added ungated (DeepSeek's
  n_shared_experts * moe_intermediate_size, Llama 4's shared_expert).
- `routing_weights_on`: "output" (y = sum_k w_k MLP_k(x), every family but Llama 4) or "input" (y = sum_k
  MLP_k(w_k x): HF Llama4TextMoe scales each expert's input by its router score; with a gated MLP the two differ).
"""


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
    lines += ["", "## What each option computes", "", DETAILS]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(), end="")
