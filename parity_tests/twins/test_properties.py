"""Property tests: random shapes and configs, float64 forward and gradient parity.

Bounded (few examples, small sizes) so the whole suite stays inside the CI budget;
the seed of each example is fixed by hypothesis' database-free derandomized mode.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flax_blocks as fb

from .harness import TOL, Case, parity


@st.composite
def cases(draw) -> Case:
    heads = draw(st.integers(1, 3))
    # d_model >= 2: a LayerNorm over one feature outputs a constant, whose gradients are
    # pure rounding noise (relative errors of O(1) between any two implementations)
    head_dim = draw(st.integers(2 if heads == 1 else 1, 4))
    scaling = draw(st.sampled_from(["none", "rezero", "layerscale", "deepnorm"]))
    norm = "post" if scaling == "deepnorm" else draw(st.sampled_from(["pre", "post", "none"]))
    residual = "add" if scaling != "none" else draw(st.sampled_from(["add", "none"]))
    cfg = fb.BlockConfig(
        d_model=heads * head_dim, num_heads=heads, d_ff=draw(st.integers(1, 9)), dropout=0.0,
        activation=draw(st.sampled_from(["relu", "gelu", "gelu_tanh"])), bias=draw(st.booleans()),
        norm=norm, residual=residual, scaling=scaling, causal=draw(st.booleans()),
    )
    kind = draw(st.sampled_from(["ResidualMHA", "FeedForward", "TransformerBlock", "Encoder"]))
    masks = kind != "FeedForward"
    return Case(kind, cfg, num_layers=draw(st.integers(1, 3)), batch=draw(st.integers(1, 3)),
                seq=draw(st.integers(1, 5)), attention_mask=masks and draw(st.booleans()),
                key_mask=masks and draw(st.booleans()), seed=draw(st.integers(0, 100)))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases())
def test_float64_parity_holds_for_random_configs(case):
    err = parity(case, "float64")
    assert err.forward <= TOL["forward", "float64"], case.name
    assert max(err.grad, err.dx) <= TOL["grad", "float64"], case.name
