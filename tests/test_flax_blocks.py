"""flax_blocks on its own: every config option, the option semantics, masks (flax convention:
True = may attend), dropout modes, initialisation, dtypes and bad input (raised at trace time).

Speed: on a small CPU every new XLA program costs a noticeable fraction of a second, and an eager
JAX call compiles each operation the first time it meets a shape and dtype. So the tests share one
set of shapes, do their own arithmetic in numpy, build parameters with "rbg" keys (much cheaper to
compile than threefry), batch the Encoder's paired calls (each eager Encoder call compiles its scan),
and jit the calls in other dtypes (one compile instead of one per operation)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_options import FF, KINDS, MASKED_KINDS, OPTIONS, B, E, H, T, init_spec  # shared with test_torch_blocks.py
from flax import nnx

import flax_blocks as fb
from flax_blocks.core.config import BlockConfig, FullyMaskedWarning, invert_mask

OPTIONS = {
    **OPTIONS,
    "dtype-bfloat16": dict(dtype="bfloat16"),
    "dtype-float32-params-bf16": dict(dtype="float32", param_dtype="bfloat16"),
}
LOW_PRECISION = {"bfloat16", "float16", "dtype-bfloat16", "dtype-float32-params-bf16"}
# ResidualMHA and FeedForward are TransformerBlock's sublayers (the same code): they run the
# float32 options, and TransformerBlock also the low-precision ones. The Encoder runs the options
# that touch what it adds (dtypes through the scan carry, dropout keys per layer, depth-resolved
# scaling); norms, final norm, rezero, deepnorm and causal meet the Encoder in the tests below.
# ("bfloat16" params and "dtype-bfloat16" run in test_bfloat16_params / test_computation_dtype.)
ENCODER_OPTIONS = ["layerscale", "dropout", "float16", "no-bias-pre"]
OPTION_CASES = [(k, o) for k in KINDS for o in OPTIONS if o not in ("bfloat16", "dtype-bfloat16")
                and (o in ENCODER_OPTIONS if k == "Encoder" else k == "TransformerBlock" or o not in LOW_PRECISION)]


def make_cfg(**kw) -> BlockConfig:
    return BlockConfig(**{**dict(d_model=E, num_heads=H, d_ff=FF, dropout=0.0), **kw})


def rngs(seed: int) -> nnx.Rngs:
    """Keys of the "rbg" PRNG (test_seed_reproducibility covers the default nnx.Rngs(int))."""
    return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def build(kind: str, cfg: BlockConfig, seed: int = 0, **kw):
    if kind == "Encoder":
        kw.setdefault("num_layers", 2)
    return getattr(fb, kind)(cfg, rngs=rngs(seed), **kw)


def jbuild(kind: str, cfg: BlockConfig, seed: int = 0, **kw):
    """Built under nnx.jit: one compile, for parameter dtypes the eager kernels have not met."""
    return nnx.jit(lambda: build(kind, cfg, seed, **kw))()


def cast_build(kind: str, cfg: BlockConfig, seed: int = 0):
    """A module of `cfg` (any param_dtype) holding the float32 draws cast to that dtype: no
    compile at all (test_bfloat16_params and test_float64_params draw in the dtype itself)."""
    abstract = nnx.split(nnx.eval_shape(lambda: build(kind, cfg, seed)))
    graphdef, shapes = abstract
    _, values = nnx.split(build(kind, dataclasses.replace(cfg, param_dtype="float32"), seed))

    def cast(a, s):
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key) or a.dtype == s.dtype:
            return a
        return jnp.asarray(np.asarray(a).astype(s.dtype))

    return nnx.merge(graphdef, jax.tree.map(cast, values, shapes))


def rand(*shape, seed=0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def call(m, x, attention_mask=None, key_mask=None, **kw):
    if isinstance(m, fb.FeedForward):
        return m(x, **kw)
    return m(x, attention_mask=attention_mask, key_mask=key_mask, **kw)


def call_pair(m, x, x2, attention_mask=None, key_mask=None):
    """(m(x), m(x2)); one batched call for the Encoder, whose every eager call compiles."""
    if not isinstance(m, fb.Encoder):
        return npy(call(m, x, attention_mask, key_mask)), npy(call(m, x2, attention_mask, key_mask))
    km = None if key_mask is None else np.concatenate([key_mask, key_mask])
    yy = npy(call(m, np.concatenate([x, x2]), attention_mask, km))
    return yy[: len(x)], yy[len(x):]


@nnx.jit
def jcall(m, x):
    return m(x)


def npy(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def diff(a, b) -> float:
    return float(np.abs(npy(a) - npy(b)).max())


def params(m) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): npy(v[...]) for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}


def close(a, b, atol=1e-6):
    np.testing.assert_allclose(npy(a), npy(b), rtol=0, atol=atol)


# ------------------------------------------------------------------------------------
# Every option, every block kind: forward, gradient, shape, dtype
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,option", OPTION_CASES)
def test_every_option_runs(kind, option):
    cfg = make_cfg(**OPTIONS[option])
    pdt = jnp.dtype(cfg.param_dtype)
    m = (cast_build if pdt != jnp.float32 else build)(kind, cfg)
    assert all(v[...].dtype == pdt for _, v in nnx.to_flat_state(nnx.state(m, nnx.Param)))
    out_dt = jnp.dtype(cfg.dtype) if cfg.dtype else jnp.promote_types(jnp.float32, pdt)
    x = rand(B, T, E)
    y = (jcall if option in LOW_PRECISION else call)(m, x)
    assert y.shape == (B, T, E) and y.dtype == out_dt and np.isfinite(npy(y)).all()
    if kind == "Encoder" or option in LOW_PRECISION:
        return  # gradients and eval mode: in float32, and for the Encoder in test_jax_ecosystem
    # nnx.grad (not jax.grad) lets train-mode dropout advance its RNG state inside the trace
    gx = npy(nnx.grad(lambda m, x: jnp.sum(call(m, x) ** 2), argnums=1)(m, x))
    assert np.isfinite(gx).all() and np.abs(gx).sum() > 0
    m.eval()
    y1, y2 = call(m, x), call(m, x)
    assert y1.dtype == out_dt and diff(y1, y2) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_names_and_shapes(kind):
    d = E // H
    layer = {"self_attn/in_kernel": (E, H, 3, d), "self_attn/in_bias": (H, 3, d),
             "self_attn/out_kernel": (H, d, E), "self_attn/out_bias": (E,),
             "linear1/kernel": (E, FF), "linear1/bias": (FF,), "linear2/kernel": (FF, E), "linear2/bias": (E,),
             "norm1/scale": (E,), "norm1/bias": (E,), "norm2/scale": (E,), "norm2/bias": (E,),
             "scale1": (), "scale2": ()}
    expected = {
        "ResidualMHA": {"mha/in_kernel": (E, H, 3, d), "mha/in_bias": (H, 3, d), "mha/out_kernel": (H, d, E),
                        "mha/out_bias": (E,), "norm/scale": (E,), "norm/bias": (E,), "scale": ()},
        "FeedForward": {"linear1/kernel": (E, FF), "linear1/bias": (FF,), "linear2/kernel": (FF, E),
                        "linear2/bias": (E,), "norm/scale": (E,), "norm/bias": (E,), "scale": ()},
        "TransformerBlock": layer,
        "Encoder": {**{f"layers/{k}": (2, *v) for k, v in layer.items()}, "norm/scale": (E,), "norm/bias": (E,)},
    }[kind]
    got = {k: v.shape for k, v in params(build(kind, make_cfg(scaling="rezero", norm="pre"))).items()}
    assert got == expected


def test_no_bias_and_no_norm_parameters():
    assert set(params(build("TransformerBlock", make_cfg(bias=False)))) == {
        "self_attn/in_kernel", "self_attn/out_kernel", "linear1/kernel", "linear2/kernel", "norm1/scale", "norm2/scale"}
    names = set(params(build("TransformerBlock", make_cfg(norm="none"))))
    assert not any(n.startswith("norm") for n in names) and "linear1/bias" in names


# ------------------------------------------------------------------------------------
# Option semantics
# ------------------------------------------------------------------------------------

ACT = {"relu": jax.nn.relu, "gelu": lambda v: jax.nn.gelu(v, approximate=False),
       "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}


def ffn(m, h):
    return m.linear2(ACT[m.cfg.activation](m.linear1(h)))


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
@pytest.mark.parametrize("residual", ["add", "none"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feedforward_formula(norm, residual, activation):
    m = build("FeedForward", make_cfg(norm=norm, residual=residual, activation=activation))
    x = rand(B, T, E)
    ln = m.norm if m.norm is not None else (lambda v: v)
    inner = npy(ffn(m, ln(x) if norm == "pre" else x))
    pre_norm = (inner + x if residual == "add" else inner).astype(np.float32)
    close(m(x), ln(pre_norm) if norm == "post" else pre_norm)


def test_gelu_is_exact_and_gelu_tanh_is_not():
    v = np.linspace(-3, 3, 12, dtype=np.float32)
    exact = 0.5 * v * (1 + np.array([math.erf(t / math.sqrt(2)) for t in v]))
    close(ACT["gelu"](v), exact, atol=1e-6)
    assert diff(ACT["gelu_tanh"](v), exact) > 1e-5
    x = rand(B, T, E)
    a, b = build("FeedForward", make_cfg(activation="gelu")), build("FeedForward", make_cfg(activation="gelu_tanh"))
    assert diff(a(x), b(x)) > 1e-5


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("residual", ["add", "none"])
def test_residual_mha_formula(norm, residual):
    m = build("ResidualMHA", make_cfg(norm=norm, residual=residual))
    x = rand(B, T, E)
    h = m.norm(x) if norm == "pre" else x
    inner = npy(m.mha(h)[0])
    pre_norm = (inner + x if residual == "add" else inner).astype(np.float32)
    close(m(x), m.norm(pre_norm) if norm == "post" else pre_norm)


def test_attention_is_softmax_qk_v():
    """The packed (E, K, G+2, hd) kernel (K = H, G = 1) means per head q, k, v slots; check
    against a plain formula."""
    m = build("ResidualMHA", make_cfg(norm="post"))
    x = rand(B, T, E)
    a = m.mha
    wi, bi, wo, bo = (npy(v[...]) for v in (a.in_kernel, a.in_bias, a.out_kernel, a.out_bias))
    out = np.zeros((B, T, E))
    for h in range(H):
        q, k, v = (x @ wi[:, h, i] + bi[h, i] for i in range(3))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(E // H)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out += (p @ v) @ wo[h]
    close(a(x)[0], out + bo, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_no_skip_pre_ln_block_is_scale_invariant(kind):
    """residual="none": the output is F(LN(x)) and does not contain x, so y(3x) == y(x);
    with the skip path it does not hold."""
    x = rand(B, T, E)
    for residual, same in [("none", True), ("add", False)]:
        m = build(kind, make_cfg(norm="pre", residual=residual, layer_norm_eps=1e-12))
        d = diff(*call_pair(m, x, 3 * x))
        assert (d < 1e-5) == same, (residual, d)


def gates_of(m):
    if isinstance(m, fb.Encoder):
        return [m.layers.scale1, m.layers.scale2]
    return [m.scale1, m.scale2] if isinstance(m, fb.TransformerBlock) else [m.scale]


@pytest.mark.parametrize("kind,norm", [(k, n) for k in KINDS for n in ("none", "pre") if (k, n) != ("Encoder", "pre")])
def test_rezero_is_identity_at_init(kind, norm):
    m = build(kind, make_cfg(scaling="rezero", norm=norm), **({"final_norm": False} if kind == "Encoder" else {}))
    gates = gates_of(m)
    assert all(g[...].shape == ((2,) if kind == "Encoder" else ()) for g in gates)
    assert all((npy(g[...]) == 0).all() for g in gates)
    x = rand(B, T, E)
    assert diff(call(m, x), x) == 0
    for g in gates:
        g[...] = jnp.asarray(np.full(g[...].shape, 0.5, np.float32))
    assert diff(call(m, x), x) > 1e-2


def test_rezero_and_layerscale_gate_the_branch_linearly():
    x = rand(B, T, E)
    for scaling, shape in [("rezero", ()), ("layerscale", (E,))]:
        m = build("FeedForward", make_cfg(scaling=scaling, norm="pre"))
        assert m.scale[...].shape == shape
        m.scale[...] = jnp.asarray(np.ones(shape, np.float32))
        branch = npy(m(x)) - x
        g = np.linspace(-1.0, 2.0, E, dtype=np.float32) if shape else np.float32(0.7)
        m.scale[...] = jnp.asarray(g)
        close(npy(m(x)) - x, g * branch)


@pytest.mark.parametrize("num_layers,eps", [(1, 0.1), (2, 0.1)])
def test_layerscale_gate_values(num_layers, eps):
    cfg = make_cfg(scaling="layerscale", norm="pre")
    if num_layers == 1:
        m = build("TransformerBlock", cfg)
        gates, shape = [m.scale1, m.scale2], (E,)
    else:
        m = build("Encoder", cfg, num_layers=num_layers)
        gates, shape = [m.layers.scale1, m.layers.scale2], (num_layers, E)
    for g in gates:
        assert g[...].shape == shape and (np.asarray(g[...]) == np.float32(eps)).all()


@pytest.mark.parametrize("num_layers,eps", [(20, 1e-5), (26, 1e-6)])
def test_deep_encoder_resolves_layerscale_for_its_depth(num_layers, eps):
    # abstract construction (no arrays): the layers are built from the depth-resolved config,
    # whose gate value test_layerscale_gate_values shows is what the gates hold
    cfg = make_cfg(scaling="layerscale", norm="pre")
    enc = nnx.eval_shape(lambda: fb.Encoder(cfg, num_layers=num_layers, rngs=rngs(0)))
    assert enc.cfg.layerscale_init == eps and enc.layers.cfg.layerscale_init == eps
    assert enc.layers.scale1.get_value().shape == (num_layers, E)


def layer_at(enc, i: int):
    """Layer i of an Encoder's stacked layers, as a standalone TransformerBlock."""
    graphdef, state = nnx.split(enc.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def test_deepnorm_uses_alpha():
    m = build("FeedForward", make_cfg(scaling="deepnorm"))
    alpha = 2 ** 0.25
    assert m.cfg.deepnorm_alpha == pytest.approx(alpha)
    x = rand(B, T, E)
    close(m(x), m.norm((alpha * x + npy(ffn(m, x))).astype(np.float32)))
    assert diff(m(x), m.norm((x + npy(ffn(m, x))).astype(np.float32))) > 1e-3
    enc = build("Encoder", make_cfg(scaling="deepnorm"), num_layers=2)
    assert enc.cfg.residual_alpha == pytest.approx(4 ** 0.25)
    assert enc.cfg.deepnorm_beta == pytest.approx(16 ** -0.25)
    # the stacked layers use the depth's alpha (not a single block's 2^(1/4)): layer 0 by hand
    layer = layer_at(enc, 0)
    assert layer.cfg.residual_alpha == pytest.approx(4 ** 0.25)
    a = 4 ** 0.25
    h = layer.norm1((a * x + npy(layer.self_attn(x)[0])).astype(np.float32))
    want = layer.norm2((a * npy(h) + npy(ffn(layer, h))).astype(np.float32))
    close(layer(x), want, atol=1e-5)
    _, extra = enc(x, return_intermediates=True)
    close(extra["residual"][0], want, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_post_ln_rows_are_normalised(kind):
    x = 3 * rand(B, T, E) + 1
    y = npy(call(build(kind, make_cfg(norm="post")), x))
    close(y.mean(-1), np.zeros((B, T)), atol=1e-5)
    close(y.var(-1), np.ones((B, T)), atol=1e-4)
    y = npy(call(build(kind, make_cfg(norm="pre"), **({"final_norm": False} if kind == "Encoder" else {})), x))
    assert np.abs(y.var(-1) - 1).max() > 0.1  # pre-LN output is not normalised


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_causal(kind):
    x = rand(B, T, E)
    x2 = x.copy()
    x2[:, 4:] += rand(B, T - 4, E, seed=1)  # the future changed
    out = {}
    for causal in (True, False):
        m = build(kind, make_cfg(causal=causal))
        out[causal] = y, y2 = call_pair(m, x, x2)
        early = diff(y[:, :4], y2[:, :4])
        assert (early == 0.0) == causal, early
        assert diff(y[:, 4:], y2[:, 4:]) > 1e-3
    # an explicit causal mask (True = may attend) means the same as the flag
    close(call(m, x, np.tril(np.ones((T, T), bool))), out[True][0], atol=0)


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_key_mask(kind):
    key_mask = np.array([[True] * 4 + [False] * 2, [True] * 6])  # True = real token
    x = rand(B, T, E)
    x2 = x.copy()
    x2[0, 4:] += 5 * rand(2, E, seed=1)  # change only the padded tokens
    m = build(kind, make_cfg())
    y, y2 = call_pair(m, x, x2, key_mask=key_mask)
    assert diff(y[0, :4], y2[0, :4]) == 0 and diff(y[1], y2[1]) == 0
    y, y2 = call_pair(m, x, x2)
    assert diff(y[0, :4], y2[0, :4]) > 1e-3  # without the mask they do matter


def test_attention_weights():
    m = build("TransformerBlock", make_cfg(causal=True, dropout=0.5))
    m.eval()
    attn = np.ones((B, T, T), bool)
    attn[1, :, 2] = False  # batch 1: nobody may attend to key 2
    key_mask = np.ones((B, T), bool)
    key_mask[0, 5] = False
    _, extra = m(rand(B, T, E), attention_mask=attn, key_mask=key_mask, return_intermediates=True)
    w = npy(extra["attention_weights"])
    assert w.shape == (B, H, T, T)
    close(w.sum(-1), np.ones((B, H, T)))
    allowed = np.tril(np.ones((T, T), bool)) & attn & key_mask[:, None, :]
    allowed = np.broadcast_to(allowed[:, None], w.shape)
    assert np.all(w[~allowed] == 0) and np.all(w[allowed] > 0)


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_fully_masked_rows(kind):
    """Rows with no key: zero attention output and weights (not uniform, not NaN), finite gradients."""
    m = build(kind, make_cfg(norm="pre"), **({"final_norm": False} if kind == "Encoder" else {}))
    attn = np.ones((T, T), bool)
    attn[3] = False  # query 3 may attend to nothing
    key_mask = np.ones((B, T), bool)
    key_mask[1] = False  # batch 1: every key is padding
    x = rand(B, T, E)
    with pytest.warns(FullyMaskedWarning, match=r"some batch elements have no key.*padded element.*invert_mask"):
        y, extra = call(m, x, attn, key_mask, return_intermediates=True)  # eager: the convention check warns
    y = npy(y)
    assert np.isfinite(y).all()
    w = npy(extra["attention_weights"])
    w0 = w[0] if kind == "Encoder" else w
    assert np.all(w0[1] == 0) and np.all(w0[0, :, 3] == 0)
    close(w0[0, :, 2].sum(-1), np.ones(H))
    if kind == "ResidualMHA":  # pre-LN: x + 0 on the rows without keys
        assert diff(y[1], x[1]) == 0 and diff(y[0, 3], x[0, 3]) == 0
        assert diff(y[0, 2], x[0, 2]) > 0
    if kind == "Encoder":
        return  # the same attention; its gradients are checked on the blocks (an Encoder grad compiles a scan)
    r = rand(B, T, E, seed=5)
    gs, gx = nnx.grad(lambda m, x: jnp.sum(call(m, x, attn, key_mask) * r), argnums=(0, 1))(m, x)
    assert np.isfinite(npy(gx)).all()
    for path, g in nnx.to_flat_state(gs):
        assert np.isfinite(npy(g[...])).all(), path


@pytest.mark.parametrize("kind", ["ResidualMHA", "FeedForward", "TransformerBlock"])  # Encoder: test_jax_ecosystem
def test_dropout_train_and_eval(kind):
    x = np.concatenate([rand(1, T, E)] * 2)  # two copies: train-mode dropout treats them differently
    m = build(kind, make_cfg(dropout=0.3))
    ref = build(kind, make_cfg(dropout=0.0))  # same seed: same parameters
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(m, nnx.Param)), nnx.to_flat_state(nnx.state(ref, nnx.Param)),
                              strict=True):
        assert diff(a[...], b[...]) == 0, p
    y, y0 = npy(call(m, x)), npy(call(ref, x))
    assert diff(y[0], y[1]) > 1e-3 and diff(y, y0) > 1e-3 and diff(y0[0], y0[1]) == 0
    m.eval()
    close(call(m, x), y0, atol=0)
    m.train()
    y2 = call(m, x)  # the RNG advanced: new masks
    assert diff(y2, y) > 1e-3 and diff(y2, y0) > 1e-3
    assert diff(call(build(kind, make_cfg(dropout=0.3)), x), y) == 0  # same seed, same masks


