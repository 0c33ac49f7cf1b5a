"""Loading's walk through the house: a second fb.from_hf of a tiny LLaMA folder reads its
config once, resolves its family once, and calls into at most 15 of the library's files (0.3.0:
25 files and 1,652 re-entries into a file the walk had left; before issue 60's merges: 27 and
343; now 15 and about 330). The profile counts Python calls into the library's files.

The 15: the reading (checkpoints/checkpoint.py: config, files, whole model, generation
settings, load report), the family's tables (family.py with the readers several families
share, families/llama.py, dialects.py), the tensors (stream.py), the Flax placing (hf.py,
convert/place.py), the configs (core/config.py, core/declarations.py, core/lm_config.py) and the model built abstract
(lm.py, stacks.py, blocks.py, attention.py, layers.py)."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fb.__file__)))
LIBRARY = os.path.dirname(os.path.abspath(fb.__file__))  # the walk counts the library's files


def _walk(fn) -> tuple[Counter, int]:
    """(calls per (file, function), re-entries into a file the walk had left) while fn runs."""
    seq: list[tuple[str, str]] = []

    def hook(frame, event, arg):
        f = frame.f_code.co_filename
        if event == "call" and f.startswith(LIBRARY + os.sep):
            seq.append((os.path.relpath(f, ROOT), frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    left, here, reentries = set(), None, 0
    for f, _ in seq:
        if f != here:
            reentries += f in left
            if here is not None:
                left.add(here)
            here = f
    return Counter(seq), reentries


def test_a_second_load_reads_its_config_once_and_walks_through_few_files(tmp_path):
    import torch

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(tmp_path)
    fb.from_hf(tmp_path, part="causal-lm")
    calls, reentries = _walk(lambda: fb.from_hf(tmp_path, part="causal-lm"))
    by_name = Counter()
    for (_, name), n in calls.items():
        by_name[name] += n
    assert by_name["read_folder"] == 1 and by_name["read_config"] == 1, by_name
    assert by_name["family_of"] == 1, by_name  # the family resolved once
    assert reentries <= 1652 // 4, reentries  # a quarter of 0.3.0's (measured: about 330)
    files = {f for f, _ in calls}
    # 0.3.0 visited 25 files, the one reading 27 before its modules were merged: 15 now
    assert {"flax_blocks/checkpoints/checkpoint.py", "flax_blocks/checkpoints/convert/place.py"} <= files
    assert len(files) <= 15, sorted(files)


def test_the_flax_placing_refuses_what_it_cannot_hold_before_reading():
    """fb.from_hf's placing (hf.place -> convert.place.place_named) checks names, shapes and
    dtypes before any tensor is read: a tensor of an integer dtype, a float64 one while
    jax_enable_x64 is off (it would silently become float32), a missing one."""
    import jax
    import torch

    from flax_blocks.checkpoints.checkpoint import describe
    from flax_blocks.checkpoints.hf import place

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    config = hf.config.to_dict()
    norm = "model.layers.0.input_layernorm.weight"
    with pytest.raises(fb.ConversionError, match="dtype of encoder.layers.0.norm1.weight: expected a floating"):
        place(describe(config, {**sd, norm: sd[norm].astype("int32")}, "causal-lm"))
    with jax.enable_x64(False), pytest.raises(fb.ConversionError, match="float64 .* jax_enable_x64 is off"):
        place(describe(config, {k: v.astype("float64") for k, v in sd.items()}, "causal-lm"))
    ckpt = describe(config, sd, "causal-lm")
    tensors = {k: v for k, v in ckpt.tensors.items() if k != "head.weight"}
    with pytest.raises(fb.ConversionError, match="missing key head.weight"):
        place(type(ckpt)(**{**ckpt.__dict__, "tensors": tensors}))
    assert place(ckpt).lm.vocab_size == 64  # the same checkpoint, whole, places
