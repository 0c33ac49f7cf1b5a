"""Shapes and the option table shared by the Flax and torch block tests (tests/test_flax_blocks.py,
tests/test_torch_blocks.py): one definition, so both frameworks are tested on the same options."""

from __future__ import annotations

E, H, FF, B, T = 12, 3, 20, 2, 6  # heads (3) != head_dim (4)
KINDS = ["ResidualMHA", "FeedForward", "TransformerBlock", "Encoder"]
MASKED_KINDS = ["ResidualMHA", "TransformerBlock", "Encoder"]

# name -> BlockConfig overrides; each test file adds the dtype options its framework supports
OPTIONS = {
    "default-post": {},
    "gelu": dict(activation="gelu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "pre": dict(norm="pre"),
    "norm-none": dict(norm="none"),
    "no-skip-post": dict(residual="none"),
    "no-skip-pre": dict(residual="none", norm="pre"),
    "deepnorm": dict(scaling="deepnorm"),
    "rezero": dict(scaling="rezero", norm="none"),
    "rezero-pre": dict(scaling="rezero", norm="pre"),
    "layerscale": dict(scaling="layerscale", norm="pre"),
    "causal": dict(causal=True),
    "no-bias": dict(bias=False),
    "no-bias-pre": dict(bias=False, norm="pre"),
    "xavier": dict(init="xavier"),
    "eps": dict(layer_norm_eps=1e-3),
    "dropout": dict(dropout=0.3),
    "bfloat16": dict(param_dtype="bfloat16"),
    "float16": dict(param_dtype="float16", norm="pre"),
}


def init_spec(cfg, name: str):
    """The declared init distribution of TransformerBlock parameter `name` (torch name), from
    flax_blocks.core.declarations: one spec, or a tuple of one per (rows, spec) chunk (q, k, v)."""
    from flax_blocks.core.declarations import block, flatten

    params = {t: p for t, _, p in flatten(block(cfg.resolve(), "TransformerBlock"))}
    chunks = params[name].init
    return chunks[0][1] if len(chunks) == 1 else tuple(spec for _, spec in chunks)
