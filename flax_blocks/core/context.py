"""What one call hands a block's sublayers besides the stream, and what they hand back: one
object in both twins (its arrays are JAX's or torch's). A block's `run(x, ctx)` reads its
sublayers in order; a stack gives each layer its own (`Context.at`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class Context:
    """masks: {"self": ..., "cross": ...}, each twin's prepared masks (Flax: (mask, rows)
    from `build_mask`; torch: a `Mask`). path: the self-attention's (`attention_path`;
    torch: None picks it from the config). memory (B, S, E): what a cross-attention reads.
    index: the chunk's first position in a cached call. positions (B, T): the rotary
    positions (None: index onwards). key_valid (B, S): the key mask of Flax's blocked and
    fused paths. weights: the attention weights are asked for (torch computes them only
    then). deterministic: Flax's dropout off (True), on (False) or as the module's mode.

    Per block: layer, its index in its stack from 1 (traced in a Flax scan); cache, its
    caches {"self": {"k", "v"}, "cross": {"k", "v"}} (None: uncached); keys, Flax's dropout
    keys, two per sublayer (inside, output; None: the modules' own RNG streams); mlp, the
    layer's MLP where a Flax mixed stack holds it apart from the block (None: the block's own).

    Handed back: found, the intermediates ("attention_weights", "attention_logits_max",
    "cross_..."); written, the updated caches by part."""

    masks: dict[str, Any]
    path: str | None = "dense"
    memory: Any = None
    index: Any = 0
    positions: Any = None
    key_valid: Any = None
    weights: bool = False
    deterministic: bool | None = None
    layer: Any = 1
    cache: Any = None
    keys: Any = None
    mlp: Any = None
    found: dict[str, Any] = field(default_factory=dict)
    written: dict[str, Any] = field(default_factory=dict)

    def at(self, layer: Any, cache: Any = None, keys: Any = None) -> Context:
        """The context of one layer of a stack: the call's shared part, its own layer index,
        cache and keys, and nothing found or written yet."""
        return replace(self, layer=layer, cache=cache, keys=keys, found={}, written={})

    def key(self, i: int) -> Any:
        """Dropout key i of this block (2j: inside sublayer j, 2j + 1: on its output), or None."""
        return None if self.keys is None else self.keys[i]

    def shared(self) -> dict[str, Any]:
        """The call's arrays every layer reads (a Flax scan carries them)."""
        return {"masks": self.masks, "memory": self.memory, "index": self.index, "positions": self.positions,
                "key_valid": self.key_valid}