def test_attention_dropout_is_on_in_train_mode():
    m = build("ResidualMHA", make_cfg(dropout=0.5))
    m.dropouts[0].rate = 0.0  # leave only the dropout on the attention weights
    x = rand(B, T, E)
    assert diff(m(x), m(x)) > 1e-3
    m.eval()
    assert diff(m(x), m(x)) == 0


def test_encoder_layers_are_independent():
    p = params(build("Encoder", make_cfg()))
    for k in ("self_attn/in_kernel", "self_attn/out_kernel", "linear1/kernel", "linear1/bias",
              "linear2/kernel", "linear2/bias"):
        a = p[f"layers/{k}"]
        assert a.shape[0] == 2 and not np.array_equal(a[0], a[1]), k


@pytest.mark.parametrize("norm,final", [("pre", True), ("post", False), ("none", False)])
def test_encoder_final_norm_default(norm, final):
    assert (build("Encoder", make_cfg(norm=norm)).norm is not None) == final
    assert (build("Encoder", make_cfg(norm=norm), final_norm=not final).norm is not None) == (not final)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_encoder_is_the_layers_in_sequence(norm):
    m = build("Encoder", make_cfg(norm=norm, causal=True))
    x = rand(B, T, E)
    key_mask = np.array([[True] * 5 + [False], [True] * 6])
    y, extra = m(x, key_mask=key_mask, return_intermediates=True)
    assert extra["residual"].shape == (2, B, T, E) and extra["attention_weights"].shape == (2, B, H, T, T)
    h = x
    for i in range(2):
        h, w = layer_at(m, i)(h, key_mask=key_mask, return_intermediates=True)
        close(extra["residual"][i], h)
        close(extra["attention_weights"][i], w["attention_weights"])
    close(y, m.norm(h) if norm == "pre" else h)
    close(m(x, key_mask=key_mask), y, atol=0)


