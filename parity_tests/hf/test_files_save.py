"""fb.save_hf: a Flax model written back as a Hugging Face folder that transformers'
from_pretrained reads with no missing or unexpected weight and the same logits: whole models
(sharded, tied heads left out, scaled rotary kept), after an optax fine-tune, a stack with the
parts around it taken from its source folder, BERT's pooler copied, ModernBERT's masked-LM head kept, a model built from
scratch with its family named (and refused where the family cannot hold it), a folder that
held another layout, and two processes holding the model across their devices."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from flax import nnx  # noqa: E402

import flax_blocks as fb  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IDS = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 9, 27, 17, 51, 25, 11, 33, 40, 2]])
LLAMA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40, num_hidden_layers=2,
             vocab_size=64, max_position_embeddings=64, tie_word_embeddings=True,
             rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8})


def _perturbed(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def _hf_load(folder, cls=transformers.AutoModelForCausalLM):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    return model.eval(), problems


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


pytestmark = pytest.mark.xdist_group("hf_files_save")  # its module fixtures built by one worker (--dist loadgroup)

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    _perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))).save_pretrained(folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config["gradient_checkpointing"] = False  # a legacy key: kept as it was read
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return folder


def test_a_loaded_model_goes_back_sharded_and_transformers_reads_it_whole(llama_folder, tmp_path):
    lm = fb.from_hf(llama_folder, part="causal-lm")
    files = fb.save_hf(lm, tmp_path, max_shard_size="20KB")
    names = sorted(os.path.basename(f) for f in files)
    assert "model.safetensors.index.json" in names and sum(n.startswith("model-0") for n in names) >= 2
    with open(tmp_path / "model.safetensors.index.json") as f:
        weights = json.load(f)["weight_map"]
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights  # tied: as save_pretrained
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    assert config["gradient_checkpointing"] is False and config["architectures"] == ["LlamaForCausalLM"]
    hf, problems = _hf_load(tmp_path)
    assert problems == {}
    assert _rel(lm(jnp.asarray(IDS)), hf(torch.tensor(IDS)).logits.detach()) <= 1e-5
    assert fb.from_hf(tmp_path, part="causal-lm").cfg == lm.cfg  # and back again


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_save_hf_dtype_casts_every_tensor_it_writes(llama_folder, tmp_path, dtype):
    """save_hf(..., dtype=) writes each tensor cast to that dtype (the config saying so), the
    values the model's own rounded once; a model loaded back is of that dtype."""
    from safetensors.torch import load_file

    lm = fb.from_hf(llama_folder, part="causal-lm")
    fb.save_hf(lm, tmp_path, dtype=dtype)
    written = load_file(tmp_path / "model.safetensors")
    want = getattr(torch, dtype)
    assert {str(t.dtype) for t in written.values()} == {str(want)}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == dtype
    full = load_file(fb.save_hf(lm, tmp_path / "f32")[1])
    assert written.keys() == full.keys()
    assert all(torch.equal(written[k], full[k].to(want)) for k in full)
    assert {str(v.dtype) for v in jax.tree.leaves(nnx.state(fb.from_hf(tmp_path, part="causal-lm"), nnx.Param))} \
        == {dtype}


def test_a_fine_tuned_model_reloads_in_transformers(llama_folder, tmp_path):
    import optax

    lm = fb.from_hf(llama_folder, part="causal-lm")
    before = np.asarray(lm(jnp.asarray(IDS)))
    opt = nnx.Optimizer(lm, optax.adamw(1e-2, weight_decay=0.0), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, ids):
        def loss(m):
            logits = m(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    losses = [float(step(lm, opt, jnp.asarray(IDS))) for _ in range(5)]
    assert losses[-1] < losses[0]
    fb.save_hf(lm, tmp_path)
    hf, problems = _hf_load(tmp_path)
    assert problems == {}
    after = hf(torch.tensor(IDS)).logits.detach().numpy()
    assert _rel(lm(jnp.asarray(IDS)), after) <= 1e-5 and _rel(before, after) > 1e-3


def test_a_stack_goes_back_with_the_parts_of_its_source_folder(llama_folder, tmp_path):
    stack = fb.from_hf(llama_folder)  # the layers and final norm only
    stack.layers.norm1.scale.set_value(stack.layers.norm1.scale[...] * 1.5)  # a change to the layers
    fb.save_hf(stack, tmp_path)
    hf, problems = _hf_load(tmp_path)
    assert problems == {}
    whole = fb.from_hf(tmp_path, part="causal-lm")
    assert _rel(whole(jnp.asarray(IDS)), hf(torch.tensor(IDS)).logits.detach()) <= 1e-5
    np.testing.assert_array_equal(np.asarray(whole.encoder.layers.norm1.scale[...]),
                                  np.asarray(stack.layers.norm1.scale[...]))
    lone = fb.from_hf(transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)))  # from an object: no folder
    with pytest.raises(fb.ConversionError, match="pass base="):
        fb.save_hf(lone, tmp_path / "lone")
    fb.save_hf(lone, tmp_path / "lone", base=llama_folder)  # the embeddings and head of another folder


