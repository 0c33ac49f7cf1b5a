"""The lab's experts variants (post-moe, pre-moe) on tiny sizes: they build and train, the
router's measures are finite and in range, the auxiliary loss coefficient changes the
objective, and the dense variants' cells keep their names (so the committed runs stay theirs)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.stability.model import DENSE_TWIN, MOE_EXPERTS, MOE_TOP_K, MOE_VARIANTS, ModelConfig, pure_params
from experiments.stability.presets import PRESETS
from experiments.stability.sweep import cell_config, cell_name, parse_args, sweep_from_args
from experiments.stability.tasks import markov_task
from experiments.stability.train import RunSpec, TrainConfig, Trainer, compiler_options, router_measures

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab=8, seq_len=8, d_model=8, num_heads=2, d_ff=16)


def _trainer(variant: str, coef: float = 0.0) -> Trainer:
    task = markov_task(vocab=8, seq_len=8, seed=0)
    train_cfg = TrainConfig(steps=2, batch=4, chunk=2, heldout=4, pool=32, router_aux_coef=coef)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("runs",))
    return Trainer(ModelConfig(variant, 2, **TINY), task, train_cfg, mesh=mesh, options=compiler_options(0))


def test_the_experts_variants_are_their_dense_twins_with_an_experts_mlp_of_equal_active_width():
    assert set(MOE_VARIANTS) == {"post-moe", "pre-moe"}
    for moe in MOE_VARIANTS:
        dense, experts = ModelConfig(DENSE_TWIN[moe], 6).block_config(), ModelConfig(moe, 6).block_config()
        assert experts.norm == dense.norm and experts.num_experts == MOE_EXPERTS == 8
        assert experts.num_experts_per_tok == MOE_TOP_K == 2 and experts.norm_topk_prob
        assert experts.experts_width * MOE_TOP_K == dense.d_ff  # a token's active width is the dense d_ff
        assert dense.num_experts == 0


def test_an_experts_variant_trains_with_the_aux_loss_and_its_router_measures_are_in_range():
    tr = _trainer("post-moe", 0.5)
    *_, (steps, results) = tr.run([RunSpec(1e-2, 0, 0)])
    (m,) = results
    assert steps == 2 and np.all(np.isfinite(m["loss"])) and np.all(np.isfinite(m["heldout_loss"]))
    assert m["aux_loss"].shape == (2,) and np.all(m["aux_loss"] > 0)  # recorded every step when on
    probes, layers = 2, 2  # at init and after the one chunk
    assert m["router_logit_max"].shape == m["router_logit_rms"].shape == m["expert_balance"].shape == (probes, layers)
    assert m["expert_load"].shape == (probes, layers, MOE_EXPERTS) and m["router_aux"].shape == (probes,)
    for k in ("router_logit_max", "router_logit_rms", "expert_balance", "expert_load", "router_aux"):
        assert np.all(np.isfinite(m[k])), k
    assert np.all(m["router_logit_max"] >= m["router_logit_rms"]) and np.all(m["router_logit_rms"] > 0)
    np.testing.assert_allclose(m["expert_load"].sum(-1), 1.0, rtol=1e-6)
    assert np.all(m["expert_balance"] >= 1 - 1e-6) and np.all(m["expert_balance"] <= MOE_EXPERTS / MOE_TOP_K + 1e-6)
    assert m["w2_grad_norm"].shape == (1, layers) and np.all(m["w2_grad_norm"] > 0)  # the experts' down projections


def test_router_measures_balanced_and_collapsed():
    x, k, n = MOE_EXPERTS, MOE_TOP_K, 64
    # every token prefers experts 3 and 5: collapsed, balance X / k
    collapsed = jnp.zeros((1, 2, n // 2, x)).at[..., 3].set(5.0).at[..., 5].set(4.0)
    m = router_measures(collapsed, k)
    np.testing.assert_allclose(m["expert_balance"], [x / k])
    np.testing.assert_allclose(m["expert_load"][0, [3, 5]], [0.5, 0.5])
    np.testing.assert_allclose(m["router_logit_max"], [5.0])
    np.testing.assert_allclose(m["router_logit_rms"], [np.sqrt((25 + 16) / x)], rtol=1e-6)
    # token t prefers experts t mod X and t + 1 mod X: every expert gets 1 / X of the picks
    t = jnp.arange(n)
    balanced = (2.0 * jax.nn.one_hot(t % x, x) + jax.nn.one_hot((t + 1) % x, x)).reshape(1, 2, n // 2, x)
    np.testing.assert_allclose(router_measures(balanced, k)["expert_balance"], [1.0])


def test_the_aux_coefficient_changes_the_objective():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 8, (4, 9)), jnp.int32)
    cfg = ModelConfig("pre-moe", 2, **TINY)
    params, rest = jax.jit(lambda key: pure_params(cfg, key))(jax.random.key(0))  # eagerly: 4 s of small ops
    off, on = _trainer("pre-moe", 0.0), _trainer("pre-moe", 0.5)
    assert off.aux_coef == 0.0 and on.aux_coef == 0.5 and _trainer("pre", 0.5).aux_coef == 0.0  # dense: ignored
    objective = jax.jit(on._objective).lower(params, rest, tokens).compile(compiler_options(0))
    obj, (ce, aux) = objective(params, rest, tokens)
    assert float(aux) > 0 and float(obj) == pytest.approx(float(ce) + 0.5 * float(aux), rel=1e-6)
    assert float(obj) > float(ce) + 0.1  # HF's loss is about k = 2 near balance: the coefficient moves the objective


def test_cells_of_the_experts_variants_name_their_settings_and_dense_cells_keep_their_names():
    sweep = PRESETS["cpu-moe"]
    moe = cell_config(sweep, "pre-moe", 6, 1e-3, 0, 0)
    assert (moe["num_experts"], moe["experts_per_tok"], moe["expert_d_ff"], moe["router_aux_coef"]) == (8, 2, 64, 0.0)
    from dataclasses import replace

    assert cell_name(cell_config(replace(sweep, router_aux_coef=0.01), "pre-moe", 6, 1e-3, 0, 0)) != cell_name(moe)
    dense = cell_config(replace(sweep, router_aux_coef=0.01), "pre", 6, 1e-3, 0, 0)
    assert "router_aux_coef" not in dense and cell_name(dense) == cell_name(cell_config(sweep, "pre", 6, 1e-3, 0, 0))
    # a dense cell's name is what it was: the depth study's are those its committed sweep.json lists
    depth = PRESETS["depth"]
    depth_cells = json.loads((ROOT / "experiments/stability/results/depth/sweep.json").read_text())["cells"]
    assert [cell_name(cell_config(depth, *run)) for run in depth.runs()] == depth_cells
    assert sweep_from_args(parse_args(["--preset", "cpu-moe", "--router-aux-coef", "0.01"])).router_aux_coef == 0.01
    assert sweep.router_aux_coef == 0.0 and all(p.router_aux_coef == 0.0 for p in PRESETS.values())


def test_the_lab_takes_a_mesh_of_explicit_axes():
    """jax.make_mesh's default mesh (Explicit axes) runs as the same devices with Auto axes (the
    Trainer places its own arrays; measured on 2 simulated devices: the same losses, bit for bit)."""
    explicit = jax.make_mesh((1,), ("runs",))
    assert explicit.axis_types == (jax.sharding.AxisType.Explicit,)
    task = markov_task(vocab=8, seq_len=8, seed=0)
    tr = Trainer(ModelConfig("pre-moe", 2, **TINY), task, TrainConfig(steps=2, batch=4, chunk=2, heldout=4, pool=32),
                 mesh=explicit, options=compiler_options(0))
    assert tr.mesh.axis_types == (jax.sharding.AxisType.Auto,) and tr.mesh.axis_names == ("runs",)
    assert tr.mesh.devices.tolist() == explicit.devices.tolist()
