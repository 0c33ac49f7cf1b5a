"""Whole models against Hugging Face: fb.from_hf(part="model" / "causal-lm") of LLaMA (tied and
untied), Qwen2, Mistral, GPT-2 and BERT, fb.to_hf of a whole model, per-row positions, and
fb.generate against HF's generate and its logits warpers. The other families' whole models:
test_models_families.py; the LanguageModel twins without HF: tests/test_lm.py.

Tiny float32 Hugging Face models (d_model 32, 2 layers, vocab 96, random weights with the
norms and biases moved off 1 / 0), built once per module. The batch is left-padded (row 1
has 3 padding tokens on the left) and both sides get HF's positions, cumsum(mask) - 1
(0 at padding); logits are compared at real tokens only (a padded query's output is
meaningless on both sides).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
import torch_blocks as tb  # noqa: E402

V, E = 96, 32
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA = dict(vocab_size=V, hidden_size=E, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             num_hidden_layers=2, rms_norm_eps=1e-6, max_position_embeddings=64, rope_theta=500.0, **NO_SPECIAL)
CAUSAL = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**LLAMA, "num_key_value_heads": 1}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA, "sliding_window": None}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=E, n_head=4, n_layer=2, n_positions=40,
                                                   **NO_SPECIAL)),
}


def _build(cfg_cls, model_cls, kw, seed=0):
    config = getattr(transformers, cfg_cls)(**kw, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


pytestmark = pytest.mark.xdist_group("hf_models")  # its module fixtures built by one worker (--dist loadgroup)

@pytest.fixture(scope="module")
def hf_models():
    return {name: _build(*spec) for name, spec in CAUSAL.items()}


@pytest.fixture(scope="module")
def flax_models(hf_models):
    return {name: fb.from_hf(m, part="causal-lm") for name, m in hf_models.items()}


def _batch(t=7, pad=3, seed=0):
    ids = np.random.default_rng(seed).integers(0, V, (2, t))
    mask = np.ones((2, t), np.int64)
    mask[1, :pad] = 0
    positions = np.maximum(mask.cumsum(1) - 1, 0)
    return ids, mask, positions


@pytest.mark.parametrize("family", list(CAUSAL))
def test_causal_lm_logits_match_hf_on_a_left_padded_batch(family, hf_models, flax_models):
    hf, lm = hf_models[family], flax_models[family]
    assert lm.lm.head == ("tied" if family in ("llama-tied", "gpt2") else "untied")
    ids, mask, positions = _batch()
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)).logits
    ours = np.asarray(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask), positions=jnp.asarray(positions)))
    live = mask.astype(bool)
    ref = ref.numpy()
    err = np.abs(ours - ref)[live].max() / np.abs(ref[live]).max()
    assert err < 1e-5, err
    if lm.lm.max_positions is not None:
        # learned positions: without positions= row 1's real tokens sit at 3..6 and the logits
        # move (rotary attention sees only relative positions, so a whole row's shift does not)
        shifted = np.asarray(lm(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
        assert np.abs(shifted - ref)[1, 3:].max() / np.abs(ref[live]).max() > 1e-3

    # to_hf: every weight back under HF's own names, bit for bit; strict load
    sd = fb.to_hf(lm)
    original = hf.state_dict()
    assert set(sd) == set(original)
    assert all(np.array_equal(v, original[k].numpy()) for k, v in sd.items())
    hf.load_state_dict(tb.to_tensors(sd), strict=True)


def greedy_equals_hf(hf, lm):
    """Greedy 16 tokens from two left-padded prompts (lengths 6 and 4): fb.generate's equal
    HF generate(do_sample=False)'s token for token -> (HF's tokens, ids, mask)."""
    ids, mask, _ = _batch(t=6, pad=2, seed=1)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=16, do_sample=False,
                          pad_token_id=0).numpy()
    ours = np.asarray(fb.generate(lm, ids, mask, max_new_tokens=16))
    assert ours.shape == ref.shape == (2, 22)
    np.testing.assert_array_equal(ours, ref)
    return ref, ids, mask


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_generation_equals_hf_generate(family, hf_models, flax_models):
    hf, lm = hf_models[family], flax_models[family]
    ref, ids, mask = greedy_equals_hf(hf, lm)
    if family == "llama":  # an eos: that row is padded after it, as HF's (which stops once all rows end)
        eos = int(ref[0, 10])
        with torch.no_grad():
            ref = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=16,
                              do_sample=False, pad_token_id=1, eos_token_id=eos).numpy()
        ours = np.asarray(fb.generate(lm, ids, mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=1))
        n = ref.shape[1]
        np.testing.assert_array_equal(ours[:, :n], ref)
        assert (ours[:, n:] == 1).all() and (ours[0, 11:] == 1).all()


def test_generate_follows_the_folders_generation_config_as_hf(hf_models, tmp_path):
    """A LLaMA folder whose generation_config.json names eos ids that greedy decoding reaches
    (one id, then a list; pad named, then left to HF's eos[0]): fb.generate and the torch twin's
    generate give HF's generate output exactly (its length too: HF stops once every row has
    ended); an argument overrides the file; the config.json fallback without the file."""
    import json

    hf = hf_models["llama"]
    ids, mask, _ = _batch(t=6, pad=2, seed=1)
    with torch.no_grad():  # greedy without an eos (the model's config names none)
        free = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=16,
                           do_sample=False, pad_token_id=0).numpy()[:, 6:]
    cases = [({"eos_token_id": int(free[0, 3]), "pad_token_id": 1},  # row 0 ends at step 3, row 1 runs on
             {"eos_token_id": [int(free[1, 2]), int(free[0, 4])]})]  # both rows end; pad = eos[0]
    outputs = []
    for gen in cases[0]:
        folder = tmp_path / f"eos{len(json.dumps(gen))}"
        hf.save_pretrained(folder)
        (folder / "generation_config.json").write_text(json.dumps(gen))
        theirs_model = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():
            theirs = theirs_model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask),
                                           max_new_tokens=16).numpy()
        lm = fb.from_hf(folder, part="causal-lm")
        ours = np.asarray(fb.generate(lm, ids, mask, max_new_tokens=16))
        np.testing.assert_array_equal(ours, theirs)
        if "pad_token_id" in gen:  # row 0 padded after its eos, row 1 to the end
            assert ours.shape == (2, 22) and (ours[0, 10:] == 1).all() and (ours[1, 6:] == free[1]).all()
        else:  # both rows ended: HF's shorter output
            assert ours.shape[1] <= 6 + 5 and np.isin(ours[:, -1], gen["eos_token_id"]).any()
        twin = tb.LanguageModel(lm.cfg, lm.lm).eval()
        twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
        np.testing.assert_array_equal(tb.lm.generate(twin, torch.tensor(ids), torch.tensor(mask),
                                                     max_new_tokens=16).numpy(), theirs)
        outputs.append(ours)
    again = fb.generate(lm, ids, mask, max_new_tokens=16, eos_token_id=int(free[0, 3]), pad_token_id=1)
    np.testing.assert_array_equal(np.asarray(again), outputs[0])  # the arguments win over the file
    fb.save_hf(lm, tmp_path / "saved")  # writes the settings back
    assert fb.from_hf(tmp_path / "saved", part="causal-lm").lm.generation == lm.lm.generation

    # a file that samples: the torch twin draws HF's tokens from the same torch seed (temperature,
    # HF's default top_k 50, top_p); fb.generate samples too, so it asks for a key
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9}))
    sampler = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    lm = fb.from_hf(folder, part="causal-lm")
    twin = tb.LanguageModel(lm.cfg, lm.lm).eval()
    twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(lm)), strict=True)
    draws = []
    for generate in (sampler.generate, lambda *a, **k: tb.generate(twin, *a, **k)):
        torch.manual_seed(3)
        with torch.no_grad():
            draws.append(generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=8).numpy())
    np.testing.assert_array_equal(draws[0], draws[1])
    with pytest.raises(ValueError, match="needs key="):
        fb.generate(lm, ids, mask, max_new_tokens=8)
    (folder / "generation_config.json").unlink()  # transformers' fallback: config.json's keys
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": int(free[0, 3])}))
    assert fb.from_hf(folder, part="causal-lm").lm.generation.eos_token_id == (int(free[0, 3]),)


def test_part_model_is_the_base_model_and_bert_reads_token_types(hf_models):
    hf = hf_models["llama"]
    base = fb.from_hf(hf, part="model")
    ids, mask, positions = _batch()
    with torch.no_grad():
        ref = hf.model(torch.tensor(ids), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(positions)).last_hidden_state.numpy()
    ours = np.asarray(base(ids, attention_mask=mask, positions=positions))
    live = mask.astype(bool)
    assert np.abs(ours - ref)[live].max() / np.abs(ref[live]).max() < 1e-5
    assert set(fb.to_hf(base)) == set(hf.model.state_dict())

    bert = _build("BertConfig", "BertModel", dict(vocab_size=V, hidden_size=E, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=48,
                                                  max_position_embeddings=16, type_vocab_size=2))
    lm = fb.from_hf(bert, part="model")
    types = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        ref = bert(torch.tensor(ids), attention_mask=torch.tensor(mask),
                   token_type_ids=torch.tensor(types)).last_hidden_state.numpy()
    ours = np.asarray(lm(ids, attention_mask=mask, token_type_ids=types))
    assert np.abs(ours - ref)[live].max() / np.abs(ref[live]).max() < 1e-5
    sd = fb.to_hf(lm)
    missing, unexpected = bert.load_state_dict(tb.to_tensors(sd), strict=False)
    assert unexpected == [] and all(k.startswith("pooler.") for k in missing)
    with pytest.raises(fb.ConversionError, match="not a causal language model"):
        fb.from_hf(bert, part="causal-lm")


def test_sampling_is_reproducible_and_warps_as_hf(flax_models):
    lm = flax_models["llama"]
    ids, mask, _ = _batch(t=4, pad=1)
    a = fb.generate(lm, ids, mask, max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.8, key=jax.random.key(3))
    b = fb.generate(lm, ids, mask, max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.8, key=jax.random.key(3))
    c = fb.generate(lm, ids, mask, max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.8, key=jax.random.key(4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)

    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from flax_blocks.generation import _choose

    # probabilities 0.4 0.3 0.15 0.1 0.05 (at temperature 1): top_p 0.8 keeps three tokens,
    # an off-by-one keeps two; top_k 4 drops the last one
    logits = np.log(np.array([0.15, 0.4, 0.05, 0.3, 0.1], np.float32))[None]
    for temperature, top_k, top_p in ((1.0, None, 0.8), (0.7, 4, 0.9), (1.3, 3, None)):
        scores = torch.tensor(logits)
        for warper in ([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                       + ([TopPLogitsWarper(top_p)] if top_p else [])):
            scores = warper(None, scores)
        want = torch.softmax(scores, -1).numpy()[0]
        n = 20000
        draws = jax.vmap(lambda k, temperature=temperature, top_k=top_k, top_p=top_p:
                         _choose(jnp.asarray(logits), k, 0, temperature, top_k, top_p))(
            jax.random.split(jax.random.key(0), n))
        freq = np.bincount(np.asarray(draws).ravel(), minlength=5) / n
        assert np.abs(freq - want).max() < 0.015, (temperature, top_k, top_p, freq, want)
        assert (freq[want == 0] == 0).all()


def test_top_p_keeps_what_hf_keeps_at_its_boundary():
    """Where a running sum of probabilities lands exactly on top_p (exact powers of two), or
    near it, the tokens kept are HF's TopPLogitsWarper's, token for token."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from flax_blocks.generation import warp_logits

    cases = [([0.5, 0.25, 0.1875, 0.0625], 0.75), ([0.5, 0.25, 0.1875, 0.0625], 0.5),
             ([0.0625, 0.5, 0.1875, 0.25], 0.9375), ([0.25, 0.25, 0.25, 0.25], 0.5), ([0.5, 0.5], 0.5)]
    rng = np.random.default_rng(0)
    for _ in range(50):  # random distributions, top_p just either side of a running sum (away from float32's noise)
        probs = rng.dirichlet(np.ones(6)).astype(np.float32)
        edge = float(np.sort(probs)[::-1].cumsum()[rng.integers(0, 5)])
        cases.append((list(probs), edge + rng.choice([-1, 1]) * 1e-4))
    for probs, p in cases:
        logits = np.log(np.asarray(probs, np.float32))[None]
        theirs = np.isfinite(TopPLogitsWarper(p)(None, torch.tensor(logits)).numpy())
        ours = np.isfinite(np.asarray(warp_logits(jnp.asarray(logits), top_p=p)))
        assert (ours == theirs).all(), (probs, p, ours, theirs)
    kept = np.isfinite(np.asarray(warp_logits(jnp.log(jnp.asarray([[0.5, 0.25, 0.1875, 0.0625]])), top_p=0.75)))
    assert kept.tolist() == [[True, True, False, False]]


