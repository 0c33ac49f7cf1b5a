"""Which files a folder's weights are read from (from_pretrained's choice and order), and every
refusal that says transformers fails too, checked against transformers itself."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
from flax_blocks.checkpoints.checkpoint import read_config  # noqa: E402

LLAMA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40, num_hidden_layers=2,
             vocab_size=64)
IDS = np.array([[5, 6, 7, 8, 9, 10]])


def _llama(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()


def _logits_equal(folder) -> float:
    ours = np.asarray(fb.from_hf(folder, part="causal-lm")(jnp.asarray(IDS)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(torch.tensor(IDS)).logits
    return float(np.abs(ours - theirs.detach().numpy()).max())


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two different models' folders: a single file, and shards with their index."""
    root = tmp_path_factory.mktemp("layouts")
    _llama(0).save_pretrained(root / "single")
    _llama(1).save_pretrained(root / "sharded", max_shard_size="20KB")
    _llama(2).save_pretrained(root / "bin", safe_serialization=False) if _bin_supported() else None
    return root


def _bin_supported() -> bool:
    import inspect

    return "safe_serialization" in inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters


def _merge(root, names, out):
    out.mkdir()
    for name in names:
        for f in (root / name).iterdir():
            if not (out / f.name).exists():
                shutil.copy(f, out / f.name)
    return out


def test_a_single_file_beside_an_index_is_read_as_transformers_reads_it(two, tmp_path):
    both = _merge(two, ["single", "sharded"], tmp_path / "both")  # a model saved twice into one folder
    assert _logits_equal(both) < 1e-5
    report = fb.load_report(fb.from_hf(both, part="causal-lm"))
    assert report.files == ("model.safetensors",)


def test_model_safetensors_is_read_before_pytorch_model_bin(two, tmp_path):
    """A folder holding model.safetensors and another model's pytorch_model.bin: transformers
    reads model.safetensors, and so do we (the .bin alone is read as the other model)."""
    both = _merge(two, ["single"], tmp_path / "safe-and-bin")
    torch.save(_llama(2).state_dict(), both / "pytorch_model.bin")
    assert _logits_equal(both) < 1e-5
    assert fb.load_report(fb.from_hf(both, part="causal-lm")).files == ("model.safetensors",)
    (both / "model.safetensors").unlink()
    assert _logits_equal(both) < 1e-5  # the other model: the two files differ


def test_a_stale_index_beside_a_single_file_is_not_read(two, tmp_path):
    stale = _merge(two, ["single"], tmp_path / "stale")
    (stale / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "gone.bin"}}))
    (stale / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    assert _logits_equal(stale) < 1e-5  # transformers reads model.safetensors first; so do we


def test_transformers_weights_in_the_config_names_the_file(two, tmp_path):
    both = _merge(two, ["single", "sharded"], tmp_path / "named")
    config = json.loads((both / "config.json").read_text())
    (both / "config.json").write_text(json.dumps({**config, "transformers_weights": "model.safetensors.index.json"}))
    assert _logits_equal(both) < 1e-5  # the index's shards, though model.safetensors is there
    assert fb.load_report(fb.from_hf(both, part="causal-lm")).files[0].startswith("model-0")
    (both / "config.json").write_text(json.dumps({**config, "transformers_weights": "pytorch_model.bin"}))
    with pytest.raises(FileNotFoundError, match="transformers refuses it too"):
        fb.from_hf(both, part="causal-lm")
    with pytest.raises(ValueError):
        transformers.AutoModelForCausalLM.from_pretrained(both)


# Each refusal that says transformers fails too: (family config, what our refusal says, where HF fails).
def _config(model_type: str, **kw):
    return {"model_type": model_type, **LLAMA, **kw}


CLAIMS = {
    "kv heads that do not divide the heads": (
        _config("llama", num_key_value_heads=3), "transformers fails on it too"),
    "partial rotary with a scaled type on a whole-head family": (
        _config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
        "transformers fails on it too"),
    "a scaled type without a key it requires": (
        _config("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8}), "transformers requires them too"),
    "yarn over an odd rotary dim": (
        {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 40,
         "num_hidden_layers": 2, "vocab_size": 64, "head_dim": 16, "rotary_pct": 0.3125,
         "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4}}, "fails too"),
    "a rope type Phi3Config does not accept": (
        _config("phi3", rope_scaling={"rope_type": "linear", "factor": 2.0}), "transformers refuses the config"),
    "a rope type transformers does not know": (
        _config("llama", rope_scaling={"rope_type": "frobnicated", "factor": 2.0}), "transformers knows no such"),
    "Qwen2 local layers without a window": (
        _config("qwen2", use_sliding_window=False, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"]), "transformers refuses this config"),
}


@pytest.mark.parametrize("name", list(CLAIMS))
def test_each_claim_that_transformers_fails_too_is_true(name):
    config, words = CLAIMS[name]
    with pytest.raises(fb.ConversionError, match=words):
        read_config(config)
    cls = {"llama": "LlamaForCausalLM", "gpt_neox": "GPTNeoXForCausalLM", "phi3": "Phi3ForCausalLM",
           "qwen2": "Qwen2ForCausalLM"}[config["model_type"]]
    with pytest.raises(Exception):  # noqa: B017 - transformers fails in its own way: config, build or forward
        hf_config = transformers.AutoConfig.for_model(**config)
        model = getattr(transformers, cls)(hf_config).eval()
        with torch.no_grad():
            model(torch.tensor(IDS))


def test_the_mistral_layer_types_claim_holds_in_transformers_generate():
    """Mistral ignores layer_types in its layers but its cache reads them: a contradiction
    (some layers full though a window is set) makes HF's cached decoding fail, as refused."""
    config = _config("mistral", sliding_window=2, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(fb.ConversionError, match="cached decoding then fails"):
        read_config(config)
    model = transformers.MistralForCausalLM(transformers.AutoConfig.for_model(**config)).eval()
    with pytest.raises(Exception):  # noqa: B017
        model.generate(torch.tensor(IDS), max_new_tokens=4, do_sample=False, pad_token_id=0)
