"""What a new user tries first does what they expect (a working result, or one clear error
naming the fix). One test per thing a newcomer tries, plus --help everywhere.

Tests marked xfail(strict=True, reason=LEAD) assert library behaviour that is not built
yet; strict, so each one flags (XPASS fails) the moment it works and its mark must go.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LEAD = "lead: a library row of what newcomers try"
# bench first: it sets XLA_FLAGS, which must happen before any JAX backend exists
CLI_MODULES = ["experiments.bench", "flax_blocks.checkpoints.convert", "parity_tests.check",
               "parity_tests.twins.report", "experiments.stability", "experiments.stability.report"]
MAIN_OF = {"flax_blocks.checkpoints.convert": "flax_blocks.checkpoints.convert.cli",  # a package's main
           "experiments.bench": "experiments.bench.blocks", "experiments.stability": "experiments.stability.sweep"}


def stock_encoder(d=16, heads=4, ff=32, layers=2, norm_first=True, final_norm=False, seed=0):
    """A stock nn.TransformerEncoder of pre-LN (or post-LN) GELU layers."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, heads, ff, 0.0, activation="gelu", batch_first=True,
                                             norm_first=norm_first)
    return torch.nn.TransformerEncoder(layer, layers, norm=torch.nn.LayerNorm(d) if final_norm else None,
                                       enable_nested_tensor=False)


# ------------------------------------------------------------------------------------
# --help on every module with a main, help text on every option
# ------------------------------------------------------------------------------------


HELP_RUNNER = """
import contextlib, io, json, runpy, sys
out = {}
for mod in json.loads(sys.argv[1]):
    sys.argv = [mod, "--help"]
    buf = io.StringIO()
    code = "no SystemExit"
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_module(mod, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
        except BaseException as e:
            code = f"{type(e).__name__}: {e}"
    out[mod] = {"code": code, "text": buf.getvalue()}
print(json.dumps(out))
"""


def test_help_works_on_every_module_with_a_main():
    """`python -m MODULE --help` exits 0 with a usage line (run as __main__, one interpreter)."""
    res = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(CLI_MODULES)], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    for mod in CLI_MODULES:
        assert out[mod]["code"] in (0, None) and "usage: python -m " + mod in out[mod]["text"], (mod, out[mod])


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(main, argv, monkeypatch) -> argparse.ArgumentParser:
    """The parser a CLI's main() builds: stop main at its parse_args and keep the parser."""
    def grab(self, args=None, namespace=None):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(_Parser) as caught:
        main(argv)
    monkeypatch.undo()
    return caught.value.parser


@pytest.mark.parametrize("module", CLI_MODULES)
def test_every_cli_option_has_help_text(module, monkeypatch):
    import importlib

    main = importlib.import_module(MAIN_OF.get(module, module)).main
    parser = _parser_of(main, ["--xla-defaults"] if module == "experiments.bench" else [], monkeypatch)
    bare = [a.option_strings or [a.dest] for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())]
    assert not bare, f"{module}: options without help text: {bare}"


# ------------------------------------------------------------------------------------
# The converter CLI: .pt destinations, config flags, metadata, pickled modules
# ------------------------------------------------------------------------------------