def test_bad_input_is_refused_before_anything_runs(flax_models):
    lm, gpt2 = flax_models["llama"], flax_models["gpt2"]
    ids, mask, _ = _batch()
    cases = [
        (dict(input_ids=ids + V), "outside the vocabulary"),
        (dict(attention_mask=mask == 0), "padding"),  # True = padding: the last column is 'padding'
        (dict(attention_mask=np.where(mask > 0, 0.0, -np.inf)), "additive"),
        (dict(top_p=0.0, temperature=1.0, key=jax.random.key(0)), "top_p"),
        (dict(top_p=1.5, temperature=1.0, key=jax.random.key(0)), "top_p"),
        (dict(temperature=1.0), "key"),
    ]
    for kw, match in cases:
        args = {"input_ids": ids, "attention_mask": mask, **kw}
        with pytest.raises(ValueError, match=match):
            fb.generate(lm, args.pop("input_ids"), args.pop("attention_mask"), max_new_tokens=4, **args)
    long_ids = np.zeros((1, 41), np.int64)
    with pytest.raises(ValueError, match="learned positions"):
        fb.generate(gpt2, long_ids, max_new_tokens=1)  # longer than GPT-2's n_positions=40
    with pytest.raises(ValueError, match="learned positions"):
        fb.generate(gpt2, ids, mask, max_new_tokens=34)  # 7 + 34 > 40
    with pytest.raises(ValueError, match="learned positions"):
        gpt2(long_ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm(ids + V)
    with pytest.raises(ValueError, match="no real token"):
        lm(ids, attention_mask=np.zeros_like(mask))
