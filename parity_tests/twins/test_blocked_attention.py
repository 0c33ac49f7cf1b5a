"""The attention paths, chosen statically by BlockConfig.attention ("auto", "dense",
"blocked", "fused"): each forced path equals the dense one (blocked in float64 with small
blocks, fused in float32), forward and gradients; "auto" resolves from static facts only
(jit, jax.export with a symbolic length); forced paths refuse calls they cannot serve, on
both sides alike; the memory the blocked path saves at T = 8192. Parity with the torch
twin of each forced path runs in the matrix (cases.py, test_forward_grad.py)."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_blocks as fb
import flax_blocks.attention as fa
import flax_blocks.flash as fl
import torch_blocks as tb
from flax_blocks.core.config import FullyMaskedWarning

from .cases import BASE, LLAMA
from .harness import TOL, precision

T = 9  # not a multiple of the blocks below


def _inputs(cfg, batch=2, seq=T, seed=0):
    kx, kr = jax.random.split(jax.random.key(seed))
    dt = jnp.dtype(cfg.param_dtype)
    keys = np.ones((batch, seq), bool)
    keys[1, seq - 3:] = False  # padding
    keys[0, :2] = False  # causal: queries 0 and 1 of sequence 0 see no key
    return (jax.random.normal(kx, (batch, seq, cfg.d_model), dt), jax.random.normal(kr, (batch, seq, cfg.d_model), dt),
            keys)


def _forward_and_grads(module, x, r, keys):
    """y and the gradients of sum(y * r) with respect to the parameters and x."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params, x):
        y = nnx.merge(graphdef, params, rest)(x, key_mask=keys)
        return jnp.sum(y * r), y

    (gp, gx), y = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, jax.tree.leaves(gp) + [gx]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


PATH_CASES = [  # (kind, cfg, path, dtype)
    ("TransformerBlock", replace(LLAMA, norm="peri"), "blocked", "float64"),
    ("Encoder", replace(BASE, causal=True), "blocked", "float64"),
    # Llama 4's chunks of 3 (layer 2 unchunked), sequence 0 left-padded by 2: chunks from its first real key
    ("Encoder", replace(LLAMA, attention_chunk_size=3, unchunked_layers=(1,)), "blocked", "float64"),
    ("TransformerBlock", LLAMA, "fused", "float32"),
    ("Encoder", replace(BASE, causal=True), "fused", "float32"),
]


@pytest.mark.parametrize(("kind", "cfg", "path", "dtype"), PATH_CASES,
                         ids=[f"{k}-{p}-{d}" for k, _, p, d in PATH_CASES])
def test_forced_path_equals_dense_forward_and_gradients(kind, cfg, path, dtype):
    """Blocks of 2 or 4 keys (T = 9) in float64 within the parity tolerances; the fused
    path (float32 softmax) in float32."""
    with precision(dtype):
        cfg = replace(cfg, param_dtype=dtype)
        kw = {"num_layers": 2} if kind == "Encoder" else {}
        x, r, keys = _inputs(cfg)
        dense = getattr(fb, kind)(replace(cfg, attention="dense"), rngs=nnx.Rngs(0), **kw)
        y0, g0 = _forward_and_grads(dense, x, r, keys)
        for block in (((2,) if kind == "Encoder" else (4,)) if path == "blocked" else (512,)):
            forced = getattr(fb, kind)(replace(cfg, attention=path, attention_block=block), rngs=nnx.Rngs(0), **kw)
            y, g = _forward_and_grads(forced, x, r, keys)
            assert _rel(y, y0) <= TOL["forward", dtype], (block, _rel(y, y0))
            worst = max(_rel(a, b) for a, b in zip(g, g0, strict=True))
            assert worst <= TOL["grad", dtype], (block, worst)


