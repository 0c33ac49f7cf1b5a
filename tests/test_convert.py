"""The converter: stock checkpoints, lossless round trips, strict and atomic failures, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file

import flax_blocks as fb
import torch_blocks as tb
from flax_blocks.checkpoints.convert import (
    ConversionError,
    flax_state_dict,
    infer_config,
    load_flax_state_dict,
    load_torch_state_dict,
    torch_state_dict,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# heads != head_dim everywhere, so a wrong reshape of the packed projection cannot pass
CFG = fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, norm="pre", activation="gelu")
KINDS = ["ResidualMHA", "FeedForward", "TransformerBlock", "Encoder"]
CONFIGS = {
    "pre": CFG,
    "post_nobias": replace(CFG, norm="post", bias=False),
    "rezero": replace(CFG, norm="none", scaling="rezero"),
    "layerscale": replace(CFG, scaling="layerscale"),
    "deepnorm": replace(CFG, norm="post", scaling="deepnorm"),
    "dyt": replace(CFG, norm_type="dyt"),
    "families": replace(CFG, num_heads=3, num_kv_heads=1, head_dim=6, qk_norm=True, qk_norm_over="projection",
                        norm="out", norm_type="rmsnorm", norm_weight_offset=1.0),  # issue 22's block options
}


def flax_module(kind: str, cfg: fb.BlockConfig = CFG, seed: int = 0, num_layers: int = 3, **kw):
    cls = getattr(fb, kind)
    if kind == "Encoder":
        return cls(cfg, num_layers=num_layers, rngs=nnx.Rngs(seed), **kw)
    return cls(cfg, rngs=nnx.Rngs(seed))


def torch_module(kind: str, cfg: fb.BlockConfig = CFG, seed: int = 0, num_layers: int = 3, **kw):
    g = torch.Generator().manual_seed(seed)
    cls = getattr(tb, kind)
    if kind == "Encoder":
        return cls(cfg, num_layers=num_layers, generator=g, **kw)
    return cls(cfg, generator=g)


def snapshot(module) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in flax_state_dict(module).items()}


def assert_same_bytes(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def stock_encoder(num_layers: int = 6, seed: int = 0) -> torch.nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(12, 2, 20, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers, norm=torch.nn.LayerNorm(12), enable_nested_tensor=False)
    with torch.no_grad():  # stock deep-copies one layer: make the layers (and norms) differ
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def test_stock_encoder_checkpoint_loads_and_matches(tmp_path):
    model = stock_encoder()
    path = tmp_path / "encoder.pt"
    torch.save(model.state_dict(), path)
    enc = fb.from_torch(fb.Encoder, CFG, str(path), num_layers=6)  # strict: every key used
    x = np.random.default_rng(0).normal(size=(3, 7, 12)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = np.asarray(enc(jnp.asarray(x)))
    assert np.abs(got - want).max() <= 1e-5
    # negative twin: the same weights in a tanh-GELU block miss at this tolerance
    wrong = fb.from_torch(fb.Encoder, replace(CFG, activation="gelu_tanh"), str(path), num_layers=6)
    assert np.abs(np.asarray(wrong(jnp.asarray(x))) - want).max() > 1e-5


def test_from_torch_equals_init_then_load_and_has_working_dropout():
    model = stock_encoder(num_layers=2)
    cfg = replace(CFG, dropout=0.5)
    eager = fb.Encoder(cfg, num_layers=2, rngs=nnx.Rngs(0))
    result = load_torch_state_dict(eager, model)
    assert result.missing_keys == [] and result.unexpected_keys == []
    built = fb.from_torch(fb.Encoder, cfg, model, num_layers=2, seed=3)
    assert_same_bytes(flax_state_dict(built), flax_state_dict(eager))
    x = jnp.ones((1, 4, 12))
    eager.eval(), built.eval()
    np.testing.assert_array_equal(built(x), eager(x))
    # the RNG state was made concrete: training mode draws fresh dropout masks per call,
    # under nnx.jit too, and the stacked layers got one key each
    built.train()
    call = nnx.jit(lambda m, x: m(x))
    a, b = np.asarray(call(built, x)), np.asarray(call(built, x))
    assert np.isfinite(a).all() and not np.array_equal(a, b)
    keys = jax.random.key_data(built.layers.dropouts[0].rngs.key[...])
    assert keys.shape[0] == 2 and not np.array_equal(keys[0], keys[1])
    # strict: a checkpoint that lacks a tensor is an error naming it, not a half-built module
    sd = {k: v for k, v in model.state_dict().items() if k != "layers.1.linear2.bias"}
    with pytest.raises(ConversionError, match=r"missing key layers\.1\.linear2\.bias"):
        fb.from_torch(fb.Encoder, cfg, sd, num_layers=2)


def test_safetensors_loads_without_torch(tmp_path):
    model = stock_encoder()
    path = tmp_path / "encoder.safetensors"
    save_file({k: v.numpy() for k, v in model.state_dict().items()}, str(path))
    x = np.random.default_rng(1).normal(size=(2, 5, 12)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "want.npy", want)
    script = f"""
import sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np, jax.numpy as jnp
import flax_blocks as fb
cfg = fb.BlockConfig(d_model=12, num_heads=2, d_ff=20, dropout=0.0, norm="pre", activation="gelu")
enc = fb.from_torch(fb.Encoder, cfg, {str(path)!r}, num_layers=6)
x = np.load({str(tmp_path / 'x.npy')!r})
err = np.abs(np.asarray(enc(jnp.asarray(x))) - np.load({str(tmp_path / 'want.npy')!r})).max()
assert err <= 1e-5, err
sd = fb.torch_state_dict(enc)
try:
    fb.load_torch_state_dict(enc, {str(tmp_path / 'missing.pt')!r})
except FileNotFoundError as e:  # named before any import of torch is attempted
    assert "checkpoint not found" in str(e) and "missing.pt" in str(e), e
else:
    raise AssertionError("loading a missing checkpoint raised nothing")
open({str(tmp_path / 'enc.pt')!r}, "wb").close()
try:
    fb.load_torch_state_dict(enc, {str(tmp_path / 'enc.pt')!r})
except ImportError as e:
    assert "'torch' extra" in str(e), e
    print("OK", err)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK")


ROUND_TRIPS = [(k, "pre") for k in KINDS] + [("Encoder", n) for n in CONFIGS if n != "pre"] + [
    ("ResidualMHA", "rezero"), ("FeedForward", "layerscale"), ("FeedForward", "post_nobias")]


def abstract_module(kind: str, cfg: fb.BlockConfig, num_layers: int = 3):
    """A module with shapes but no values: a load target that costs no random init."""
    return nnx.eval_shape(lambda: flax_module(kind, cfg, num_layers=num_layers))


@pytest.mark.parametrize("kind,name", ROUND_TRIPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_round_trips_are_bit_exact(kind, name, dtype):
    cfg = replace(CONFIGS[name], param_dtype=dtype)
    with jax.enable_x64(dtype == "float64"):
        # torch -> Flax -> torch
        tmod = torch_module(kind, cfg, seed=3)
        with torch.no_grad():  # gates and norms start constant: make every tensor distinct
            for p in tmod.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype))
        fmod = abstract_module(kind, cfg)
        load_torch_state_dict(fmod, tmod)
        back = torch_state_dict(fmod)
        original = tmod.state_dict()
        assert set(back) == set(original)
        for k, v in original.items():
            again = tb.to_tensor(back[k])
            assert again.dtype == v.dtype and again.shape == v.shape, k
            assert torch.equal(again, v), k
        tmod.load_state_dict(tb.to_tensors(back), strict=True)
        # Flax -> torch -> Flax
        fmod2 = flax_module(kind, cfg, seed=5)
        before = snapshot(fmod2)
        tmod2 = torch_module(kind, cfg, seed=6)
        tmod2.load_state_dict(tb.to_tensors(torch_state_dict(fmod2)), strict=True)
        fmod3 = abstract_module(kind, cfg)
        load_torch_state_dict(fmod3, tmod2.state_dict())
        assert_same_bytes(before, snapshot(fmod3))
        assert str(next(iter(before.values())).dtype) == dtype


def test_dtype_preserved_and_cast():
    model = stock_encoder(num_layers=2).double()
    enc = fb.Encoder(CFG, num_layers=2, rngs=nnx.Rngs(0))
    with pytest.raises(ConversionError, match="jax_enable_x64 is off"):
        load_torch_state_dict(enc, model.state_dict())
    load_torch_state_dict(enc, model.state_dict(), dtype=np.float32)
    assert all(v.dtype == np.float32 for v in flax_state_dict(enc).values())
    with jax.enable_x64(True):
        enc = fb.Encoder(CFG, num_layers=2, rngs=nnx.Rngs(0))
        load_torch_state_dict(enc, model.state_dict())
        assert all(v.dtype == np.float64 for v in flax_state_dict(enc).values())
        x = np.random.default_rng(0).normal(size=(2, 4, 12))
        y = enc(jnp.asarray(x))
        assert y.dtype == jnp.float64
        with torch.no_grad():
            want = model.eval()(torch.from_numpy(x)).numpy()
        assert np.abs(np.asarray(y) - want).max() <= 1e-12
    bf = model.to(torch.bfloat16).state_dict()
    enc = fb.Encoder(CFG, num_layers=2, rngs=nnx.Rngs(0))
    load_torch_state_dict(enc, bf)
    assert all(v.dtype == ml_dtypes.bfloat16 for v in flax_state_dict(enc).values())


