"""The initialisation study (experiments.init_study, experiments.init_study.report).

At the quick size: it writes its cells and report, the report regenerates identically through
`python -m experiments.init_study.report`, a rerun resumes. Against answers computed another way: the
measured FFN W2 gradient is the derivative of the loss with respect to that very matrix
(jax.grad through that matrix alone, with the loss written out again from the library's
forward, and a central finite difference), the measured stream gradient at the embedded input
is the loss's gradient there; measuring W1 for W2 or skipping fairseq's embedding rescale is
caught. The report's statistics recover planted factors and exponents, and the rules read them.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.init_study import report as init_report
from experiments.init_study import study as init_study
from experiments.stability.train import compile_lowered, compiler_options

QUICK = init_study.QUICK
DEPTH = QUICK.depths[0]
DRAW = 1


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick study's folder, computed once for the session: under pytest-xdist the
    workers share the base temporary folder's parent, and a file lock lets the first worker
    compute it while another waits (then reads it; no test rewrites a cell)."""
    from filelock import FileLock  # torch's dependency, so always here with the test extras

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "init_quick"
    with FileLock(str(out) + ".lock"):
        if not (out / "done").exists():
            assert init_study.main(["--out", str(out), "--quick", "--no-progress"]) == 0
            (out / "done").touch()
    return out


def _cell(out, setting: str, variant: str) -> dict:
    (path,) = (out / "cells").glob(f"{setting}_{variant}_L{DEPTH}-*.json")
    return json.loads(path.read_text())


def test_quick_study_writes_cells_and_report_and_resumes(quick):
    meta = json.loads((quick / "init.json").read_text())
    assert len(meta["cells"]) == len(QUICK.settings) * len(QUICK.variants) * len(QUICK.depths) == 4
    assert all((quick / "cells" / f"{name}.json").exists() for name in meta["cells"])
    text = (quick / "report.md").read_text()
    assert "## Findings" in text and "## The measured reason" in text and "Theorem 1" in text
    for png in (f"profiles_L{DEPTH}.png", "profiles_depths.png", "last_layer.png", "ratios.png"):
        assert (quick / png).stat().st_size > 1000
    d = _cell(quick, "xiong", "pre")["draws"]
    n = QUICK.draws_of("xiong", DEPTH)
    assert np.shape(d["dec_w2"]) == (n, DEPTH) and np.shape(d["dec_ratio"]) == (n, DEPTH, 3)  # self, cross, FFN
    assert np.shape(d["enc_gstream"]) == (n, DEPTH + 1) and np.shape(d["dec_gsub"]) == (n, DEPTH, 3, 2)
    for setting, variant, stack in (("xiong", "post", "dec"), ("lab", "pre", "lm")):
        d = _cell(quick, setting, variant)["draws"]
        g, gs = np.asarray(d[f"{stack}_gsub"]), np.asarray(d[f"{stack}_gstream"])  # (n, L, S, 2), (n, L + 1)
        # the probe after a layer's last sublayer meets the probe at the next layer boundary (4 digits kept)
        np.testing.assert_allclose(g[:, :, -1, 1], gs[:, 1:], rtol=1e-3)
        if variant == "pre":  # no norm after the add: the stream after a sublayer is z itself
            np.testing.assert_array_equal(g[..., 0], g[..., 1])
        else:  # a LayerNorm after the add changes the gradient
            assert np.all(np.abs(g[..., 0] / g[..., 1] - 1) > 1e-3)
    for setting in ("xiong", "lab"):  # the layer-by-layer rerun is the library's own forward
        for variant in ("post", "pre"):
            d = _cell(quick, setting, variant)["draws"]
            assert max(np.max(np.abs(d[k])) for k in d if k == "check" or k.endswith("_recon")) < 1e-5
    # python -m experiments.init_study.report regenerates the same report from the cells alone
    (quick / "report.md").unlink()
    assert init_report.main([str(quick)]) == 0
    assert (quick / "report.md").read_text() == text
    # a rerun computes nothing
    assert init_study.main(["--out", str(quick), "--quick", "--no-progress", "--no-report"]) == 0
    assert json.loads((quick / "init.json").read_text())["runs"][-1]["cells_computed"] == 0


PATHS = {"enc": ("transformer", "encoder"), "dec": ("transformer", "decoder"), "lm": ("encoder",)}


