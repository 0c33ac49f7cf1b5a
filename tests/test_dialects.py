"""Checkpoint dialects: detection, both directions, refusals; settings read from a torch module."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import flax_blocks as fb
from flax_blocks.checkpoints import dialects
from flax_blocks.checkpoints.convert import ConversionError

torch = pytest.importorskip("torch")

CFG = fb.BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, d_ff=24, norm="pre", norm_type="rmsnorm", mlp="swiglu",
                     activation="silu", rope_theta=10000.0, bias=False, qkv_bias=True, causal=True, dropout=0.0)


def _ours(cfg: fb.BlockConfig, layers: int = 2, final: bool = True) -> dict[str, np.ndarray]:
    """A random torch-named Encoder state dict of `cfg` (every declared parameter)."""
    from flax_blocks.checkpoints.convert import module_params

    rng = np.random.default_rng(0)
    return {t: rng.normal(size=p.shape)
            for t, _, p, _ in module_params("Encoder", cfg, num_layers=layers, final_norm=final)}


BERT = replace(CFG, num_kv_heads=None, norm="post", norm_type="layernorm", mlp="dense", activation="gelu",
               rope_theta=None,
               bias=True, qkv_bias=None, causal=False)
GPT2 = replace(BERT, norm="pre", causal=True, activation="gelu_tanh")
CASES = {"hf-llama": (CFG, "model."), "hf-bert": (BERT, "bert."), "hf-gpt2": (GPT2, "transformer.")}


@pytest.mark.parametrize("name", list(CASES))
def test_both_directions_are_exact_and_detected(name):
    cfg, prefix = CASES[name]
    ours = _ours(cfg, final=name != "hf-bert")
    theirs = dialects.to_dialect(ours, name, cfg, prefix=prefix)
    assert not set(theirs) & set(ours)  # every name changed
    extra = {f"{prefix}embed.weight": np.ones((5, 16)), "lm_head.weight": np.ones((5, 16))}
    if dialects.DIALECTS[name].shared_by:  # LLaMA's names fit many families: only an explicit dialect loads them
        with pytest.raises(ConversionError, match="cannot tell the checkpoint's family from its key names"):
            fb.detect_dialect({**theirs, **extra})
        back = dialects.translate({**theirs, **extra}, name)
    else:
        assert fb.detect_dialect({**theirs, **extra}) == name
        back = dialects.translate({**theirs, **extra})
    assert back.dialect == name and back.prefix == prefix and sorted(back.dropped) == sorted(extra)
    assert set(back.state_dict) == set(ours)
    assert all(np.array_equal(back.state_dict[k], v) for k, v in ours.items())


def test_known_names_and_shapes():
    theirs = dialects.to_dialect(_ours(CFG), "hf-llama", CFG)
    assert theirs["layers.1.self_attn.q_proj.weight"].shape == (16, 16)  # 4 heads of 4
    assert theirs["layers.1.self_attn.k_proj.bias"].shape == (8,)  # 2 KV heads
    assert theirs["layers.0.mlp.gate_proj.weight"].shape == (24, 16) and "norm.weight" in theirs
    gpt2 = dialects.to_dialect(_ours(GPT2), "hf-gpt2", GPT2)
    assert gpt2["h.0.attn.c_attn.weight"].shape == (16, 48) and gpt2["h.0.mlp.c_fc.weight"].shape == (16, 24)
    assert "ln_f.weight" in gpt2


def test_torch_dialect_is_the_default_and_unknown_keys_list_the_dialects():
    assert fb.detect_dialect(_ours(BERT)) == "torch"
    assert fb.detect_dialect({f"encoder.{k}": v for k, v in _ours(BERT).items()}) == "torch"
    with pytest.raises(ConversionError) as info:
        fb.detect_dialect({"decoder.blocks.0.attn.wq": np.ones(2), "tok.weight": np.ones(2)})
    text = str(info.value)
    assert "no dialect recognises" in text and "['decoder.', 'tok.']" in text
    assert all(name in text for name in dialects.DIALECTS)


def test_translation_errors_name_the_keys():
    theirs = dialects.to_dialect(_ours(BERT, final=False), "hf-bert", BERT)
    theirs.pop("encoder.layer.1.attention.self.key.weight")
    theirs["encoder.layer.0.crossattention.self.query.weight"] = np.ones((16, 16))
    with pytest.raises(ConversionError) as info:
        dialects.translate(theirs)
    text = str(info.value)
    assert "missing key encoder.layer.1.attention.self.key.weight" in text
    assert ("encoder.layer.0.crossattention.self.query.weight (shape (16, 16)): "
            "not a parameter the hf-bert dialect knows") in text


def test_a_config_the_family_cannot_hold_is_refused_naming_fields():
    with pytest.raises(ConversionError) as info:
        dialects.to_dialect(_ours(BERT), "hf-gpt2", BERT)
    assert "norm='post', but hf-gpt2 checkpoints have norm='pre'" in str(info.value)
    assert "causal" not in str(info.value)  # GPT-2 reads is_causal (False: bidirectional), so either is written
    # ModernBERT's bidirectional window |i - j| < W: a LLaMA-named family (Mistral) would window |i - j| <= W
    llama = fb.BlockConfig(d_model=16, num_heads=4, d_ff=20, norm="pre", norm_type="rmsnorm", mlp="swiglu",
                           activation="silu", bias=False, rope_theta=1e4, sliding_window=3)
    with pytest.raises(ConversionError, match=r"sliding_window=3 with causal=False.*hf-llama"):
        dialects.check_settings(llama, "hf-llama")
    dialects.check_settings(replace(llama, causal=True), "hf-llama")


def test_from_torch_reads_an_hf_state_dict_with_its_dialect(caplog):
    theirs = dialects.to_dialect(_ours(GPT2), "hf-gpt2", GPT2, prefix="transformer.")
    with caplog.at_level("INFO", logger="flax_blocks"):
        enc = fb.from_torch(fb.Encoder, replace(GPT2, param_dtype="float32"), theirs, num_layers=2, dtype="float32")
    assert "checkpoint dialect hf-gpt2 (detected from the key names)" in caplog.text
    assert enc.final_norm is not None  # ln_f read as the final norm
    sd = fb.torch_state_dict(enc)
    want = _ours(GPT2)
    assert all(np.allclose(sd[k], want[k].astype(np.float32)) for k in want)
    with pytest.raises(ConversionError,
                       match=r"no key matches encoder\.layer\.\{i\}\. \(the keys' roots are \['transformer\.'\]\)"):
        fb.from_torch(fb.Encoder, GPT2, theirs, num_layers=2, dialect="hf-bert")


# ---------------------------------------------------------------------------------------
# Settings read from the source module
# ---------------------------------------------------------------------------------------


def _stock(norm_first=True, activation="gelu", final=False):
    layer = torch.nn.TransformerEncoderLayer(16, 4, 24, 0.0, activation=activation, batch_first=True,
                                             norm_first=norm_first, layer_norm_eps=1e-6)
    return torch.nn.TransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(16) if final else None,
                                       enable_nested_tensor=False)


STOCK_CFG = fb.BlockConfig(d_model=16, num_heads=4, d_ff=24, norm="pre", activation="gelu", layer_norm_eps=1e-6,
                           dropout=0.0)


def test_from_torch_refuses_a_config_contradicting_a_stock_module():
    model = _stock()
    enc = fb.from_torch(fb.Encoder, STOCK_CFG, model, num_layers=2)  # the right settings load
    assert enc.final_norm is None
    wrong = replace(STOCK_CFG, num_heads=2, norm="post", activation="relu", layer_norm_eps=1e-5)
    with pytest.raises(ConversionError) as info:
        fb.from_torch(fb.Encoder, wrong, model, num_layers=2)
    text = str(info.value)
    for field in ("num_heads=2", "norm='post'", "activation='relu'", "layer_norm_eps=1e-05"):
        assert field in text
    with pytest.raises(ConversionError, match="final_norm=True given, but the source module has final_norm=False"):
        fb.from_torch(fb.Encoder, STOCK_CFG, model, num_layers=2, final_norm=True)
    with pytest.raises(ConversionError, match="num_heads=2 given"):
        fb.from_torch(fb.TransformerBlock, replace(STOCK_CFG, num_heads=2), model.layers[0])


def test_a_torch_blocks_module_tells_its_settings():
    import torch_blocks as tb

    model = tb.Encoder(CFG, num_layers=2)
    fb.from_torch(fb.Encoder, CFG, model, num_layers=2)
    dialects.check_against_source(CFG, model, True, torch_blocks=True)
    with pytest.raises(ConversionError) as info:
        dialects.check_against_source(replace(CFG, num_kv_heads=4, rope_theta=None), model, torch_blocks=True)
    assert "num_kv_heads=4 given, but the source module has num_kv_heads=2" in str(info.value)
    assert "rope_theta=None given" in str(info.value)


def test_parity_check_compares_against_stock_torch_and_fails_wrong_heads(tmp_path, capsys):
    from parity_tests.check import check, main

    model = _stock()
    good = check(model, num_heads=4, norm="pre", activation="gelu", layer_norm_eps=1e-6)
    assert good.ok and "the source TransformerEncoder itself" in good.reference
    assert [r[0] for r in good.stock_rows] == ["stock torch"] and 0 < good.stock_rows[0][2] <= 2e-6
    bad = check(model, num_heads=2, norm="pre", activation="gelu", layer_norm_eps=1e-6)
    assert not bad.ok
    assert "settings: num_heads=2 given, but the source module has num_heads=4" in bad.failures
    assert any(f.startswith("stock torch: forward rel error") for f in bad.failures)
    path = tmp_path / "encoder.pt"
    torch.save(model.state_dict(), path)
    assert main([str(path), "--num-heads", "4", "--norm", "pre", "--activation", "gelu", "--eps", "1e-6"]) == 0
    assert "Flax vs the torch_blocks twin and stock torch (TransformerEncoder rebuilt" in capsys.readouterr().out


def test_the_converter_cli_leaves_the_callers_x64_setting_as_it_was(tmp_path):
    """main() converts with x64 on (float64 checkpoints stay float64), then restores the
    caller's setting: left on, it made later float32 tests in the same process see float64."""
    import jax
    from safetensors.numpy import save_file

    from flax_blocks.checkpoints.convert.cli import main

    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    save_file({k: v.detach().numpy().astype("float64") for k, v in layer.state_dict().items()},
              str(tmp_path / "layer.safetensors"))
    before = jax.config.jax_enable_x64
    assert main([str(tmp_path / "layer.safetensors"), str(tmp_path / "flax.safetensors"), "--num-heads", "2"]) == 0
    assert jax.config.jax_enable_x64 == before
    from safetensors.numpy import load_file
    assert {str(a.dtype) for a in load_file(str(tmp_path / "flax.safetensors")).values()} == {"float64"}


def test_the_old_layout_keyword_names_its_new_name():
    with pytest.raises(TypeError, match=r"takes dialect= .*layout= was its old name"):
        fb.from_torch(fb.Encoder, CFG, _ours(CFG), num_layers=2, layout="hf-llama")


def test_a_dialect_rule_that_could_not_be_read_both_ways_is_refused_where_it_is_written():
    from flax_blocks.checkpoints.dialects import Rule

    with pytest.raises(ValueError, match="a split rule names one part per tensor of theirs"):
        Rule("self_attn.in_proj_weight", ("q.weight", "k.weight", "v.weight"), split=("q", "kv"))
    with pytest.raises(ValueError, match="a chunk rule takes one tensor of theirs"):
        Rule("linear1.weight", ("a.weight", "b.weight"), chunk=(0, 2))
    with pytest.raises(ValueError, match="a per-head rule takes one tensor of theirs"):
        Rule("self_attn.in_proj_weight", ("qkv.weight",), per_head=3, transpose=True)
    Rule("self_attn.in_proj_weight", ("q.weight", "k.weight", "v.weight"), split=("q", "kv", "kv"))  # well formed