def test_eager_encoder_call_reuses_its_compiled_scan():
    """A second eager call (same config and shapes, any weights or inputs) compiles nothing."""
    m, m2 = build("Encoder", make_cfg(causal=True)), build("Encoder", make_cfg(causal=True), seed=1)
    m(rand(B, T, E))
    events = []

    def listener(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        m(rand(B, T, E, seed=1))
        m2(rand(B, T, E, seed=2))
        assert events == []
        m(rand(B + 1, T, E))  # a new shape does compile: the listener sees compiles
        assert events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# ------------------------------------------------------------------------------------
# Initialisation
# ------------------------------------------------------------------------------------


def check_sample(values, spec, what=""):
    """Entries iid from spec: ("const", c), ("uniform", bound) or ("normal", std)."""
    a = npy(values).ravel()
    kind, v = spec
    if kind == "const":
        assert np.all(a == np.float32(v)), what
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
    p = params(m)
    assert p["self_attn/in_kernel"].shape == (64, 4, 3, 16)  # (E, K, G+2, hd), K = H = 4, G = 1
    for i, spec in enumerate(init_spec(m.cfg, "self_attn.in_proj_weight")):
        check_sample(p["self_attn/in_kernel"][:, :, i], spec, f"qkv {i}")
    torch_names = {"self_attn/in_bias": "self_attn.in_proj_bias", "self_attn/out_kernel": "self_attn.out_proj.weight",
                   "self_attn/out_bias": "self_attn.out_proj.bias", "linear1/kernel": "linear1.weight",
                   "linear1/bias": "linear1.bias", "linear2/kernel": "linear2.weight", "linear2/bias": "linear2.bias",
                   "norm1/scale": "norm1.weight", "norm1/bias": "norm1.bias", "norm2/scale": "norm2.weight",
                   "norm2/bias": "norm2.bias"}
    for name, torch_name in torch_names.items():
        check_sample(p[name], init_spec(m.cfg, torch_name), name)


def test_torch_scheme_in_proj_bound():
    w = params(build("TransformerBlock", BlockConfig(d_model=64, num_heads=4)))["self_attn/in_kernel"]
    bound = math.sqrt(6 / (4 * 64))
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound


def test_encoder_deepnorm_init_uses_depth():
    """The layers are drawn with the gain beta of the stack's depth ((8*2)^(-1/4) = 0.5 here),
    not a single block's (8^(-1/4) = 0.59): pool every beta-gain weight, scaled to unit std."""
    p = params(build("Encoder", make_cfg(scaling="deepnorm")))
    cfg2, cfg1 = make_cfg(scaling="deepnorm").resolve(2), make_cfg(scaling="deepnorm").resolve(1)
    pooled = {}
    for c in (cfg1, cfg2):
        parts = [p["layers/self_attn/in_kernel"][:, :, :, 2] / init_spec(c, "self_attn.in_proj_weight")[2][1],
                 p["layers/self_attn/out_kernel"] / init_spec(c, "self_attn.out_proj.weight")[1],
                 p["layers/linear1/kernel"] / init_spec(c, "linear1.weight")[1],
                 p["layers/linear2/kernel"] / init_spec(c, "linear2.weight")[1]]
        pooled[c] = np.concatenate([a.ravel() for a in parts])
    assert pooled[cfg2].size > 1500
    assert pooled[cfg2].std() == pytest.approx(1.0, rel=0.06)
    assert pooled[cfg1].std() < 0.9  # the single-block gain would not fit
    q = p["layers/self_attn/in_kernel"][:, :, :, 0] / init_spec(cfg2, "self_attn.in_proj_weight")[0][1]  # q: gain 1
    assert q.std() == pytest.approx(1.0, rel=0.15)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pooled_draws_are_exact_size_draws(dtype):
    """Construction draws from pools of rounded-up sizes (one compiled program per size, shared
    across configs): each value must be the one an exact-size draw gives, or every parameter
    would depend on how the sizes round. A pool that started elsewhere in the stream (the
    mistake: an offset) is caught."""
    from flax_blocks import layers

    key = jax.random.key(3)
    for n in (1, 1000):
        size = layers._bucket(n)
        assert n <= size <= max(256, 1.25 * n)
        for kind, exact in (("uniform", lambda k, m: jax.random.uniform(k, (m,), dtype, -1.0, 1.0)),
                            ("normal", lambda k, m: jax.random.normal(k, (m,), dtype))):
            pool = layers._pool(key, kind, size, jnp.dtype(dtype))
            np.testing.assert_array_equal(np.asarray(pool[:n], np.float32), np.asarray(exact(key, n), np.float32))
            if n > 1:
                assert not np.array_equal(np.asarray(pool[1:n + 1], np.float32), np.asarray(exact(key, n), np.float32))


def test_seed_reproducibility():
    a, b, c = (params(build("Encoder", make_cfg(), seed=s)) for s in (0, 0, 1))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["layers/linear1/kernel"], c["layers/linear1/kernel"])
    # the default key type (threefry) of nnx.Rngs(int), as users write it
    d, e = (fb.FeedForward(make_cfg(), rngs=nnx.Rngs(s)) for s in (0, 0))
    x = rand(B, T, E)
    assert diff(d(x), e(x)) == 0
    check_sample(params(d)["linear1/kernel"], init_spec(d.cfg, "linear1.weight"))


