"""Parity against the real Hugging Face implementations: BERT, GPT-2, LLaMA (GQA), Mistral
(multi-query), Qwen2 (q/k/v biases).

Each tiny model (2 layers, d_model 64, 4 heads of 16, random weights, no download) is built
from its config, saved with save_pretrained, read back with `fb.from_hf(folder)`, and both run
on the same random hidden states fed as `inputs_embeds`, with the embeddings' own additions
out of the way: BERT's position and token-type embeddings zeroed and its embedding LayerNorm
replaced by the identity, GPT-2's position embeddings zeroed (LLaMA-family models add nothing
to inputs_embeds; their rotary positions live in the layers and both sides compute them).
The HF model's last hidden state is then exactly its layers + final norm.

float64 needs three things of the HF model that are not about semantics but precision, all
done on the test's model instances only (parity_tests.hf.reference):
  - LLaMA-family eager attention takes its softmax in float32 (softmax(..., dtype=float32))
    even in a float64 model: these models run with attn_implementation="sdpa" (float64
    throughout) instead.
  - Their RMSNorm casts the hidden states to float32 (hidden_states.to(torch.float32)) and
    their rotary embedding computes inv_freq, the angles and cos/sin in float32 (.float(),
    autocast off), even in a float64 model; our blocks compute both in float64 under float64.
    Those two forwards are replaced on the instances by the same formulas without the float32
    casts (`float64_faithful`), so that 1e-12 measures the formulas, not float32 rounding.
float32 runs the HF models untouched (eager attention included).

Padding: tokens 1-3 of the last batch element are padding (HF attention_mask 0, our
key_mask False). Outputs and the cotangent are compared at real (non-padded) query positions
only: a padded query's output is meaningless on both sides and differs by construction
(our blocks zero fully-masked rows; HF gives something else).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
import flax_blocks.checkpoints.dialects  # noqa: E402,F401  (fb.checkpoints.dialects below)
import torch_blocks as tb  # noqa: E402
from flax_blocks.checkpoints.checkpoint import hf_config  # noqa: E402
from parity_tests.check import main as check_main  # noqa: E402
from parity_tests.hf.reference import embeddings_out_of_the_way, flax_runs, float64_faithful, hf_run, rel_at  # noqa: E402

B, T, E, PAD = 2, 7, 64, 3
TINY = dict(vocab_size=16, num_hidden_layers=2)

FAMILIES = {
    "bert": ("BertConfig", "BertModel", "eager",
             dict(hidden_size=E, num_attention_heads=4, intermediate_size=96, max_position_embeddings=16,
                  hidden_act="gelu", layer_norm_eps=1e-12)),
    "gpt2": ("GPT2Config", "GPT2Model", "eager",
             dict(n_embd=E, n_head=4, n_layer=2, n_positions=16, vocab_size=16, layer_norm_epsilon=1e-5,
                  bos_token_id=None, eos_token_id=None)),
    "llama": ("LlamaConfig", "LlamaModel", "sdpa",
              dict(hidden_size=E, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   rms_norm_eps=1e-6, max_position_embeddings=32, rope_theta=500.0)),
    "mistral": ("MistralConfig", "MistralModel", "sdpa",
                dict(hidden_size=E, num_attention_heads=4, num_key_value_heads=1, intermediate_size=96,
                     rms_norm_eps=1e-5, max_position_embeddings=32, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2Model", "sdpa",
              dict(hidden_size=E, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   rms_norm_eps=1e-6, max_position_embeddings=32)),
}


def _build(family: str, dtype):
    cfg_cls, model_cls, attn, kw = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**{**TINY, **kw}, attn_implementation=attn)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    with torch.no_grad():  # HF initialises norms to 1/0 and biases to 0: make every tensor count
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _inputs(dtype):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, T, E))
    ct = rng.normal(size=(B, T, E))
    keys = np.ones((B, T), bool)
    keys[-1, 1:1 + PAD] = False  # mid-sequence: later real queries of causal models see padded keys
    ct = ct * keys[..., None]  # cotangent zero at padded queries
    return x.astype(dtype), ct.astype(dtype), keys


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_hf_matches_the_hf_model(family, tmp_path, x64):
    model = _build(family, torch.float64)
    model.save_pretrained(tmp_path)
    flax = fb.from_hf(tmp_path)
    assert flax.num_layers == 2 and flax.cfg.param_dtype == "float64"
    ref = float64_faithful(embeddings_out_of_the_way(model))
    x, ct, keys = _inputs(np.float64)
    errors, flax_out, hf_out = {}, flax_runs(flax, x, ct, keys), {}
    for masked in (False, True):
        (yf, gf), (yh, gh) = flax_out[masked], hf_out.setdefault(masked, hf_run(ref, x, ct, keys if masked else None))
        live = keys if masked else np.ones_like(keys)
        errors[masked] = (rel_at(yf, yh, live), rel_at(gf, gh, live))
    assert rel_at(hf_out[True][0], hf_out[False][0], keys) > 1e-3  # the padding mask changes real positions
    print(f"{family} float64 (fwd, grad) unmasked {errors[False]}, masked {errors[True]}")
    for fwd, grad in errors.values():
        assert fwd <= 1e-12 and grad <= 1e-12

    # float32: the HF model untouched, read from the model object
    model32 = embeddings_out_of_the_way(_build(family, torch.float32))
    flax32 = fb.from_hf(model32)
    assert flax32.cfg.param_dtype == "float32"
    x, ct, keys = _inputs(np.float32)
    yf, gf = flax_runs(flax32, x, ct, keys, (True,))[True]
    yh, gh = hf_run(model32, x, ct, keys)
    fwd, grad = rel_at(yf, yh, keys), rel_at(gf, gh, keys)
    print(f"{family} float32 masked (fwd, grad) {fwd:.2e} {grad:.2e}")
    assert fwd <= 2e-6 and grad <= 2e-6

    # to_hf round trip: Flax -> HF names -> a fresh HF model, bit for bit
    sd = fb.to_hf(flax)
    fresh = type(model)(model.config)
    missing, unexpected = fresh.to(torch.float64).load_state_dict(tb.to_tensors(sd), strict=False)
    assert unexpected == []
    original = model.state_dict()
    assert all(k not in sd for k in missing)  # missing: only what is outside the stack
    assert not any(".0." in k or ".1." in k for k in missing)
    for k, v in sd.items():
        assert v.dtype == np.float64 and np.array_equal(v, original[k].numpy()), k


def test_a_wrong_setting_gives_a_clear_refusal():
    config = transformers.LlamaConfig(**{**TINY, **FAMILIES["llama"][3]}, rope_scaling={
        "rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}).to_dict()
    with pytest.raises(fb.ConversionError, match="rope_type 'proportional'"):
        hf_config(config)
    gpt2 = transformers.GPT2Config(n_embd=E, n_head=4, n_layer=2, scale_attn_by_inverse_layer_idx=True).to_dict()
    with pytest.raises(fb.ConversionError, match="scale_attn_by_inverse_layer_idx"):
        hf_config(gpt2)
    with pytest.raises(fb.ConversionError, match="model_type 't5'"):
        hf_config({"model_type": "t5"})


def test_parity_check_uses_the_hf_model_and_fails_wrong_heads(tmp_path, capsys):
    model = _build("gpt2", torch.float32)
    model.save_pretrained(tmp_path)
    assert check_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Flax vs the Hugging Face GPT2Model rebuilt from" in out and "PASS" in out
    assert check_main([str(tmp_path), "--num-heads", "2"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_cli_converts_an_hf_folder_and_writes_hf_names_back(tmp_path, capsys):
    from safetensors.numpy import load_file

    from flax_blocks.checkpoints.convert.cli import main as convert_main

    model = _build("llama", torch.float32)
    model.save_pretrained(tmp_path / "hf")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "flax.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face llama (dialect hf-llama) -> Flax: Encoder: 2 layer(s)" in out and "num_kv_heads=2" in out
    assert convert_main([str(tmp_path / "flax.safetensors"), str(tmp_path / "back.safetensors"),
                         "--dialect", "hf-llama"]) == 0
    back, original = load_file(str(tmp_path / "back.safetensors")), model.state_dict()
    assert set(back) == {k for k in original if k.startswith(("layers.", "norm."))}
    assert all(np.array_equal(v, original[k].numpy()) for k, v in back.items())
    # the HF weights file alone: LLaMA's names fit many families, so the dialect is given, and
    # the unknowable settings as flags
    weights = str(next((tmp_path / "hf").glob("*.safetensors")))
    flags = ["--num-heads", "4", "--num-kv-heads", "2", "--norm", "pre", "--norm-type", "rmsnorm", "--mlp", "swiglu",
             "--activation", "silu", "--rope-theta", "500", "--causal"]
    capsys.readouterr()
    assert convert_main([weights, str(tmp_path / "f2.safetensors"), *flags]) == 1
    assert "pass dialect='hf-llama' (--dialect hf-llama)" in capsys.readouterr().err
    assert convert_main([weights, str(tmp_path / "f2.safetensors"), *flags, "--dialect", "hf-llama"]) == 0
    f2, f1 = load_file(str(tmp_path / "f2.safetensors")), load_file(str(tmp_path / "flax.safetensors"))
    assert set(f2) == set(f1) and all(np.array_equal(f2[k], f1[k]) for k in f1)


# ----------------------------------------------------------------------------------------
# Nothing loads silently wrong: a family is told by the model's config, never by key names
# ----------------------------------------------------------------------------------------


def test_a_mistral_sliding_window_is_read():
    """Mistral's sliding_window (every layer local; measured against HF in parity_tests/hf/test_stacks_families.py)."""
    config = transformers.MistralConfig(**{**TINY, **{**FAMILIES["mistral"][3], "sliding_window": 4}}).to_dict()
    assert (hf_config(config)[1].sliding_window, hf_config(config)[1].sliding_window_pattern) == (4, None)
    assert hf_config({**config, "sliding_window": None})[1].sliding_window is None