@functools.cache
def _direct(setting_name: str, variant: str):
    """Draw DRAW of the quick study's (setting, variant) cell, recomputed without the study's
    code: (loss_and_grad, kernels, inputs). kernels = {(stack, "linear1"|"linear2"): (L, in, out)}
    of every stack; inputs = the embedded inputs {stack: (B, T, E)}; loss_and_grad(kernels,
    inputs) = (loss, (dloss/dkernels, dloss/dinputs)), every other parameter held fixed, the
    loss written out here from the library's forward (Transformer / the LM's Encoder)."""
    setting = init_study.make_setting(setting_name, QUICK)
    k_init, k_data = jax.random.split(init_study.draw_key(QUICK.seed, DRAW))
    graphdef, params, rest = setting.create(variant, DEPTH, k_init)
    batch = setting.batch(k_data)

    def path(kp) -> tuple[str, ...]:
        return tuple(k.key for k in kp if isinstance(k, jax.tree_util.DictKey))

    where = {(*PATHS[stack], "layers", m, "kernel"): (stack, m) for stack in setting.stacks
             for m in ("linear1", "linear2")}
    kernels = {where[path(kp)]: x for kp, x in jax.tree_util.tree_leaves_with_path(params) if path(kp) in where}
    model = nnx.merge(graphdef, params, rest)
    if setting_name == "xiong":
        inputs = {"enc": model.embed_tokens(batch["src"]), "dec": model.embed_tokens(batch["tgt_in"])}
    else:
        inputs = {"lm": model.embed_tokens(batch["tokens"][:, :-1])}

    @functools.partial(jax.value_and_grad, argnums=(0, 1))
    def loss_of(kernels, inputs, params, rest):  # the parameters with these matrices in place, functionally
        p = jax.tree_util.tree_map_with_path(lambda kp, x: kernels[where[path(kp)]] if path(kp) in where else x, params)
        model = nnx.merge(graphdef, p, rest)
        if setting_name == "xiong":
            logits = model.transformer(inputs["enc"], inputs["dec"]) @ model.embed[...].T
            targets = batch["tgt"]
        else:
            logits = model.head(model.encoder(inputs["lm"]))
            targets = batch["tokens"][:, 1:]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

    # compiled as the quick study compiles (XLA:CPU at LLVM level 0: fastest to compile)
    program = compile_lowered(jax.jit(loss_of).lower(kernels, inputs, params, rest), compiler_options(0))
    return (lambda kernels, inputs: program(kernels, inputs, params, rest)), kernels, inputs


def _check(setting_name: str, variant: str, stack: str, layer: int, matrix: str = "linear2") -> tuple[float, float]:
    """(||dLoss/dW|| of `matrix` in `layer` of `stack`, the central finite difference of the loss
    along that gradient's direction), W alone perturbed."""
    loss_and_grad, kernels, inputs = _direct(setting_name, variant)
    g = loss_and_grad(kernels, inputs)[1][0][(stack, matrix)][layer]
    norm = float(jnp.linalg.norm(g))
    eps = 1e-2

    def loss_at(step):
        moved = dict(kernels)
        moved[(stack, matrix)] = kernels[(stack, matrix)].at[layer].add(step * g / norm)
        return float(loss_and_grad(moved, inputs)[0])

    return norm, (loss_at(eps) - loss_at(-eps)) / (2 * eps)


@pytest.mark.parametrize("setting_name,variant,stack", [
    ("xiong", "post", "enc"), ("xiong", "post", "dec"), ("lab", "pre", "lm")])
def test_w2_gradient_is_the_loss_derivative(quick, setting_name, variant, stack):
    measured = np.asarray(_cell(quick, setting_name, variant)["draws"][f"{stack}_w2"])[DRAW]  # (L,)
    loss_and_grad, kernels, inputs = _direct(setting_name, variant)
    direct = np.linalg.norm(np.asarray(loss_and_grad(kernels, inputs)[1][0][(stack, "linear2")]), axis=(1, 2))
    np.testing.assert_allclose(measured, direct, rtol=1e-4)  # every layer; the cells keep 5 digits
    norm, fd = _check(setting_name, variant, stack, DEPTH - 1)
    assert fd == pytest.approx(norm, rel=2e-2)  # and it is the derivative of the loss, of that matrix


@pytest.mark.parametrize("setting_name,variant", [("xiong", "post"), ("lab", "pre")])
def test_stream_gradient_at_the_input_is_the_loss_gradient(quick, setting_name, variant):
    d = _cell(quick, setting_name, variant)["draws"]
    loss_and_grad, kernels, inputs = _direct(setting_name, variant)
    grads = loss_and_grad(kernels, inputs)[1][1]
    for stack, g in grads.items():
        assert d[f"{stack}_gstream"][DRAW][0] == pytest.approx(float(jnp.linalg.norm(g)), rel=1e-4)