# ------------------------------------------------------------------------------------
# dtypes and unbatched input
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["TransformerBlock"])  # (holds the other blocks' sublayers)
def test_float64_params(kind):
    x = rand(B, T, E)
    with jax.enable_x64(True):
        m = jbuild(kind, make_cfg(param_dtype="float64", norm="pre"))
        p64 = nnx.state(m, nnx.Param)
        assert all(v[...].dtype == jnp.float64 for _, v in nnx.to_flat_state(p64))
        y = jcall(m, x.astype(np.float64))
        assert y.dtype == jnp.float64
        assert jcall(m, x).dtype == jnp.float64  # promoted with the parameters
        p32 = jax.tree.map(lambda a: np.asarray(a, np.float32), p64)
    # computed in float64: close to, but not, the float32 result with the same parameters
    m32 = build(kind, make_cfg(norm="pre"))
    nnx.update(m32, p32)
    assert 0 < diff(y, call(m32, x)) < 1e-4


@pytest.mark.parametrize("kind", ["TransformerBlock"])  # Encoder: the "float16" option above
def test_bfloat16_params(kind):
    m = jbuild(kind, make_cfg(param_dtype="bfloat16", norm="pre"))
    p = params(m)
    bounds = {"in_kernel": init_spec(m.cfg, "self_attn.in_proj_weight")[0][1],
              "linear1/kernel": init_spec(m.cfg, "linear1.weight")[1]}
    checked = 0
    for name, a in p.items():  # drawn in bfloat16 from the same distribution
        for suffix, bound in bounds.items():
            if name.endswith(suffix):
                assert bound * 0.8 < np.abs(a).max() <= bound * 1.01, name
                checked += 1
    assert checked == 2
    x = rand(B, T, E)
    y = jcall(m, jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    m32 = build(kind, make_cfg(norm="pre"))  # the same (rounded) parameters in float32
    nnx.update(m32, jax.tree.map(lambda a: np.asarray(a).astype(np.float32), nnx.state(m, nnx.Param)))
    assert 0 < diff(y, call(m32, x)) < 0.04  # measured 0.013 (bfloat16 keeps 8 bits of mantissa)


@pytest.mark.parametrize("kind", ["TransformerBlock", "Encoder"])
def test_computation_dtype(kind):
    """dtype="bfloat16": computed and returned in bfloat16 from float32 parameters and input."""
    m = build(kind, make_cfg(dtype="bfloat16", norm="post"))
    assert all(v[...].dtype == jnp.float32 for _, v in nnx.to_flat_state(nnx.state(m, nnx.Param)))
    x = rand(B, T, E)
    y = jcall(m, x)
    assert y.dtype == jnp.bfloat16
    m32 = build(kind, make_cfg(norm="post"))
    assert 0 < diff(y, call(m32, x)) < 0.04  # measured 0.008 (block), 0.010 (Encoder)
    if kind == "Encoder":  # dtype None: a bfloat16 input is promoted with the float32 parameters,
        assert jcall(m32, jnp.asarray(x, jnp.bfloat16)).dtype == jnp.float32  # through the scan carry


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input(kind):
    m = build(kind, make_cfg(causal=True))
    x = rand(1, T, E)
    if kind == "FeedForward":
        close(m(x[0]), m(x)[0])
        return
    if kind == "TransformerBlock":  # batch of one with a key mask; unbatched x takes a (1, T) key mask
        key_mask = np.array([[True, False, True, True, True, True]])
        y = call(m, x, key_mask=key_mask)
        close(y[0], call(m, x[0], key_mask=key_mask))
        x2 = x.copy()
        x2[0, 1] += 1.0  # a padded key, visible (causally) to positions 2..5 but for the mask
        close(call(m, x2, key_mask=key_mask)[0, 2:], y[0, 2:], atol=0)
        assert diff(call(m, x2)[0, 2:], call(m, x)[0, 2:]) > 1e-3
    y, extra = call(m, x[0], return_intermediates=True)
    y_b, extra_b = call(m, x, return_intermediates=True)
    close(y, y_b[0])
    if kind != "Encoder":  # (each eager Encoder call compiles)
        close(call(m, x[0]), y_b[0])
    for k, v in extra.items():  # the largest logit is one number per layer
        close(v, extra_b[k] if k == "attention_logits_max"
              else extra_b[k][:, 0] if kind == "Encoder" else extra_b[k][0])


# ------------------------------------------------------------------------------------
# Bad input: raised at trace time, before XLA
# ------------------------------------------------------------------------------------


def traced(m, *args, **kw):
    """Trace (not run) the module's call under jax.jit, with abstract inputs."""
    graphdef, state = nnx.split(m)
    f = jax.jit(lambda state, *a: call(nnx.merge(graphdef, state), *a, **kw))
    abstract = [None if a is None else jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    return f.trace(state, *abstract)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(B, T, E + 1), (T, 2 * E), (B, T, E, 1), (E,)])
