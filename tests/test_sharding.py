"""flax_blocks.sharding: every parameter carries Flax's sharding annotation (logical names,
"layers" in front of stacked ones), the rules work through `shard_model` and through Flax's
own `nn.logical_axis_rules` alike, user annotations and optimizer state are placed (or refused
by name); an axis a mesh axis does not divide is replicated over it, never refused (4 KV heads on an
8-way "model" axis); 1-device, data-parallel, tensor-parallel and 2-D sharding rules on 8
simulated CPU devices give the same outputs and gradients (float64, so a wrong all-reduce
cannot hide under float32 rounding), and a full sharded AdamW train step (FSDP x
tensor-parallel, dropout on) equals the unsharded one, with every parameter and
optimizer-state array placed as declared.

The multi-device check runs in a subprocess: XLA's host device count is fixed when JAX
initialises its CPU backend, which the pytest process may already have done with 1 device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from xla_env import xla_flags  # the suite's XLA flags, the device count replaced

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from flax_blocks import BlockConfig  # noqa: E402
from flax_blocks import sharding as S  # noqa: E402
from flax_blocks.blocks import FeedForward, ResidualMHA, TransformerBlock  # noqa: E402
from flax_blocks.stacks import Decoder, Encoder  # noqa: E402


@pytest.mark.parametrize("options", [dict(scaling="none"), dict(scaling="rezero"), dict(scaling="layerscale"),
                                     dict(norm="peri", norm_type="rmsnorm", mlp="swiglu", activation="silu",
                                          num_kv_heads=2, qk_norm=True, rope_theta=1e4)])
@pytest.mark.parametrize("module", [ResidualMHA, FeedForward, TransformerBlock, Encoder, Decoder])
def test_rules_cover_every_param(module, options):
    cfg = BlockConfig(d_model=16, num_heads=4, d_ff=24, **{"norm": "pre", **options})
    stacked = module in (Encoder, Decoder)
    m = module(cfg, rngs=nnx.Rngs(0), **({"num_layers": 2} if stacked else {}))
    params = nnx.state(m, nnx.Param)
    for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = S.annotation(v)  # one annotation per dimension, stacked ones led by "layers"
        assert names is not None and len(names) == v.get_value().ndim, (path, names, v.get_value().shape)
        assert set(names) <= set(S.LOGICAL_AXES), (path, names)  # the library's names are all known
        assert (names[:1] == ("layers",)) == (stacked and S.path_str(path).startswith("layers/")), (path, names)
        assert "axes" not in v.get_metadata()  # one source of truth: out_sharding
    for rules in (S.HYBRID, S.FSDP | S.TENSOR_PARALLEL):
        rows = S.describe(nnx.state(m), rules)
        assert len(rows) == len(jax.tree.leaves(params))
        for path, shape, spec in rows:
            assert len(spec) == len(shape), (path, shape, spec)


def test_flax_get_partition_spec_names_the_axes():
    """What the issue asked: Flax's own reader sees the logical names."""
    cfg = BlockConfig(d_model=16, num_heads=4, d_ff=24, num_kv_heads=2, norm="pre", scaling="rezero")
    enc = Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(enc))
    layer = specs["layers"]
    assert layer["self_attn"]["in_kernel"].get_value() == P("layers", "embed", "kv_heads", "qkv", "head_dim")
    assert layer["self_attn"]["out_kernel"].get_value() == P("layers", "heads", "head_dim", "embed")
    assert layer["linear1"]["kernel"].get_value() == P("layers", "embed", "mlp")
    assert layer["linear2"]["kernel"].get_value() == P("layers", "mlp", "embed")
    assert layer["linear1"]["bias"].get_value() == P("layers", "mlp")
    assert layer["scale1"].get_value() == P("layers")  # a stacked scalar (ReZero) too
    assert specs["norm"]["scale"].get_value() == P("embed")  # the final norm is not stacked


def test_flax_logical_axis_rules_and_shard_model_agree():
    cfg = BlockConfig(d_model=16, num_heads=4, d_ff=24, mlp="swiglu", activation="silu", qk_norm=True)
    state = nnx.state(Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0)))
    leaves = lambda t: jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, P))  # noqa: E731
    for rules in (S.DATA_PARALLEL, S.TENSOR_PARALLEL, S.HYBRID, S.FSDP, S.FSDP | S.TENSOR_PARALLEL,
                  S.ShardingRules({"layers": "data"})):
        with nn.logical_axis_rules(rules.as_flax_rules()):
            flax_specs = nnx.get_partition_spec(state)
        ours = leaves(S.partition_specs(state, rules))
        assert leaves(flax_specs) == ours, rules
        assert any(any(a is not None for a in s) for s in ours) == (rules != S.DATA_PARALLEL), rules