CLI_RUNNER = """
import contextlib, importlib, io, json, sys
results = []
for mod, argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = importlib.import_module(mod).main(argv)
        except SystemExit as e:
            rc = e.code
    results.append({"rc": rc, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


def _cli(*runs: tuple[str, list[str]]) -> list[dict]:
    """Run CLI mains in one fresh interpreter (the converter turns on jax_enable_x64)."""
    res = subprocess.run([sys.executable, "-c", CLI_RUNNER, json.dumps(runs)], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def _metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return json.loads(f.metadata()["config"])


def test_converter_cli_destinations_flags_metadata_and_pickled_modules(tmp_path):
    model = stock_encoder()
    pt, module_pt = tmp_path / "encoder.pt", tmp_path / "module.pt"
    torch.save(model.state_dict(), pt)
    torch.save(model, module_pt)  # the whole pickled module, a common first try
    given, bare, to_pt, back_pt, pickled, check_pickled = _cli(
        ("flax_blocks.checkpoints.convert.cli", [str(pt), str(tmp_path / "given.safetensors"), "--num-heads", "4",
                                     "--norm", "pre", "--activation", "gelu", "--layer-norm-eps", "1e-6"]),
        ("flax_blocks.checkpoints.convert.cli", [str(pt), str(tmp_path / "bare.safetensors"), "--num-heads", "4"]),
        ("flax_blocks.checkpoints.convert.cli", [str(pt), str(tmp_path / "out.pt"), "--num-heads", "4"]),
        ("flax_blocks.checkpoints.convert.cli", [str(tmp_path / "given.safetensors"), str(tmp_path / "back.pt")]),
        ("flax_blocks.checkpoints.convert.cli", [str(module_pt), str(tmp_path / "m.safetensors"), "--num-heads", "4"]),
        ("parity_tests.check", [str(module_pt), "--num-heads", "4"]),
    )
    # Given flags are recorded; inferred facts are recorded; nothing is guessed.
    assert given["rc"] == 0, given["err"]
    meta = _metadata(tmp_path / "given.safetensors")
    assert meta["cfg"] == {"d_model": 16, "bias": True, "num_heads": 4, "d_ff": 32, "param_dtype": "float32",
                           "norm": "pre", "activation": "gelu", "layer_norm_eps": 1e-6,
                           "norm_type": "layernorm", "qk_norm": False}  # the last two read off the tensors
    assert meta["final_norm"] is False and meta["num_layers"] == 2
    assert bare["rc"] == 0, bare["err"]
    meta = _metadata(tmp_path / "bare.safetensors")
    assert not {"norm", "activation", "layer_norm_eps"} & set(meta["cfg"])
    assert {"norm", "activation", "layer_norm_eps"} <= set(meta["not_recorded"])
    assert "not recorded" in bare["out"] and "activation" in bare["out"]
    # torch -> Flax into a .pt: refused before any work, no file written.
    assert to_pt["rc"] == 1 and "name the destination *.safetensors" in to_pt["err"]
    assert not (tmp_path / "out.pt").exists()
    # Flax -> torch into a .pt: a real torch file with the original tensors.
    assert back_pt["rc"] == 0, back_pt["err"]
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(back) == sorted(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    # A pickled module: one line naming the fix, from both CLIs.
    for r in (pickled, check_pickled):
        assert r["rc"] == 1 and "Traceback" not in r["err"], r["err"]
        assert len(r["err"].strip().splitlines()) == 1, r["err"]
        assert "save module.state_dict()" in r["err"] and "TransformerEncoder" in r["err"]
    assert not (tmp_path / "m.safetensors").exists()


def test_safetensors_bytes_under_a_pt_name_is_named(tmp_path):
    from safetensors.numpy import save_file

    from flax_blocks.checkpoints.io_errors import CheckpointReadError, torch_load_state_dict

    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "x.pt"))  # what the old CLI wrote
    with pytest.raises(CheckpointReadError, match=r"is a safetensors file with a torch name: rename it"):
        torch_load_state_dict(tmp_path / "x.pt")
    torch.save({"w": torch.ones(3)}, tmp_path / "ok.pt")
    assert torch.equal(torch_load_state_dict(tmp_path / "ok.pt")["w"], torch.ones(3))


# ------------------------------------------------------------------------------------
# The parity check CLI: the mask check is on by default
# ------------------------------------------------------------------------------------


def test_parity_check_mask_check_on_by_default(tmp_path, monkeypatch, capsys):
    from parity_tests import check as check_mod

    assert check_mod.fully_masked_elements(np.array([[True, False], [False, False]])) == [1]
    assert check_mod.fully_masked_elements(np.array([[True, False], [False, True]])) == []
    seen = {}

    def fake(checkpoint, **kw):
        seen.update(kw)
        return check_mod.CheckReport("Encoder", "float32")

    monkeypatch.setattr(check_mod, "check", fake)
    assert check_mod.main(["x.pt", "--num-heads", "2"]) == 0 and seen["mask_check"] is True
    assert check_mod.main(["x.pt", "--num-heads", "2", "--no-mask-check"]) == 0 and seen["mask_check"] is False
    monkeypatch.undo()
    torch.save(stock_encoder(layers=1).state_dict(), tmp_path / "e.pt")
    capsys.readouterr()
    report = check_mod.check(str(tmp_path / "e.pt"), num_heads=4, norm="pre", activation="gelu", pad_keys=8)
    err = capsys.readouterr().err
    assert report.ok and "batch element(s) [1] is fully masked" in err and "convention" in err


# ------------------------------------------------------------------------------------
# Experiments: the hidden extra group, "inconclusive", where `make run` writes
# ------------------------------------------------------------------------------------


def test_stability_variants_and_depths_run_only_what_was_asked():
    from experiments.stability.sweep import PRESETS, parse_args, sweep_from_args

    pairs = lambda argv: sweep_from_args(parse_args(argv)).pairs()  # noqa: E731
    assert pairs(["--variants", "pre,post", "--depths", "2"]) == [("post", 2), ("pre", 2)]
    # the quick preset's variants
    assert pairs(["--depths", "2"]) == [("post", 2), ("pre", 2), ("deepnorm", 2), ("peri", 2)]
    assert ("noskip", 6) in pairs([]) and ("noskip", 6) in pairs(["--seeds", "1"])  # the quick preset's own grid
    assert ("noskip", 2) in pairs(["--depths", "2", "--extra", "noskip:2"])
    assert PRESETS["quick"].extra == (("noskip", 6),)


def _record(variant: str, depth: int, status: str, final: float) -> dict:
    return {"config": {"variant": variant, "depth": depth, "lr": 1e-3, "warmup": 0, "seed": 0},
            "summary": {"status": status, "final_loss": final, "step": None}}


def test_report_says_inconclusive_when_nothing_trained():
    from experiments.stability.report import Data, claim_depth, claim_skip

    nothing = Data([_record(v, L, "plateau", 3.3) for v in ("post", "pre", "noskip") for L in (2, 4)])
    for claim in (claim_skip, claim_depth):
        verdict, body = claim(nothing)
        assert verdict == "inconclusive" and "No post-LN or pre-LN" in body
    trained = Data([_record("post", 2, "trained", 1.9), _record("pre", 2, "trained", 1.9),
                    _record("noskip", 2, "plateau", 3.3)])
    assert claim_skip(trained)[0] == "agrees"
    half = Data([_record("post", 2, "plateau", 3.3), _record("pre", 2, "trained", 1.9),
                 _record("noskip", 2, "plateau", 3.3)])
    assert claim_skip(half)[0] == "does not agree"  # a control trained: the rule can judge


def test_make_run_readme_and_stability_default_agree():
    """`make run` is the quick preset with the runner's default folder, and README says where
    that is (that git ignores it: test_experiments.py's run in a fresh clone)."""
    from experiments.stability.sweep import PRESETS, RUNS, default_out

    assert default_out("quick", PRESETS["quick"]) == RUNS / "quick" == ROOT / "experiments/stability/runs/quick"
    recipe = re.search(r"^run:.*\n\t(.*)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert recipe.split("#")[0].split()[1:] == ["-m", "experiments.stability"]  # no options: the quick preset, RUNS
    make_run = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("make run"))
    assert "experiments/stability/runs/quick/" in make_run


# ------------------------------------------------------------------------------------
# Library rows (the lead's): each asserts what the issue says a user expects
# ------------------------------------------------------------------------------------


def _flax_cfg(**kw):
    import flax_blocks as fb

    base = dict(d_model=16, num_heads=4, d_ff=32, norm="pre", activation="gelu", dropout=0.0)
    return fb.BlockConfig(**{**base, **kw})


def _assert_loaded(encoder, model):
    import flax_blocks as fb

    got = fb.torch_state_dict(encoder)
    ref = model.state_dict()
    assert sorted(got) == sorted(ref)
    assert all(np.array_equal(got[k], ref[k].numpy()) for k in ref)


def test_from_torch_infers_final_norm_from_the_checkpoint():
    import flax_blocks as fb

    model = stock_encoder()  # pre-LN layers, no final norm: a plain nn.TransformerEncoder
    encoder = fb.from_torch(fb.Encoder, _flax_cfg(), model.state_dict(), num_layers=2)
    assert encoder.norm is None
    _assert_loaded(encoder, model)


def test_from_torch_with_final_norm_given_loads_a_stock_encoder():
    """What the README does today; keeps working once final_norm is inferred."""
    import flax_blocks as fb

    model = stock_encoder()
    _assert_loaded(fb.from_torch(fb.Encoder, _flax_cfg(), model.state_dict(), num_layers=2, final_norm=False), model)


def _full_transformer():
    torch.manual_seed(0)
    return torch.nn.Transformer(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=32,
                                dropout=0.0, batch_first=True)


def test_whole_transformer_without_prefix_suggests_encoder_prefix():
    from flax import nnx

    import flax_blocks as fb

    module = nnx.eval_shape(lambda: fb.Encoder(_flax_cfg(norm="post"), num_layers=2, final_norm=True, rngs=nnx.Rngs(0)))
    with pytest.raises(fb.ConversionError) as e:
        fb.load_torch_state_dict(module, _full_transformer().state_dict())
    text = str(e.value)
    assert re.search(r"prefix\W{1,3}encoder\.", text), text  # the hint the CLI already gives


def test_prefix_without_trailing_dot_works():
    import flax_blocks as fb

    model = _full_transformer()
    encoder = fb.from_torch(fb.Encoder, _flax_cfg(norm="post"), model.state_dict(), prefix="encoder", num_layers=2,
                            final_norm=True)
    _assert_loaded(encoder, model.encoder)


def test_prefix_with_dot_loads_the_encoder_of_a_whole_transformer():
    import flax_blocks as fb

    model = _full_transformer()
    encoder = fb.from_torch(fb.Encoder, _flax_cfg(norm="post"), model.state_dict(), prefix="encoder.", num_layers=2,
                            final_norm=True)
    _assert_loaded(encoder, model.encoder)


def _dtype_objects():
    import jax.numpy as jnp

    return {"jnp.bfloat16": (jnp.bfloat16, "bfloat16"), "np.float32": (np.float32, "float32"),
            "torch.bfloat16": (torch.bfloat16, "bfloat16"), "np.dtype(float64)": (np.dtype("float64"), "float64"),
            "torch.float16": (torch.float16, "float16")}


@pytest.mark.parametrize("name", list(_dtype_objects()))
def test_block_config_accepts_dtype_objects(name):
    import flax_blocks as fb

    obj, text = _dtype_objects()[name]
    cfg = fb.BlockConfig(d_model=8, num_heads=2, dtype=obj, param_dtype=obj)
    assert (cfg.dtype, cfg.param_dtype) == (text, text) and type(cfg.dtype) is str and type(cfg.param_dtype) is str


def test_from_torch_accepts_a_torch_dtype():
    import flax_blocks as fb

    model = stock_encoder()
    encoder = fb.from_torch(fb.Encoder, _flax_cfg(), model.state_dict(), num_layers=2, final_norm=False,
                            dtype=torch.float32)
    assert {str(v.dtype) for v in fb.torch_state_dict(encoder).values()} == {"float32"}


def test_torch_twin_takes_a_float_additive_mask_like_stock_torch():
    import torch_blocks as tb

    torch.manual_seed(0)
    stock = torch.nn.TransformerEncoderLayer(16, 4, 32, 0.0, activation="gelu", batch_first=True, norm_first=True)
    twin = tb.TransformerBlock(tb.BlockConfig(d_model=16, num_heads=4, d_ff=32, norm="pre", activation="gelu",
                                              dropout=0.0))
    twin.load_state_dict(stock.state_dict(), strict=True)
    x = torch.randn(2, 5, 16)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)  # float: 0 and -inf
    assert mask.dtype == torch.float32
    torch.testing.assert_close(twin(x, src_mask=mask), stock(x, src_mask=mask))
    bias = torch.randn(5, 5)  # any additive float mask, not only 0 / -inf
    torch.testing.assert_close(twin(x, src_mask=bias), stock(x, src_mask=bias))


