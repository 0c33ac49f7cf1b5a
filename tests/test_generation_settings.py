"""How generate's arguments combine with a checkpoint's generation settings (framework-free,
both twins): HF's precedence (argument > the model's generation config > HF's defaults),
eos as an int or a list, pad None -> eos[0], greedy ignoring the sampling values."""

from __future__ import annotations

import json

import pytest

from flax_blocks.checkpoints.checkpoint import read_generation_config
from flax_blocks.checkpoints.io import ConversionError
from flax_blocks.core.lm_config import GenerationSettings, Resolved, resolve

NONE = dict(eos_token_id=None, pad_token_id=None, do_sample=None, temperature=None, top_k=None, top_p=None)


def test_arguments_over_the_file_over_hfs_defaults():
    file = GenerationSettings(eos_token_id=[2, 7], do_sample=True, temperature=0.6, top_p=0.9)
    assert resolve(file, **NONE) == Resolved(True, 0.6, 50, 0.9, (2, 7), 2)  # top_k: HF's 50; pad: eos[0]
    assert resolve(file, **{**NONE, "do_sample": False}) == Resolved(False, 0.0, None, None, (2, 7), 2)
    assert resolve(file, **{**NONE, "eos_token_id": 5, "pad_token_id": 0, "top_k": 0, "top_p": 1.0}) == \
        Resolved(True, 0.6, None, None, (5,), 0)  # top_k 0 and top_p 1 switch their warpers off
    assert resolve(None, **NONE) == Resolved(False, 0.0, None, None, None, None)  # greedy, no eos
    assert resolve(None, **{**NONE, "temperature": 0.8}).sample  # the library's switch: temperature > 0
    assert not resolve(file, **{**NONE, "temperature": 0.0}).sample
    with pytest.raises(ValueError, match="eos_token_id"):
        GenerationSettings(eos_token_id="2")


def test_the_folder_is_read_as_transformers_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3, "bos_token_id": 1, "temperature": 0.5}))
    assert read_generation_config(tmp_path, {}) == GenerationSettings(eos_token_id=(3,), bos_token_id=1,
                                                                      temperature=0.5)  # no file: config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5], "pad_token_id": 0}))
    assert read_generation_config(tmp_path, {}) == GenerationSettings(eos_token_id=(4, 5), pad_token_id=0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4.5}))
    with pytest.raises(ConversionError, match="generation_config.json: eos_token_id must be an int"):
        read_generation_config(tmp_path, {})
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ConversionError, match="expected a JSON object, got list"):
        read_generation_config(tmp_path, {})
