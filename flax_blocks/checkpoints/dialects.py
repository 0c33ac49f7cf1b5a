"""Checkpoint dialects: other models' key names <-> our torch names.

Our torch names are those of `torch_blocks` (and of the declarations): an Encoder is
`layers.{i}.<block name>` plus a final `norm.`. A dialect is ONE table saying how a
family of PyTorch checkpoints names the same tensors, read in both directions:

    layer:       the per-layer key pattern ("encoder.layer.{i}." for BERT), found under any
                 model prefix ("bert.", "transformer.", "model.") which is detected;
    final_norm:  the module name of the stack's final norm ("ln_f"), or None;
    rules:       our name within a layer <- their name(s): a rename, a many-to-one merge
                 (several tensors concatenated along dim 0, as BERT's query/key/value into our
                 packed in_proj rows [q; k; v]; split back by head counts), a one-to-many split
                 (`chunk`: Phi-3's fused gate_up_proj rows [gate; up] into our linear_gate and
                 linear1; concatenated back), and/or a transpose (GPT-2's Conv1D stores (in, out));
    ignore:      per-layer buffers that are not parameters (GPT-2's attn.bias);
    shared_by:   the families whose checkpoints use the same key names but compute something
                 else: names alone never choose such a dialect (`detect_dialect` refuses).
    settings:    BlockConfig fields the family fixes (norm placement, norm type, MLP kind...),
                 checked when writing a checkpoint of that family;
    reads:       BlockConfig fields read from the family's own config (by its reader).
                 Every option that changes the computation is in one of the two (a guard test
                 checks it), so a new option cannot be written into a family that lacks it.

Each Hugging Face family's dialect lives in its module (`flax_blocks.checkpoints.families`),
which registers it (`register_dialect`); this module holds our own names (`TORCH`), the rule
builders and tables the families share, and the translation both ways.

Only the transformer stack is translated: the layers and the final norm. Embeddings, pooler,
LM heads and rotary buffers outside the layers are left out (and named in `Translated.dropped`).

    translate(sd, dialect=None)           their names -> ours (auto-detected when None)
    to_dialect(sd, dialect, cfg)          ours -> their names
    detect_dialect(sd)                    which dialect a state dict is written in
    settings_of(module)                   what a torch module fixes about its own config
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import declarations
from ..core.config import BlockConfig
from ..core.options import PROBES
from .family import families_of_dialect
from .io import ConversionError, read_state_dict

log = logging.getLogger("flax_blocks")


@dataclass(frozen=True)
class Rule:
    """Our torch name within a layer <- their name(s) within a layer.

    theirs: one name (a rename) or several, concatenated along dim 0 into ours (split back
      with `split`: rows per part, "q" = num_heads * head_dim, "kv" = kv_heads * head_dim).
    transpose: they store the matrix (in, out) (GPT-2's Conv1D), we (out, in).
    chunk: (index, count): ours is the index-th of `count` equal row blocks of their one
      tensor (Phi-3's gate_up_proj: gate = block 0, up = block 1); the rules sharing that
      tensor are concatenated back in index order. Slicing and concatenating are exact.
    per_head: P > 0: their one tensor's rows are grouped per head, [part 0; ...; part P-1] of
      head_dim rows each for head 0, then for head 1, ... (GPT-NeoX's query_key_value, viewed
      by HF as (..., heads, 3 * head_dim): [q_0; k_0; v_0; q_1; k_1; v_1; ...]); ours holds
      the same rows part by part ([q_0; q_1; ...; k_0; ...; v_...]), as our in_proj. Needs the
      head count; the permutation is exact both ways.
    zero: parts of `theirs` the family never has, read as zeros (Whisper's k_proj has no bias:
      a bias on the keys adds q_i . b to every logit of query i, which softmax ignores, so a
      zero one computes exactly what HF computes); written back only when zero, else refused.
    axis: the axis a chunk rule splits (transformers 5's fused experts.gate_up_proj (X, 2F, E):
      gate = block 0, up = block 1 along axis 1).
    interleave: a chunk rule's blocks alternate entry by entry along `axis` (block i = entries
      i, i + count, ...: GPT-OSS's gate_up_proj, gate = [..., ::2], up = [..., 1::2]) instead of
      lying one after the other. A chunk rule may transpose too (the last two axes swapped first:
      GPT-OSS's experts store (X, in, out)).
    per_group: their one tensor's rows are grouped per key/value head, [the group's
      num_heads / num_kv_heads queries; its key; its value] of head_dim rows each (Falcon's
      query_key_value: one group for multi-query, one per head for the old layout, num_kv_heads
      for new_decoder_architecture); ours holds [every query; every key; every value]. Needs
      both head counts; exact both ways.
    only: (BlockConfig field, value): the rule is written only when the config has that value
      (Falcon's ln_attn / ln_mlp under parallel_residual="two_norms", input_layernorm else);
      read whenever the checkpoint holds its tensor.
    per_expert: their one name holds "{j}", one tensor per expert (Mixtral's
      block_sparse_moe.experts.{j}.w1.weight (F, E)): ours stacks experts 0..X-1 along a new
      axis 0 ((X, F, E)); written back one tensor per expert.

    fill: the family's first layer has no such tensor (ModernBERT's layer 0 attn_norm is nn.Identity; the
      blocks' alike layers hold one, unused under first_attn_norm=False): read as this value, shaped as
      the next layer's (or the final norm's); never written for layer 0.

    Several rules may give the same name of ours from different names of theirs (the per-expert
    tensors on disk and the fused ones transformers 5 holds): a checkpoint is read from whichever
    it holds, and written in the first rule's names.
    """

    ours: str
    theirs: tuple[str, ...]
    transpose: bool = False
    split: tuple[str, ...] = ()
    chunk: tuple[int, int] | None = None
    per_head: int = 0
    zero: tuple[str, ...] = ()
    axis: int = 0
    per_expert: bool = False
    interleave: bool = False
    per_group: bool = False
    only: tuple[str, Any] | tuple[()] = ()
    fill: float | None = None

    def __post_init__(self):
        if self.split and len(self.split) != len(self.theirs):
            raise ValueError(f"{self.ours}: a split rule names one part per tensor of theirs, got split={self.split} "
                             f"for theirs={self.theirs}")
        if self.chunk is not None and (len(self.theirs) != 1 or self.split):
            raise ValueError(f"{self.ours}: a chunk rule takes one tensor of theirs, unsplit")
        if self.interleave and self.chunk is None:
            raise ValueError(f"{self.ours}: interleave says how a chunk rule's blocks lie: it needs chunk")
        if self.per_head and (len(self.theirs) != 1 or self.transpose or self.split or self.chunk):
            raise ValueError(f"{self.ours}: a per-head rule takes one tensor of theirs, untransposed and unsplit")
        if self.per_group and (len(self.theirs) != 1 or self.transpose or self.split or self.chunk or self.per_head):
            raise ValueError(f"{self.ours}: a per-group rule takes one tensor of theirs, untransposed and unsplit")
        if self.per_expert and (len(self.theirs) != 1 or "{j}" not in self.theirs[0] or self.transpose
                                or self.split or self.chunk or self.per_head):
            raise ValueError(f"{self.ours}: a per-expert rule takes one name of theirs holding {{j}}, untransposed, "
                             "unsplit and unchunked")

    @property
    def expert_regex(self) -> re.Pattern:
        """A per-expert rule's name of theirs, the expert's index captured."""
        return re.compile("^" + re.escape(self.theirs[0]).replace(r"\{j\}", r"(\d+)") + "$")


def _regroup(a, heads: int, parts: int, *, to_ours: bool):
    """Rows [part p of head h] ordered head-major (theirs) <-> part-major (ours); exact."""
    a_rows = a.shape[0]
    d = a_rows // (heads * parts)
    shape = (heads, parts) if to_ours else (parts, heads)
    return a.reshape(*shape, d, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


def _ungroup(a, heads: int, kv: int, *, to_ours: bool):
    """Rows per key/value group [its heads // kv queries; its key; its value] (theirs: Falcon's
    query_key_value) <-> [every query; every key; every value] (ours), head_dim rows each; exact."""
    n, rest = heads // kv, tuple(a.shape[1:])
    d = a.shape[0] // (heads + 2 * kv)
    if to_ours:
        g = a.reshape(kv, n + 2, d, *rest)
        return np.concatenate([g[:, :n].reshape(heads * d, *rest), g[:, n].reshape(kv * d, *rest),
                               g[:, n + 1].reshape(kv * d, *rest)])
    q, k, v = a[:heads * d], a[heads * d:(heads + kv) * d], a[(heads + kv) * d:]
    g = np.concatenate([q.reshape(kv, n * d, *rest), k.reshape(kv, d, *rest), v.reshape(kv, d, *rest)], axis=1)
    return g.reshape(a.shape)


# A family without experts fixes the experts options at their defaults (one dense MLP in every layer).
DENSE = {"num_experts": 0, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
         "mlp_only_layers": ()}
# A family without DeepSeek's latent attention and routing fixes those options at their defaults (the ones
# it reads excepted).
NOT_DEEPSEEK = {"kv_lora_rank": None, "rope_interleave": False, "latent_norm_eps": 1e-6, "routing": "softmax",
                "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "shared_expert_gate": True}
# What GPT-OSS alone computes (families/gpt_oss.py reads them): every other family fixes them off.
NO_GPT_OSS = {"attn_sinks": False, "experts_bias": False, "swiglu_limit": None, "swiglu_alpha": 1.702}
# What ModernBERT alone computes (families/modernbert.py fixes them): every other family fixes them off.
NO_MODERNBERT = {"first_attn_norm": True, "pattern_global_first": False}
NO_NOPE = {"nope_layers": (), "query_temperature_floor": None, "qk_l2_norm": False}  # all but SmolLM3, Llama 4
NO_CHUNKS = {"attention_chunk_size": None}  # all but Llama 4 (chunked attention)
NO_LLAMA4_EXPERTS = {"routing_weights_on": "output"}  # all but Llama 4 (its experts scale their input)


@dataclass(frozen=True)
class Dialect:
    """One checkpoint dialect; see the module docstring. `rules` None: our own names."""

    name: str
    description: str
    layer: str
    final_norm: str | None
    rules: tuple[Rule, ...] | None
    ignore: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    reads: tuple[str, ...] = ()
    shared_by: str = ""  # families that use the same key names and compute something else
    outside: str = ""  # what the rest of such a checkpoint holds, for messages
    stack: str = "Encoder"  # the stack it reads: "Encoder", or "Decoder" (cross-attention layers)
    by_name: bool = True  # False: names alone never choose it (GPT-BigCode's are GPT-2's, its shapes transposed)

    def __post_init__(self) -> None:
        if self.rules is not None and "num_experts" not in self.settings and "num_experts" not in self.reads:
            object.__setattr__(self, "settings", {**DENSE, **self.settings})  # a family without experts
        if self.rules is not None:  # DeepSeek's, GPT-OSS's, ModernBERT's, Llama 4's options off unless read or fixed
            everyone = {**NOT_DEEPSEEK, **NO_GPT_OSS, **NO_MODERNBERT, **NO_NOPE, **NO_LLAMA4_EXPERTS, **NO_CHUNKS}
            off = {k: v for k, v in everyone.items() if k not in self.reads}
            object.__setattr__(self, "settings", {**off, **self.settings})
        if self.rules is not None and "residual_multiplier" not in {*self.settings, *self.reads}:
            object.__setattr__(self, "settings", {**self.settings, "residual_multiplier": 1.0})  # all but Granite
        if self.rules is not None and "alibi" not in {*self.settings, *self.reads}:
            object.__setattr__(self, "settings", {**self.settings, "alibi": False})  # all but Falcon

    @property
    def layer_regex(self) -> re.Pattern:
        """prefix, layer index and the rest of a key of this dialect's layers."""
        return re.compile("^(.*?)" + re.escape(self.layer).replace(r"\{i\}", r"(\d+)") + "(.+)$")


def same(*names: str) -> tuple[Rule, ...]:
    return tuple(Rule(n, (n,)) for n in names)


def linear(ours: str, theirs: str, *, transpose: bool = False) -> tuple[Rule, ...]:
    """A linear map's weight and (where the checkpoint has one) bias."""
    return (Rule(f"{ours}.weight", (f"{theirs}.weight",), transpose), Rule(f"{ours}.bias", (f"{theirs}.bias",)))


def qkv(q: str, k: str, v: str) -> tuple[Rule, ...]:
    """Separate q / k / v projections -> our packed in_proj rows [q; k; v] (weight and bias)."""
    return (
        Rule("self_attn.in_proj_weight", (f"{q}.weight", f"{k}.weight", f"{v}.weight"), split=("q", "kv", "kv")),
        Rule("self_attn.in_proj_bias", (f"{q}.bias", f"{k}.bias", f"{v}.bias"), split=("q", "kv", "kv")),
    )


def norm(ours: str, theirs: str) -> tuple[Rule, ...]:
    return (Rule(f"{ours}.weight", (f"{theirs}.weight",)), Rule(f"{ours}.bias", (f"{theirs}.bias",)))


def fused(theirs: str, *ours: str) -> tuple[Rule, ...]:
    """One fused tensor of theirs whose equal row blocks are our `ours`, in order."""
    return tuple(Rule(o, (theirs,), chunk=(i, len(ours))) for i, o in enumerate(ours))


def experts(on_disk: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), *,
            fused_in: str = "mlp.", shared: str | None = None) -> tuple[Rule, ...]:
    """An experts MLP (our experts.router, experts.gate / up (X, F, E), experts.down (X, E, F)) from
    both layouts of the four transformers MoE families:
    - on disk (save_pretrained's names): `{on_disk}gate.weight` (X, E), and per expert j
      `{on_disk}experts.{j}.<gate>.weight` (F, E), `<up>` (F, E), `<down>` (E, F), names = (gate,
      up, down) (Mixtral's on_disk "block_sparse_moe.", names ("w1", "w3", "w2"); Qwen2-MoE,
      Qwen3-MoE, OLMoE: "mlp.", gate_proj, up_proj, down_proj); written back in these names;
    - transformers 5's fused parameters (its state_dict(), save_pretrained(save_original_format=
      False)): `{fused_in}gate.weight`, `{fused_in}experts.gate_up_proj` (X, 2F, E), rows [:F] the
      gate and [F:] up, and `{fused_in}experts.down_proj` (X, E, F);
    - shared: a shared expert's module name ("mlp.shared_expert": gate_proj, up_proj, down_proj as
      nn.Linear) and its sigmoid gate `{shared}_gate.weight` (1, E)."""
    gate, up, down = names
    rules = [Rule("experts.router", (f"{on_disk}gate.weight",)),
             Rule("experts.gate", (f"{on_disk}experts.{{j}}.{gate}.weight",), per_expert=True),
             Rule("experts.up", (f"{on_disk}experts.{{j}}.{up}.weight",), per_expert=True),
             Rule("experts.down", (f"{on_disk}experts.{{j}}.{down}.weight",), per_expert=True)]
    if fused_in != on_disk:
        rules.append(Rule("experts.router", (f"{fused_in}gate.weight",)))
    rules += [Rule("experts.gate", (f"{fused_in}experts.gate_up_proj",), chunk=(0, 2), axis=1),
              Rule("experts.up", (f"{fused_in}experts.gate_up_proj",), chunk=(1, 2), axis=1),
              Rule("experts.down", (f"{fused_in}experts.down_proj",))]
    if shared is not None:
        rules += [*linear("experts.shared_gate", f"{shared}.gate_proj"),
                  *linear("experts.shared_up", f"{shared}.up_proj"),
                  *linear("experts.shared_down", f"{shared}.down_proj"),
                  Rule("experts.shared_expert_gate", (f"{shared}_gate.weight",))]
    return tuple(rules)


# BlockConfig's experts fields: what a family with experts reads from its config (or fixes).
EXPERTS_READS = ("num_experts", "num_experts_per_tok", "expert_d_ff", "norm_topk_prob", "shared_expert_d_ff",
                 "decoder_sparse_step", "mlp_only_layers")


# ----------------------------------------------------------------------------------------
# Our own names, and what the families' dialects share (each family's module holds its own:
# flax_blocks.checkpoints.families)
# ----------------------------------------------------------------------------------------

TORCH = Dialect(
    "torch", "torch_blocks / stock nn.TransformerEncoder names (layers.{i}.self_attn.in_proj_weight, ...)",
    layer=f"{declarations.LAYERS}.{{i}}.", final_norm=declarations.FINAL_NORM, rules=None,
)

# What BERT and GPT-2 share: LayerNorm, a dense MLP with biases, no positions inside the
# layers, no QK-norm or residual scaling; they differ in norm placement and causality.
CLASSIC = {"norm_type": "layernorm", "norm_weight_offset": 0.0, "mlp": "dense", "rope_theta": None,
           "rope_scaling": None, "partial_rotary_factor": 1.0, "attn_logit_softcapping": None,
               "query_pre_attn_scalar": None,
            "sliding_window": None, "sliding_window_pattern": None, "rope_local_theta": None, "qk_norm": False,
            "rope_interleaved": False, "rope_local_only": False,
            "scaling": "none", "residual": "add", "bias": True, "qkv_bias": None, "mlp_bias": None, "norm_bias": None,
            "layernorm_scaling": False,
            "parallel_residual": "none"}
CLASSIC_READS = ("activation", "layer_norm_eps", "num_kv_heads")


# LLaMA's layers: what LLaMA, Mistral, Qwen2 and (with other settings) Qwen3 and Gemma name alike.
LLAMA_RULES = (
    *qkv("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    *linear("self_attn.out_proj", "self_attn.o_proj"),
    *same("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    *linear("linear_gate", "mlp.gate_proj"),
    *linear("linear1", "mlp.up_proj"),
    *linear("linear2", "mlp.down_proj"),
    *norm("norm1", "input_layernorm"),
    *norm("norm2", "post_attention_layernorm"),
)
# LLaMA's attention and norms alone (the MoE families put experts in place of the MLP).
LLAMA_ATTENTION_NORMS = tuple(r for r in LLAMA_RULES if r.ours.split(".")[0] not in declarations.MLP_MODULES)
LLAMA_SETTINGS = {"norm": "pre", "norm_type": "rmsnorm", "norm_weight_offset": 0.0, "mlp": "swiglu",
                   "activation": "silu", "scaling": "none", "residual": "add", "qk_norm": False,
                   "layernorm_scaling": False, "partial_rotary_factor": 1.0, "parallel_residual": "none",
                   "attn_logit_softcapping": None, "query_pre_attn_scalar": None, "rope_local_theta": None,
                   "mlp_bias": None, "norm_bias": None, "rope_interleaved": False, "rope_local_only": False}
WINDOWS = ("sliding_window", "sliding_window_pattern")  # read from sliding_window and layer_types
# Qwen3, Gemma (2, 3), OLMo 2: attention_bias puts biases on q, k, v and o, never on the MLP (read:
# bias=attention_bias, mlp_bias=False).
ATTENTION_BIAS = {k: v for k, v in LLAMA_SETTINGS.items() if k != "mlp_bias"}
LLAMA_OUTSIDE = "token embeddings (embed_tokens), the rotary inv_freq buffer and the LM head"
# Every family below writes LLaMA's key names (or a superset) and computes something else: names
# alone never choose one of them.
LLAMA_NAMED = ("Gemma, Gemma 2, Gemma 3 (norms that multiply by 1 + w, GeGLU, soft-capping, sliding windows), "
                "Qwen3 and OLMo 2 (QK-norm, norms after the sublayers), Mistral / Qwen2 with sliding windows, "
                "Cohere, Granite and others")


DIALECTS: dict[str, Dialect] = {TORCH.name: TORCH}  # name -> Dialect; the families register theirs


def register_dialect(dialect: Dialect) -> None:
    """Add a family's dialect (flax_blocks.checkpoints.families: each module registers its own)."""
    if dialect.name in DIALECTS and DIALECTS[dialect.name] is not dialect:
        raise ValueError(f"dialect {dialect.name!r} registered twice")
    DIALECTS[dialect.name] = dialect


# Every torch name a block can have under some option (the probe configs, every option on).
_TORCH_NAMES = {
    kind: {t for probe in PROBES for t, _, _ in declarations.flatten(declarations.block(probe, kind))}
    for kind in declarations.BLOCKS
}


def _get(name: str) -> Dialect:
    if isinstance(name, Dialect):
        return name
    if name not in DIALECTS:
        raise ValueError(f"unknown dialect {name!r}; expected one of {', '.join(DIALECTS)}")
    return DIALECTS[name]


def _known_in_layer(lay: Dialect) -> set[str]:
    if lay.rules is None:
        return _TORCH_NAMES["TransformerBlock"]
    return {t for r in lay.rules if not r.per_expert for t in r.theirs} | set(lay.ignore)


def _knows(lay: Dialect, known: set[str], name: str) -> bool:
    """Whether `name` (within a layer) is one of the dialect's: a name, or a per-expert one."""
    return name in known or (lay.rules is not None and any(r.expert_regex.match(name)
                                                            for r in lay.rules if r.per_expert))


def _roots(keys) -> list[str]:
    return sorted({k.split(".")[0] + "." if "." in k else k for k in keys})[:10]


# ----------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------


def _stack_keys(keys: list[str], lay: Dialect) -> list[str]:
    """The keys this dialect recognises as its stack's (any model prefix)."""
    known = _known_in_layer(lay)
    hits = [k for k in keys if (m := lay.layer_regex.match(k)) and _knows(lay, known, m.group(3))]
    if lay.rules is None:  # a single block of ours has no layers.{i}.
        blocks = set().union(*_TORCH_NAMES.values())
        hits += [k for k in keys if k in blocks]
    return hits


class UnknownDialectError(ConversionError):
    """No dialect recognises a checkpoint's keys (a ConversionError; the loaders read such a
    checkpoint as our own names and report the keys they miss)."""


def detect_dialect(source: Any) -> str:
    """The name of the dialect whose stack keys the state dict holds (one of DIALECTS).
    source: a mapping of name -> array, a module with .state_dict() or a path.
    Raises ConversionError when no dialect or several recognise the keys, listing the dialects
    and the keys' roots, and when the one that does is shared by families that compute
    something else (LLaMA's names; OPT's, whose norm placement they do not say): then only
    an explicit dialect= (or fb.from_hf, which reads the model's config) says which family
    the checkpoint is."""
    keys = list(source.keys()) if isinstance(source, Mapping) else list(read_state_dict(source, lazy=True))
    counts = {name: len(_stack_keys(keys, lay)) for name, lay in DIALECTS.items() if lay.by_name}
    best = max(counts.values(), default=0)
    winners = [n for n, c in counts.items() if c == best and c > 0]
    if winners and all(DIALECTS[w].shared_by for w in winners):  # several families name their tensors alike
        lay = DIALECTS[winners[0]]
        families = {w: ", ".join(sorted(families_of_dialect(w))) for w in winners}
        raise ConversionError([f"these keys are in {lay.name}'s naming ({lay.description}), which {lay.shared_by} "
                               "share while computing something else",
                               *(f"pass dialect={w!r} (--dialect {w}) if the checkpoint is one of {families[w]}"
                                 if families[w] else f"pass dialect={w!r} (--dialect {w}) for the "
                                 f"{DIALECTS[w].description}" for w in winners),
                               "or load the Hugging Face folder or model with fb.from_hf, which reads its "
                               "model_type"],
                              header="cannot tell the checkpoint's family from its key names alone")
    if len(winners) == 1:
        return winners[0]
    known = "; ".join(f"{lay.name}: {lay.description}" for lay in DIALECTS.values())
    what = "several dialects fit equally" if winners else "no dialect recognises these keys"
    error = ConversionError if winners else UnknownDialectError
    raise error([f"the keys' roots are {_roots(keys)}", f"dialects: {known}",
                 "pass dialect= (--dialect) to choose one"], header=f"cannot detect the checkpoint dialect ({what})")


# ----------------------------------------------------------------------------------------
# Their names -> ours
# ----------------------------------------------------------------------------------------


@dataclass
class Translated:
    """A state dict in our torch names, and what the translation did."""

    state_dict: dict[str, Any]
    dialect: str
    prefix: str  # the model prefix the stack was found under ("bert.", "model.", "")
    dropped: list[str] = field(default_factory=list)  # keys outside the stack (embeddings, heads)


def _swap(a):
    """a matrix transposed; a stack of matrices (X, m, n) each transposed (X, n, m)."""
    return a.T if a.ndim < 3 else a.transpose(*range(a.ndim - 2), a.ndim - 1, a.ndim - 2)


def _cat(parts: list, transpose: bool):
    parts = [_swap(p) if transpose else p for p in parts]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def _block(a, r: Rule):
    """Block r.chunk[0] of r.chunk[1] along r.axis of a: contiguous, or every count-th entry (interleave)."""
    assert r.chunk is not None  # a chunk rule's
    (index, count), n = r.chunk, a.shape[r.axis]
    pick = slice(index, None, count) if r.interleave else slice(index * n // count, (index + 1) * n // count)
    return a[(slice(None),) * r.axis + (pick,)]


def _join(parts: list, axis: int, interleave: bool):
    """The blocks of a fused tensor joined back along axis (interleaved entry by entry, or one after another)."""
    if not interleave:
        return np.concatenate(parts, axis=axis)
    a = np.stack(parts, axis=axis + 1)
    return a.reshape(*a.shape[:axis], -1, *a.shape[axis + 2:])


def translate(sd: Mapping[str, Any], dialect: str | None = None, *, prefix: str = "",
              num_heads: int | None = None, num_kv_heads: int | None = None) -> Translated:
    """Their state dict (numpy arrays) -> ours: `layers.{i}.<our name>` and `norm.*`.

    dialect None: detected (see `detect_dialect`). prefix: their keys' model prefix; detected
    when not given (the part before the first layer key: "bert.", "transformer.", "model.").
    The torch dialect returns the dict unchanged. Raises ConversionError listing keys inside
    the layers that the dialect does not know and merges with parts missing. num_heads: the
    query heads, needed by a dialect that fuses q, k, v per head (GPT-NeoX); num_kv_heads: the
    key/value heads besides, for one that fuses them per key/value group (Falcon). A stack mixing
    dense and experts layers holds each layer's own MLP, as the checkpoint does: nothing is filled."""
    name = detect_dialect(sd) if dialect is None else _get(dialect).name
    lay = DIALECTS[name]
    if lay.rules is None:
        return Translated(dict(sd), name, prefix)
    if prefix and not prefix.endswith("."):
        prefix += "."
    regex = lay.layer_regex
    found = {m.group(1) for k in sd if (m := regex.match(k)) and k.startswith(prefix)}
    if not prefix:
        if len(found) > 1:
            raise ConversionError([f"layer keys under several prefixes {sorted(found)}: pass prefix="],
                                  header=f"cannot read the {name} checkpoint")
        prefix = found.pop() if found else ""
    layers: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    dropped, problems = [], []
    final = f"{prefix}{lay.final_norm}." if lay.final_norm else None
    for k, a in sd.items():
        m = regex.match(k)
        if m and m.group(1) == prefix:
            layers.setdefault(int(m.group(2)), {})[m.group(3)] = a
        elif final and k.startswith(final) and k[len(final):] in ("weight", "bias"):
            out[f"{declarations.FINAL_NORM}.{k[len(final):]}"] = a
        else:
            dropped.append(k)
    known = _known_in_layer(lay)
    for i, theirs in sorted(layers.items()):
        unknown = sorted(t for t in theirs if not _knows(lay, known, t))
        problems += [f"{prefix}{lay.layer.format(i=i)}{t} (shape {tuple(theirs[t].shape)}): not a parameter "
                     f"the {name} dialect knows" for t in unknown]
        for r in lay.rules:
            if r.per_expert:  # one tensor per expert, stacked along a new axis 0
                rx = r.expert_regex
                each = {int(m.group(1)): t for t in theirs if (m := rx.match(t))}
                if each and sorted(each) != list(range(len(each))):
                    problems.append(f"{prefix}{lay.layer.format(i=i)}{r.theirs[0]}: experts {sorted(each)} (expected "
                                    f"0..{len(each) - 1})")
                elif each:
                    out[f"{declarations.LAYERS}.{i}.{r.ours}"] = np.stack([theirs[each[j]] for j in range(len(each))])
                continue
            have = [t for t in r.theirs if t in theirs]
            if not have:
                continue
            for t in r.zero:  # a part the family never has: zeros shaped as a part of the same rows
                twin = next(u for u, part in zip(r.theirs, r.split, strict=True) if u != t and u in theirs
                            and part == r.split[r.theirs.index(t)])
                theirs.setdefault(t, theirs[twin] * 0)
            have = [t for t in r.theirs if t in theirs]
            if len(have) < len(r.theirs):
                gone = [f"{prefix}{lay.layer.format(i=i)}{t}" for t in r.theirs if t not in theirs]
                problems.append(f"missing key {', '.join(gone)} (merged into {r.ours} with {', '.join(have)})")
                continue
            a = _cat([theirs[t] for t in r.theirs], r.transpose)
            if r.chunk is not None:
                count, rows = r.chunk[1], a.shape[r.axis]
                if rows % count:
                    problems.append(f"{prefix}{lay.layer.format(i=i)}{r.theirs[0]} (shape {tuple(a.shape)}): {rows} "
                                    f"{'rows' if r.axis == 0 else f'entries along axis {r.axis}'} do not split into "
                                    f"{count} equal blocks")
                    continue
                a = _block(a, r)
            if r.per_head:
                if num_heads is None or a.shape[0] % (num_heads * r.per_head):
                    problems.append(f"{prefix}{lay.layer.format(i=i)}{r.theirs[0]} (shape {tuple(a.shape)}): its "
                                    f"rows are grouped per head, " + ("and the head count was not given (num_heads="
                                    ")" if num_heads is None else f"{num_heads} heads x {r.per_head} parts do not "
                                    "divide them"))
                    continue
                a = _regroup(a, num_heads, r.per_head, to_ours=True)
            if r.per_group:
                if num_heads is None or num_kv_heads is None or num_heads % num_kv_heads or \
                        a.shape[0] % (num_heads + 2 * num_kv_heads):
                    problems.append(f"{prefix}{lay.layer.format(i=i)}{r.theirs[0]} (shape {tuple(a.shape)}): its "
                                    "rows are grouped per key/value head, " + (
                                        "and the head counts were not given (num_heads=, num_kv_heads=)"
                                        if num_heads is None or num_kv_heads is None else
                                        f"{num_heads} query and {num_kv_heads} key/value heads do not divide them"))
                    continue
                a = _ungroup(a, num_heads, num_kv_heads, to_ours=True)
            out[f"{declarations.LAYERS}.{i}.{r.ours}"] = a
    _fill_first_layer(lay, layers, out)
    if problems:
        raise ConversionError(problems, header=f"cannot read the {name} checkpoint")
    if not layers:
        raise ConversionError([f"no key matches {prefix}{lay.layer} (the keys' roots are {_roots(sd)})"],
                              header=f"cannot read the {name} checkpoint")
    return Translated(out, name, prefix, dropped)


def _fill_first_layer(lay: Dialect, layers: dict[int, dict[str, Any]], out: dict[str, Any]) -> None:
    """Layer 0's tensors the family never has (`Rule.fill`), shaped as layer 1's or the final norm's."""
    for r in lay.rules or ():
        ours = f"{declarations.LAYERS}.0.{r.ours}"
        if r.fill is None or 0 not in layers or ours in out:
            continue
        shaped = (f"{declarations.LAYERS}.1.{r.ours}", f"{declarations.FINAL_NORM}.{r.ours.split('.')[-1]}")
        like = [out[k] for k in shaped if k in out]
        if like:
            out[ours] = np.full(like[0].shape, r.fill, like[0].dtype)


# ----------------------------------------------------------------------------------------
# Ours -> their names
# ----------------------------------------------------------------------------------------


def _rows(part: str, cfg: BlockConfig) -> int:
    return {"q": cfg.num_heads, "kv": cfg.kv_heads}[part] * cfg.head_width


def check_settings(cfg: BlockConfig, dialect: str) -> None:
    """Raise ConversionError naming every BlockConfig field that the dialect's family fixes
    to another value (a post-LN block written as GPT-2 names would load but compute
    something else)."""
    lay = _get(dialect)
    bad = [f"{k}={getattr(cfg, k)!r}, but {lay.name} checkpoints have {k}={v!r}"
           for k, v in lay.settings.items() if getattr(cfg, k) != v]
    if cfg.sliding_window is not None and not cfg.causal and lay.settings.get("causal") is not False:
        bad.append(f"sliding_window={cfg.sliding_window} with causal=False is the bidirectional window |i - j| < W, "
                   f"which {lay.name} checkpoints compute otherwise (transformers: |i - j| <= W) or not at all")
    if bad:
        raise ConversionError(bad, header=f"this config cannot be written as a {lay.name} checkpoint")


def to_dialect(sd: Mapping[str, Any], dialect: str, cfg: BlockConfig, *, prefix: str = "") -> dict[str, Any]:
    """Our torch-named state dict (an Encoder's: layers.{i}.*, norm.*) -> the dialect's names,
    under `prefix` ("" gives the names relative to the model the layers sit in). Checks the
    config against the family's settings; an our-name the dialect has no place for is an error."""
    lay = _get(dialect)
    if lay.rules is None:
        return {prefix + k: v for k, v in sd.items()}
    check_settings(cfg, lay.name)
    by_ours: dict[str, Rule] = {}
    for rule in lay.rules:  # the first rule of each name of ours: the names the family's files hold
        if not rule.only or getattr(cfg, rule.only[0]) == rule.only[1]:
            by_ours.setdefault(rule.ours, rule)
    layer = re.compile(rf"{declarations.LAYERS}\.(\d+)\.(.+)")
    out: dict[str, Any] = {}
    fused: dict[str, dict[int, Any]] = {}  # their fused name -> {block index: our tensor}
    blocks: dict[str, Rule] = {}  # their fused name -> a rule of its blocks (how many, along which axis, how)
    problems = []
    for k, a in sd.items():
        m = layer.match(k)
        if m is None:
            if lay.final_norm and k.startswith(f"{declarations.FINAL_NORM}."):
                out[f"{prefix}{lay.final_norm}.{k.split('.', 1)[1]}"] = a
            else:
                problems.append(f"{k}: the {lay.name} dialect has no place for it")
            continue
        r = by_ours.get(m.group(2))
        if r is None:
            problems.append(f"{k}: the {lay.name} dialect has no place for it")
            continue
        if r.fill is not None and m.group(1) == "0":  # a tensor the family's first layer lacks (held, unused)
            continue
        base = f"{prefix}{lay.layer.format(i=m.group(1))}"
        if r.per_expert:
            out.update({base + r.theirs[0].format(j=j): a[j] for j in range(a.shape[0])})
            continue
        if r.chunk is not None:  # one block of a fused tensor of theirs: joined below
            fused.setdefault(base + r.theirs[0], {})[r.chunk[0]] = a
            blocks[base + r.theirs[0]] = r
            continue
        if r.per_head:
            out[base + r.theirs[0]] = _regroup(a, cfg.num_heads, r.per_head, to_ours=False)
            continue
        if r.per_group:
            out[base + r.theirs[0]] = _ungroup(a, cfg.num_heads, cfg.kv_heads, to_ours=False)
            continue
        if len(r.theirs) == 1:
            out[base + r.theirs[0]] = _swap(a) if r.transpose else a
            continue
        start = 0
        for t, part in zip(r.theirs, r.split, strict=True):
            n = _rows(part, cfg)
            piece = a[start:start + n].T if r.transpose else a[start:start + n]
            start += n
            if t in r.zero:  # the family has no such tensor: only a zero one is written (as nothing)
                if piece.any():
                    problems.append(f"{k}: its rows for {t} are not zero, and {lay.name} checkpoints have no {t} "
                                    "(a key bias changes no output: softmax ignores it; zero it to write)")
                continue
            out[base + t] = piece
    for name, parts in fused.items():
        r = blocks[name]
        count = r.chunk[1] if r.chunk else 0
        if sorted(parts) != list(range(count)):
            problems.append(f"{name}: {count} blocks fused, only {sorted(parts)} given")
        else:
            joined = _join([parts[i] for i in range(count)], r.axis, r.interleave)
            out[name] = _swap(joined) if r.transpose else joined
    if problems:
        raise ConversionError(problems, header=f"cannot write a {lay.name} checkpoint")
    return out


# ----------------------------------------------------------------------------------------
# What a torch module says about its own config
# ----------------------------------------------------------------------------------------


def settings_of(module: Any) -> dict[str, Any]:
    """BlockConfig fields (and final_norm) that a torch module fixes: a torch_blocks module's
    own cfg, or a stock nn.TransformerEncoder / nn.TransformerEncoderLayer's heads, norm
    placement, activation, eps and final norm. Empty for anything else."""
    cfg = getattr(module, "cfg", None)
    if isinstance(cfg, BlockConfig):
        out = {k: getattr(cfg, k) for k in ("num_heads", "num_kv_heads", "norm", "norm_type", "norm_weight_offset",
                                             "activation", "layer_norm_eps", "causal", "mlp", "qk_norm",
                                             "qk_norm_over", "rope_theta", "partial_rotary_factor",
                                             "attn_logit_softcapping", "query_pre_attn_scalar", "sliding_window",
                                             "sliding_window_pattern", "pattern_global_first", "first_attn_norm",
                                             "rope_local_theta", "rope_interleaved",
                                             "parallel_residual", "residual", "scaling", "layernorm_scaling",
                                             "attn_sinks", "swiglu_limit", "swiglu_alpha", "alibi")}
        if type(module).__name__ in declarations.STACKS:
            out["final_norm"] = getattr(module, declarations.FINAL_NORM, None) is not None
        return out
    torch = sys.modules.get("torch")  # a torch module cannot exist without it; never import torch here
    if torch is None or not isinstance(module, torch.nn.Module):
        return {}
    layer, out = module, {}
    if isinstance(module, torch.nn.TransformerEncoder):
        layer = module.layers[0]
        out["final_norm"] = module.norm is not None
    if not isinstance(layer, torch.nn.TransformerEncoderLayer):
        return {}
    act = layer.activation
    act_name = {torch.nn.functional.relu: "relu", torch.nn.functional.gelu: "gelu"}.get(act)
    if act_name is None and isinstance(act, (torch.nn.ReLU, torch.nn.GELU)):
        act_name = "relu" if isinstance(act, torch.nn.ReLU) else ("gelu" if act.approximate == "none" else "gelu_tanh")
    out.update(num_heads=layer.self_attn.num_heads, norm="pre" if layer.norm_first else "post",
               layer_norm_eps=layer.norm1.eps, norm_type="layernorm", norm_weight_offset=0.0, mlp="dense",
               parallel_residual="none", layernorm_scaling=False, attn_sinks=False, alibi=False,
               first_attn_norm=True)
    if act_name is not None:
        out["activation"] = act_name
    return out


def check_against_source(cfg: BlockConfig, module: Any, final_norm: bool | None = None, *,
                         torch_blocks: bool = True) -> None:
    """Raise ConversionError naming each field where `cfg` (and final_norm, when given)
    contradicts what the torch module `module` fixes about itself: a stock
    nn.TransformerEncoder / nn.TransformerEncoderLayer, or a torch_blocks module (unless
    `torch_blocks` is False). To load weights into a deliberately different config (a
    wrong twin), pass the module's state_dict() instead of the module."""
    if not torch_blocks and isinstance(getattr(module, "cfg", None), BlockConfig):
        return
    facts = settings_of(module)
    mine = {k: getattr(cfg, k) for k in facts if k != "final_norm"}
    if final_norm is not None and "final_norm" in facts:
        mine["final_norm"] = final_norm
    bad = [f"{k}={mine[k]!r} given, but the source module has {k}={facts[k]!r}"
           for k in mine if mine[k] != facts[k]
           and not (k == "num_kv_heads" and (mine[k] or cfg.num_heads) == (facts[k] or facts.get("num_heads")))]
    if bad:
        raise ConversionError(bad, header=f"the config contradicts the source {type(module).__name__}")


def prepare(source: Any, dialect: str | None, prefix: str = "", num_heads: int | None = None,
            num_kv_heads: int | None = None) -> tuple[dict[str, Any], str, str | None]:
    """For the loaders: read `source` and translate it to our names.

    Returns (state dict, prefix left to apply, hint). A torch-named source comes back as it
    was (with the caller's prefix); another dialect's comes back in our names (prefix "").
    With dialect None and keys no dialect recognises, the source comes back as it was, with a
    hint (listing the dialects and the keys' roots) for the loader's error message. Files
    are described, not read (`read_state_dict(lazy=True)`): their values are read when placed."""
    sd = read_state_dict(source, lazy=True)
    hint = None
    if dialect is None:
        try:
            dialect = detect_dialect(sd)
        except UnknownDialectError as e:
            dialect, hint = "torch", f"{e.args[0].splitlines()[0]}: " + "; ".join(e.problems[:2])
        else:
            if dialect != "torch":
                log.info("checkpoint dialect %s (detected from the key names)", dialect)
    if _get(dialect).rules is None:
        return sd, prefix, hint
    return translate(sd, dialect, prefix=prefix, num_heads=num_heads, num_kv_heads=num_kv_heads).state_dict, "", None
