"""What a language model adds around its stack, declared once for both frameworks.

    tokens (B, T) -> embed (+ learned positions) (+ token types) (-> embed_norm)
                  -> the library's Encoder (layers + final norm)
                  -> head (its own weight, or the token embedding's transpose when tied) -> logits

`LMConfig` says which of those parts a model has; `components` declares their parameters
(torch name, Flax path, shape, axes, init, transform) as `flax_blocks.declarations` does for
the blocks, so `flax_blocks.lm.LanguageModel` and `torch_blocks.lm.LanguageModel` build the
same parameters, and the converter maps one onto the other by the same rules. Torch names:
embed.weight (V, E), pos.weight (P, E), token_type.weight (types, E), embed_norm.*,
encoder.layers.{i}.* / encoder.norm.*, head.weight (V, E), head.bias (V,). Framework-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import declarations
from .config import BlockConfig
from .declarations import LINEAR, Component, Param

HEADS = ("untied", "tied", "none")
ENCODER = "encoder"  # the stack's attribute / torch prefix


@dataclass(frozen=True)
class LMConfig:
    """The parts of a language model around its stack; hashable (it keys compiled programs).

    vocab_size: rows of the token embedding (and of the head).
    num_layers: the stack's depth.
    max_positions: learned absolute position embeddings of this many positions (GPT-2's wpe,
      BERT's position_embeddings); None: none (rotary positions live in the blocks, from
      cfg.rope_theta). Rotary models take any position a cache holds.
    token_types: rows of BERT's token-type embedding; 0: none.
    embed_norm: a norm (the blocks' norm type and eps) on the embedded input (BERT).
    final_norm: the stack's final norm; None: the stack's default (pre-LN and Peri-LN).
    head: "untied" (its own (V, E) weight), "tied" (logits = h @ embed.weight^T, as GPT-2 and
      tie_word_embeddings) or "none" (the model returns its last hidden state).
    head_bias: a bias on the head (not with "tied" or "none").
    init_std: the std of the embeddings' and the head's normal init (HF's initializer_range).
    """

    vocab_size: int
    num_layers: int
    max_positions: int | None = None
    token_types: int = 0
    embed_norm: bool = False
    final_norm: bool | None = None
    head: str = "untied"
    head_bias: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{name} must be a positive int, got {v!r}")
        if self.max_positions is not None and (not isinstance(self.max_positions, int) or self.max_positions < 1):
            problems.append(f"max_positions must be a positive int or None, got {self.max_positions!r}")
        if not isinstance(self.token_types, int) or self.token_types < 0:
            problems.append(f"token_types must be an int >= 0, got {self.token_types!r}")
        if self.head not in HEADS:
            problems.append(f"head must be one of {HEADS}, got {self.head!r}")
        elif self.head_bias and self.head != "untied":
            problems.append(f"head_bias needs head='untied' (got head={self.head!r})")
        if problems:
            raise ValueError("; ".join(problems))


def _embedding(rows: int, e: int, dim: str, std: float) -> Component:
    return Component("embedding", (Param("weight", "embedding", (rows, e), (dim, "d_model"), ("vocab", "embed"),
                                         ((rows, ("normal", std)),)),))


def components(lm: LMConfig, cfg: BlockConfig) -> tuple[tuple[str, Component], ...]:
    """The model's own components besides the stack, in torch's order: (name, Component)."""
    e, v, std = cfg.d_model, lm.vocab_size, lm.init_std
    out: list[tuple[str, Component]] = [("embed", _embedding(v, e, "vocab_size", std))]
    if lm.max_positions is not None:
        out.append(("pos", _embedding(lm.max_positions, e, "max_positions", std)))
    if lm.token_types:
        out.append(("token_type", _embedding(lm.token_types, e, "token_types", std)))
    if lm.embed_norm:
        out.append(("embed_norm", declarations.norm(cfg, e)))
    if lm.head == "untied":
        params = [Param("weight", "kernel", (v, e), ("vocab_size", "d_model"), ("embed", "vocab"),
                        ((v, ("normal", std)),), LINEAR)]
        if lm.head_bias:
            params.append(Param("bias", "bias", (v,), ("vocab_size",), ("vocab",), ((v, ("const", 0.0)),)))
        out.append(("head", Component("linear", tuple(params))))
    return tuple(out)


OPTIONAL = ("pos", "token_type", "embed_norm", "head")  # attributes that are None when a model lacks them
