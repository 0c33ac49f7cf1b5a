"""Loading's walk through the house: a second fb.from_hf of a tiny LLaMA folder reads its
config once, resolves its family once, and moves between the project's files at most half as
often as 0.3.0 did (1,652 re-entries into a file it had left, 25 files; measured with the
same profile hook as below). The profile counts Python calls into the project's files. The
issue's 15 files is not reached: model construction alone visits 9."""

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


def test_a_second_load_reads_its_config_once_and_walks_half_as_far(tmp_path):
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
    assert reentries <= 1652 // 2, reentries
    files = {f for f, _ in calls}
    # 0.3.0 visited 25 files; the one reading added checkpoint.py, the generation settings two more
    # (core/generation_settings.py, checkpoints/generation_config.py): the walk must not grow past that
    assert "flax_blocks/checkpoints/checkpoint.py" in files and len(files) <= 27, sorted(files)