def test_wrong_width_names_expected_and_actual(kind, shape):
    m = build(kind, make_cfg())
    for run in (lambda: call(m, np.zeros(shape, np.float32)), lambda: traced(m, np.zeros(shape, np.float32))):
        with pytest.raises(ValueError) as e:
            run()
        assert f"(batch, seq, {E})" in str(e.value) and str(tuple(shape)) in str(e.value)


def test_trace_helper_traces_good_input():
    traced(build("Encoder", make_cfg()), np.zeros((B, T, E), np.float32), None, np.ones((B, T), bool))


@pytest.mark.parametrize("kind", MASKED_KINDS)
def test_bad_masks(kind):
    m = build(kind, make_cfg())
    x = np.zeros((B, T, E), np.float32)
    additive = np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf).astype(np.float32)  # torch's float mask
    for attn, key_mask, exc, fragments in [
        (np.ones((T, T + 1), bool), None, ValueError, ["attention_mask", f"({T}, {T + 1})", f"({T}, {T})"]),
        (np.ones((B + 1, T, T), bool), None, ValueError, ["attention_mask", f"({B + 1}, {T}, {T})"]),
        (None, np.ones((B, T + 1), bool), ValueError, ["key_mask", f"({B}, {T + 1})", f"({B}, {T})"]),
        (None, np.ones((T,), bool), ValueError, ["key_mask", f"({T},)"]),
        (np.ones((T, T), np.complex64), None, TypeError, ["attention_mask", "complex64", "bool", "0 / 1"]),
        (None, np.ones((B, T), np.complex64), TypeError, ["key_mask", "complex64", "bool"]),
        # numbers other than 0 / 1: refused where the values are known (eagerly; traced: read as mask > 0)
        (additive, None, ValueError, ["attention_mask", "float32", "-inf", "additive", "mask == 0"]),
        (None, np.full((B, T), 2, np.int32), ValueError, ["key_mask", "int32", "[2]", "1 (may attend) and 0"]),
    ]:
        runs = [lambda attn=attn, key_mask=key_mask: call(m, x, attn, key_mask)]
        if "additive" not in fragments and "[2]" not in fragments:  # shapes and dtypes: traced too
            runs.append(lambda attn=attn, key_mask=key_mask: traced(m, x, attn, key_mask))
        for run in runs:
            with pytest.raises(exc) as e:
                run()
            for f in fragments:
                assert f in str(e.value), (f, str(e.value))


