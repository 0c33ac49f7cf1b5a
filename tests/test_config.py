"""BlockConfig: validation, depth-dependent constants, the declared init distributions, the
shared residual add, and the promise that the config imports no framework.

Nothing here imports jax or torch (the import checks run in subprocesses)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from block_options import init_spec  # the declared distribution of a parameter, by torch name

from flax_blocks.core.config import (
    ACTIVATIONS,
    DTYPES,
    INITS,
    MLPS,
    NORM_TYPES,
    NORMS,
    RESIDUALS,
    SCALINGS,
    BlockConfig,
    check_width,
    invert_mask,
)

BASE = dict(d_model=12, num_heads=3, d_ff=20)


def make(**kw) -> BlockConfig:
    return BlockConfig(**{**BASE, **kw})


# ------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------

ENUM_FIELDS = [
    ("activation", "swish", ACTIVATIONS),
    ("activation", "GELU", ACTIVATIONS),
    ("norm", "sandwich", NORMS),
    ("norm", None, NORMS),
    ("norm_type", "batchnorm", NORM_TYPES),
    ("mlp", "moe", MLPS),
    ("residual", "mul", RESIDUALS),
    ("scaling", "admin", SCALINGS),
    ("init", "kaiming", INITS),
    ("dtype", "float8", (None, *DTYPES)),
    ("dtype", "int32", (None, *DTYPES)),
    ("param_dtype", "int8", DTYPES),
    ("param_dtype", None, DTYPES),
]


@pytest.mark.parametrize("field,value,allowed", ENUM_FIELDS)
def test_bad_choice_names_every_allowed_value(field, value, allowed):
    with pytest.raises(ValueError) as e:
        make(**{field: value})
    msg = str(e.value)
    assert field in msg and repr(value) in msg
    for a in allowed:
        assert repr(a) in msg, (a, msg)


@pytest.mark.parametrize(
    "kw,fragments",
    [
        (dict(d_model=10, num_heads=3), ["d_model (10)", "divisible", "num_heads (3)"]),
        (dict(d_model=0), ["d_model", "positive int", "0"]),
        (dict(d_model=-12), ["d_model", "positive int"]),
        (dict(d_model=12.0), ["d_model", "positive int", "12.0"]),
        (dict(d_model=True, num_heads=1), ["d_model", "positive int", "True"]),
        (dict(num_heads=0), ["num_heads", "positive int"]),
        (dict(d_ff=0), ["d_ff", "positive int"]),
        (dict(d_ff="20"), ["d_ff", "positive int"]),
        (dict(dropout=-0.1), ["dropout", "[0, 1)", "-0.1"]),
        (dict(dropout=1.0), ["dropout", "[0, 1)", "1.0"]),
        (dict(dropout=float("nan")), ["dropout", "[0, 1)", "nan"]),
        (dict(layer_norm_eps=0.0), ["layer_norm_eps", "> 0"]),
        (dict(layer_norm_eps=-1e-5), ["layer_norm_eps", "> 0"]),
        (dict(scaling="deepnorm", norm="pre"), ["deepnorm", "norm='post'", "norm='pre'"]),
        (dict(scaling="deepnorm", norm="none"), ["deepnorm", "norm='post'", "norm='none'"]),
        (dict(scaling="rezero", residual="none", norm="pre"), ["rezero", "residual='add'"]),
        (dict(scaling="layerscale", residual="none", norm="pre"), ["layerscale", "residual='add'"]),
        (dict(scaling="deepnorm", residual="none"), ["deepnorm", "residual='add'"]),
        (dict(scaling="deepnorm", deepnorm_alpha=0.0), ["deepnorm_alpha", "> 0"]),
        (dict(scaling="deepnorm", deepnorm_beta=-1.0), ["deepnorm_beta", "> 0"]),
        (dict(scaling="layerscale", norm="pre", layerscale_init=0.0), ["layerscale_init", "> 0"]),
        (dict(num_kv_heads=2), ["num_kv_heads", "divisor of num_heads (3)", "2"]),
        (dict(num_kv_heads=0), ["num_kv_heads", "divisor"]),
        (dict(num_kv_heads=1.0), ["num_kv_heads", "1.0"]),
        (dict(d_model=18, num_heads=2, rope_theta=1e4), ["rope_theta", "even head_dim", "head_dim=9"]),
        (dict(head_dim=0), ["head_dim", "positive int"]),
        (dict(attention="fused", attn_logit_softcapping=50.0), ["attention='fused'", "soft-cap", "'blocked'"]),
        (dict(query_pre_attn_scalar=0), ["query_pre_attn_scalar", "> 0"]),
        (dict(partial_rotary_factor=1.5), ["partial_rotary_factor", "(0, 1]"]),
        (dict(d_model=8, num_heads=4, rope_theta=1e4, partial_rotary_factor=0.25), ["rotary_dim", "at least 1"]),
        (dict(d_model=12, num_heads=4, rope_theta=1e4), ["even head_dim"]),  # 3 dims: HF rotates 4, no head has
        (dict(norm_weight_offset=float("nan")), ["norm_weight_offset", "finite"]),
        (dict(qk_norm_over="heads"), ["qk_norm_over", "projection"]),
        (dict(mlp_bias=1), ["mlp_bias", "None or a bool"]),
        (dict(norm_bias="yes"), ["norm_bias", "None or a bool"]),
        (dict(sliding_window=4, attention="blocked"), ["sliding_window=4", "bidirectional", "causal=True"]),
        (dict(sliding_window=4, pattern_global_first=True), ["pattern_global_first", "sliding_window_pattern"]),
        (dict(first_attn_norm=False), ["first_attn_norm=False", "norm='pre'", "norm='post'"]),
        (dict(sliding_window=0, causal=True), ["sliding_window", "positive int"]),
        (dict(sliding_window_pattern=2, causal=True), ["sliding_window_pattern", "needs sliding_window"]),
        (dict(rope_local_theta=10.0, sliding_window=4, causal=True), ["rope_local_theta", "rope_theta"]),
        (dict(sliding_window=4, sliding_window_pattern=2, causal=True, attention="fused"), ["'fused'", "pattern"]),
        (dict(parallel_residual="two_norms"), ["parallel_residual", "norm='pre'", "norm='post'"]),
        (dict(parallel_residual=True, norm="pre"), ["parallel_residual", "shared_norm"]),
        (dict(d_model=18, num_heads=4), ["divisible", "head_dim given"]),
        (dict(num_heads=2, head_dim=5, rope_theta=1e4), ["rope_theta", "even head_dim", "head_dim=5"]),
        (dict(rope_theta=-1.0), ["rope_theta", "> 0"]),
        (dict(mlp="swiglu"), ["mlp='swiglu'", "activation='silu'", "activation='relu'"]),
        (dict(mlp="geglu", activation="silu"), ["mlp='geglu'", "'gelu'", "activation='silu'"]),
        (dict(qk_norm=1), ["qk_norm", "1"]),
        (dict(qkv_bias="yes"), ["qkv_bias", "'yes'"]),
        (dict(norm_type="dyt", qk_norm=True), ["norm_type='dyt'", "qk_norm=True", "ambiguous"]),
        (dict(norm_type="dyt", dyt_alpha_init=0.0), ["dyt_alpha_init", "> 0"]),
        (dict(layernorm_scaling=True), ["layernorm_scaling", "norm='pre'", "norm='post'"]),
        (dict(layernorm_scaling=True, norm="peri"), ["layernorm_scaling", "norm='pre'", "Peri-LN's output norm"]),
        (dict(layernorm_scaling=True, norm="none"), ["layernorm_scaling", "norm='none'"]),
        (dict(layernorm_scaling=1, norm="pre"), ["layernorm_scaling", "bool"]),
        # GPT-OSS's options
        (dict(attn_sinks=True, attention="fused"), ["attention='fused'", "attn_sinks", "'blocked'"]),
        (dict(attn_sinks=1), ["attn_sinks", "bool"]),
        # Falcon-RW's ALiBi: the dense path alone adds its biases
        (dict(alibi=True, attention="blocked"), ["attention='blocked'", "ALiBi", "'dense'"]),
        (dict(alibi=True, attention="fused"), ["attention='fused'", "ALiBi"]),
        (dict(alibi=1), ["alibi", "bool"]),
        # Llama 4's chunked attention: causal, without a window, the dense path alone
        (dict(attention_chunk_size=4), ["attention_chunk_size=4", "causal=True", "causal=False"]),
        (dict(attention_chunk_size=4, causal=True, attention="fused"), ["masks chunks", "attention='fused'"]),
        (dict(attention_chunk_size=4, causal=True, sliding_window=2), ["no sliding_window", "sliding_window=2"]),
        (dict(attention_chunk_size=0, causal=True), ["attention_chunk_size", "positive int", "0"]),
        (dict(attention_chunk_size=True, causal=True), ["attention_chunk_size", "positive int", "True"]),
        (dict(unchunked_layers=(1,)), ["unchunked_layers=(1,)", "needs attention_chunk_size"]),
        (dict(attention_chunk_size=4, causal=True, unchunked_layers=(-1,)), ["unchunked_layers", "indices >= 0"]),
        (dict(swiglu_limit=7.0), ["swiglu_limit=7.0", "num_experts > 0"]),
        (dict(num_experts=2, mlp="swiglu", activation="silu", swiglu_limit=0.0), ["swiglu_limit", "> 0"]),
        (dict(num_experts=2, swiglu_limit=7.0), ["swiglu_limit=7.0", "mlp='swiglu'", "mlp='dense'"]),
        (dict(num_experts=2, mlp="swiglu", activation="silu", swiglu_limit=7.0, shared_expert_d_ff=4),
         ["swiglu_limit", "shared_expert_d_ff=4"]),
        (dict(num_experts=2, mlp="swiglu", activation="silu", swiglu_alpha=float("nan")), ["swiglu_alpha", "finite"]),
        (dict(num_experts=2, experts_bias="yes"), ["experts_bias", "bool"]),
    ],
)
def test_invalid_values_raise_valueerror_saying_what_is_allowed(kw, fragments):
    with pytest.raises(ValueError) as e:
        make(**kw)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_valid_configs_construct():
    for a in ACTIVATIONS:
        make(activation=a)
    for n in NORMS:
        make(norm=n)
    for s, n in [("none", "post"), ("deepnorm", "post"), ("rezero", "none"), ("rezero", "pre"), ("layerscale", "pre")]:
        make(scaling=s, norm=n)
    for dt in (None, *DTYPES):
        make(dtype=dt)
    for p in DTYPES:
        make(param_dtype=p)
    make(dropout=0.0), make(dropout=0.999), make(residual="none", norm="pre"), make(bias=False, causal=True)
    llama = BlockConfig(d_model=64, num_heads=8, num_kv_heads=2, norm="pre", norm_type="rmsnorm", mlp="swiglu",
                        activation="silu", rope_theta=10000.0, qk_norm=True, bias=False, causal=True, dropout=0.0)
    assert (llama.head_width, llama.kv_heads, llama.has_qkv_bias, llama.gated) == (8, 2, False, True)
    assert (llama.head_dim, BlockConfig(18, 4, head_dim=6).head_width) == (None, 6)  # Qwen3 / Gemma: explicit
    stablelm = BlockConfig(8, 2, bias=False, norm_bias=True)
    assert (stablelm.has_norm_bias, stablelm.has_mlp_bias, BlockConfig(8, 2, mlp_bias=False).has_mlp_bias) == (
        True, False, False)
    assert BlockConfig(8, 2, bias=False, qkv_bias=True).has_qkv_bias and BlockConfig(8, 2).kv_heads == 2
    make(mlp="geglu", activation="gelu_tanh"), make(norm="peri", norm_type="rmsnorm")


def test_dtype_objects_are_accepted_and_named():
    import ml_dtypes

    for obj, name in [(np.float32, "float32"), (np.dtype("float64"), "float64"), (ml_dtypes.bfloat16, "bfloat16"),
                      (np.float16, "float16")]:
        cfg = make(dtype=obj, param_dtype=obj)
        assert (cfg.dtype, cfg.param_dtype) == (name, name) and cfg == make(dtype=name, param_dtype=name)
    with pytest.raises(ValueError, match="param_dtype"):
        make(param_dtype=np.int32)


def test_defaults_are_torchs_encoder_layer_defaults():
    cfg = BlockConfig(d_model=512, num_heads=8)
    assert (cfg.d_ff, cfg.dropout, cfg.activation, cfg.layer_norm_eps, cfg.norm, cfg.bias) == (
        2048, 0.1, "relu", 1e-5, "post", True)
    assert (cfg.residual, cfg.scaling, cfg.causal, cfg.init, cfg.dtype, cfg.param_dtype) == (
        "add", "none", False, "torch", None, "float32")
    assert cfg.head_width == 64


def test_config_is_frozen_and_hashable():
    cfg = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 24  # type: ignore[misc]
    assert hash(cfg) == hash(make()) and cfg == make() and cfg != make(causal=True)


# ------------------------------------------------------------------------------------
# resolve(): the published depth formulas
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 6, 12, 48, 1000])
def test_deepnorm_resolve_formulas(n):
    r = make(scaling="deepnorm").resolve(n)
    assert r.deepnorm_alpha == pytest.approx((2 * n) ** 0.25, rel=1e-12)
    assert r.deepnorm_beta == pytest.approx((8 * n) ** -0.25, rel=1e-12)
    assert r.residual_alpha == pytest.approx((2 * n) ** 0.25, rel=1e-12)
    assert r.layerscale_init is None


def test_deepnorm_known_values_and_explicit_values_kept():
    r = make(scaling="deepnorm").resolve(6)
    assert r.deepnorm_alpha == pytest.approx(12 ** 0.25) and r.deepnorm_alpha == pytest.approx(1.8612097)
    assert r.deepnorm_beta == pytest.approx(48 ** -0.25) and r.deepnorm_beta == pytest.approx(0.3799178)
    kept = make(scaling="deepnorm", deepnorm_alpha=3.0, deepnorm_beta=0.5).resolve(100)
    assert (kept.deepnorm_alpha, kept.deepnorm_beta) == (3.0, 0.5)
    # resolving once fixes the constants: a later resolve (as each block does) keeps them
    assert make(scaling="deepnorm").resolve(48).resolve().deepnorm_alpha == pytest.approx(96 ** 0.25)
    # un-resolved: residual_alpha of a single block (N = 1)
    assert make(scaling="deepnorm").residual_alpha == pytest.approx(2 ** 0.25)


@pytest.mark.parametrize("n,eps", [(1, 0.1), (12, 0.1), (18, 0.1), (19, 1e-5), (24, 1e-5), (25, 1e-6), (36, 1e-6),
                                   (200, 1e-6)])
def test_layerscale_eps_by_depth(n, eps):
    r = make(scaling="layerscale", norm="pre").resolve(n)
    assert r.layerscale_init == eps
    assert init_spec(r, "scale1") == ("const", eps)
    assert make(scaling="layerscale", norm="pre", layerscale_init=0.5).resolve(n).layerscale_init == 0.5


def test_resolve_leaves_other_schemes_alone_and_rejects_bad_depth():
    for kw in [dict(), dict(scaling="rezero", norm="pre")]:
        cfg = make(**kw)
        assert cfg.resolve(48) == cfg
        assert cfg.residual_alpha == 1.0
        assert cfg.resolve(48).deepnorm_alpha is None and cfg.resolve(48).layerscale_init is None
    for bad in (0, -3):
        with pytest.raises(ValueError, match="num_layers"):
            make().resolve(bad)


# ------------------------------------------------------------------------------------
# The declared init distributions (flax_blocks.core.declarations), by torch name
# ------------------------------------------------------------------------------------

E, F = 16, 40


def spec_cfg(**kw):
    return BlockConfig(d_model=E, num_heads=4, d_ff=F, **kw)


def test_init_spec_torch_scheme():
    cfg = spec_cfg()
    qkv = init_spec(cfg, "self_attn.in_proj_weight")
    assert len(qkv) == 3
    for s in qkv:  # xavier-uniform over the packed (3E, E) matrix
        assert s[0] == "uniform" and s[1] == pytest.approx(math.sqrt(6 / (4 * E)))
    assert init_spec(cfg, "self_attn.in_proj_bias") == ("const", 0.0)
    assert init_spec(cfg, "self_attn.out_proj.bias") == ("const", 0.0)
    # nn.Linear: kaiming_uniform(a=sqrt(5)) == U(+-1/sqrt(fan_in)), bias too
    assert init_spec(cfg, "self_attn.out_proj.weight") == ("uniform", pytest.approx(1 / math.sqrt(E)))
    assert init_spec(cfg, "linear1.weight") == ("uniform", pytest.approx(1 / math.sqrt(E)))
    assert init_spec(cfg, "linear1.bias") == ("uniform", pytest.approx(1 / math.sqrt(E)))
    assert init_spec(cfg, "linear2.weight") == ("uniform", pytest.approx(1 / math.sqrt(F)))
    assert init_spec(cfg, "linear2.bias") == ("uniform", pytest.approx(1 / math.sqrt(F)))
    assert init_spec(cfg, "norm1.weight") == ("const", 1.0)
    assert init_spec(cfg, "norm1.bias") == ("const", 0.0)


def test_init_spec_grouped_query_packs_fewer_rows():
    cfg = spec_cfg(num_kv_heads=2)  # q: 4 heads x 4, k and v: 2 heads x 4 rows each
    from flax_blocks.core.declarations import attention

    (w,) = [p for p in attention(cfg).params if p.torch == "in_proj_weight"]
    assert w.shape == (E + 2 * 8, E) and [rows for rows, _ in w.init] == [E, 8, 8]
    for _, s in w.init:  # torch's scheme: xavier over the whole packed matrix
        assert s == ("uniform", pytest.approx(math.sqrt(6 / (E + 32))))
    x = spec_cfg(num_kv_heads=2, init="xavier")
    (w,) = [p for p in attention(x).params if p.torch == "in_proj_weight"]
    assert [s[1] for _, s in w.init] == pytest.approx([math.sqrt(6 / (2 * E)), math.sqrt(6 / (E + 8)),
                                                       math.sqrt(6 / (E + 8))])


def test_init_spec_xavier_scheme():
    cfg = spec_cfg(init="xavier", mlp="swiglu", activation="silu")
    for s in init_spec(cfg, "self_attn.in_proj_weight"):  # per chunk (E, E)
        assert s == ("uniform", pytest.approx(math.sqrt(6 / (2 * E))))
    assert init_spec(cfg, "self_attn.out_proj.weight") == ("uniform", pytest.approx(math.sqrt(6 / (2 * E))))
    assert init_spec(cfg, "linear1.weight") == ("uniform", pytest.approx(math.sqrt(6 / (E + F))))
    assert init_spec(cfg, "linear_gate.weight") == ("uniform", pytest.approx(math.sqrt(6 / (E + F))))
    assert init_spec(cfg, "linear2.weight") == ("uniform", pytest.approx(math.sqrt(6 / (E + F))))
    for name in ("self_attn.in_proj_bias", "self_attn.out_proj.bias", "linear1.bias", "linear2.bias", "norm1.bias"):
        assert init_spec(cfg, name) == ("const", 0.0)
    assert init_spec(cfg, "norm1.weight") == ("const", 1.0)


@pytest.mark.parametrize("n", [1, 12])
def test_init_spec_deepnorm_gains(n):
    cfg = spec_cfg(scaling="deepnorm").resolve(n)
    beta = (8 * n) ** -0.25
    q, k, v = init_spec(cfg, "self_attn.in_proj_weight")
    assert q == ("normal", pytest.approx(math.sqrt(2 / (2 * E))))  # q, k: gain 1
    assert k == q
    assert v == ("normal", pytest.approx(beta * math.sqrt(2 / (2 * E))))  # v, out, FFN: gain beta
    assert init_spec(cfg, "self_attn.out_proj.weight") == ("normal", pytest.approx(beta * math.sqrt(1 / E)))
    assert init_spec(cfg, "linear1.weight") == ("normal", pytest.approx(beta * math.sqrt(2 / (E + F))))
    assert init_spec(cfg, "linear2.weight") == ("normal", pytest.approx(beta * math.sqrt(2 / (E + F))))
    for name in ("self_attn.in_proj_bias", "self_attn.out_proj.bias", "linear1.bias", "linear2.bias"):
        assert init_spec(cfg, name) == ("const", 0.0)


def test_init_spec_gates():
    assert init_spec(spec_cfg(scaling="rezero", norm="none"), "scale1") == ("const", 0.0)
    assert init_spec(spec_cfg(scaling="layerscale", norm="pre"), "scale2") == ("const", 0.1)
    assert init_spec(spec_cfg(scaling="layerscale", norm="pre").resolve(30), "scale1") == ("const", 1e-6)


# ------------------------------------------------------------------------------------
# check_width, invert_mask (framework-free, checked with numpy; the residual formulas are
# in tests/test_residual_order.py)
# ------------------------------------------------------------------------------------


def test_check_width():
    cfg = make()
    check_width(cfg, (2, 5, 12))
    check_width(cfg, (5, 12))
    for bad in [(2, 5, 13), (5, 24), (12,), (1, 2, 5, 12), (2, 12, 5)]:
        with pytest.raises(ValueError) as e:
            check_width(cfg, bad, what="x")
        msg = str(e.value)
        assert str(bad) in msg and "(batch, seq, 12)" in msg and msg.startswith("x")


def test_invert_mask_numpy():
    m = np.array([[True, False], [False, False]])
    np.testing.assert_array_equal(invert_mask(m), ~m)
    np.testing.assert_array_equal(invert_mask(invert_mask(m)), m)
    assert invert_mask(None) is None
    for bad in [m.astype(np.int32), m.astype(np.float32), [[True, False]], True]:
        with pytest.raises(TypeError, match="boolean"):
            invert_mask(bad)
    with pytest.raises(TypeError, match="float32"):
        invert_mask(m.astype(np.float32))


# ------------------------------------------------------------------------------------
# The config imports no framework
# ------------------------------------------------------------------------------------


def _loaded_after(code: str) -> set[str]:
    probe = code + "\nimport sys\nprint(' '.join(m for m in ('jax', 'flax', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "code",
    [
        "import flax_blocks.core.config",
        "from flax_blocks import BlockConfig, invert_mask; BlockConfig(d_model=4, num_heads=2)",
        "from flax_blocks.core.declarations import block, BlockConfig; block(BlockConfig(4, 2), 'TransformerBlock')",
        "import flax_blocks.core.options, flax_blocks.core.lm_config",
    ],
)
def test_config_imports_no_framework(code):
    assert _loaded_after(code) == set()


def test_torch_blocks_imports_torch_but_neither_jax_nor_flax():
    assert _loaded_after("import torch_blocks; torch_blocks.Encoder") == {"torch"}


def test_torch_blocks_takes_only_the_spec_from_flax_blocks():
    """Statically, every import of flax_blocks in torch_blocks is of the framework-free spec
    (flax_blocks.core.*), of the framework-free checkpoint reading that tb.from_hf shares with
    fb.from_hf (flax_blocks.checkpoints.*, never its JAX-side converter `convert`: importing
    torch_blocks and loading through it loads no JAX, test_torch_blocks_imports_torch_but_neither_jax_nor_flax and
    parity_tests/hf/test_torch_from_hf.py), or of the package's own __init__ (__version__, BlockConfig)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    taken = set()
    for path in (root / "torch_blocks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                taken.add(node.module)
            elif isinstance(node, ast.Import):
                taken.update(alias.name for alias in node.names)
    flax_side = {m for m in taken if m.split(".")[0] == "flax_blocks"}
    assert flax_side and all(m == "flax_blocks" or m.startswith(("flax_blocks.core", "flax_blocks.checkpoints"))
                             and not m.startswith("flax_blocks.checkpoints.convert") for m in flax_side), flax_side


def test_flax_blocks_imports_jax_but_not_torch():
    # also shows the probe is not vacuous: it does see the framework that was imported
    assert _loaded_after("import flax_blocks; flax_blocks.TransformerBlock") == {"jax", "flax"}


def test_sinks_never_take_the_fused_path():
    """Attention sinks join the softmax's denominator, which jax.nn.dot_product_attention and SDPA have no
    place for: "auto" takes the blocked path past AUTO_MIN_KEYS even on a GPU (Flax), torch the explicit
    softmax."""
    from flax_blocks.attention import attention_path
    from torch_blocks.attention import attention_path as torch_attention_path

    cfg = make(attn_sinks=True, causal=True)
    for platform in ("cpu", "gpu"):
        assert attention_path(cfg, 4096, need_weights=False, explicit_mask=False, dropout_active=False,
                              platform=platform) == "blocked"
    assert attention_path(make(causal=True), 4096, need_weights=False, explicit_mask=False, dropout_active=False,
                          platform="gpu") == "fused"
    assert torch_attention_path(cfg, need_weights=False) == "dense"


@pytest.mark.parametrize("option, flax", [(dict(alibi=True), "dense"), (dict(attention_chunk_size=4), "blocked")])
def test_alibi_and_chunks_take_the_paths_that_compute_them(option, flax):
    """ALiBi's biases are added on the dense path alone, Llama 4's chunks masked on the dense path and Flax's
    blocked kernel: "auto" never takes a fused kernel (either twin) nor SDPA (torch) for them."""
    from flax_blocks.attention import attention_path
    from torch_blocks.attention import attention_path as torch_attention_path

    cfg = make(causal=True, **option)
    for platform in ("cpu", "gpu"):
        assert attention_path(cfg, 4096, need_weights=False, explicit_mask=False, dropout_active=False,
                              platform=platform) == flax
    for platform in ("cpu", "cuda"):
        assert torch_attention_path(cfg, 4096, need_weights=False, platform=platform) == "dense"
        assert torch_attention_path(make(causal=True), 4096, need_weights=False, platform=platform) == "fused"
