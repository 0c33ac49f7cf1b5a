"""What one call hands a block's sublayers besides the stream, and what they hand back: one
object in both twins (its arrays are JAX's or torch's). A block's `run(x, ctx)` reads its
sublayers in order; a stack gives each layer its own (`Context.at`). An attention takes its
part of it as one `AttentionCall`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class AttentionCall:
    """What one attention call takes besides its input x (B, T, E), in both twins.

    mask: the twin's prepared mask or None (Flax: (mask (B|1, H|1, T, S), rows (B|1, H|1, T, 1))
    from `build_mask` / `cache_mask`; torch: a `Mask`). path: "dense", "blocked" or "fused"
    (`attention_paths.choose_path`); None: the twin resolves it (torch by the rule, Flax, whose
    call returns the weights, "dense"). cross: a cross-attention to memory (B, S, E), or to the
    keys and values in cache (`memory_kv`). cache: a self-attention's {"k", "v"} (B, K, L, hd),
    the chunk at positions index .. index+T-1 written there. positions (B, T): the rotary
    positions (None: index onwards). layer: the block's index in its stack from 1 (traced in a
    Flax scan; a local layer or not). key_valid (B, S): Flax's blocked and fused paths' key mask."""

    mask: Any = None
    path: str | None = None
    cross: bool = False
    memory: Any = None
    cache: Any = None
    index: Any = 0
    positions: Any = None
    layer: Any = 1
    key_valid: Any = None


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

    def attention_call(self, part: str) -> AttentionCall:
        """The call of this block's attention `part`: "self", or "cross" (to the memory, or to
        its keys and values in the cache)."""
        cache = None if self.cache is None else self.cache[part]
        if part == "cross":
            return AttentionCall(self.masks.get("cross"), cross=True, memory=self.memory, cache=cache)
        return AttentionCall(self.masks.get("self"), self.path, cache=cache, index=self.index,
                             positions=self.positions, layer=self.layer, key_valid=self.key_valid)

    def key(self, i: int) -> Any:
        """Dropout key i of this block (2j: inside sublayer j, 2j + 1: on its output), or None."""
        return None if self.keys is None else self.keys[i]

    def shared(self) -> dict[str, Any]:
        """The call's arrays every layer reads (a Flax scan carries them)."""
        return {"masks": self.masks, "memory": self.memory, "index": self.index, "positions": self.positions,
                "key_valid": self.key_valid}