def test_wrong_matrix_is_caught(quick):
    """Had the study measured W1 (linear1) for W2, the check above would fail: their norms differ."""
    measured = np.asarray(_cell(quick, "xiong", "post")["draws"]["dec_w2"])[DRAW, -1]
    w1, fd = _check("xiong", "post", "dec", DEPTH - 1, matrix="linear1")
    assert fd == pytest.approx(w1, rel=2e-2)  # a true derivative, of the wrong matrix
    assert abs(w1 / measured - 1) > 0.05


def test_embedding_scale_is_measured_and_a_missing_rescale_is_caught():
    """fairseq's sqrt(d) rescale makes the token part ~ N(0, 1) per coordinate and the sinusoidal
    part has mean square exactly 1/2; without the rescale the token part is ~1/d."""
    setup = QUICK.xiong

    def embedding(setup):
        setting = init_study.XiongSetting(setup)
        k_init, k_data = jax.random.split(init_study.draw_key(0, 0))
        graphdef, params, rest = setting.create("post", 1, k_init)
        tok, pos = nnx.merge(graphdef, params, rest).embed_parts(setting.batch(k_data)["src"])
        return init_study._embedding_stats(tok, pos)

    right, wrong = embedding(setup), embedding(replace(setup, embed_scale=False))
    assert float(right["x0_pos_ms"]) == pytest.approx(0.5, abs=1e-6)
    assert 0.6 < float(right["x0_token_ms"]) < 1.5
    assert float(wrong["x0_token_ms"]) == pytest.approx(float(right["x0_token_ms"]) / setup.d_model, rel=1e-5)
    assert not 0.6 < float(wrong["x0_token_ms"]) < 1.5


def test_fairseq_qkv_law():
    """q/k/v drawn as fairseq's packed (3d, d) xavier: |w| <= sqrt(6 / 4d), the largest of
    hundreds of draws close to it; attention's output projection plain xavier sqrt(6 / 2d)."""
    setting = init_study.make_setting("xiong", QUICK)
    graphdef, params, rest = setting.create("post", 1, init_study.draw_key(0, 0))
    model = nnx.merge(graphdef, params, rest)
    d = QUICK.xiong.d_model
    for attn in (model.transformer.encoder.layers.self_attn, model.transformer.decoder.layers.multihead_attn):
        for w, bound in ((attn.in_kernel[...], np.sqrt(6 / (4 * d))), (attn.out_kernel[...], np.sqrt(6 / (2 * d)))):
            assert 0.95 * bound < np.abs(np.asarray(w)).max() <= bound


def test_statistics_recover_planted_factors_and_exponents():
    """Per-draw data with a known answer: profiles rising 2x from the first layer to the last,
    last-layer norms ~ L^-1/2, each with 10% lognormal noise over 32 draws."""
    rng = np.random.default_rng(1)
    def noise(*shape):
        return np.exp(0.1 * rng.standard_normal(shape))
    profile = 2.0 ** np.linspace(0, 1, 6) * noise(32, 6)
    f, lo, hi = init_report.factor_ci(profile)
    assert lo < 2.0 < hi and hi - lo < 0.3
    assert init_report.rise_part(lo, hi) == "yes"
    assert init_report.rise_part(*init_report.factor_ci(profile[:, ::-1])[1:]) == "no"  # the wrong way round
    depths = [6, 12, 24, 48]
    p, lo, hi = init_report.exponent_ci(depths, [L ** -0.5 * noise(32) for L in depths])
    assert lo < -0.5 < hi and hi - lo < 0.2
    assert init_report.exponent_part(lo, hi, -0.5) == "yes" and init_report.exponent_part(lo, hi, 0.0) == "no"


def test_verdict_rules():
    """The rules on intervals (written before the data)."""
    assert init_report.rise_part(1.5, 2.0) == "yes" and init_report.rise_part(0.9, 1.2) == "no"
    assert init_report.rise_part(1.2, 1.5) == "unclear"
    assert init_report.level_part(0.8, 1.2) == "yes" and init_report.level_part(0.4, 0.6) == "no"
    assert init_report.level_part(0.6, 0.9) == "unclear"
    assert init_report.exponent_part(-0.6, -0.45, -0.5) == "yes"
    assert init_report.exponent_part(0.1, 0.3, 0.0) == "yes"  # 0.1 from the prediction: within the tolerance
    assert init_report.exponent_part(0.2, 0.3, 0.0) == "no"
    assert init_report.exponent_part(-1.0, 0.5, 0.0) == "unclear"
    assert init_report.combine(["yes", "yes"]) == "agrees"
    assert init_report.combine(["no", "no"]) == "does not agree"
    assert init_report.combine(["yes", "no"]) == "partly agrees"
    assert init_report.combine(["no", "unclear"]) == "inconclusive"