def test_families_the_blocks_do_not_compute_are_refused_naming_the_reason():
    for model_type, reason in [("bloom", "ALiBi"), ("t5", "relative position bias"),
                               ("dbrx", "p-norm")]:
        with pytest.raises(fb.ConversionError, match=rf"model_type '{model_type}': .*{reason}"):
            hf_config({"model_type": model_type})


def test_a_gemma_handed_to_from_torch_with_a_llama_config_is_refused():
    """Gemma shares LLaMA's key names and multiplies its norms by (1 + w): the model object
    says what it is, so from_torch refuses it by name instead of loading it 1.0 off."""
    gemma = transformers.GemmaModel(transformers.GemmaConfig(
        vocab_size=16, hidden_size=E, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).eval()
    llama_cfg = fb.BlockConfig(d_model=E, num_heads=4, num_kv_heads=2, d_ff=96, norm="pre", norm_type="rmsnorm",
                               mlp="swiglu", activation="silu", rope_theta=10000.0, bias=False, causal=True,
                               dropout=0.0)
    with pytest.raises(fb.ConversionError, match=r"norm_weight_offset=0.0 given, but the gemma model has "
                                                 r"norm_weight_offset=1.0"):
        fb.from_torch(fb.Encoder, llama_cfg, gemma, num_layers=2)
    with pytest.raises(fb.ConversionError, match="cannot tell the checkpoint's family from its key names"):
        fb.from_torch(fb.Encoder, llama_cfg, gemma.state_dict(), num_layers=2)  # a bare state dict: names only


def test_an_hf_model_object_checks_the_config_it_is_given():
    llama = _build("llama", torch.float32)
    cfg, num_layers, final = hf_config(llama.config.to_dict())[1:]
    enc = fb.from_torch(fb.Encoder, cfg, llama, num_layers=num_layers, final_norm=final)  # its dialect from the model
    assert enc.num_layers == 2
    with pytest.raises(fb.ConversionError, match=r"rope_theta=10000.0 given, but the llama model has rope_theta=500.0"):
        fb.from_torch(fb.Encoder, replace(cfg, rope_theta=10000.0), llama, num_layers=2, final_norm=final)
    with pytest.raises(fb.ConversionError, match="dialect='hf-gpt2' given, but a llama model is written in hf-llama"):
        fb.from_torch(fb.Encoder, cfg, llama, num_layers=2, final_norm=final, dialect="hf-gpt2")


def test_llama_names_alone_need_an_explicit_dialect():
    sd = _build("llama", torch.float32).state_dict()
    with pytest.raises(fb.ConversionError, match=r"(?s)which Gemma.*pass dialect='hf-llama' \(--dialect hf-llama\) "
                                                 r"if the checkpoint is one of llama, mistral, qwen2"):
        fb.detect_dialect(sd)
    assert fb.checkpoints.dialects.translate(sd, "hf-llama").dialect == "hf-llama"


def test_folders_as_hf_writes_them(tmp_path):
    """An index file decides which files are read: a stray consolidated.safetensors beside the
    shards is ignored, and a sharded pytorch_model.bin folder loads."""
    import json

    from safetensors.torch import save_file

    model = _build("llama", torch.float32)
    model.save_pretrained(tmp_path / "st", max_shard_size="60KB")
    assert (tmp_path / "st" / "model.safetensors.index.json").exists()
    save_file({"tok_embeddings.weight": torch.zeros(3, 3)}, tmp_path / "st" / "consolidated.safetensors")
    ref = fb.from_hf(tmp_path / "st")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(sd)
    (tmp_path / "bin").mkdir()
    shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for file, keys in shards.items():
        torch.save({k: sd[k] for k in keys}, tmp_path / "bin" / file)
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    from_bin = fb.from_hf(tmp_path / "bin")
    a, b = fb.torch_state_dict(ref), fb.torch_state_dict(from_bin)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    (tmp_path / "bin" / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match="names shards that are not in the folder"):
        fb.from_hf(tmp_path / "bin")