def _flax_block():
    from flax import nnx

    import flax_blocks as fb

    return fb.TransformerBlock(_flax_cfg(d_model=8, num_heads=2, d_ff=16), rngs=nnx.Rngs(0))


def test_torch_convention_mask_passed_to_flax_warns():
    import jax.numpy as jnp

    block = _flax_block()
    x = jnp.ones((2, 4, 8))
    torch_style = np.zeros((2, 4), bool)  # torch: True = padding; here no padding at all
    torch_style[1, 3] = True
    with pytest.warns(Warning, match=r"(?i)convention|invert_mask"):
        block(x, key_mask=jnp.asarray(torch_style))  # in flax's convention: element 0 has no key at all


def test_valid_padding_mask_does_not_warn():
    import jax.numpy as jnp

    block = _flax_block()
    keys = np.ones((2, 4), bool)
    keys[1, 2:] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(jnp.ones((2, 4, 8)), key_mask=jnp.asarray(keys))


def test_float64_checkpoint_without_x64_is_one_line():
    import jax

    import flax_blocks as fb

    sd = {k: v.double() for k, v in stock_encoder().state_dict().items()}  # 24 float64 tensors
    with jax.enable_x64(False), pytest.raises(fb.ConversionError) as e:
        fb.from_torch(fb.Encoder, _flax_cfg(), sd, num_layers=2, final_norm=False)
    lines = [ln for ln in str(e.value).splitlines() if "float64" in ln]
    assert len(lines) == 1, "\n".join(lines)
    assert "jax_enable_x64" in lines[0]