def test_sharding_rules_forms():
    assert S.HYBRID == {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model"}
    assert S.FSDP == {"batch": "data", "embed": "data"}
    pairs = (S.FSDP | S.TENSOR_PARALLEL).as_flax_rules()
    assert pairs[:2] == (("batch", "data"), ("embed", "data")) and ("mlp", "model") in pairs
    assert ("layers", None) in pairs and ("qkv", None) in pairs  # unlisted library names replicate
    assert {name for name, _ in pairs} == set(S.LOGICAL_AXES)
    pairs = S.ShardingRules([("mlp", "model"), ("embed", ["data", "model"])])
    assert pairs == {"mlp": "model", "embed": ("data", "model")}
    assert {"mlp": None} | S.TENSOR_PARALLEL == S.TENSOR_PARALLEL  # the right side wins
    assert (S.TENSOR_PARALLEL | {"mlp": None})["mlp"] is None
    assert hash(S.ShardingRules({"a": "data"})) == hash(S.ShardingRules([("a", "data")]))
    with pytest.raises(ValueError, match="two rules for 'mlp'"):
        S.ShardingRules([("mlp", "model"), ("mlp", "data")])
    with pytest.raises(TypeError, match="rule 'mlp'"):
        S.ShardingRules({"mlp": 3})


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
    staged = {p: s for p, _, s in S.describe(nnx.state(Encoder(cfg, num_layers=3, rngs=nnx.Rngs(0))),
                                             {"layers": "data"})}
    assert staged["layers/linear1/kernel"] == P("data", None, None)


def test_expert_parallel_specs_of_an_experts_stack():
    """Each expert's matrices on its device (the stacked expert axis over "expert"), their width over
    "model" with tensor parallelism, the router and the shared expert's gate replicated; make_mesh's
    third axis."""
    cfg = BlockConfig(d_model=16, num_heads=4, d_ff=24, bias=False, mlp="swiglu", activation="silu", num_experts=4,
                      expert_d_ff=8, shared_expert_d_ff=8, decoder_sparse_step=2)
    state = nnx.state(Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0)))
    specs = {p: s for p, _, s in S.describe(state, S.TENSOR_PARALLEL | S.EXPERT_PARALLEL)}
    assert specs["layers/experts/up"] == P(None, "expert", None, "model")  # (L, X, E, F)
    assert specs["layers/experts/down"] == P(None, "expert", "model", None)  # (L, X, F, E)
    assert specs["layers/experts/router"] == P(None, None, None)  # (L, E, X)
    assert specs["layers/experts/shared_up/kernel"] == P(None, None, "model")
    assert specs["layers/linear1/kernel"] == P(None, None, "model")  # a mixed stack's dense MLP
    mesh = S.make_mesh(data=1, model=1, expert=1)
    assert mesh.axis_names == ("data", "model", "expert")
    assert S.loading_rules(mesh) == S.TENSOR_PARALLEL | S.EXPERT_PARALLEL
    assert S.loading_rules(S.make_mesh()) == S.TENSOR_PARALLEL
    with pytest.raises(ValueError, match=r"mesh 1 x 1 x 2 \(data, model, expert\) needs 2 devices"):
        S.make_mesh(expert=2, devices=jax.devices()[:1])


def test_an_axis_the_mesh_does_not_divide_is_replicated_over_it():
    """2 KV heads on a 4-way "model" axis: the q/k/v kernel (split by KV head) is replicated
    over "model", the output projection (8 query heads) and the FFN width stay split; a
    dimension over several mesh axes keeps the longest leading part of them that divides it."""
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh((2, 4), ("data", "model"))
    assert S.fit_spec(P(None, "model", ("data", "model")), (3, 2, 12), mesh) == P(None, None, "data")
    assert S.fit_spec(P(None, "model", ("data", "model")), (3, 8, 16), mesh) == P(None, "model", ("data", "model"))
    assert S.fit_spec(P("model"), (6, 5), mesh) == P(None)
    cfg = BlockConfig(d_model=16, num_heads=8, num_kv_heads=2, d_ff=24, mlp="swiglu", activation="silu")
    state = nnx.state(Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0)))
    placed = {p: s for p, _, s in S.describe(state, S.FSDP | S.TENSOR_PARALLEL, mesh=mesh)}
    assert placed["layers/self_attn/in_kernel"] == P(None, "data", None, None, None)  # (L, E, K=2, G+2, hd)
    assert placed["layers/self_attn/out_kernel"] == P(None, "model", None, "data")  # (L, H=8, hd, E)
    assert placed["layers/linear_gate/kernel"] == P(None, "data", "model")  # (L, E, F=24)
    declared = {p: s for p, _, s in S.describe(state, S.FSDP | S.TENSOR_PARALLEL)}  # no mesh: the rules' own
    assert declared["layers/self_attn/in_kernel"] == P(None, "data", "model", None, None)