# ------------------------------------------------------------------------------------
# Mask conventions: flax mask m (True = may attend) and invert_mask
# ------------------------------------------------------------------------------------

FLAX_MASK = np.array([[True, True, False, True, False, True]] * T)  # keys 2 and 4 are hidden
FLAX_MASK[1] = [True, False, False, False, False, False]


def test_flax_mask_means_may_attend_and_invert_mask_converts():
    """Same matrix as in test_torch_blocks: here used as is, there through invert_mask; both
    sides hide exactly the keys where it is False."""
    m = build("ResidualMHA", make_cfg())
    x = rand(B, T, E)
    _, extra = m(x, attention_mask=FLAX_MASK, return_intermediates=True)
    w = npy(extra["attention_weights"])
    assert np.all(w[..., ~FLAX_MASK] == 0) and np.all(w[..., FLAX_MASK] > 0)
    torch_convention = invert_mask(FLAX_MASK)  # what a torch user would pass to torch_blocks
    back = invert_mask(jnp.asarray(torch_convention))
    assert back.dtype == jnp.bool_ and np.array_equal(np.asarray(back), FLAX_MASK)
    _, extra2 = m(x, attention_mask=back, return_intermediates=True)
    close(extra2["attention_weights"], w, atol=0)
    _, extra3 = m(x, attention_mask=torch_convention, return_intermediates=True)  # unconverted: the opposite
    assert np.all(npy(extra3["attention_weights"])[..., FLAX_MASK] == 0)
    for bad in (jnp.asarray(FLAX_MASK, jnp.int32), jnp.asarray(FLAX_MASK, jnp.float32)):
        with pytest.raises(TypeError, match="boolean"):
            invert_mask(bad)


@pytest.mark.parametrize("kind", ["ResidualMHA", "FeedForward", "DecoderBlock"])
def test_parallel_residual_needs_one_attention_and_one_mlp(kind):
    with pytest.raises(ValueError, match="parallel_residual='two_norms' runs an attention and an MLP side by side"):
        getattr(fb, kind)(BlockConfig(E, H, d_ff=FF, norm="pre", parallel_residual="two_norms"), rngs=nnx.Rngs(0))
