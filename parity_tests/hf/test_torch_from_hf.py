"""tb.from_hf / tb.save_hf / tb.load_report: the torch twin reads and writes Hugging Face folders
itself, through the framework-free reading the Flax twin uses, without importing JAX.

A fresh interpreter (JAX never imported there) loads a LLaMA and a mixed Qwen2-MoE folder
whole, compares the logits of a left-padded batch with transformers' (HF's position ids),
writes each back with tb.save_hf and reads that with from_pretrained: every tensor identical.
In this process: the refusals are the Flax twin's word for word, a tensor of the wrong shape
is named before anything is read, the dtype asked for is the one placed, and a stack loads
as tb.Encoder equal to the Flax twin's stack.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

import flax_blocks as fb  # noqa: E402
import torch_blocks as tb  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

_WITHOUT_JAX = textwrap.dedent("""
    import sys, tempfile, torch, transformers
    import torch_blocks as tb

    def rel(a, b, m):
        return float((a - b)[m].abs().max() / b[m].abs().max())

    def check(hf, name):
        torch.manual_seed(1)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.2 * torch.randn_like(p))  # routers off their zero init: no ties among experts
        folder, back = tempfile.mkdtemp(), tempfile.mkdtemp()
        hf.eval().save_pretrained(folder)
        lm = tb.from_hf(folder, part="causal-lm")
        ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 9]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            ref = hf(ids, attention_mask=mask, position_ids=pos).logits
            out = lm(ids, attention_mask=mask, positions=pos)
        err = rel(out, ref, mask.bool())
        assert err <= 1e-4, (name, err)
        assert type(lm).__name__ == "LanguageModel" and tb.load_report(lm).model_type == name
        eos = hf.generation_config.eos_token_id  # generation_config.json read, as from_pretrained reads it
        want = None if eos is None else tuple(eos if isinstance(eos, list) else [eos])
        assert lm.lm.generation.eos_token_id == want
        tb.save_hf(lm, back)
        again = type(hf).from_pretrained(back)
        theirs = hf.state_dict()
        assert again.state_dict().keys() == theirs.keys(), name
        assert all(torch.equal(v, theirs[k]) for k, v in again.state_dict().items()), name
        print(name, f"{err:.1e}")

    check(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)), "llama")
    check(transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, decoder_sparse_step=2)), "qwen2_moe")
    assert "jax" not in sys.modules, sorted(m for m in sys.modules if m.startswith(("jax", "flax")))
    print("no jax")
""")


def test_whole_models_equal_hf_and_written_back_without_jax():
    out = subprocess.run([sys.executable, "-c", _WITHOUT_JAX], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no jax" in out.stdout and "llama" in out.stdout and "qwen2_moe" in out.stdout


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=50,
                                                         n_positions=16)).save_pretrained(folder)
    return folder


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(fb.ConversionError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_refusals_are_the_flax_twins_word_for_word(gpt2_folder, tmp_path):
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(n_embd=32, n_head=4, n_layer=1, vocab_size=50,
                                                                 rotary_dim=5))
    assert _error(tb.from_hf, model) == _error(fb.from_hf, model)
    assert "gptj" in _error(tb.from_hf, model) and "rotary_dim=5" in _error(tb.from_hf, model)
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                                          intermediate_size=40, vocab_size=50))
    assert "not a causal language model" in _error(tb.from_hf, bert, part="causal-lm")
    assert _error(tb.from_hf, bert, part="causal-lm") == _error(fb.from_hf, bert, part="causal-lm")
    with pytest.raises(ValueError, match="part must be one of"):
        tb.from_hf(gpt2_folder, part="lm")


def test_a_tensor_of_another_shape_is_named_before_anything_is_read(gpt2_folder):
    from flax_blocks.checkpoints.checkpoint import check_shapes, read_checkpoint

    ckpt = read_checkpoint(gpt2_folder, part="causal-lm")
    expected = {k: tuple(v.shape) for k, v in tb.LanguageModel(ckpt.cfg, ckpt.lm).state_dict().items()}
    check_shapes(ckpt, expected)  # the real shapes pass
    wrong = {**expected, "embed.weight": (51, 32)}
    with pytest.raises(fb.ConversionError, match=r"embed.weight: expected shape \(51, 32\), the checkpoint has "
                                                 r"\(50, 32\)"):
        check_shapes(ckpt, wrong)
    with pytest.raises(fb.ConversionError, match="missing key extra.weight"):
        check_shapes(ckpt, {**expected, "extra.weight": (1,)})
    with pytest.raises(fb.ConversionError, match="unexpected key pos.weight"):
        check_shapes(ckpt, {k: v for k, v in expected.items() if k != "pos.weight"})


@pytest.mark.parametrize("dtype, want", [(None, torch.float32), ("bfloat16", torch.bfloat16),
                                         (torch.float64, torch.float64)])
def test_the_dtype_asked_is_the_dtype_placed(gpt2_folder, dtype, want):
    lm = tb.from_hf(gpt2_folder, part="causal-lm", dtype=dtype)
    assert {p.dtype for p in lm.parameters()} == {want}
    assert lm.cfg.param_dtype == str(want).removeprefix("torch.")
    ref = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder).state_dict()["transformer.wte.weight"]
    assert torch.equal(lm.embed.weight.float(), ref.to(want).float())  # cast once, from the file's values


def test_a_stack_loads_as_the_flax_twins_stack(gpt2_folder):
    stack = tb.from_hf(gpt2_folder)
    flax_stack = fb.from_hf(gpt2_folder)
    assert type(stack).__name__ == "Encoder" and stack.num_layers == 2 and stack.final_norm is not None
    theirs = fb.torch_state_dict(flax_stack)
    assert stack.state_dict().keys() == theirs.keys()
    assert all(np.array_equal(v.numpy(), theirs[k]) for k, v in stack.state_dict().items())
    assert tb.to_hf(stack).keys() == fb.to_hf(flax_stack).keys()
    assert str(tb.load_report(stack)) == str(fb.load_report(flax_stack))