def test_unknown_parameters_are_all_reported():
    class Extra(nnx.Module):
        def __init__(self):
            self.block = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0))
            self.embed = nnx.Param(jax.numpy.zeros((5, 8)))
            self.head = nnx.Param(jax.numpy.zeros((8, 5)))

    with pytest.raises(KeyError) as err:
        S.partition_specs(nnx.state(Extra()), S.HYBRID)
    assert "'embed'" in str(err.value) and "'head'" in str(err.value)
    assert "'block/" not in str(err.value)


def test_user_parameters_annotated_the_flax_way():
    """nnx.with_partitioning with logical names (mapped by a rule) or mesh axis names."""
    init = nnx.initializers.zeros_init()

    class LM(nnx.Module):
        def __init__(self):
            key = jax.random.key(0)
            self.block = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0))
            self.embed = nnx.Param(nnx.with_partitioning(init, ("tokens", "embed"))(key, (6, 8)))  # a name of theirs
            self.head = nnx.Param(nnx.with_partitioning(init, (None, "model"))(key, (8, 6)))  # a mesh axis

    with nnx.use_eager_sharding(False):  # no mesh here: Flax would shard them at creation
        lm = LM()
    mesh = S.make_mesh(data=1, model=1)
    rules = S.FSDP | {"tokens": "model"}
    specs = S.partition_specs(nnx.state(lm), rules, mesh=mesh)
    assert specs["embed"].get_value() == P("model", "data") and specs["head"].get_value() == P(None, "model")
    assert specs["block"]["linear1"]["kernel"].get_value() == P("data", None)
    S.shard_model(lm, mesh, rules)
    assert lm.head[...].sharding.spec == P(None, "model")
    with pytest.raises(KeyError, match=r"'embed': axis name 'tokens' of \('tokens', 'embed'\) is neither"):
        S.shard_model(lm, mesh, S.FSDP)  # a logical name without a rule, not a mesh axis either


def _adamw():
    return optax.adamw(learning_rate=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def test_optimizer_state_follows_its_parameters():
    block = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8, mlp="swiglu", activation="silu"),
                             rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(block, _adamw(), wrt=nnx.Param)
    rules = S.FSDP | S.TENSOR_PARALLEL
    specs = S.partition_specs(nnx.state(opt), rules)
    params = S.partition_specs(nnx.state(block, nnx.Param), rules)
    adam = specs["opt_state"][0]
    for moment in ("mu", "nu"):
        assert jax.tree.leaves(adam[moment]) == jax.tree.leaves(params)
    assert adam[moment]["linear_gate"]["kernel"].get_value() == P("data", "model")
    assert adam["count"].get_value() == P() and specs["step"].get_value() == P()
    S.shard_model(opt, S.make_mesh(1, 1), rules)  # places the optimizer (a graph node) in place


def test_optimizer_state_without_annotations_is_refused_by_name():
    class Extra(nnx.Module):
        def __init__(self):
            self.block = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0))
            self.embed = nnx.Param(jnp.zeros((5, 8)))

    opt = nnx.Optimizer(Extra(), _adamw(), wrt=nnx.Param)
    with pytest.raises(KeyError) as err:
        S.partition_specs(nnx.state(opt), S.FSDP)
    assert "'opt_state/0/mu/embed': optimizer state of shape (5, 8) without a sharding annotation" in str(err.value)
    assert "'opt_state/0/nu/embed'" in str(err.value) and "block" not in str(err.value)

    flat = optax.GradientTransformation(lambda p: jnp.zeros(7), lambda g, s, p=None: (g, s))  # not a tree of params
    opt = nnx.Optimizer(TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0)), flat,
                        wrt=nnx.Param)
    with pytest.raises(KeyError, match="'opt_state': optimizer state of shape \\(7,\\)"):
        S.shard_model(opt, S.make_mesh(1, 1), S.FSDP)