# ---------------------------------------------------------------------------------------
# Failures: every problem listed at once, and the module left exactly as it was
# ---------------------------------------------------------------------------------------


def _good(kind="Encoder"):
    return {k: v.clone() for k, v in torch_module(kind, seed=11).state_dict().items()}


FAILURES = {
    "missing": (lambda sd: {k: v for k, v in sd.items() if k != "layers.1.linear1.bias"}, {},
                ["missing key layers.1.linear1.bias (expected shape (20,))"]),
    "unexpected": (lambda sd: sd.update({"layers.0.extra.weight": torch.ones(3)}) or sd, {},
                   ["unexpected key layers.0.extra.weight (shape (3,))"]),
    "shape": (lambda sd: sd.update({"layers.2.self_attn.in_proj_weight": torch.ones(12, 36)}) or sd, {},
              ["shape mismatch for layers.2.self_attn.in_proj_weight: expected (36, 12), found (12, 36)"]),
    "dtype": (lambda sd: sd.update({"layers.0.norm1.weight": torch.ones(12, dtype=torch.int32)}) or sd, {},
              ["dtype of layers.0.norm1.weight: expected a floating dtype, found int32"]),
    "prefix": (lambda sd: sd, {"prefix": "encoder."}, ["prefix 'encoder.' matches no key"]),
    "layers": (lambda sd: {k: v for k, v in sd.items() if not k.startswith("layers.2.")}, {},
               ["layer count: checkpoint has layers 0-1 (2), module has 3 (0-2)",
                "missing key layers.2.self_attn.in_proj_weight"]),
    "width": (lambda sd: torch_module("Encoder", replace(CFG, d_model=16), seed=1).state_dict(), {},
              ["config mismatch: d_model is 16 in the checkpoint, 12 in the module"]),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failures_are_listed_and_leave_module_unchanged(failure):
    corrupt, kwargs, messages = FAILURES[failure]
    enc = flax_module("Encoder", seed=2)
    before = snapshot(enc)
    with pytest.raises(ConversionError) as info:
        load_torch_state_dict(enc, corrupt(_good()), **kwargs)
    text = str(info.value)
    for m in messages:
        assert m in text
    assert_same_bytes(before, snapshot(enc))


def test_all_problems_reported_together():
    sd = _good()
    sd.pop("norm.weight")
    sd["layers.0.linear2.weight"] = torch.ones(20, 12)
    sd["bogus"] = torch.ones(1)
    enc = flax_module("Encoder", seed=2)
    with pytest.raises(ConversionError) as info:
        load_torch_state_dict(enc, sd)
    assert len(info.value.problems) == 4  # missing, unexpected, shape, final_norm mismatch
    assert "config mismatch: final_norm is False in the checkpoint, True in the module" in str(info.value)


def test_non_strict_reports_and_never_invents():
    sd = _good()
    sd.pop("layers.1.linear1.bias")
    sd["head.weight"] = torch.ones(3)
    enc = flax_module("Encoder", seed=2)
    kept = np.asarray(enc.layers.linear1.bias[...][1]).copy()
    result = load_torch_state_dict(enc, sd, strict=False)
    assert result.missing_keys == ["layers.1.linear1.bias"] and result.unexpected_keys == ["head.weight"]
    assert np.array_equal(np.asarray(enc.layers.linear1.bias[...][1]), kept)  # its own value, not a new one
    assert np.array_equal(np.asarray(enc.layers.linear1.bias[...][0]), sd["layers.0.linear1.bias"].numpy())
    with pytest.raises(ConversionError, match="shape mismatch"):  # shapes stay errors
        sd["layers.0.linear1.bias"] = torch.ones(3)
        load_torch_state_dict(enc, sd, strict=False)


def test_prefix_reads_a_nested_model():
    inner = _good()
    sd = {**{f"encoder.{k}": v for k, v in inner.items()}, "head.weight": torch.ones(4, 12)}
    enc = flax_module("Encoder", seed=2)
    load_torch_state_dict(enc, sd, prefix="encoder.")
    assert np.array_equal(torch_state_dict(enc)["layers.2.linear2.weight"], inner["layers.2.linear2.weight"].numpy())


def test_infer_config_reports_known_and_unknown():
    report = infer_config(stock_encoder(num_layers=4).state_dict())
    assert report.inferred["kind"] == "Encoder"
    assert {k: report.inferred[k] for k in ("d_model", "d_ff", "num_layers", "bias", "final_norm")} == {
        "d_model": 12, "d_ff": 20, "num_layers": 4, "bias": True, "final_norm": True}
    assert "num_heads" in report.unknown and "activation" in report.unknown
    block = infer_config(torch_module("TransformerBlock", replace(CFG, bias=False, scaling="layerscale")))
    assert block.inferred["kind"] == "TransformerBlock" and block.inferred["bias"] is False
    assert block.inferred["scaling"] == "layerscale"
    for bias in (True, False):  # DyT is read from its alpha, with or without its bias
        dyt = infer_config(torch_module("Encoder", replace(CFG, norm_type="dyt", bias=bias)))
        assert dyt.inferred["norm_type"] == "dyt" and dyt.inferred["bias"] is bias and dyt.inferred["final_norm"]
    assert "norm_type" not in infer_config(torch_module("Encoder", replace(CFG, bias=False))).inferred
    # an explicit head_dim (Qwen3, Gemma) is read where QK-norm shows the head width: heads from out_proj
    wide = infer_config(torch_module("TransformerBlock", replace(CFG, num_heads=3, num_kv_heads=1, head_dim=6,
                                                                 qk_norm=True)))
    assert {k: wide.inferred[k] for k in ("head_dim", "num_heads", "num_kv_heads")} == {
        "head_dim": 6, "num_heads": 3, "num_kv_heads": 1}
    assert "head_dim" not in infer_config(torch_module("TransformerBlock", replace(CFG, qk_norm=True))).inferred
    # bias=False with the MLP's or the LayerNorms' own biases (LLaMA's mlp_bias, StableLM's norms) reads as bias=False
    assert infer_config(torch_module("TransformerBlock", replace(CFG, bias=False, mlp_bias=True,
                                                                 norm_bias=True))).inferred["bias"] is False


def test_flax_named_checkpoint_round_trip(tmp_path):
    enc = flax_module("Encoder", seed=8)
    path = tmp_path / "flax.safetensors"
    save_file(flax_state_dict(enc), str(path))
    other = flax_module("Encoder", seed=9)
    load_flax_state_dict(other, str(path))
    assert_same_bytes(snapshot(enc), snapshot(other))
    bad = flax_state_dict(enc)
    bad.pop("norm.scale")
    before = snapshot(other)
    with pytest.raises(ConversionError, match="missing key norm.scale"):
        load_flax_state_dict(flax_module("Encoder", seed=3), bad)
    assert_same_bytes(before, snapshot(other))


CLI_RUNNER = """
import contextlib, io, json, sys
from flax_blocks.checkpoints.convert.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    results.append({"returncode": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def _cli(*runs: list[str]) -> list[SimpleNamespace]:
    """Run the converter CLI's main() once per argv list, all in one fresh interpreter
    (it turns on jax_enable_x64, which must not leak into this test process)."""
    out = subprocess.run([sys.executable, "-c", CLI_RUNNER, json.dumps(list(runs))], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return [SimpleNamespace(**r) for r in json.loads(out.stdout.splitlines()[-1])]


def test_cli_round_trip_and_errors(tmp_path):
    model = stock_encoder(num_layers=3)
    pt, fx, back = tmp_path / "enc.pt", tmp_path / "enc_flax.safetensors", tmp_path / "back.safetensors"
    torch.save(model.state_dict(), pt)
    bad = model.state_dict()
    bad["layers.1.linear1.weight"] = torch.ones(20, 5)
    torch.save(bad, tmp_path / "bad.pt")
    to_flax, to_torch, no_heads, wrong_shape = _cli(
        [str(pt), str(fx), "--num-heads", "2"], [str(fx), str(back)], [str(pt), str(fx)],
        [str(tmp_path / "bad.pt"), str(tmp_path / "o.safetensors"), "--num-heads", "2"])
    assert to_flax.returncode == 0, to_flax.stderr
    assert "Encoder: 3 layer(s), 38 tensors" in to_flax.stdout and "float32" in to_flax.stdout
    assert to_torch.returncode == 0, to_torch.stderr
    from safetensors.numpy import load_file

    restored = load_file(str(back))
    for k, v in model.state_dict().items():
        assert restored[k].tobytes() == v.numpy().tobytes(), k
    assert no_heads.returncode == 1 and "--num-heads is required" in no_heads.stderr
    assert wrong_shape.returncode == 1
    assert not (tmp_path / "o.safetensors").exists()
    assert "shape mismatch for layers.1.linear1.weight: expected (20, 12), found (20, 5)" in wrong_shape.stderr
    entry = subprocess.run([sys.executable, "-m", "flax_blocks.checkpoints.convert", "--help"], capture_output=True,
                           text=True, cwd=ROOT)
    assert entry.returncode == 0 and "--num-heads" in entry.stdout


def test_ranges_writes_runs_and_nothing_for_none():
    from flax_blocks.checkpoints.io import ranges

    assert ranges([8, 0, 1, 2, 5, 7]) == "0-2, 5, 7-8"
    assert ranges([3]) == "3" and ranges([]) == ""
