"""Parity against the real Hugging Face implementations of the families read without new block
options: RoBERTa (BERT's stack, here as a decoder: is_decoder=True makes it causal), DistilBERT,
OPT (pre-LN, and post-LN with project_in / project_out as OPT-350m), ViT and Phi-3 (fused
qkv_proj and gate_up_proj). The builds, inputs and measurements are parity_tests.families'
(which also writes docs/families.md); each family is built and measured ONCE per module.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
from flax_blocks import dialects  # noqa: E402
from flax_blocks.hf_config import NOT_COMPUTED, hf_config, read_folder  # noqa: E402
from parity_tests import families  # noqa: E402
from parity_tests.families import FAMILIES, REFUSALS, config, forward, measure  # noqa: E402
from parity_tests.hf_reference import rel_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> parity_tests.families.Measured, built and measured on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = measure(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_hf_matches_the_hf_stack(family, built):
    m = built(family)
    print(f"{family}: float64 (fwd, grad) {m.float64}, float32 {m.float32}")
    assert m.num_layers == 3
    assert m.mask_matters > 1e-3  # the padding mask changes real positions' outputs
    assert max(m.float64) <= 1e-12, m.float64
    assert max(m.float32) <= 2e-6, m.float32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_to_hf_writes_the_folders_stack_back_bit_for_bit(family, built):
    m = built(family)
    with jax.enable_x64(True):
        sd = fb.to_hf(m.flax)  # the dialect from_hf read it in
    _, files = read_folder(str(m.folder))
    assert set(sd) == set(files) - set(dialects.translate(files, m.dialect).dropped)
    for k, v in sd.items():
        assert v.dtype == files[k].dtype == np.float64 and np.array_equal(v, files[k]), k


# A real mistake per family: fields changed, or None for Phi-3's fused gate_up_proj read in the wrong order.
MISTAKES = {
    "roberta": ("is_decoder ignored: read as BERT's bidirectional encoder", dict(causal=False)),
    "distilbert": ("torch's LayerNorm eps 1e-5 for DistilBERT's hard-coded 1e-12", dict(layer_norm_eps=1e-5)),
    "opt": ("post-LN assumed (OPT's names do not say the placement)", dict(norm="post")),
    "opt-350m": ("pre-LN assumed for a post-LN OPT", dict(norm="pre")),
    "vit": ("tanh GELU (jax.nn.gelu's default) for ViT's exact GELU", dict(activation="gelu_tanh")),
    "phi3": ("gate_up_proj split in the wrong order (up first)", None),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_real_mistake_is_caught(family, built):
    m = built(family)
    what, fields = MISTAKES[family]
    with jax.enable_x64(True):
        theirs = fb.to_hf(m.flax)
        if fields is None:
            theirs = {k: np.concatenate(np.split(v, 2)[::-1]) if k.endswith("gate_up_proj.weight") else v
                      for k, v in theirs.items()}
        cfg = replace(m.flax.cfg, **(fields or {}))
        wrong = fb.from_torch(fb.Encoder, cfg, theirs, dialect=m.dialect, num_layers=3,
                              final_norm=m.flax.final_norm is not None)
        err = rel_at(forward(wrong, m.x, m.keys), m.hf_y, m.keys)
    print(f"{family}: {what}: rel error {err:.1e}")
    assert err > 1e-6  # a million times the float64 tolerance


# ----------------------------------------------------------------------------------------
# What each config says and what is refused (configs only: no model is built)
# ----------------------------------------------------------------------------------------


def test_settings_read_from_each_family_config():
    dialect, cfg, layers, final = hf_config(config("roberta"))
    assert (dialect, cfg.norm, cfg.causal, final) == ("hf-bert", "post", True, False)
    assert hf_config(config("roberta", is_decoder=False))[1].causal is False
    dialect, cfg, layers, final = hf_config(config("distilbert"))
    assert (dialect, cfg.norm, cfg.layer_norm_eps, cfg.d_model, cfg.num_heads, cfg.d_ff, layers) == \
        ("hf-distilbert", "post", 1e-12, 24, 3, 40, 3)
    _, cfg, _, final = hf_config(config("opt"))
    assert (cfg.norm, cfg.layer_norm_eps, final) == ("pre", 1e-5, True)
    _, cfg, _, final = hf_config(config("opt-350m"))
    assert (cfg.norm, final) == ("post", False)  # post-LN OPT has no final norm
    assert hf_config(config("opt", _remove_final_layer_norm=True))[3] is False
    vit = hf_config(config("vit", qkv_bias=False))[1]
    assert (vit.norm, vit.activation, vit.has_qkv_bias, vit.bias, vit.layer_norm_eps) == \
        ("pre", "gelu", False, True, 1e-6)
    phi = hf_config(config("phi3"))[1]
    assert (phi.num_kv_heads, phi.rope_theta, phi.bias, phi.mlp, phi.layer_norm_eps) == \
        (2, 500.0, False, "swiglu", 1e-5)
    assert not {"phi3", "roberta", "distilbert", "opt", "vit"} & set(NOT_COMPUTED)


@pytest.mark.parametrize("name, changes, words", [(n, c, w) for n, rs in REFUSALS.items() for c, w in rs])
def test_what_a_family_computes_otherwise_is_refused_by_name(name, changes, words):
    with pytest.raises(fb.ConversionError, match=re.escape(words)):
        hf_config(config(name, **changes))


def test_bert_position_embedding_type_is_ignored_by_transformers_and_refused_here():
    """transformers 5.24's BERT computes absolute positions whatever position_embedding_type
    says (no distance_embedding is even built): a checkpoint trained with relative_key would
    load into it silently wrong, so hf_config refuses it, saying so."""
    kw = dict(vocab_size=16, hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1)
    model = transformers.BertModel(transformers.BertConfig(**kw, position_embedding_type="relative_key"))
    assert not any("distance_embedding" in k for k in model.state_dict())
    with pytest.raises(fb.ConversionError, match="transformers 5 no longer does either"):
        hf_config(model.config.to_dict())


# ----------------------------------------------------------------------------------------
# Rule 3: a model object or folder says what it is; names alone pick no family they share
# ----------------------------------------------------------------------------------------


def test_names_alone(built):
    files = {n: read_folder(str(built(n).folder))[1] for n in ("roberta", "distilbert", "vit", "phi3", "opt")}
    assert fb.detect_dialect(files["roberta"]) == "hf-bert"  # RoBERTa's stack is BERT's: one table
    assert fb.detect_dialect(files["distilbert"]) == "hf-distilbert"
    assert fb.detect_dialect(files["vit"]) == "hf-vit"
    assert fb.detect_dialect(files["phi3"]) == "hf-phi3"  # not hf-llama: the fused names are Phi-3's
    with pytest.raises(fb.ConversionError, match=r"(?s)OPT itself in both norm placements.*pass dialect='hf-opt'"):
        fb.detect_dialect(files["opt"])
    with pytest.raises(fb.ConversionError, match=r"several Hugging Face dialects hold this config \(hf-bert, "
                                                 r"hf-distilbert\)"):
        # a stack not read by from_hf does not know its family: a post-LN, eps 1e-12 one is BERT's or DistilBERT's
        cfg = replace(hf_config(config("distilbert"))[1], param_dtype="float32")
        fb.to_hf(fb.from_torch(fb.Encoder, cfg, files["distilbert"], num_layers=3, dtype="float32"))


def test_an_hf_module_says_what_it_is(built):
    """from_torch given the HF model object reads its family (ViT: its transformers-5 module
    names read as the checkpoint's) and refuses a config contradicting it, naming the field."""
    model = built("opt").model32
    cfg = hf_config(model.config.to_dict())[1]
    fb.from_torch(fb.Encoder, cfg, model, num_layers=3)
    with pytest.raises(fb.ConversionError, match="norm='post' given, but the opt model has norm='pre'"):
        fb.from_torch(fb.Encoder, replace(cfg, norm="post"), model, num_layers=3)
    vit = built("vit").model32
    enc = fb.from_torch(fb.Encoder, hf_config(vit.config.to_dict())[1], vit, num_layers=3)
    assert enc.final_norm is not None


def test_cli_and_parity_check_on_family_folders(built, tmp_path, capsys):
    from safetensors.numpy import load_file

    from flax_blocks.convert_cli import main as convert_main
    from parity_tests.check import main as check_main

    m = built("phi3")
    assert convert_main([str(m.folder), str(tmp_path / "flax.safetensors")]) == 0
    assert "Hugging Face phi3 (dialect hf-phi3)" in capsys.readouterr().out
    assert convert_main([str(tmp_path / "flax.safetensors"), str(tmp_path / "back.safetensors"),
                         "--dialect", "hf-phi3"]) == 0
    back, (_, files) = load_file(str(tmp_path / "back.safetensors")), read_folder(str(m.folder))
    assert back and all(np.array_equal(v, files[k]) for k, v in back.items())
    assert check_main([str(built("vit").folder), "--dtype", "float64"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_docs_table_is_what_the_writer_writes(built):
    """docs/families.md's table: its words are what `describe` derives from the code now, and
    its errors are this run's to within a factor of 10 (rewrite it with python -m
    parity_tests.families --doc docs/families.md)."""
    text = (ROOT / families.DOC).read_text()
    assert text.count(families.START) == 1 and text.count(families.END) == 1
    committed = text[text.index(families.START) + len(families.START):text.index(families.END)].strip().splitlines()
    fresh = families.table({n: built(n) for n in FAMILIES}).strip().splitlines()
    assert len(committed) == len(fresh)
    number = re.compile(r"\d(?:\.\d+)?e[-+]\d\d")
    for old, new in zip(committed, fresh):
        assert number.sub("#", old) == number.sub("#", new), (old, new)
        for a, b in zip(map(float, number.findall(old)), map(float, number.findall(new))):
            assert a == b or (a > 0 and b > 0 and 0.1 <= a / b <= 10), (old, new)
