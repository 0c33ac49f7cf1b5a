"""The suite checks itself: bugs planted at run time (monkeypatching, no file edited) that
twin-vs-twin parity cannot see, because both twins share them or share the code they sit
in. Each must be caught by the numpy reference checks (test_reference.py), in the twin(s)
it was planted in and only there.

Where each bug is planted is the table WHERE just below: when the library's code
moves, re-point it there. Every patch counts its calls, and a plant that never ran fails
the test (so a stale patch point cannot pass as "caught").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import pytest
import torch.nn.functional as F

import flax_blocks.attention
import flax_blocks.blocks
import torch_blocks.attention
import torch_blocks.blocks
import torch_blocks.layers
from flax_blocks.core.config import BlockConfig

from . import test_reference as tr
from .cases import CASES
from .test_reference import EPS_CASES, TOL, reference_errors

# Patch points: (object or dict, attribute or key). Re-point here after the code moves.
WHERE = {
    "flax logit scale": (flax_blocks.attention, "jnp"),  # jnp.sqrt(d) in Attention.__call__
    "torch logit scale": (torch_blocks.attention, "math"),  # math.sqrt(d): the path returning weights
    "torch fused attention": (torch_blocks.attention, "F"),  # F.scaled_dot_product_attention
    "torch norm": (torch_blocks.layers.Norm, "__init__"),  # sets self.eps from the config
    "flax gelu": (flax_blocks.blocks.ACTIVATION_FNS, "gelu"),
    "torch gelu": (torch_blocks.blocks.ACTIVATION_FNS, "gelu"),
    "residual alpha": (BlockConfig, "residual_alpha"),  # the skip's weight both twins read
    "flax layer scale": (flax_blocks.blocks, "layer_scale"),  # LayerNorm Scaling's 1/sqrt(l), as imported
    "torch layer scale": (torch_blocks.blocks, "layer_scale"),
    "flax parallel residual": (flax_blocks.blocks._Block, "parallel"),  # the block's own method
    "torch parallel residual": (torch_blocks.blocks._Block, "parallel"),
}


class _Proxy:
    """A module stand-in: `overrides` by name, everything else from `module`."""

    def __init__(self, module: Any, **overrides: Callable):
        self._module, self._overrides = module, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


def _counted(fn: Callable, hits: list) -> Callable:
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        hits.append(1)
        return fn(*a, **kw)

    return wrapper


# --- the plants: factory(original, hits) -> replacement ---------------------------------

def _sqrt_is_identity(jnp_module, hits):  # logits / sqrt(d) -> logits / d
    return _Proxy(jnp_module, sqrt=_counted(lambda a: a, hits))


def _math_sqrt_is_identity(math_module, hits):  # q * sqrt(1 / d) -> q * (1 / d)
    return _Proxy(math_module, sqrt=_counted(lambda a: a, hits))


def _functional_sdpa_over_d(functional, hits):  # torch.nn.functional as one module sees it
    sdpa = functional.scaled_dot_product_attention
    return _Proxy(functional, scaled_dot_product_attention=_counted(
        lambda q, k, v, *a, **kw: sdpa(q, k, v, *a, **{**kw, "scale": 1.0 / q.size(-1)}), hits))


def _tanh_gelu(_, hits):
    return _counted(lambda x: jax.nn.gelu(x, approximate=True) if isinstance(x, jax.Array)
                    else F.gelu(x, approximate="tanh"), hits)


def _norm_init_eps_1e5(init, hits):  # torch twin's norms ignore layer_norm_eps
    def patched(self, *a, **kw):
        init(self, *a, **kw)
        hits.append(1)
        self.eps = 1e-5

    return patched


def _drop_alpha(alpha, hits):  # DeepNorm's alpha read as 1
    return property(_counted(lambda cfg: 1.0, hits))


def _layer_squared(layer_scale, hits):  # LayerNorm Scaling by 1/l: 1/sqrt(l^2)
    return _counted(lambda layer, dtype: layer_scale(layer * layer, dtype), hits)


def _sequential(parallel, hits):  # GPT-NeoX's parallel residual run one branch after the other
    def patched(self, x, fs, ctx):
        hits.append(1)
        for i, f in enumerate(fs):
            sub = self.sublayers[i]
            h = self.dropouts[i](f(getattr(self, sub.norm)(x), ctx, i))
            s = getattr(self, sub.scale)
            x = x + (h if s is None else s[...] * h)
        return x

    return patched


# bug -> [(patch point, factory(original, hits) -> replacement)]
PATCHES = {
    "logits scaled by 1/d instead of 1/sqrt(d)": [
        ("flax logit scale", _sqrt_is_identity),
        ("torch logit scale", _math_sqrt_is_identity),
        ("torch fused attention", _functional_sdpa_over_d),
    ],
    "torch twin's norms at eps 1e-5 whatever layer_norm_eps says": [("torch norm", _norm_init_eps_1e5)],
    "exact GELU replaced by its tanh approximation": [("flax gelu", _tanh_gelu), ("torch gelu", _tanh_gelu)],
    "DeepNorm's alpha dropped from the skip both twins read": [("residual alpha", _drop_alpha)],
    "LayerNorm Scaling by 1/l in the shared layer scale": [
        ("flax layer scale", _layer_squared),
        ("torch layer scale", _layer_squared),
    ],
    "the parallel residual computed sequentially in both blocks": [
        ("flax parallel residual", _sequential),
        ("torch parallel residual", _sequential),
    ],
}


def _first(cases, pred, n=1):
    picked = [c for c in cases if c.kind not in ("Encoder", "Decoder") and pred(c)][:n]  # no scan
    assert picked, "no case fits this plant"
    return picked


@dataclass
class Plant:
    cases: list  # where it shows
    twins: tuple[str, ...]  # which twins carry it
    diagnosis: str  # what the reference check's message must say


PLANTS = {
    "logits scaled by 1/d instead of 1/sqrt(d)": Plant(
        _first(CASES, lambda c: c.kind == "TransformerBlock"), ("torch", "flax"),
        "scales attention logits by 1/head_dim"),
    "torch twin's norms at eps 1e-5 whatever layer_norm_eps says": Plant(
        _first(CASES + EPS_CASES, lambda c: c.cfg.layer_norm_eps == 1e-3 and c.kind == "TransformerBlock"), ("torch",),
        "ignores layer_norm_eps (uses torch's 1e-5)"),
    "exact GELU replaced by its tanh approximation": Plant(
        _first(CASES, lambda c: c.cfg.activation == "gelu" and c.kind == "FeedForward"),
        ("torch", "flax"), "computes tanh GELU where exact GELU is asked"),
    "DeepNorm's alpha dropped from the skip both twins read": Plant(
        _first(CASES, lambda c: c.cfg.scaling == "deepnorm"), ("torch", "flax"), "drops DeepNorm's alpha"),
    # a stack (LayerNorm Scaling is the identity in a block alone), unrolled: no cached scan body
    "LayerNorm Scaling by 1/l in the shared layer scale": Plant(
        [c for c in CASES if c.cfg.layernorm_scaling and not c.scan_layers][:1], ("torch", "flax"),
        "scales layer l's pre-norms by 1/l"),
    "the parallel residual computed sequentially in both blocks": Plant(
        _first(CASES, lambda c: c.cfg.parallel_residual == "two_norms"), ("torch", "flax"),
        "runs the parallel residual's branches one after the other"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(PATCHES))
def test_planted_bug_is_caught_by_reference(bug, monkeypatch):
    hits: list = []
    for where, factory in PATCHES[bug]:
        target, name = WHERE[where]
        if isinstance(target, dict):
            monkeypatch.setitem(target, name, factory(target[name], hits))
        else:
            monkeypatch.setattr(target, name, factory(getattr(target, name), hits))
            if isinstance(target, type):  # subclasses holding their own copy are patched too:
                # nnx.tabulate (tests/test_flax_native.py) leaves the inherited methods it wrapped
                # set on the subclass itself, which would hide a plant on the base class
                todo = list(target.__subclasses__())
                while todo:
                    sub = todo.pop()
                    todo.extend(sub.__subclasses__())
                    if name in sub.__dict__:
                        monkeypatch.setattr(sub, name, factory(sub.__dict__[name], hits))
    # The plants act on Python-level code that the twins run (torch) or trace (Flax, a fresh
    # nnx.jit per case) at every call; no Encoder here, whose cached scan body could outlive
    # a patch (LayerNorm Scaling's plant takes an unrolled Encoder: a Python loop over the
    # layers, traced afresh). The hit counter below proves each plant ran.
    try:
        plant = PLANTS[bug]
        for case in plant.cases:
            diagnoses: dict = {}
            errors = reference_errors(case, diagnoses)
            with pytest.raises(AssertionError) as caught:  # the suite's own check, as test_case_*_matches_reference
                tr.check_against_reference(case, errors, diagnoses)
            for twin in plant.twins:
                assert f"the {twin} twin matches the reference if it {plant.diagnosis}" in str(caught.value), (
                    f"planted bug {bug!r}: the reference check failed without naming it: {caught.value}")
            for twin, errs in errors.items():
                worst = max(errs, key=errs.get)
                print(f"{bug} | {case.name} | {twin}: {worst} {errs[worst]:.1e}")
                if twin in plant.twins:
                    assert errs[worst] > TOL, (
                        f"planted bug NOT caught: {bug!r} in the {twin} twin, {case.name}: "
                        f"{worst} within {errs[worst]:.1e} of the numpy reference")
                else:
                    assert errs[worst] <= TOL, f"{bug!r} (planted in {plant.twins}) blamed the {twin} twin"
        assert hits, f"the plant {bug!r} never ran: re-point PATCHES in {__file__}"
        if "torch twin's norms" in bug:  # stock torch is untouched and still agrees with the reference
            tr.test_reference_matches_stock_encoder_layer(False, "gelu", True, 1e-3)
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # nothing traced under a plant outlives it


def test_patch_points_exist():
    """The table points at things that exist (cheap; the slow test proves they are used)."""
    for where, (target, name) in WHERE.items():
        assert (name in target) if isinstance(target, dict) else hasattr(target, name), where
    assert {w for patches in PATCHES.values() for w, _ in patches} == set(WHERE)
    assert math.isclose(torch_blocks.attention.math.sqrt(4.0), 2.0)  # nothing left patched