def test_created_inside_a_mesh_flax_shards_eagerly():
    cfg = BlockConfig(d_model=8, num_heads=2, d_ff=8, scaling="rezero")
    mesh = S.make_mesh(data=1, model=1)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="'embed' is no mesh axis: create it under"):
        Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh), nn.logical_axis_rules(S.HYBRID.as_flax_rules()):
        enc = nnx.jit(lambda: Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0)))()  # one program, not one per op
        opt = nnx.Optimizer(enc, _adamw(), wrt=nnx.Param)
    assert enc.layers.linear1.kernel[...].sharding.mesh.axis_names == ("data", "model")
    assert S.misplaced(nnx.state(enc), mesh, S.HYBRID) == [] and S.misplaced(nnx.state(opt), mesh, S.HYBRID) == []


def test_a_pure_dict_is_refused_naming_the_fix():
    block = TransformerBlock(BlockConfig(d_model=8, num_heads=2, d_ff=8), rngs=nnx.Rngs(0))
    with pytest.raises(KeyError, match=r"is a bare array: pass the Variables \(nnx.state\(model\)"):
        S.partition_specs(nnx.to_pure_dict(nnx.state(block, nnx.Param)), S.HYBRID)


def test_sharding_rule_errors():
    with pytest.raises(ValueError, match="onto one mesh axis"):
        S.logical_to_spec(("heads", "mlp"), S.TENSOR_PARALLEL)
    assert S.logical_to_spec(("batch", "seq", "activation_embed"), S.FSDP) == P("data", None, None)
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
    from flax_blocks.stacks import Encoder

    assert jax.device_count() == 8, jax.devices()
    # heads (8) and d_ff (64) divide by every model-axis size used, KV heads (4) by 4 but not
    # by 8 (replicated there); heads != head_dim; the Encoder's layers are TransformerBlocks
    # with a stacked leading layer axis
    cfg = BlockConfig(d_model=24, num_heads=8, num_kv_heads=4, d_ff=64, dropout=0.0, norm="pre", causal=True,
                      scaling="layerscale", param_dtype="float64")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6, 24))
    r = rng.standard_normal((8, 6, 24))
    key_mask = np.ones((8, 6), bool); key_mask[1, 4:] = False
    O1 = {"xla_backend_optimization_level": 1}  # compiles faster; float64 results are exact either way
    # one model, built in one compiled program (eager init would compile every small op)
    graphdef0, state0 = nnx.split(nnx.jit(lambda: Encoder(cfg, num_layers=2, rngs=nnx.Rngs(2)))())

    def run(mesh, rules):
        model = nnx.merge(graphdef0, state0, copy=True)  # fresh Variables on the same arrays
        if mesh is not None:
            S.shard_model(model, mesh, rules)
            assert S.misplaced(nnx.state(model), mesh, rules) == []
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
        qkv = params["layers"]["self_attn"]["in_kernel"][...]  # (L, E, K, G+2, hd), K = 4, G = 2
        k_local = 4 // n_model if 4 % n_model == 0 else 4  # 8 devices on "model": replicated
        assert qkv.addressable_shards[0].data.shape == (2, 24, k_local, 4, 3), (lname, qkv.sharding)
        out = params["layers"]["self_attn"]["out_kernel"][...]  # (L, H, hd, E): split whatever K does
        assert out.addressable_shards[0].data.shape == (2, 8 // n_model, 3, 24), (lname, out.sharding)
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


def _run_on_8_devices(script: str) -> str:
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_sharding_rules_agree_on_8_simulated_devices():
    _run_on_8_devices(_SCRIPT)


_TRAIN_SCRIPT = textwrap.dedent(
    """
    import jax
    import numpy as np, jax.numpy as jnp, optax
    import flax.linen as nn
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from flax_blocks import BlockConfig
    from flax_blocks import sharding as S
    from flax_blocks.stacks import Encoder

    assert jax.device_count() == 8, jax.devices()
    # float32, dropout on (train mode, an explicit dropout stream). No q/k/v biases: the key
    # bias's gradient is zero in exact arithmetic (softmax ignores a shift), so Adam would
    # turn its rounding noise into +-lr steps that differ between any two programs.
    cfg = BlockConfig(d_model=32, num_heads=8, d_ff=64, dropout=0.1, norm="pre", causal=True,
                      scaling="layerscale", qkv_bias=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6, 32), np.float32)
    r = rng.standard_normal((8, 6, 32), np.float32)  # a random cotangent: loss sum(y * r)
    O0 = {"xla_backend_optimization_level": 0}  # compiles faster; the same float32 results here
    graphdef0, state0 = nnx.split(nnx.jit(lambda: Encoder(cfg, num_layers=2, rngs=nnx.Rngs(params=0, dropout=1)))())

    def train_step(model, optimizer, x, r):  # nnx.jit's work, spelled out to pass compiler options
        graphdef, state = nnx.split((model, optimizer))

        def step(state, x, r):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) * r))(model)
            optimizer.update(model, grads)
            return loss, nnx.state((model, optimizer))

        loss, state = jax.jit(step).lower(state, x, r).compile(O0)(state, x, r)
        nnx.update((model, optimizer), state)
        return loss

    def run(mesh, rules):
        model = nnx.merge(graphdef0, state0, copy=True)
        # every hyperparameter explicit (optax's weight_decay default is 1e-4, torch's 1e-2)
        optimizer = nnx.Optimizer(model, optax.adamw(learning_rate=1e-3, b1=0.9, b2=0.95, eps=1e-8,
                                                     weight_decay=0.1), wrt=nnx.Param)
        xs, rs = jnp.asarray(x), jnp.asarray(r)
        if mesh is not None:
            # the model by Flax's recipe, the optimizer (made before, so unplaced) by shard_model
            with nn.logical_axis_rules(rules.as_flax_rules()):
                shardings = nnx.get_named_sharding(nnx.state(model), mesh)
            nnx.update(model, jax.device_put(nnx.state(model), shardings))
            S.shard_model(optimizer, mesh, rules)
            assert S.misplaced(nnx.state(model), mesh, rules) == []
            assert S.misplaced(nnx.state(optimizer), mesh, rules) == []
            xs, rs = (jax.device_put(a, S.input_sharding(mesh, rules)) for a in (x, r))
        count = int(model.rngs.count[...])
        loss = train_step(model, optimizer, xs, rs)
        assert int(model.rngs.count[...]) == count + 1  # the dropout stream was drawn
        return model, optimizer, loss

    def arrays(model, optimizer):
        tree = (nnx.state(model, nnx.Param), nnx.state(optimizer))
        return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(tree)}

    model0, opt0, loss0 = run(None, None)
    ref = arrays(model0, opt0)
    mesh, rules = S.make_mesh(data=2, model=4), S.FSDP | S.TENSOR_PARALLEL
    model, optimizer, loss = run(mesh, rules)
    got = arrays(model, optimizer)
    assert got.keys() == ref.keys() and len(ref) > 40
    err = {k: float(np.max(np.abs(got[k] - ref[k])) / (np.max(np.abs(ref[k])) + 1e-30)) for k in ref}
    worst = max(err, key=err.get)
    assert err[worst] < 1e-5 and abs(float(loss) - float(loss0)) < 1e-5 * abs(float(loss0)), (worst, err[worst])

    # every parameter and optimizer-state array, after the step, placed as declared
    assert S.misplaced(nnx.state(model), mesh, rules) == []
    assert S.misplaced(nnx.state(optimizer), mesh, rules) == []
    adam = optimizer.opt_state[0]
    for name, spec, shard in [("linear1", P(None, "data", "model"), (2, 16, 16)),
                              ("linear2", P(None, "model", "data"), (2, 16, 16))]:
        for arr in (getattr(model.layers, name).kernel[...], adam.mu["layers"][name]["kernel"][...],
                    adam.nu["layers"][name]["kernel"][...]):
            assert arr.sharding.spec == spec and arr.addressable_shards[0].data.shape == shard, (name, arr.sharding)
    for arr in (model.layers.self_attn.in_kernel[...], adam.nu["layers"]["self_attn"]["in_kernel"][...]):
        spec = tuple(arr.sharding.spec)  # (L, E, K, G+2, hd); XLA may drop trailing Nones
        assert spec + (None,) * (5 - len(spec)) == (None, "data", "model", None, None), arr.sharding
    assert adam.count[...].sharding.is_fully_replicated and optimizer.step[...].sharding.is_fully_replicated

    # negative: the check sees a changed declaration, of one Param or of the rules
    kernel = model.layers.linear1.kernel
    kernel.set_metadata(out_sharding=("layers", "mlp", "embed"))
    bad = S.misplaced(nnx.state(model), mesh, rules)
    assert bad == ["layers/linear1/kernel: declared P(None, 'model', 'data'), actual P(None, 'data', 'model')"], bad
    kernel.set_metadata(out_sharding=("layers", "embed", "mlp"))
    bad = S.misplaced(nnx.state(optimizer), mesh, rules | {"mlp": None})
    assert "opt_state/0/mu/layers/linear1/kernel" in "".join(bad) and len(bad) == 2 * 3, bad  # mu, nu: 2 kernels + bias
    print(f"worst {worst} {err[worst]:.1e}")
    print("OK")
    """
)


def test_sharded_train_step_on_8_simulated_devices():
    """FSDP x tensor-parallel AdamW step with dropout: the numbers and the placements."""
    _run_on_8_devices(_TRAIN_SCRIPT)


_EXPLICIT_SCRIPT = textwrap.dedent(
    """
    import sys, tempfile
    import jax, numpy as np, optax, torch, transformers
    from jax.sharding import AxisType
    from flax import nnx
    import flax_blocks as fb
    from flax_blocks import sharding as S

    assert jax.device_count() == 8, jax.devices()
    folder = tempfile.mkdtemp()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                      intermediate_size=64, num_hidden_layers=2, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    ids = np.random.default_rng(0).integers(0, 64, (4, 6))
    ref = fb.from_hf(folder, part="causal-lm")
    want = np.asarray(ref(ids))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None)

    moe = tempfile.mkdtemp()
    config = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                         intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                         num_hidden_layers=1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(moe)
    want_moe = np.asarray(fb.from_hf(moe, part="causal-lm")(ids))

    explicit = jax.make_mesh((2, 4), ("data", "model"))  # JAX 0.10's default: Explicit axes
    assert explicit.axis_types == (AxisType.Explicit,) * 2
    # mixed axes, and expert parallelism: the experts over an Explicit "expert" axis
    mixed = jax.make_mesh((2, 2, 2), ("data", "model", "expert"),
                          axis_types=(AxisType.Explicit, AxisType.Auto, AxisType.Explicit))
    for mesh, source, rules, ref_logits in ((explicit, folder, S.HYBRID, want),
                                            (mixed, moe, S.HYBRID | S.EXPERT_PARALLEL, want_moe)):
        lm = fb.from_hf(source, part="causal-lm", mesh=mesh, rules=rules)
        x = jax.device_put(ids, S.token_sharding(mesh))
        got = lm(x)
        assert got.sharding.spec[0] == "data", got.sharding
        err = np.abs(np.asarray(got) - ref_logits).max() / np.abs(ref_logits).max()
        assert err < 1e-5, err
    assert lm.encoder.layers.experts.up[...].sharding.spec[1] == "expert"  # (layers, experts, ...)

    lm = fb.from_hf(folder, part="causal-lm", mesh=explicit, rules=S.HYBRID)
    x = jax.device_put(ids, S.token_sharding(explicit))
    np.testing.assert_array_equal(np.asarray(fb.generate(lm, x, max_new_tokens=3)),
                                  np.asarray(fb.generate(ref, ids, max_new_tokens=3)))
    optimizer = S.sharded_optimizer(lm, optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))

    @nnx.jit
    def step(model, optimizer, x):
        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x[:, :-1]), x[:, 1:]).mean()
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    first = float(step(lm, optimizer, x))
    n = len(compiles)
    second = float(step(lm, optimizer, x))
    assert len(compiles) == n, compiles[n:]  # step 2 runs the program of step 1
    loss0 = float(optax.softmax_cross_entropy_with_integer_labels(ref(ids[:, :-1]), ids[:, 1:]).mean())
    assert abs(first - loss0) < 1e-5 * loss0 and second < first, (first, loss0, second)
    assert S.misplaced(nnx.state(optimizer), explicit, S.HYBRID) == []
    print("OK")
    """
)


def test_jax_make_mesh_explicit_and_mixed_axes_on_8_simulated_devices():
    """jax.make_mesh's default mesh (Explicit axes) and a mixed one with an "expert" axis: a
    sharded load, the call (logits equal to the unsharded model's, the batch split over "data";
    a Qwen2-MoE's experts over "expert"), generate, and a jitted optax step whose second call
    compiles nothing (sharded_optimizer)."""
    _run_on_8_devices(_EXPLICIT_SCRIPT)
