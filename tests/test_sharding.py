"""flax_blocks.sharding: the rule table covers every parameter, and 1-device, data-parallel,
tensor-parallel and 2-D sharding rules on 8 simulated CPU devices give the same outputs and
gradients (float64, so a wrong all-reduce cannot hide under float32 rounding).

The multi-device check runs in a subprocess: XLA's host device count is fixed when JAX
initialises its CPU backend, which the pytest process may already have done with 1 device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

jax = pytest.importorskip("jax")
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from flax_blocks import BlockConfig  # noqa: E402
from flax_blocks import sharding as S  # noqa: E402
from flax_blocks.blocks import Encoder, FeedForward, ResidualMHA, TransformerBlock  # noqa: E402


@pytest.mark.parametrize("options", [dict(scaling="none"), dict(scaling="rezero"), dict(scaling="layerscale"),
                                     dict(norm="peri", norm_type="rmsnorm", mlp="swiglu", activation="silu",
                                          num_kv_heads=2, qk_norm=True, rope_theta=1e4)])
@pytest.mark.parametrize("module", [ResidualMHA, FeedForward, TransformerBlock, Encoder])
def test_rules_cover_every_param(module, options):
    cfg = BlockConfig(d_model=16, num_heads=4, d_ff=24, **{"norm": "pre", **options})
    kw = {"num_layers": 2} if module is Encoder else {}
    m = module(cfg, rngs=nnx.Rngs(0), **kw)
    rows = S.describe(nnx.state(m), S.HYBRID)
    assert len(rows) == len(jax.tree.leaves(nnx.state(m, nnx.Param)))
    for path, shape, spec in rows:
        assert len(spec) == len(shape), (path, shape, spec)


def test_tensor_parallel_specs_of_a_stacked_encoder():
    cfg = BlockConfig(d_model=16, num_heads=4, d_ff=24)
    specs = {p: s for p, _, s in S.describe(nnx.state(Encoder(cfg, num_layers=3, rngs=nnx.Rngs(0))), S.TENSOR_PARALLEL)}
    assert specs["layers/self_attn/in_kernel"] == P(None, None, "model", None, None)  # (L, E, K, G+2, hd)
    assert specs["layers/self_attn/in_bias"] == P(None, "model", None, None)  # (L, K, G+2, hd)
    assert specs["layers/self_attn/out_kernel"] == P(None, "model", None, None)  # (L, H, hd, E)
    assert specs["layers/linear1/kernel"] == P(None, None, "model")  # (L, E, F)
    assert specs["layers/linear1/bias"] == P(None, "model")
    assert specs["layers/linear2/kernel"] == P(None, "model", None)  # (L, F, E)
    assert specs["layers/linear2/bias"] == P(None, None)
    assert specs["layers/norm1/scale"] == P(None, None)
    gqa = BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, d_ff=24, mlp="swiglu", activation="silu", qk_norm=True)
    specs = {p: s for p, _, s in S.describe(nnx.state(TransformerBlock(gqa, rngs=nnx.Rngs(0))), S.TENSOR_PARALLEL)}
    assert specs["self_attn/in_kernel"] == P(None, "model", None, None)  # (E, K, G+2, hd): whole groups per device
    assert specs["self_attn/out_kernel"] == P("model", None, None)  # (H, hd, E): the same heads, in group order
    assert specs["linear_gate/kernel"] == P(None, "model") and specs["self_attn/q_norm/scale"] == P(None)
    # the layer axis can be mapped too (e.g. to stage layers over a mesh axis)
    staged = {p: s for p, _, s in S.describe(nnx.state(Encoder(cfg, num_layers=3, rngs=nnx.Rngs(0))), {"layers": "data"})}
    assert staged["layers/linear1/kernel"] == P("data", None, None)


def test_unknown_parameters_are_all_reported():
    class Extra(nnx.Module):
        def __init__(self):
            self.block = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0))
            self.embed = nnx.Param(jax.numpy.zeros((5, 8)))
            self.head = nnx.Param(jax.numpy.zeros((8, 5)))

    with pytest.raises(KeyError) as err:
        S.partition_specs(nnx.state(Extra()), S.HYBRID)
    assert "'embed'" in str(err.value) and "'head'" in str(err.value)


def test_a_pure_dict_is_refused_naming_the_fix():
    block = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0))
    with pytest.raises(KeyError, match=r"is a bare array: pass the Variables \(nnx.state\(model\)"):
        S.partition_specs(nnx.to_pure_dict(nnx.state(block, nnx.Param)), S.HYBRID)


def test_sharding_rule_errors():
    with pytest.raises(ValueError, match="onto one mesh axis"):
        S.logical_to_spec(("heads", "mlp"), S.TENSOR_PARALLEL)
    m = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0))
    mesh = S.make_mesh(data=1, model=1)
    S.shard_model(m, mesh, S.HYBRID)  # a 1 x 1 mesh accepts every rule set


_SCRIPT = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np, jax.numpy as jnp
    from flax import nnx
    from flax_blocks import BlockConfig
    from flax_blocks import sharding as S
    from flax_blocks.blocks import Encoder

    assert jax.device_count() == 8, jax.devices()
    # heads (8) and d_ff (64) divide by every model-axis size used; heads != head_dim; the
    # Encoder's layers are TransformerBlocks with a stacked leading layer axis
    cfg = BlockConfig(d_model=24, num_heads=8, d_ff=64, dropout=0.0, norm="pre", causal=True,
                      scaling="layerscale", param_dtype="float64")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6, 24))
    r = rng.standard_normal((8, 6, 24))
    key_mask = np.ones((8, 6), bool); key_mask[1, 4:] = False
    O1 = {"xla_backend_optimization_level": 1}  # compiles faster; float64 results are exact either way
    # one model, built in one compiled program (eager init would compile every small op)
    graphdef0, state0 = nnx.split(nnx.jit(lambda: Encoder(cfg, num_layers=2, rngs=nnx.Rngs(2)))())

    def run(mesh, rules):
        model = nnx.merge(graphdef0, state0)  # fresh Variables on the same arrays
        if mesh is not None:
            S.shard_model(model, mesh, rules)
            xs = jax.device_put(x, S.input_sharding(mesh, rules))
            rs = jax.device_put(r, S.input_sharding(mesh, rules))
            km = jax.device_put(key_mask, S.input_sharding(mesh, rules, ("batch", "seq")))
        else:
            xs, rs, km = jnp.asarray(x), jnp.asarray(r), jnp.asarray(key_mask)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def step(params, xs, rs, km):
            def loss(params, xs):
                y = nnx.merge(graphdef, params, rest)(xs, key_mask=km)
                return jnp.sum(y * rs), y
            (_, y), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, xs)
            return y, gp, gx

        y, gp, gx = jax.jit(step).lower(params, xs, rs, km).compile(O1)(params, xs, rs, km)
        return params, y, gp, gx

    _, y0, gp0, gx0 = run(None, None)
    assert len(y0.devices()) == 1
    y0, gx0, gp0 = np.asarray(y0), np.asarray(gx0), [np.asarray(a) for a in jax.tree.leaves(gp0)]
    rule_sets = {
        "data-parallel 8x1": (S.make_mesh(data=8, model=1), S.DATA_PARALLEL),
        "tensor-parallel 1x8": (S.make_mesh(data=1, model=8), S.TENSOR_PARALLEL),
        "hybrid 2x4": (S.make_mesh(data=2, model=4), S.HYBRID),
    }
    for lname, (mesh, rules) in rule_sets.items():
        params, y, gp, gx = run(mesh, rules)
        # the rules really distribute: FFN width and heads split over "model", batch over "data"
        n_model, n_data = mesh.shape["model"], mesh.shape["data"]
        w1 = params["layers"]["linear1"]["kernel"][...]  # (L, E, F)
        assert w1.addressable_shards[0].data.shape == (2, 24, 64 // n_model), (lname, w1.sharding)
        qkv = params["layers"]["self_attn"]["in_kernel"][...]  # (L, E, K, G+2, hd), K = H = 8, G = 1
        assert qkv.addressable_shards[0].data.shape == (2, 24, 8 // n_model, 3, 3), (lname, qkv.sharding)
        assert y.addressable_shards[0].data.shape[0] == 8 // n_data and len(y.devices()) == 8
        g_w1 = gp["layers"]["linear1"]["kernel"][...]
        assert g_w1.sharding.is_equivalent_to(w1.sharding, 3), (lname, g_w1.sharding, w1.sharding)
        y, gx, gp = np.asarray(y), np.asarray(gx), [np.asarray(a) for a in jax.tree.leaves(gp)]
        err_y = np.max(np.abs(y - y0)) / np.max(np.abs(y0))
        err_x = np.max(np.abs(gx - gx0)) / np.max(np.abs(gx0))
        err_p = max(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-300) for a, b in zip(gp, gp0))
        assert max(err_y, err_x, err_p) < 1e-12, (lname, err_y, err_x, err_p)
        print(f"{lname:20s} out {err_y:.1e} grad_x {err_x:.1e} grad_params {err_p:.1e}")
    print("OK")
    """
)


def test_sharding_rules_agree_on_8_simulated_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