def test_linen_users_can_evaluate_without_dropout():
    import jax
    from flax.nnx import bridge

    import flax_blocks as fb

    cfg = _flax_cfg(dropout=0.5)
    lin = bridge.to_linen(fb.Encoder, cfg, num_layers=2)
    x = jax.random.normal(jax.random.key(0), (2, 3, 16))
    variables = lin.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    y = lin.apply(variables, x, deterministic=True)
    y_other_key = lin.apply(variables, x, deterministic=True, rngs={"dropout": jax.random.key(7)})
    y_no_dropout = bridge.to_linen(fb.Encoder, replace(cfg, dropout=0.0), num_layers=2).apply(variables, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_other_key))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_no_dropout), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(lin.apply(variables, x, rngs={"dropout": jax.random.key(7)})), np.asarray(y))


def test_python_api_names_a_pickled_module_in_one_line(tmp_path):
    import flax_blocks as fb

    model = stock_encoder()
    torch.save(model, tmp_path / "module.pt")
    with pytest.raises(ValueError) as e:
        fb.from_torch(fb.Encoder, _flax_cfg(), str(tmp_path / "module.pt"), num_layers=2, final_norm=False)
    assert len(str(e.value).splitlines()) == 1 and "save module.state_dict()" in str(e.value)
    # the module itself
    _assert_loaded(fb.from_torch(fb.Encoder, _flax_cfg(), model, num_layers=2, final_norm=False), model)
