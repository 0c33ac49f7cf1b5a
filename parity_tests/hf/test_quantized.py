"""Published quantized checkpoints read as transformers reads them: a tiny Qwen3 folder in
block-scaled FP8 (written here from a transformers model's weights, each linear of the layers
quantized to e4m3 per 32 x 32 block, its lm_head kept by modules_to_not_convert) gives the
logits and greedy tokens of transformers' `FineGrainedFP8Config(dequantize=True)` load, its
weights in bfloat16 (the config's dtype) bit for bit; `fb.save_hf` writes it back dequantized
(transformers reads the same model) or, with quantization="fp8", as the same bytes.

transformers asks for accelerate before any FP8 load, dequantized on CPU or not; accelerate is
not installed here and the dequantizing load does not use it: the check is patched out."""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import flax_blocks as fb  # noqa: E402
from flax_blocks.checkpoints import quantized as qz  # noqa: E402
from flax_blocks.checkpoints import stream  # noqa: E402

IDS = np.array([[5, 6, 7, 8, 9, 10, 11, 12], [3, 9, 27, 17, 51, 25, 11, 33]])
BLOCK = (32, 32)


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """Qwen3 (hidden 64, 2 heads of 32, MLP 96) in FP8 blocks of 32 x 32, bfloat16 elsewhere."""
    folder = tmp_path_factory.mktemp("qwen3-fp8")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    tensors = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = qz.fp8_quantize(w, BLOCK)
        else:
            tensors[name] = w.astype(ml_dtypes.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    written = config.to_dict() | {"dtype": "bfloat16", "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
        "modules_to_not_convert": ["lm_head"]}}
    (folder / "config.json").write_text(json.dumps(written))
    return folder


def _hf_fp8(folder, monkeypatch, dtype):
    import transformers.quantizers.quantizer_finegrained_fp8 as quantizer

    monkeypatch.setattr(quantizer, "is_accelerate_available", lambda: True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=dtype).eval()


def test_an_fp8_qwen3_folder_gives_transformers_logits_and_tokens(fp8_folder, monkeypatch):
    hf = _hf_fp8(fp8_folder, monkeypatch, torch.float32)
    lm = fb.from_hf(fp8_folder, part="causal-lm", dtype="float32")
    with torch.no_grad():
        theirs = hf(torch.tensor(IDS)).logits.numpy()
    ours = np.asarray(lm(jnp.asarray(IDS)))
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4
    tokens = hf.generate(torch.tensor(IDS), max_new_tokens=6, do_sample=False).numpy()
    assert (np.asarray(fb.generate(lm, IDS, max_new_tokens=6)) == tokens).all()
    assert any("quantization_config fp8" in n for n in fb.load_report(lm).notes)


def test_the_configs_dtype_and_the_weights_bit_for_bit(fp8_folder, monkeypatch):
    """No dtype asked: bfloat16 (the config's), each weight dequantized in float32 and rounded
    once, as transformers' dequantize=True holds it."""
    hf = _hf_fp8(fp8_folder, monkeypatch, "auto")
    lm = fb.from_hf(fp8_folder, part="causal-lm")
    assert lm.cfg.param_dtype == "bfloat16"
    ours = fb.to_hf(lm)
    for name, p in hf.state_dict().items():
        assert p.dtype == torch.bfloat16, name
        np.testing.assert_array_equal(ours[name].view(np.uint16), p.view(torch.int16).numpy().view(np.uint16),
                                      err_msg=name)