def test_bert_keeps_the_pooler_it_does_not_compute(tmp_path):
    torch.manual_seed(0)
    bert = _perturbed(transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_attention_heads=4, intermediate_size=40, num_hidden_layers=2, vocab_size=64)))
    bert.save_pretrained(tmp_path / "src")
    model = fb.from_hf(tmp_path / "src", part="model")
    fb.save_hf(model, tmp_path / "out")
    hf, problems = _hf_load(tmp_path / "out", transformers.AutoModel)
    assert problems == {}
    assert _rel(model(jnp.asarray(IDS)), hf(torch.tensor(IDS)).last_hidden_state.detach()) <= 1e-5


def test_modernbert_goes_back_with_its_masked_lm_head(tmp_path):
    """ModernBERT-base's published config (sizes shrunk: 2 layers, global then local with a window of 4 // 2)
    as a ModernBertForMaskedLM folder: its base model read (part="model") gives transformers' last hidden
    state on a padded batch; save_hf writes it back beside the head the source folder holds, and
    from_pretrained reads the same weights (layer 0 without attn_norm), hidden states and masked-LM logits."""
    from parity_tests.hf.published import load, shrink

    torch.manual_seed(0)
    mlm = _perturbed(transformers.ModernBertForMaskedLM(transformers.ModernBertConfig.from_dict(
        shrink(load("modernbert_base")))))
    mlm.save_pretrained(tmp_path / "src")
    mask = np.ones_like(IDS)
    mask[1, 7:] = 0
    live = mask.astype(bool)
    with torch.no_grad():
        ref = mlm.model(torch.tensor(IDS), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
        logits = mlm(torch.tensor(IDS), attention_mask=torch.tensor(mask)).logits.numpy()
    model = fb.from_hf(tmp_path / "src", part="model")
    assert _rel(np.asarray(model(jnp.asarray(IDS), attention_mask=jnp.asarray(mask)))[live], ref[live]) <= 1e-5
    fb.save_hf(model, tmp_path / "out")
    back, problems = _hf_load(tmp_path / "out", transformers.ModernBertModel)
    assert set(problems) == {"unexpected_keys"} and all(k.startswith(("head.", "decoder.")) for k in
                                                      problems["unexpected_keys"])  # the head, kept
    assert all(torch.equal(v, mlm.model.state_dict()[k]) for k, v in back.state_dict().items())
    assert "layers.0.attn_norm.weight" not in back.state_dict()
    again, problems = _hf_load(tmp_path / "out", transformers.ModernBertForMaskedLM)
    assert problems == {}
    with torch.no_grad():
        assert np.array_equal(again(torch.tensor(IDS), attention_mask=torch.tensor(mask)).logits.numpy(), logits)


def test_a_model_built_from_scratch_is_written_as_the_family_named_or_refused(tmp_path):
    cfg = fb.BlockConfig(d_model=32, num_heads=4, num_kv_heads=2, d_ff=40, dropout=0.0, norm="pre",
                         norm_type="rmsnorm", mlp="swiglu", activation="silu", rope_theta=500.0, bias=False,
                         causal=True, layer_norm_eps=1e-5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = fb.LanguageModel(cfg, fb.LMConfig(vocab_size=64, num_layers=2), rngs=nnx.Rngs(0))
    fb.save_hf(model, tmp_path / "llama", family="llama")
    hf, problems = _hf_load(tmp_path / "llama")
    assert problems == {}
    assert _rel(model(jnp.asarray(IDS)), hf(torch.tensor(IDS)).logits.detach()) <= 1e-5
    gemma_like = fb.LanguageModel(dataclasses.replace(cfg, norm_weight_offset=1.0),
                                  fb.LMConfig(vocab_size=64, num_layers=2), rngs=nnx.Rngs(0))
    with pytest.raises(fb.ConversionError, match=r"norm_weight_offset: the model has 1.0, its config.json would give"):
        fb.save_hf(gemma_like, tmp_path / "wrong", family="llama")
    assert not (tmp_path / "wrong").exists()  # refused before anything is written
    with pytest.raises(fb.ConversionError, match="name the family"):
        fb.save_hf(model, tmp_path / "nameless")


def test_the_layout_of_an_earlier_save_is_replaced(llama_folder, tmp_path):
    lm = fb.from_hf(llama_folder, part="causal-lm")
    fb.save_hf(lm, tmp_path, max_shard_size="20KB")  # shards and an index
    (tmp_path / "pytorch_model.bin").write_bytes(b"stale")
    fb.save_hf(lm, tmp_path)  # one file now: the index, its shards and the .bin would be read first or beside it
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert _hf_load(tmp_path)[1] == {}


_TWO = textwrap.dedent("""
    import sys
    import jax
    folder, out, port, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import flax_blocks as fb
    from flax_blocks.sharding import make_mesh
    mine = jax.local_devices()
    theirs = [d for d in jax.devices() if d.process_index != jax.process_index()]
    first, second = (mine, theirs) if pid == 0 else (theirs, mine)
    # "model" across the processes: no process holds a whole kernel
    mesh = make_mesh(data=2, model=2, devices=[d for pair in zip(first, second) for d in pair])
    model = fb.from_hf(folder, part="causal-lm", mesh=mesh)
    print("WROTE", len(fb.save_hf(model, out)))
""")


def test_two_processes_gather_and_the_first_writes(llama_folder, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, "-c", _TWO, str(llama_folder), str(tmp_path / "out"), str(port),
                               str(pid)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for pid in (0, 1)]
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert "WROTE 3" in outs[0][0] and "WROTE 0" in outs[1][0]  # config, generation config and weights by process 0
    hf, problems = _hf_load(tmp_path / "out")
    assert problems == {}
    want = fb.from_hf(llama_folder, part="causal-lm")(jnp.asarray(IDS))
    assert _rel(want, hf(torch.tensor(IDS)).logits.detach()) <= 1e-5
    assert jax.process_count() == 1


def test_a_mixture_of_experts_round_trips_from_either_layout_bit_for_bit(tmp_path):
    """Qwen2-MoE with dense and experts layers mixed (decoder_sparse_step 2, mlp_only_layers [2]) and a
    shared expert, saved by transformers in its fused layout (save_original_format=False:
    experts.gate_up_proj (X, 2F, E), down_proj (X, E, F)): fb.from_hf reads it equal to HF; fb.save_hf
    writes save_pretrained's per-expert names, each layer's own MLP only (as each layer of ours holds),
    and from_pretrained reads that folder with nothing missing or unexpected, every tensor identical."""
    config = transformers.Qwen2MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=40, num_hidden_layers=3, vocab_size=64, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, decoder_sparse_step=2,
                                         mlp_only_layers=[2], max_position_embeddings=64)
    torch.manual_seed(0)
    hf = _perturbed(transformers.Qwen2MoeForCausalLM(config))
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "np") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    lm = fb.from_hf(tmp_path / "fused", part="causal-lm")
    with torch.no_grad():
        theirs = hf(torch.tensor(IDS)).logits.numpy()
    assert _rel(lm(jnp.asarray(IDS)), theirs) < 1e-5
    fb.save_hf(lm, tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(n.startswith(("model.layers.1.mlp.gate_proj", "model.layers.0.mlp.experts",
                                 "model.layers.2.mlp.experts")) for n in names)  # no other MLP
    back, problems = _hf_load(tmp_path / "ours")
    assert problems == {}
    original = hf.state_dict()
    assert set(back.state_dict()) == set(original)
    assert all(torch.equal(v, original[k]) for k, v in back.state_dict().items())
