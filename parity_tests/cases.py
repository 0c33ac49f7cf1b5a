"""The option matrix of the parity suite: every BlockConfig option, each block kind, masks,
edge shapes and Encoder depths, varied one at a time around a base config (heads=2 !=
head_dim=6, so a wrong reshape of the packed projection cannot pass)."""

from __future__ import annotations

from dataclasses import replace

import flax_blocks as fb

from .harness import KINDS, Case

BASE = fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, norm="pre", activation="gelu")
BLOCK = Case("TransformerBlock", BASE)


def _cfg(**kw) -> Case:
    return replace(BLOCK, cfg=replace(BASE, **kw))


CASES: list[Case] = [
    *(Case(kind, BASE) for kind in KINDS),
    *(Case(kind, replace(BASE, norm="post")) for kind in ("ResidualMHA", "FeedForward")),
    _cfg(norm="post"),
    _cfg(norm="none"),
    _cfg(residual="none"),
    _cfg(norm="post", residual="none"),
    _cfg(norm="post", scaling="deepnorm"),
    _cfg(norm="none", scaling="rezero"),
    _cfg(scaling="rezero"),
    _cfg(scaling="layerscale"),
    _cfg(activation="relu"),
    _cfg(activation="gelu_tanh"),
    _cfg(bias=False),
    _cfg(causal=True),
    replace(BLOCK, attention_mask=True),
    replace(BLOCK, key_mask=True),
    replace(BLOCK, attention_mask=True, key_mask=True),  # some rows lose every key
    replace(BLOCK, cfg=replace(BASE, causal=True), attention_mask=True, key_mask=True),
    replace(BLOCK, batch=1),
    replace(BLOCK, seq=1),
    replace(BLOCK, cfg=replace(BASE, d_model=24, num_heads=8, d_ff=16)),  # heads 8 > head_dim 3
    Case("ResidualMHA", BASE, attention_mask=True, key_mask=True),
    Case("Encoder", BASE, num_layers=1),
    Case("Encoder", replace(BASE, norm="post"), num_layers=4),
    Case("Encoder", BASE, num_layers=6, final_norm=False, attention_mask=True, key_mask=True),
    Case("Encoder", replace(BASE, norm="post", scaling="deepnorm", causal=True), num_layers=3),
]
