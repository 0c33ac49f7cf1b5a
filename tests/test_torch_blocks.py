"""torch_blocks on its own: every config option, the option semantics, masks (torch convention:
True = may NOT attend), dropout modes, initialisation, dtypes and bad input."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from block_options import FF, KINDS, MASKED_KINDS, OPTIONS, B, E, H, T, init_spec  # shared with test_flax_blocks.py

import torch_blocks as tb
from flax_blocks.core.attention_paths import AUTO_MIN_KEYS
from flax_blocks.core.config import BlockConfig, FullyMaskedWarning, invert_mask
from flax_blocks.core.context import AttentionCall

torch.set_num_threads(1)

TDTYPE = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = {**OPTIONS, "float64": dict(param_dtype="float64")}


def make_cfg(**kw) -> BlockConfig:
    return BlockConfig(**{**dict(d_model=E, num_heads=H, d_ff=FF, dropout=0.0), **kw})


def build(kind: str, cfg: BlockConfig, seed: int = 0, **kw):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # LayerNorm / gates are deterministic, but be safe
    if kind == "Encoder":
        return tb.Encoder(cfg, num_layers=kw.pop("num_layers", 2), generator=g, **kw)
    return getattr(tb, kind)(cfg, generator=g, **kw)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def call(m, x, attn_mask=None, kpm=None, **kw):
    if isinstance(m, tb.FeedForward):
        return m(x, **kw)
    return m(x, attn_mask, kpm, **kw)


# ------------------------------------------------------------------------------------
# Every option, every block kind: forward, backward, shape, dtype
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", KINDS)
def test_every_option_runs(kind, option):
    cfg = make_cfg(**OPTIONS[option])
    m = build(kind, cfg)
    dt = TDTYPE[cfg.param_dtype]
    assert all(p.dtype == dt for p in m.parameters())
    x = rand(B, T, E, dtype=dt).requires_grad_()
    y = call(m, x)
    assert y.shape == (B, T, E) and y.dtype == dt and torch.isfinite(y).all()
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    m.eval()
    with torch.no_grad():
        y1, y2 = call(m, x), call(m, x)
    assert y1.shape == (B, T, E) and y1.dtype == dt and torch.equal(y1, y2)


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_names(kind):
    names = set(dict(build(kind, make_cfg(scaling="rezero", norm="pre")).named_parameters()))
    layer = {"self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
             "self_attn.out_proj.bias", "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
             "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "scale1", "scale2"}
    expected = {
        "ResidualMHA": {"mha.in_proj_weight", "mha.in_proj_bias", "mha.out_proj.weight", "mha.out_proj.bias",
                        "norm.weight", "norm.bias", "scale"},
        "FeedForward": {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias", "norm.weight",
                        "norm.bias", "scale"},
        "TransformerBlock": layer,
        "Encoder": {f"layers.{i}.{n}" for i in range(2) for n in layer} | {"norm.weight", "norm.bias"},
    }[kind]
    assert names == expected


def test_no_bias_and_no_norm_parameters():
    names = set(dict(build("TransformerBlock", make_cfg(bias=False)).named_parameters()))
    assert names == {"self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight",
                     "linear2.weight", "norm1.weight", "norm2.weight"}
    names = set(dict(build("TransformerBlock", make_cfg(norm="none")).named_parameters()))
    assert not any(n.startswith("norm") for n in names) and "linear1.bias" in names


# ------------------------------------------------------------------------------------
# Option semantics
# ------------------------------------------------------------------------------------


def ffn(m, h):
    act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[m.cfg.activation]
    return m.linear2(act(m.linear1(h)))


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
@pytest.mark.parametrize("residual", ["add", "none"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feedforward_formula(norm, residual, activation):
    m = build("FeedForward", make_cfg(norm=norm, residual=residual, activation=activation))
    x = rand(B, T, E)
    with torch.no_grad():
        ident = lambda v: v  # noqa: E731
        ln = m.norm if m.norm is not None else ident
        inner = ffn(m, ln(x) if norm == "pre" else x)
        pre_norm = inner + (x if residual == "add" else 0)
        want = ln(pre_norm) if norm == "post" else pre_norm
        torch.testing.assert_close(m(x), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("residual", ["add", "none"])
def test_residual_mha_formula(norm, residual):
    m = build("ResidualMHA", make_cfg(norm=norm, residual=residual, causal=True))
    x = rand(B, T, E)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    with torch.no_grad():
        h = m.norm(x) if norm == "pre" else x
        inner = m.mha(h, AttentionCall(tb.build_mask(m.cfg, B, T, causal)))[0]
        pre_norm = inner + (x if residual == "add" else 0)
        want = m.norm(pre_norm) if norm == "post" else pre_norm
        torch.testing.assert_close(m(x), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_no_skip_pre_ln_block_is_scale_invariant(kind):
    """residual="none": the output is F(LN(x)) and does not contain x, so y(3x) == y(x);
    with the skip path it does not hold."""
    x = rand(B, T, E)
    with torch.no_grad():
        for residual, same in [("none", True), ("add", False)]:
            m = build(kind, make_cfg(norm="pre", residual=residual, layer_norm_eps=1e-12))
            d = (call(m, 3 * x) - call(m, x)).abs().max().item()
            assert (d < 1e-5) == same, (residual, d)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["none", "pre"])
def test_rezero_is_identity_at_init(kind, norm):
    cfg = make_cfg(scaling="rezero", norm=norm)
    m = build(kind, cfg, **({"final_norm": False} if kind == "Encoder" else {}))
    gates = [p for n, p in m.named_parameters() if n.split(".")[-1].startswith("scale")]
    assert gates and all(g.shape == () and g.item() == 0.0 for g in gates)
    x = rand(B, T, E)
    with torch.no_grad():
        assert torch.equal(call(m, x), x)
        for g in gates:
            g.fill_(0.5)
        assert (call(m, x) - x).abs().max() > 1e-2


def test_rezero_and_layerscale_gate_the_branch_linearly():
    x = rand(B, T, E)
    for scaling, shape in [("rezero", ()), ("layerscale", (E,))]:
        m = build("FeedForward", make_cfg(scaling=scaling, norm="pre"))
        assert m.scale.shape == shape
        with torch.no_grad():
            m.scale.fill_(1.0)
            branch = m(x) - x
            g = torch.linspace(-1.0, 2.0, E) if shape else torch.tensor(0.7)
            m.scale.copy_(g)
            torch.testing.assert_close(m(x) - x, g * branch, rtol=0, atol=1e-6)


@pytest.mark.parametrize("num_layers,eps", [(1, 0.1), (2, 0.1), (20, 1e-5), (26, 1e-6)])
def test_layerscale_gate_values(num_layers, eps):
    cfg = make_cfg(scaling="layerscale", norm="pre", d_model=4, num_heads=2, d_ff=4)
    if num_layers == 1:
        m = build("TransformerBlock", cfg)
        gates = [m.scale1, m.scale2]
    else:
        m = build("Encoder", cfg, num_layers=num_layers)
        gates = [p for n, p in m.named_parameters() if "scale" in n]
        assert len(gates) == 2 * num_layers
    for g in gates:
        assert g.shape == (4,) and torch.equal(g, torch.full((4,), eps))


def test_deepnorm_uses_alpha():
    m = build("FeedForward", make_cfg(scaling="deepnorm"))
    alpha = 2 ** 0.25
    assert m.cfg.deepnorm_alpha == pytest.approx(alpha)
    x = rand(B, T, E)
    with torch.no_grad():
        torch.testing.assert_close(m(x), m.norm(alpha * x + ffn(m, x)), rtol=0, atol=1e-6)
        assert (m(x) - m.norm(x + ffn(m, x))).abs().max() > 1e-3
    enc = build("Encoder", make_cfg(scaling="deepnorm"), num_layers=6)
    for layer in enc.layers:
        assert layer.cfg.residual_alpha == pytest.approx(12 ** 0.25)
        assert layer.cfg.deepnorm_beta == pytest.approx(48 ** -0.25)
    # the Encoder's layers use the depth's alpha: reproduce layer 0's FFN sublayer
    layer = enc.layers[0]
    with torch.no_grad():
        h = layer.norm1(12 ** 0.25 * x + layer.self_attn(x)[0])
        want = layer.norm2(12 ** 0.25 * h + ffn(layer, h))
        torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_post_ln_rows_are_normalised(kind):
    x = 3 * rand(B, T, E) + 1
    with torch.no_grad():
        y = call(build(kind, make_cfg(norm="post")), x)
        torch.testing.assert_close(y.mean(-1), torch.zeros(B, T), rtol=0, atol=1e-5)
        torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(B, T), rtol=0, atol=1e-4)
        y = call(build(kind, make_cfg(norm="pre"), **({"final_norm": False} if kind == "Encoder" else {})), x)
        assert (y.var(-1, unbiased=False) - 1).abs().max() > 0.1  # pre-LN output is not normalised


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_causal(kind):
    x = rand(B, T, E)
    x2 = x.clone()
    x2[:, 4:] += rand(B, T - 4, E, seed=1)
    with torch.no_grad():
        for causal in (True, False):
            m = build(kind, make_cfg(causal=causal))
            y, y2 = call(m, x), call(m, x2)
            early = (y[:, :4] - y2[:, :4]).abs().max().item()
            assert (early == 0.0) == causal, early
            assert (y[:, 4:] - y2[:, 4:]).abs().max() > 1e-3
            if not causal:  # an explicit causal mask means the same as the flag
                mask = torch.ones(T, T, dtype=torch.bool).triu(1)
                torch.testing.assert_close(call(m, x, mask), call(build(kind, make_cfg(causal=True)), x),
                                           rtol=0, atol=0)


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_key_padding(kind):
    kpm = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    x = rand(B, T, E)
    x2 = x.clone()
    x2[0, 4:] += 5 * rand(2, E, seed=1)  # change only the padded tokens
    m = build(kind, make_cfg())
    with torch.no_grad():
        y, y2 = call(m, x, kpm=kpm), call(m, x2, kpm=kpm)
        assert torch.equal(y[0, :4], y2[0, :4]) and torch.equal(y[1], y2[1])
        y, y2 = call(m, x), call(m, x2)
        assert (y[0, :4] - y2[0, :4]).abs().max() > 1e-3  # without the mask they do matter
        # batch size 1 (a mask of shape (1, T))
        torch.testing.assert_close(call(m, x[:1], kpm=kpm[:1]), call(m, x, kpm=kpm)[:1], rtol=0, atol=1e-6)


def test_attention_weights():
    m = build("TransformerBlock", make_cfg(causal=True, dropout=0.5))
    m.eval()
    attn = torch.zeros(B, T, T, dtype=torch.bool)
    attn[1, :, 2] = True  # batch 1: nobody may attend to key 2
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[0, 5] = True
    with torch.no_grad():
        y, extra = m(rand(B, T, E), attn, kpm, return_intermediates=True)
    w = extra["attention_weights"]
    assert w.shape == (B, H, T, T)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T), rtol=0, atol=1e-6)
    assert (w >= 0).all()
    forbidden = torch.ones(T, T, dtype=torch.bool).triu(1) | attn | kpm[:, None, :]
    assert torch.equal(w * forbidden[:, None], torch.zeros_like(w))
    assert (w[~forbidden[:, None].expand_as(w)] > 0).all()


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_fully_masked_rows(kind):
    """Rows with no key: zero attention output and weights (not NaN), finite gradients."""
    m = build(kind, make_cfg(norm="pre"), **({"final_norm": False} if kind == "Encoder" else {}))
    attn = torch.zeros(T, T, dtype=torch.bool)
    attn[3] = True  # query 3 may attend to nothing
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1] = True  # batch 1: every key is padding
    x = rand(B, T, E).requires_grad_()
    with pytest.warns(FullyMaskedWarning, match=r"some batch elements have no key.*padded element.*invert_mask"):
        y, extra = call(m, x, attn, kpm, return_intermediates=True)
    assert torch.isfinite(y).all()
    w = extra["attention_weights"]
    w0 = w[0] if kind == "Encoder" else w
    assert torch.equal(w0[1], torch.zeros_like(w0[1])) and torch.equal(w0[0, :, 3], torch.zeros_like(w0[0, :, 3]))
    torch.testing.assert_close(w0[0, :, 2].sum(-1), torch.ones(H), rtol=0, atol=1e-6)
    if kind == "ResidualMHA":  # pre-LN: x + 0 on the rows without keys
        assert torch.equal(y[1], x[1]) and torch.equal(y[0, 3], x[0, 3])
        assert not torch.equal(y[0, 2], x[0, 2])
    (y * rand(B, T, E, seed=5)).sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_eval_no_grad_path_agrees(kind):
    """From AUTO_MIN_KEYS keys on (the rule both twins share, `attention_paths.choose_path`), the
    attention runs torch's fused scaled_dot_product_attention: same results, masks and rows without
    keys included, as the weight-returning path; below it on a CPU, the explicit softmax (as Flax)."""
    m = build(kind, make_cfg(num_heads=2, norm="pre"))
    m.eval()
    F = torch.nn.functional
    for t, fused in ((T, False), (AUTO_MIN_KEYS, True)):
        attn = torch.zeros(t, t, dtype=torch.bool)
        attn[3] = True
        kpm = torch.zeros(B, t, dtype=torch.bool)
        kpm[1] = True
        kpm[0, 5] = True
        x = rand(B, t, E)
        with (mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as kernel,
              torch.no_grad()):
            fast = call(m, x, attn, kpm)
        assert kernel.called == fused, t
        with torch.no_grad():
            slow, _ = call(m, x, attn, kpm, return_intermediates=True)
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_train_and_eval(kind):
    x = rand(B, T, E)
    m = build(kind, make_cfg(dropout=0.3))
    ref = build(kind, make_cfg(dropout=0.0))
    ref.load_state_dict(m.state_dict(), strict=True)
    assert m.training
    with torch.no_grad():
        y1, y2, y0 = call(m, x), call(m, x), call(ref, x)
        assert (y1 - y2).abs().max() > 1e-3 and (y1 - y0).abs().max() > 1e-3
        m.eval()
        torch.testing.assert_close(call(m, x), y0, rtol=0, atol=0)
        m.train()
        assert (call(m, x) - y0).abs().max() > 1e-3


def test_attention_dropout_is_on_in_train_mode():
    m = build("ResidualMHA", make_cfg(dropout=0.5))
    m.dropouts[0].p = 0.0  # leave only the dropout on the attention weights
    x = rand(B, T, E)
    with torch.no_grad():
        assert (m(x) - m(x)).abs().max() > 1e-3
        m.eval()
        assert torch.equal(m(x), m(x))


def test_encoder_layers_are_independent():
    m = build("Encoder", make_cfg(), num_layers=3)
    a, b = m.layers[0].state_dict(), m.layers[1].state_dict()
    for k in ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear1.bias",
              "linear2.weight", "linear2.bias"):
        assert not torch.equal(a[k], b[k]), k
    # no shared parameters: parameters() deduplicates, so list every registration and
    # compare identities and storage
    named = list(m.named_parameters(remove_duplicate=False))
    assert len(named) == len(m.state_dict()) == 3 * 12  # 12 parameter tensors per layer
    assert len({id(p) for _, p in named}) == len(named)
    assert len({p.data_ptr() for _, p in named}) == len(named)


@pytest.mark.parametrize("norm,final", [("pre", True), ("post", False), ("none", False)])
def test_encoder_final_norm_default(norm, final):
    assert (build("Encoder", make_cfg(norm=norm)).norm is not None) == final
    assert (build("Encoder", make_cfg(norm=norm), final_norm=not final).norm is not None) == (not final)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_encoder_intermediates_are_the_layers_in_sequence(norm):
    m = build("Encoder", make_cfg(norm=norm, causal=True), num_layers=3)
    x = rand(B, T, E)
    kpm = torch.tensor([[False] * 5 + [True], [False] * 6])
    with torch.no_grad():
        y, extra = m(x, None, kpm, return_intermediates=True)
        assert extra["residual"].shape == (3, B, T, E) and extra["attention_weights"].shape == (3, B, H, T, T)
        h = x
        for i, layer in enumerate(m.layers):
            h, w = layer(h, None, kpm, return_intermediates=True)
            torch.testing.assert_close(extra["residual"][i], h, rtol=0, atol=1e-6)
            torch.testing.assert_close(extra["attention_weights"][i], w["attention_weights"], rtol=0, atol=1e-6)
        torch.testing.assert_close(y, m.norm(h) if norm == "pre" else h, rtol=0, atol=1e-6)
        # the default call skips the weights (another attention kernel): equal up to rounding
        torch.testing.assert_close(m(x, None, kpm), y, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------
# Initialisation
# ------------------------------------------------------------------------------------


def check_sample(values, spec, what=""):
    """Entries iid from spec: ("const", c), ("uniform", bound) or ("normal", std)."""
    a = np.asarray(values, dtype=np.float64).ravel()
    kind, v = spec
    if kind == "const":
        assert np.all(a == v), what
        return
    n = a.size
    assert abs(a.mean()) < 4 * v / math.sqrt(n), what
    if kind == "uniform":
        assert np.abs(a).max() <= v * (1 + 1e-6), what
        assert np.abs(a).max() >= v * (1 - 8 / n), what
        assert a.std() == pytest.approx(v / math.sqrt(3), rel=4 / math.sqrt(n)), what
    else:
        assert a.std() == pytest.approx(v, rel=4 / math.sqrt(n)), what
        assert np.abs(a).max() > 2.5 * v, what  # a normal's tails, which a uniform lacks


@pytest.mark.parametrize("scheme", [dict(), dict(init="xavier"), dict(scaling="deepnorm")])
def test_init_distributions_follow_the_spec(scheme):
    cfg = BlockConfig(d_model=64, num_heads=4, d_ff=96, **scheme)
    m = build("TransformerBlock", cfg)
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    for i, spec in enumerate(init_spec(m.cfg, "self_attn.in_proj_weight")):
        check_sample(sd["self_attn.in_proj_weight"][64 * i: 64 * (i + 1)], spec, f"qkv {i}")
    for name in ("self_attn.in_proj_bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias", "linear1.weight",
                 "linear1.bias", "linear2.weight", "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight",
                 "norm2.bias"):
        check_sample(sd[name], init_spec(m.cfg, name), name)


def test_torch_scheme_in_proj_bound():
    w = build("TransformerBlock", BlockConfig(d_model=64, num_heads=4)).self_attn.in_proj_weight
    assert w.abs().max() <= math.sqrt(6 / (4 * 64)) and w.abs().max() > 0.99 * math.sqrt(6 / (4 * 64))


def test_encoder_deepnorm_init_uses_depth():
    cfg = BlockConfig(d_model=64, num_heads=4, d_ff=96, scaling="deepnorm")
    m = build("Encoder", cfg, num_layers=12)
    beta = 96 ** -0.25
    v = m.layers[5].self_attn.in_proj_weight[128:].detach().numpy()
    check_sample(v, ("normal", beta * math.sqrt(1 / 64)))
    check_sample(m.layers[5].linear2.weight.detach().numpy(), ("normal", beta * math.sqrt(2 / 160)))


def test_generator_reproducibility():
    a, b, c = (build("Encoder", make_cfg(), seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.linear1.weight"], c["layers.0.linear1.weight"])


# ------------------------------------------------------------------------------------
# dtypes and unbatched input
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("param_dtype", ["float64", "bfloat16"])
def test_param_dtype(param_dtype):
    dt = TDTYPE[param_dtype]
    m32 = build("Encoder", make_cfg(norm="pre"))
    m = build("Encoder", make_cfg(norm="pre", param_dtype=param_dtype))
    assert all(p.dtype == dt for p in m.parameters()) and all(p.dtype == torch.float32 for p in m32.parameters())
    # same draws, stored in the other dtype
    for (k, p), q in zip(m.state_dict().items(), m32.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q.to(dt), rtol=0, atol=0, msg=k)
    x = rand(B, T, E)
    with torch.no_grad():
        y = m(x.to(dt))
        assert y.dtype == dt
        tol = 1e-5 if param_dtype == "float64" else 0.04  # measured 3.6e-7 and 0.012
        assert 0 < (y.float() - m32(x)).abs().max() < tol


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input(kind):
    m = build(kind, make_cfg(causal=True))
    x = rand(1, T, E)
    with torch.no_grad():
        torch.testing.assert_close(call(m, x[0]), call(m, x)[0], rtol=0, atol=1e-6)
        if kind != "FeedForward":
            y, extra = call(m, x[0], return_intermediates=True)
            _, extra_b = call(m, x, return_intermediates=True)
            for k, v in extra.items():  # the largest logit is one number per layer
                vb = (extra_b[k] if k == "attention_logits_max"
                      else extra_b[k][:, 0] if kind == "Encoder" else extra_b[k][0])
                torch.testing.assert_close(v, vb, rtol=0, atol=1e-6, msg=k)


# ------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(B, T, E + 1), (T, 2 * E), (B, T, E, 1), (E,)])
def test_wrong_width_names_expected_and_actual(kind, shape):
    m = build(kind, make_cfg())
    with pytest.raises(ValueError) as e:
        call(m, torch.zeros(shape))
    assert f"(batch, seq, {E})" in str(e.value) and str(tuple(shape)) in str(e.value)


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_bad_masks(kind):
    m = build(kind, make_cfg())
    x = rand(B, T, E)
    for attn, kpm, exc, fragments in [
        (torch.zeros(T, T + 1, dtype=torch.bool), None, ValueError, ["attn_mask", f"({T}, {T + 1})", f"({T}, {T})"]),
        (torch.zeros(B + 1, T, T, dtype=torch.bool), None, ValueError, ["attn_mask", f"({B + 1}, {T}, {T})"]),
        (None, torch.zeros(B, T + 1, dtype=torch.bool), ValueError,
         ["key_padding_mask", f"({B}, {T + 1})", f"({B}, {T})"]),
        (None, torch.zeros(T, dtype=torch.bool), ValueError, ["key_padding_mask", f"({T},)"]),
        (torch.zeros(T, T, dtype=torch.int32), None, TypeError, ["attn_mask", "torch.int32", "bool", "float"]),
        (None, torch.zeros(B, T, dtype=torch.int64), TypeError, ["key_padding_mask", "torch.int64", "bool"]),
        (torch.zeros(T, T + 1), None, ValueError, ["attn_mask", f"({T}, {T + 1})"]),
    ]:
        with pytest.raises(exc) as e:
            call(m, x, attn, kpm)
        for f in fragments:
            assert f in str(e.value), (f, str(e.value))


# ------------------------------------------------------------------------------------
# Mask conventions: a flax-convention mask (True = may attend), through invert_mask
# ------------------------------------------------------------------------------------

FLAX_MASK = np.array([[True, True, False, True, False, True]] * T)  # flax: keys 2 and 4 are hidden
FLAX_MASK[1] = [True, False, False, False, False, False]


def test_invert_mask_gives_the_flax_meaning_in_torch():
    """The same boolean matrix, read in the flax convention, hides keys 2 and 4; after
    invert_mask torch hides exactly those (flax_blocks checks the other side)."""
    m = build("ResidualMHA", make_cfg())
    m.eval()
    torch_mask = torch.from_numpy(invert_mask(FLAX_MASK))
    assert torch.equal(invert_mask(torch.from_numpy(FLAX_MASK)), torch_mask)
    with torch.no_grad():
        _, extra = m(rand(B, T, E), torch_mask, return_intermediates=True)
    w = extra["attention_weights"].numpy()
    assert np.all(w[..., ~FLAX_MASK] == 0) and np.all(w[..., FLAX_MASK] > 0)
    # and passing the flax mask unconverted means the opposite
    with torch.no_grad():
        _, extra = m(rand(B, T, E), torch.from_numpy(FLAX_MASK), return_intermediates=True)
    assert np.all(extra["attention_weights"].numpy()[..., FLAX_MASK] == 0)


def test_invert_mask_on_torch_tensors():
    kpm = torch.tensor([[True, False], [False, False]])
    assert torch.equal(invert_mask(kpm), ~kpm) and invert_mask(kpm).dtype == torch.bool
    for bad in (kpm.int(), kpm.float()):
        with pytest.raises(TypeError, match="torch"):
            invert_mask(bad)


@pytest.mark.parametrize("kind", ["ResidualMHA", "DecoderBlock"])
def test_parallel_residual_needs_one_attention_and_one_mlp(kind):
    with pytest.raises(ValueError, match="parallel_residual='shared_norm' runs an attention and an MLP side by side"):
        getattr(tb, kind)(BlockConfig(E, H, d_ff=FF, norm="pre", parallel_residual="shared_norm"))
