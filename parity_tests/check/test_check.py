"""The user-facing parity check: `parity_tests.check` (python -m parity_tests.check)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_blocks as fb
import torch_blocks as tb
from flax_blocks.checkpoints.convert import ConversionError

from . import check, main


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, 0.0, activation="gelu", batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 3, norm=torch.nn.LayerNorm(16), enable_nested_tensor=False)
    path = tmp_path_factory.mktemp("ckpt") / "stock.pt"
    torch.save(model.state_dict(), path)
    return path, model.state_dict(), model


def test_check_passes_on_stock_encoder(stock_checkpoint, capsys):
    path, sd, model = stock_checkpoint
    report = check(str(path), num_heads=4, norm="pre", activation="gelu")
    assert report.ok, report.failures
    assert [r[0] for r in report.rows] == ["layer 0", "layer 1", "layer 2", "output"]
    assert all(0 < r[2] <= 2e-6 for r in report.rows)  # real, non-zero differences: two frameworks ran
    assert main([str(path), "--num-heads", "4", "--norm", "pre", "--activation", "gelu"]) == 0
    assert "PASS" in capsys.readouterr().out
    # The check compares the two twins with each other; that what they compute is the stock
    # encoder itself is checked here: each twin, loaded from the checkpoint as the check
    # loads it, against the stock model on the check's own inputs.
    cfg = fb.BlockConfig(d_model=16, num_heads=4, d_ff=32, dropout=0.0, norm="pre", activation="gelu")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 16)).astype(np.float32)
    pad = np.zeros((2, 8), bool)
    pad[-1, 4:] = True  # torch convention: True = padding
    with torch.no_grad():
        want = model.train()(torch.from_numpy(x), src_key_padding_mask=torch.from_numpy(pad)).numpy()
        twin = tb.Encoder(cfg, num_layers=3)
        twin.load_state_dict(sd, strict=True)
        got_torch = twin(torch.from_numpy(x), None, torch.from_numpy(pad)).numpy()
    flax = fb.from_torch(fb.Encoder, cfg, {k: v.numpy() for k, v in sd.items()}, num_layers=3)
    got_flax = np.asarray(flax(jnp.asarray(x), key_mask=jnp.asarray(~pad)))
    scale = np.abs(want).max()
    assert np.abs(got_torch - want).max() / scale <= 2e-6
    assert np.abs(got_flax - want).max() / scale <= 2e-6


def test_check_names_the_corrupted_layer(stock_checkpoint, tmp_path, capsys):
    _, sd, _ = stock_checkpoint
    sd = {k: v.clone() for k, v in sd.items()}
    sd["layers.1.linear2.weight"][0, 0] = float("nan")
    torch.save(sd, tmp_path / "nan.pt")
    assert main([str(tmp_path / "nan.pt"), "--num-heads", "4", "--norm", "pre", "--activation", "gelu"]) == 1
    out = capsys.readouterr().out
    assert "layers.1.linear2.weight (layer 1): 1 non-finite values" in out
    assert "layer 0: forward" not in out and "layer 1: forward rel error inf" in out
    sd["layers.1.linear2.weight"] = torch.ones(16, 31)
    torch.save(sd, tmp_path / "shape.pt")
    with pytest.raises(ConversionError, match=r"layers\.1\.linear2\.weight"):
        check(str(tmp_path / "shape.pt"), num_heads=4)
    assert main([str(tmp_path / "shape.pt"), "--num-heads", "4"]) == 1


def test_check_of_a_pickled_stock_module_catches_a_wrong_head_count(stock_checkpoint, tmp_path, capsys):
    """A state dict does not record the head count, so the rebuilt stock reference shares a
    wrong --num-heads (the table says so); the whole pickled module, loaded with
    --trust-pickle, is the reference itself and refuses it by name."""
    path, _, model = stock_checkpoint
    flags = ["--norm", "pre", "--activation", "gelu"]
    assert main([str(path), "--num-heads", "2", *flags]) == 0  # nothing in the file says 4
    out = capsys.readouterr().out
    assert "note: num_heads=2, norm, activation and eps come from the flags" in out
    whole = tmp_path / "whole.pt"
    torch.save(model, whole)
    assert main([str(whole), "--num-heads", "2", *flags]) == 1  # refused without the opt-in
    assert "rerun with --trust-pickle" in capsys.readouterr().err
    assert main([str(whole), "--num-heads", "4", "--trust-pickle", *flags]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "the source TransformerEncoder itself" in out and "note:" not in out
    assert main([str(whole), "--num-heads", "2", "--trust-pickle", *flags]) == 1
    out = capsys.readouterr().out
    assert "num_heads=2 given, but the source module has num_heads=4" in out


def test_pad_keys_out_of_range_is_refused_for_every_kind_of_checkpoint(stock_checkpoint, tmp_path):
    path, _, _ = stock_checkpoint
    for source in (str(path), str(tmp_path)):  # a torch file; a folder (the Hugging Face branch)
        for bad in (-1, 9):
            with pytest.raises(ValueError, match=rf"pad_keys must be in \[0, 8\], got {bad}"):
                check(source, num_heads=4, pad_keys=bad)


def test_check_in_float64(stock_checkpoint):
    path, _, _ = stock_checkpoint
    report = check(str(path), num_heads=4, norm="pre", activation="gelu", dtype="float64")
    assert report.ok and all(0 < r[2] <= 1e-12 for r in report.rows)