def test_save_hf_writes_it_dequantized_or_as_the_same_fp8_bytes(fp8_folder, tmp_path, caplog):
    lm = fb.from_hf(fp8_folder, part="causal-lm")
    with caplog.at_level(logging.WARNING, logger="flax_blocks"):
        fb.save_hf(lm, tmp_path / "plain")
    assert "written dequantized, without quantization_config" in caplog.text
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization_config" not in config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(IDS)).logits.numpy()
    ours = np.asarray(fb.from_hf(fp8_folder, part="causal-lm", dtype="float32")(jnp.asarray(IDS)))
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-2  # the bfloat16 weights written
    fb.save_hf(lm, tmp_path / "fp8", quantization="fp8")
    source = stream.read_safetensors(fp8_folder / "model.safetensors")
    back = stream.read_safetensors(tmp_path / "fp8" / "model.safetensors")
    assert sorted(source) == sorted(back)
    for name, a in source.items():
        assert a.dtype == back[name].dtype and a.read().tobytes() == back[name].read().tobytes(), name
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == list(BLOCK)


def test_save_hf_quantizes_a_plain_model_as_transformers_reads_it(fp8_folder, tmp_path, monkeypatch):
    plain = fb.from_hf(fp8_folder, part="causal-lm", dtype="float32")
    plain.load_report = None  # as if built elsewhere: written with the family named, fresh scales
    fb.save_hf(plain, tmp_path, family="qwen3", quantization="fp8")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    stored = stream.read_safetensors(tmp_path / "model.safetensors")
    assert stored["model.layers.1.mlp.down_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert stored["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (1, 1)
    assert stored["lm_head.weight"].dtype == np.float32 and "model.norm.weight_scale_inv" not in stored
    hf = _hf_fp8(tmp_path, monkeypatch, torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor(IDS)).logits.numpy()
    ours = np.asarray(fb.from_hf(tmp_path, part="causal-lm", dtype="float32")(jnp.asarray(IDS)))
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4


def test_a_gpt_oss_folder_with_mxfp4_experts_reads_as_transformers_dequantizes_it(tmp_path):
    """A GPT-OSS folder with MXFP4 experts: its tensors as `read_folder` gives them to the family
    (experts' gate_up_proj / down_proj named, shaped and valued as transformers'
    Mxfp4Config(dequantize=True) model holds them), and the whole model's logits and greedy
    tokens, against that model."""
    from flax_blocks.checkpoints.checkpoint import read_folder

    config = transformers.GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=3,
                                       num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    rng = np.random.default_rng(0)
    tensors = {k: v.detach().numpy().astype(ml_dtypes.bfloat16) for k, v in model.state_dict().items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for name, (rows, inner) in {"gate_up_proj": (128, 64), "down_proj": (64, 64)}.items():
        prefix = f"model.layers.0.mlp.experts.{name}"
        tensors[prefix + "_blocks"] = rng.integers(0, 256, (3, rows, inner // 32, 16), dtype=np.uint8)
        tensors[prefix + "_scales"] = rng.integers(120, 130, (3, rows, inner // 32), dtype=np.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    written = config.to_dict() | {"dtype": "bfloat16", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    (tmp_path / "config.json").write_text(json.dumps(written))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    _, sd = read_folder(str(tmp_path))
    theirs = hf.state_dict()
    assert sorted(sd) == sorted(theirs)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert sd[name].shape == tuple(theirs[name].shape) and sd[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(sd[name].astype(np.float32).read(), theirs[name].numpy(), err_msg=name)
    # the whole model (the GPT-OSS family): logits of a left-padded batch and greedy tokens as transformers'
    lm = fb.from_hf(str(tmp_path), part="causal-lm", dtype="float32")
    ids, mask = np.array([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 9]]), np.array([[0, 0, 1, 1, 1, 1], [1] * 6])
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        want = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)).logits
    got = np.asarray(lm(ids, attention_mask=mask, positions=positions))
    real = mask.astype(bool)
    assert np.abs(got - want.numpy())[real].max() <= 1e-4 * np.abs(want.numpy()[real]).max()
    tokens = hf.generate(torch.tensor(ids[1:]), max_new_tokens=5, do_sample=False).numpy()
    np.testing.assert_array_equal(np.asarray(fb.generate(lm, ids[1:], max_new_tokens=5)), tokens)
