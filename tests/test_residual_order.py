"""Each placement's order of operations as the twins' blocks write it out (`_Block.residual`,
`_Block.parallel` in flax_blocks/blocks.py and torch_blocks/blocks.py), checked with numpy
markers: a block stand-in whose norm divides by 10, whose sublayer computes 2h + 1, whose
dropout subtracts 0.5 and whose Peri-LN output norm multiplies by 7, so that any step taken
in another order, or left out, gives another number."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

import flax_blocks.blocks
import torch_blocks.blocks
from flax_blocks.core.config import BlockConfig
from flax_blocks.core.context import Context
from flax_blocks.core.declarations import Sublayer

TWINS = {"flax": flax_blocks.blocks._Block, "torch": torch_blocks.blocks._Block}
X = np.array([[1.0, 2.0, -3.0]])
SUB = Sublayer("mlp", ("up", "gate", "down"), "norm1", "norm_out1", "scale1")
SUB2 = Sublayer("attention", ("attn",), "norm2", "norm_out2", "scale2")


def make(**kw) -> BlockConfig:
    return BlockConfig(**{"d_model": 12, "num_heads": 3, "d_ff": 20, **kw})


def f(h, ctx, i):
    ctx.found[f"aux{i}"] = 1  # what a sublayer hands back rides in the context
    return h * 2.0 + 1.0


def drop(h, **_):  # either twin's dropout call (Flax's takes deterministic= and rngs=)
    return h - 0.5


def stand_in(cfg: BlockConfig, scale=None, **more) -> SimpleNamespace:
    return SimpleNamespace(cfg=cfg, sublayers=(SUB, SUB2), dropouts=[drop, drop], norm1=lambda h: h / 10.0,
                           norm_out1=lambda h: h * 7.0, scale1=None if scale is None else np.asarray(scale), **more)


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize(
    "kw,scale,expected",
    [
        (dict(norm="post"), None, lambda x: (x + (2 * x + 1 - 0.5)) / 10),
        (dict(norm="pre"), None, lambda x: x + (2 * (x / 10) + 1 - 0.5)),
        (dict(norm="none"), None, lambda x: x + (2 * x + 1 - 0.5)),
        (dict(norm="out"), None, lambda x: x + ((2 * x + 1) / 10 - 0.5)),
        (dict(norm="post", residual="none"), None, lambda x: (2 * x + 1 - 0.5) / 10),
        (dict(norm="pre", residual="none"), None, lambda x: 2 * (x / 10) + 1 - 0.5),
        (dict(norm="none", residual="none"), None, lambda x: 2 * x + 1 - 0.5),
        (dict(norm="none", scaling="rezero"), 0.25, lambda x: x + 0.25 * (2 * x + 1 - 0.5)),
        (dict(norm="pre", scaling="layerscale"), np.array([0.1, 0.2, 0.3]),
         lambda x: x + np.array([0.1, 0.2, 0.3]) * (2 * (x / 10) + 1 - 0.5)),
        (dict(norm="post", scaling="deepnorm"), None, lambda x: (2 ** 0.25 * x + (2 * x + 1 - 0.5)) / 10),
        (dict(norm="post", scaling="deepnorm", deepnorm_alpha=3.0), None, lambda x: (3 * x + (2 * x + 1 - 0.5)) / 10),
        (dict(norm="peri"), None, lambda x: x + ((2 * (x / 10) + 1) * 7 - 0.5)),
        (dict(norm="peri", scaling="layerscale"), np.array([0.1, 0.2, 0.3]),
         lambda x: x + np.array([0.1, 0.2, 0.3]) * ((2 * (x / 10) + 1) * 7 - 0.5)),
    ],
)
def test_each_placements_order_of_operations(twin, kw, scale, expected):
    ctx = Context({})
    y = TWINS[twin].residual(stand_in(make(**kw), scale), 0, X, f, ctx)
    assert ctx.found == {"aux0": 1}
    np.testing.assert_allclose(y, expected(X), rtol=1e-14)


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("layer", [1, 3, np.int32(4)])
def test_layernorm_scaling_scales_the_pre_norms_output_by_one_over_sqrt_layer(twin, layer):
    """LayerNorm Scaling (Sun et al. 2025): layer l's pre-norm output times 1 / sqrt(l)."""
    y = TWINS[twin].residual(stand_in(make(norm="pre", layernorm_scaling=True)), 0, X, f, Context({}, layer=layer))
    np.testing.assert_allclose(y, X + (2 * (X / 10) / math.sqrt(int(layer)) + 1 - 0.5), rtol=1e-14)
    y1 = TWINS[twin].residual(stand_in(make(norm="pre")), 0, X, f, Context({}, layer=layer))  # off: index ignored
    np.testing.assert_allclose(y1, X + (2 * (X / 10) + 1 - 0.5), rtol=1e-14)


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("mode", ["two_norms", "shared_norm"])
def test_parallel_residual_adds_both_branches_to_the_same_input(twin, mode):
    """y = x + s1 * Dropout(F1(Norm1(x))) + s2 * Dropout(F2(Norm2(x))); shared_norm: Norm2 = Norm1."""
    g = lambda h, ctx, i: h * 3.0  # noqa: E731  the second branch's sublayer
    block = stand_in(make(norm="pre", parallel_residual=mode), scale=0.5, norm2=lambda h: h / 100.0,
                     norm_out2=None, scale2=None)
    ctx = Context({})
    y = TWINS[twin].parallel(block, X, [f, g], ctx)
    second = X / 100 if mode == "two_norms" else X / 10
    np.testing.assert_allclose(y, X + 0.5 * (2 * (X / 10) + 1 - 0.5) + (3 * second - 0.5), rtol=1e-14)
    assert ctx.found == {"aux0": 1}