def _softmax_attention(q, k, v, allowed):
    """numpy float64 reference: q (B, T, K, G, hd), k / v (B, S, K, hd), allowed (T, S)."""
    logits = np.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(allowed, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w = np.nan_to_num(w / w.sum(-1, keepdims=True))  # rows without a key: 0
    return np.einsum("bkgts,bskd->btkgd", w, v)


def _dense_attention_jax(q, k, v, allowed):
    """jax float64 reference with finite gradients: allowed (B, T, S); rows without a key give 0."""
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(q.shape[-1])
    mask = allowed[:, None, None]
    w = jax.nn.softmax(jnp.where(mask, logits, -1e300), axis=-1)
    w = jnp.where(mask.any(-1, keepdims=True), w, 0.0)
    return jnp.einsum("bkgts,bskd->btkgd", w, v)


def _flash_inputs(rng, seq=T):
    q, r = rng.normal(size=(2, 2, seq, 2, 2, 4))  # (B, T, K, G=2, hd): grouped-query heads
    k, v = rng.normal(size=(2, 2, seq, 2, 4))
    keys = np.ones((2, seq), bool)
    keys[0, :2] = False  # causal: queries 0 and 1 of sequence 0 see no key
    keys[1, seq - 3:] = False  # padding
    return tuple(map(jnp.asarray, (q, k, v, r))), jnp.asarray(keys)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_gradients_equal_the_dense_softmax(causal):
    """blocked_attention's custom VJP (blocks of 4, T = 9, GQA with G = 2, a key mask that
    leaves two causal rows without any key) against autodiff through the dense softmax in
    float64: the output and dq, dk, dv within 1e-12, all finite."""
    with jax.enable_x64(True):
        (q, k, v, r), keys = _flash_inputs(np.random.default_rng(1))
        allowed = keys[:, None, :] & (np.tri(T, dtype=bool) if causal else np.ones((T, T), bool))

        def loss(f):
            return lambda q, k, v: jnp.sum(f(q, k, v) * r)

        flash = lambda q, k, v: fl.blocked_attention(q, k, v, causal=causal, key_valid=keys, block=4)[0]  # noqa: E731
        dense = lambda q, k, v: _dense_attention_jax(q, k, v, allowed)  # noqa: E731
        assert _rel(flash(q, k, v), dense(q, k, v)) <= 1e-12
        got = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
        want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(got, want, strict=True):
            assert np.isfinite(np.asarray(a)).all()
            assert _rel(a, b) <= 1e-12
        _, has_key = fl.blocked_attention(q, k, v, causal=causal, key_valid=keys, block=4)
        np.testing.assert_array_equal(has_key, np.asarray(allowed).any(-1))


def test_flash_negative_twins_would_show():
    """The tolerance above tells the FlashAttention-2 backward from one without its
    D = rowsum(dO * O) term, and the causal pair list from one that skips the diagonal
    block; and the causal pair list visits no block wholly above the diagonal."""
    with jax.enable_x64(True):
        (q, k, v, r), keys = _flash_inputs(np.random.default_rng(2), seq=8)
        allowed = keys[:, None, :] & np.tri(8, dtype=bool)
        dq_dense = jax.grad(lambda q: jnp.sum(_dense_attention_jax(q, k, v, allowed) * r))(q)
        # in the blocked layout of blocked_attention (T = 8, blocks of 4: no padding)
        rows = lambda a: a.reshape(2, 2, 4, 2, 2, 4).transpose(1, 0, 3, 4, 2, 5).reshape(2, 2, 2, 8, 4)  # noqa: E731
        qb = rows(q)  # (nq, B, K, G * bq, hd)
        kb, vb = (a.reshape(2, 2, 4, 2, 4).transpose(1, 0, 3, 2, 4) for a in (k, v))
        validb = keys.reshape(2, 2, 4).swapaxes(0, 1)
        rb = rows(r)
        static = (True, 4, 4 ** -0.5, None, None, False)  # causal, bq, scale, softcap, window, skip
        out, res = fl._flash_fwd(qb, kb, vb, validb, jnp.asarray(True), *static)
        unblock = lambda a: a.reshape(2, 2, 2, 2, 4, 4).transpose(1, 0, 4, 2, 3, 5).reshape(q.shape)  # noqa: E731
        dq = unblock(fl._flash_bwd(*static, res, rb)[0])
        assert _rel(dq, dq_dense) <= 1e-12
        no_d = unblock(fl._flash_bwd(*static, res[:5] + (jnp.zeros_like(out), *res[6:]), rb)[0])  # D = 0
        assert _rel(no_d, dq_dense) > 1e-3

        i, j = fl._block_pairs(4, 4, 4, 4, causal=True)
        assert (j <= i).all() and len(i) == 4 * 5 // 2  # blocks above the diagonal: never visited
        # a sliding window of 3 over blocks of 2: exactly the block pairs holding a pair q - 3 < k <= q
        i, j = fl._block_pairs(4, 4, 2, 2, causal=True, window=3)
        want = {(a // 2, b // 2) for a in range(8) for b in range(8) if a - 3 < b <= a}
        assert set(zip(i.tolist(), j.tolist(), strict=True)) == want and (3, 0) not in want
        off_by_one = lambda *a, **kw: tuple(x[j < i] for x in (i, j))  # noqa: E731, ARG005
        real = fl._block_pairs
        try:
            fl._block_pairs = off_by_one
            skipped = fl.blocked_attention(q, k, v, causal=True, key_valid=keys, block=4)[0]
        finally:
            fl._block_pairs = real
        assert _rel(skipped, _dense_attention_jax(q, k, v, allowed)) > 1e-3


@pytest.mark.parametrize("window", [None, 5])
def test_unmasked_block_pairs_hold_only_allowed_positions(window):
    """The pairs the flash path runs without position masks (`_pair_groups`' first group) hold
    only allowed (query, key) pairs, every allowed pair is in some visited block, and a
    grouping that drops the masks from the diagonal blocks is caught by the float64
    tolerance (with no key mask, so that only the position masks stand between a query and
    its future)."""
    nq = nk = 4
    bq = bk = 2
    groups = fl._pair_groups(nq, nk, bq, bk, True, window, skip=window is not None)
    seen = set()
    for i, j, masked in groups:
        for a, b in zip(i.tolist(), j.tolist(), strict=True):
            pairs = {(q, kk) for q in range(a * bq, a * bq + bq) for kk in range(b * bk, b * bk + bk)}
            allowed = {(q, kk) for q, kk in pairs if kk <= q and (window is None or kk > q - window)}
            assert masked or pairs == allowed, (a, b)
            seen |= allowed
    assert seen == {(q, kk) for q in range(8) for kk in range(8) if kk <= q and (window is None or kk > q - window)}
    assert any(not m for *_, m in groups) and any(m for *_, m in groups)  # both groups are exercised

    with jax.enable_x64(True):
        (q, k, v, _), _ = _flash_inputs(np.random.default_rng(3), seq=8)
        allowed = np.tri(8, dtype=bool) if window is None else np.tri(8, dtype=bool) & ~np.tri(8, k=-window, dtype=bool)
        want = _dense_attention_jax(q, k, v, np.broadcast_to(allowed, (2, 8, 8)))
        got = fl.blocked_attention(q, k, v, causal=True, key_valid=None, block=2, window=window)[0]
        assert _rel(got, want) <= 1e-12
        real = fl._pair_groups
        unmasked = lambda *a: [(i, j, False) for i, j, _ in real(*a)]  # noqa: E731
        with mock.patch.object(fl, "_pair_groups", unmasked):
            wrong = fl.blocked_attention(q, k, v, causal=True, key_valid=None, block=2, window=window)[0]
        assert _rel(wrong, want) > 1e-3


def test_a_wrong_causal_comparison_in_the_blocked_path_would_show():
    """The negative twins: blocked_attention (blocks of 4, T = 9) matches a softmax with the
    causal comparison key <= query within 1e-12; the tolerance tells it from key < query
    and from no comparison at all by far. And the blocked path of a non-causal config is far
    from the causal dense one."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q, k, v = rng.normal(size=(2, T, 2, 2, 4)), rng.normal(size=(2, T, 2, 4)), rng.normal(size=(2, T, 2, 4))
        out, _ = fl.blocked_attention(*map(jnp.asarray, (q, k, v)), causal=True, key_valid=None, block=4)
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        assert _rel(out, _softmax_attention(q, k, v, j <= i)) <= 1e-12
        assert _rel(out, _softmax_attention(q, k, v, j < i)) > 1e-3
        assert _rel(out, _softmax_attention(q, k, v, np.ones((T, T), bool))) > 1e-3

        cfg = replace(LLAMA, param_dtype="float64", attention_block=4)
        x, _, keys = _inputs(cfg)
        dense = fb.Encoder(replace(cfg, attention="dense"), num_layers=2, rngs=nnx.Rngs(0))(x, key_mask=keys)
        wrong = fb.Encoder(replace(cfg, attention="blocked", causal=False), num_layers=2, rngs=nnx.Rngs(0))
        assert _rel(wrong(x, key_mask=keys), dense) > 1e-3


def test_fused_path_rows_without_keys_are_zero_with_finite_gradients():
    cfg = replace(BASE, causal=True)
    x = jax.random.normal(jax.random.key(0), (2, 5, BASE.d_model))
    keys = np.ones((2, 5), bool)
    keys[1, :2] = False  # causal: queries 0 and 1 of sequence 1 see no key
    dense = fb.TransformerBlock(cfg, rngs=nnx.Rngs(0))(x, key_mask=keys)
    m = fb.TransformerBlock(replace(cfg, attention="fused"), rngs=nnx.Rngs(0))
    fused = m(x, key_mask=keys)
    g = jax.jit(jax.grad(lambda x: jnp.sum(m(x, key_mask=keys) ** 2)))(x)
    assert float(jnp.abs(fused - dense).max()) < 1e-5 and bool(jnp.isfinite(g).all())


def test_blocked_path_warns_of_a_mask_in_the_other_convention():
    """A key mask with no real key in an element (torch's True = padding handed over as is)
    gets the dense path's warning on the blocked path too."""
    x = jnp.ones((2, 5, BASE.d_model))
    keys = np.ones((2, 5), bool)
    keys[1] = False
    for attention in ("dense", "blocked"):
        m = fb.TransformerBlock(replace(BASE, attention=attention, attention_block=2), rngs=nnx.Rngs(0))
        with pytest.warns(FullyMaskedWarning, match=r"some batch elements have no key"):
            m(x, key_mask=keys)


# ----------------------------------------------------------------------------------------
# The choice: static, explicit, refused where it cannot be honoured
# ----------------------------------------------------------------------------------------


def test_config_validates_the_fields():
    with pytest.raises(ValueError, match=r"attention must be one of \('auto', 'dense', 'blocked', 'fused'\)"):
        replace(BASE, attention="flash")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="attention_block must be a positive int"):
            replace(BASE, attention_block=bad)


def _module_state() -> list[str]:
    """Mutable module-level containers of flax_blocks.attention (once a dict of settings
    read at trace time; now none)."""
    return [n for n, v in vars(fa).items() if not n.startswith("__") and isinstance(v, (dict, list, set))]


def test_attention_path_resolves_from_static_facts():
    path = fa.attention_path
    call = {"need_weights": False, "explicit_mask": False, "dropout_active": False}
    auto = BASE
    assert path(auto, fa.AUTO_MIN_KEYS - 1, **call, platform="cpu") == "dense"
    assert path(auto, fa.AUTO_MIN_KEYS, **call, platform="cpu") == "blocked"
    assert path(auto, 8, **call, platform="gpu") == "fused"
    capped = replace(BASE, attn_logit_softcapping=50.0)  # Gemma 2: the fused kernels have no soft-cap
    assert path(capped, 8, **call, platform="gpu") == "dense"
    assert path(capped, fa.AUTO_MIN_KEYS, **call, platform="gpu") == "blocked"
    (t,) = jax.export.symbolic_shape("t")
    assert path(auto, t, **call, platform="cpu") == "dense" and path(auto, t, **call, platform="gpu") == "dense"
    for reason in call:  # auto falls back to dense by itself
        assert path(auto, 4096, **{**call, reason: True}, platform="gpu") == "dense"
    for forced in ("dense", "blocked", "fused"):
        assert path(replace(BASE, attention=forced), 8, **call, platform="cpu") == forced
        assert path(replace(BASE, attention=forced), t, **call, platform="cpu") == forced
    assert not _module_state()
    # torch by the same rule: its SDPA serves "blocked" and "fused", and takes what Flax's kernels do not
    torch_path = tb.attention.attention_path
    assert torch_path(auto, fa.AUTO_MIN_KEYS - 1, **call) == "dense"
    assert torch_path(auto, fa.AUTO_MIN_KEYS, **call) == "fused"
    assert torch_path(auto, 8, **call, platform="cuda") == "fused"
    assert torch_path(auto, 4096, **{**call, "explicit_mask": True}) == "fused"  # SDPA takes masks (Flax: dense)
    assert torch_path(auto, 4096, **{**call, "need_weights": True}) == "dense"
    assert torch_path(capped, 4096, **call) == "dense" and torch_path(auto, None, **call) == "dense"


REFUSALS = [  # (what the call needs, the flax call's kwargs, the torch call's kwargs, message)
    ("weights", {"return_intermediates": True}, {"return_intermediates": True}, "attention weights are asked"),
    ("mask", {"attention_mask": np.tril(np.ones((5, 5), bool))},
     {"src_mask": ~torch.tril(torch.ones(5, 5, dtype=torch.bool))}, "explicit attention mask"),
    ("dropout", {"deterministic": False}, {}, "dropout on the attention weights is active"),
]


@pytest.mark.parametrize("attention", ["blocked", "fused"])
@pytest.mark.parametrize(("what", "fkw", "tkw", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_forced_path_refuses_what_it_cannot_serve_on_both_sides(attention, what, fkw, tkw, message):
    cfg = replace(BASE, attention=attention, dropout=0.1 if what == "dropout" else 0.0)
    x = np.random.default_rng(0).normal(size=(2, 5, BASE.d_model)).astype(np.float32)
    fm = fb.TransformerBlock(cfg, rngs=nnx.Rngs(0))
    tm = tb.TransformerBlock(cfg).train()
    with pytest.raises(ValueError, match=f"attention='{attention}' cannot serve this call: .*{message}"):
        fm(jnp.asarray(x), **fkw)
    with pytest.raises(ValueError, match=message):
        tm(torch.from_numpy(x), **tkw)
    if what == "dropout":  # dropout off for the call, or eval mode: served
        fm(jnp.asarray(x), deterministic=True)
        fm.eval()
        fm(jnp.asarray(x))
        tm.eval()(torch.from_numpy(x))
    auto = fb.TransformerBlock(replace(cfg, attention="auto"), rngs=nnx.Rngs(0))
    auto(jnp.asarray(x), **fkw)  # auto falls back to the dense path


def test_jitted_auto_keeps_its_path_and_it_depends_on_the_length_only():
    """No global setting is read at trace time: the jaxpr of an auto call is the dense one
    below AUTO_MIN_KEYS keys (on a CPU) and the blocked one (a scan over key blocks) from
    there on; forcing "blocked" through the config gives the blocked program at any length."""
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU auto takes the fused path at every length")
    m = fb.TransformerBlock(BASE, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    f = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    jaxpr = lambda t: str(jax.make_jaxpr(f)(state, jax.ShapeDtypeStruct((1, t, BASE.d_model), jnp.float32)))  # noqa: E731
    assert "scan" not in jaxpr(16) and "scan" in jaxpr(fa.AUTO_MIN_KEYS)
    x = jax.random.normal(jax.random.key(0), (2, 16, BASE.d_model))
    y = f(state, x)
    dense = fb.TransformerBlock(replace(BASE, attention="dense"), rngs=nnx.Rngs(0))(x)
    assert float(jnp.abs(y - dense).max()) < 1e-6 and float(jnp.abs(f(state, x) - y).max()) == 0.0
    assert not _module_state()  # there is no setting that could change it
    forced = nnx.split(fb.TransformerBlock(replace(BASE, attention="blocked", attention_block=4), rngs=nnx.Rngs(0)))
    g = jax.jit(lambda state, x: nnx.merge(forced[0], state)(x))
    assert "scan" in str(jax.make_jaxpr(g)(forced[1], x))
    assert float(jnp.abs(g(forced[1], x) - dense).max()) < 1e-5


def test_export_with_a_symbolic_length_takes_the_dense_path_and_equals_jit():
    """jax.export of an Encoder forward over x ("b, t", d_model) and its key mask ("b, t"):
    auto never compares the symbolic t in Python; the exported function run at two lengths
    equals the jitted one."""
    cfg = replace(BASE, causal=True)
    graphdef, state = nnx.split(fb.Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0)))

    def forward(state, x, keys):
        return nnx.merge(graphdef, state)(x, key_mask=keys)

    b, t = jax.export.symbolic_shape("b, t")
    specs = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state),
             jax.ShapeDtypeStruct((b, t, cfg.d_model), jnp.float32), jax.ShapeDtypeStruct((b, t), jnp.bool_))
    exported = jax.export.export(jax.jit(forward))(*specs)
    for batch, seq in ((2, 5), (3, 11)):
        x, _, keys = _inputs(cfg, batch, seq, seed=seq)
        got, want = exported.call(state, x, keys), jax.jit(forward)(state, x, keys)
        assert got.shape == (batch, seq, cfg.d_model)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("attention", "sdpa"), [("auto", False), ("dense", False), ("blocked", True), ("fused", True)])
def test_torch_twin_reads_the_same_field(attention, sdpa):
    """torch's dense path is its explicit softmax; "blocked" and "fused" are SDPA; "auto" follows
    the twins' one rule (dense on a CPU below AUTO_MIN_KEYS keys, as Flax); all give the same output."""
    cfg = replace(BASE, causal=True, attention=attention)
    m = tb.Encoder(cfg, num_layers=2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 7, BASE.d_model, generator=torch.Generator().manual_seed(1))
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    F = torch.nn.functional
    with mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as kernel:
        y = m(x, src_key_padding_mask=kpm)
    assert kernel.called == sdpa
    ref = tb.Encoder(replace(cfg, attention="dense"), num_layers=2, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(y, ref(x, src_key_padding_mask=kpm), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_long_sequence_train_step_memory():
    """A block forward + backward at T = 8192, B = 1 (d256, 8 heads): XLA temp memory under
    256 MiB with the blocked path that auto takes on a CPU (measured 240 MiB), where the
    dense logits alone are 2 GiB (measured 8.3 GiB in all). Compiled only, never run."""
    cfg = fb.BlockConfig(d_model=256, num_heads=8, d_ff=1024, norm="pre", dropout=0.0)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: fb.TransformerBlock(cfg, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    x = jax.ShapeDtypeStruct((1, 8192, 256), jnp.float32)

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2)

    assert fa.attention_path(cfg, 8192, need_weights=False, explicit_mask=False, dropout_active=False,
                             platform="cpu") == "blocked"
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * 2**20


@pytest.mark.parametrize("key_mask", [False, True])
def test_torch_fused_causal_takes_sdpa_is_causal_without_other_masks(key_mask):
    """A causal mask alone reaches SDPA as is_causal=True (no (T, S) mask: torch at its
    best); with a key-padding mask, an explicit boolean mask. Both equal the dense path."""
    cfg = replace(BASE, causal=True, attention="fused")
    m = tb.TransformerBlock(cfg, generator=torch.Generator().manual_seed(0)).double()
    x = torch.randn(2, 7, BASE.d_model, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    kw = {"src_key_padding_mask": kpm} if key_mask else {}
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def wrapped(*args, **kwargs):
        calls.append((kwargs.get("is_causal"), kwargs.get("attn_mask") is not None))
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = wrapped
    try:
        y = m(x, **kw)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert calls == [(not key_mask, key_mask)]
    ref = tb.TransformerBlock(replace(cfg, attention="dense"), generator=torch.Generator().manual_seed(0)).double()
    torch.testing.assert_close(y, ref(x, **kw), rtol=0, atol=1e-12)
