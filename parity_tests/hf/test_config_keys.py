"""The key audit: every key of every supported family's config class is classified by that
family's module in flax_blocks.checkpoints.families (read, an alias of one, or inert with a
reason), the table's defaults are the config class's own, and a key the family's code never
reads (a published config's gradient_checkpointing, a neighbour family's sliding_window) is
ignored, as transformers ignores it, and listed.

A transformers upgrade that adds a key to a config class fails here, loudly, until the key is
read or shown inert: a new field may be one the model reads.
"""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

import flax_blocks as fb  # noqa: E402
from flax_blocks.checkpoints import dialects  # noqa: E402
from flax_blocks.checkpoints.checkpoint import read_config  # noqa: E402
from flax_blocks.checkpoints.family import (  # noqa: E402
    FAMILIES,
    NOT_COMPUTED,
    PARTS,
    TRANSFORMERS,
    Family,
    audit,
    unexpected,
)

TABLES = [*FAMILIES.values(), PARTS["whisper"]["decoder"]]
# Keys read that are no field of the config class: older names the class rewrites (rope_theta,
# rotary_pct ...), attributes the model reads with getattr (head_dim, is_causal), and keys the
# class derives (layer_types, sliding_window_pattern). Their defaults are the code's, not a field's.
NOT_FIELDS = {"rope_scaling", "rope_theta", "is_causal", "head_dim", "layer_types", "partial_rotary_factor",
              "rotary_pct", "rotary_emb_base", "sliding_window_pattern", "rope_local_base_freq",
              "position_embedding_type",
              "n_embed",  # FalconConfig.__post_init__ pops the older n_embed into hidden_size
              "global_attn_every_n_layers", "global_rope_theta", "local_rope_theta",  # ModernBertConfig's kwargs
              "num_local_experts"}  # Qwen3MoeConfig's field num_experts is stored there (attribute_map)


def unclassified(family: Family, config_class) -> list[str]:
    """Keys of the config class's to_dict() that the family's table does not classify."""
    return [k for k in config_class().to_dict() if family.classify(k) == "unread"]


def test_the_tables_mirror_the_pinned_transformers():
    assert transformers.__version__ == TRANSFORMERS


@pytest.mark.parametrize("family", TABLES, ids=lambda f: f"{f.model_type}-{f.model_class}")
def test_every_key_of_the_config_class_is_classified(family):
    assert unclassified(family, getattr(transformers, family.config_class)) == []


def test_a_key_planted_in_a_config_class_fails_the_audit(monkeypatch):
    cls = transformers.LlamaConfig
    to_dict = cls.to_dict
    monkeypatch.setattr(cls, "to_dict", lambda self: {**to_dict(self), "planted_scale": 2.0})
    assert unclassified(FAMILIES["llama"], cls) == ["planted_scale"]


@pytest.mark.parametrize("family", TABLES, ids=lambda f: f"{f.model_type}-{f.model_class}")
def test_the_tables_defaults_are_the_config_class_defaults(family):
    fields = {f.name: f for f in dataclasses.fields(getattr(transformers, family.config_class))}
    wrong = {}
    for key, ours in family.reads.items():
        if key in NOT_FIELDS:
            assert key not in fields or fields[key].default == ours, key
            continue
        assert key in fields, f"{key}: read by the {family.model_type} table but no field of {family.config_class}"
        f = fields[key]
        theirs = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if theirs != ours:
            wrong[key] = (ours, theirs)
    assert wrong == {}


def test_a_key_the_family_never_reads_is_ignored_and_listed_and_ignore_keys_reads_a_key_as_absent():
    llama = dict(model_type="llama", hidden_size=32, num_attention_heads=4, intermediate_size=48,
                 num_hidden_layers=2, rms_norm_eps=0.1)
    read = read_config({**llama, "sliding_window": 4, "gradient_checkpointing": True, "frobnicate": 1})
    assert read.cfg.sliding_window is None  # LlamaModel never reads it: neither do we
    assert "mistral" in read.ignored["sliding_window"] and "LlamaModel never reads it" in read.ignored["sliding_window"]
    assert {"gradient_checkpointing", "frobnicate"} <= set(read.ignored)
    assert unexpected(read.ignored, FAMILIES["llama"]) == ["sliding_window", "gradient_checkpointing", "frobnicate"]
    assert "dropout" in read_config({**llama, "attention_dropout": 0.1}).ignored["attention_dropout"]
    assert unexpected(read_config({**llama, "attention_dropout": 0.1}).ignored, FAMILIES["llama"]) == []  # known inert
    # ignore_keys reads a key as absent: the class default (1e-6), not the file's 0.1
    assert read_config(llama).cfg.layer_norm_eps == 0.1
    assert read_config(llama, ignore_keys=("rms_norm_eps",)).cfg.layer_norm_eps == 1e-6
    assert audit({**llama, "quantization_config": {"bits": 4}}, FAMILIES["llama"])[0][0].startswith(
        "quantization_config={'bits': 4}: quantized weights")


def test_an_alias_of_the_config_class_is_read_and_wins_as_in_transformers():
    gpt2 = transformers.GPT2Config.from_dict({"n_embd": 64, "hidden_size": 32, "n_head": 4, "n_layer": 1})
    assert gpt2.n_embd == 32  # PretrainedConfig's attribute_map: the alias, set after the fields, wins
    cfg = read_config({"model_type": "gpt2", "n_embd": 64, "hidden_size": 32, "n_head": 4, "n_layer": 1}).cfg
    assert cfg.d_model == 32
    for family in TABLES:  # each table's aliases are its config class's attribute_map, to the key
        want = {k: v for k, v in getattr(transformers, family.config_class).attribute_map.items()}
        assert dict(family.aliases) == want, family.model_type


def test_every_family_registers_a_dialect_and_every_dialect_belongs_to_a_family():
    used = {f.dialect for f in FAMILIES.values()} | {p.dialect for parts in PARTS.values() for p in parts.values()}
    assert used == set(dialects.DIALECTS) - {"torch"}


def test_a_reader_reads_only_the_keys_its_table_declares():
    from flax_blocks.checkpoints.family import Read

    c = Read({"model_type": "llama"}, FAMILIES["llama"])
    with pytest.raises(KeyError, match="the llama reader asked for 'sliding_window'"):
        c["sliding_window"]


def test_the_family_keys_page_is_what_the_writer_writes():
    from parity_tests.hf import family_keys

    with open(family_keys.DOC) as f:
        doc = f.read()
    assert family_keys.START in doc and family_keys.page() in doc
    with open(family_keys.DIALECTS_DOC) as f:  # what loads (DIALECTS) and what is refused (NOT_COMPUTED)
        dialects_doc = f.read()
    assert family_keys.DIALECTS_START in dialects_doc and family_keys.dialect_table() in dialects_doc
    assert all(f"| `{t}` |" in doc for t in NOT_COMPUTED)
    assert all(f"| `{d}` |" in dialects_doc for d in dialects.DIALECTS)


def test_ignore_keys_as_a_string_is_a_clear_error(tmp_path):
    transformers_llama = transformers.LlamaModel(transformers.LlamaConfig(
        hidden_size=16, num_attention_heads=2, intermediate_size=24, num_hidden_layers=1, vocab_size=32))
    with pytest.raises(TypeError, match=r"ignore_keys must be a tuple of config keys, e.g. \('sliding_window',\)"):
        fb.from_hf(transformers_llama, ignore_keys="sliding_window")


def _hf_explicit(family: Family, config: dict) -> dict:
    """The config as transformers' own class writes it out: every default made explicit."""
    kw = {k: v for k, v in config.items() if k != "model_type"}
    return getattr(transformers, family.config_class)(**kw).to_dict()


@pytest.mark.parametrize("family", TABLES, ids=lambda f: f"{f.model_type}-{f.model_class}")
def test_every_read_key_left_out_reads_as_transformers_default(family):
    """For each key a family reads, a config without it is read as the one transformers' config
    class writes out with its default made explicit: a default of our readers that is not
    transformers' (StableLM's partial rotary 0.25, say) shows here."""
    from parity_tests.hf.family_keys import base, part

    full = base(family)
    cases = {key: {k: v for k, v in full.items() if k != key} for key in family.reads}
    differ = {}
    for key, config in cases.items():
        try:
            ours = read_config(config, part=part(family))
        except fb.ConversionError:
            continue  # a size the base needs (refused by name without it): nothing to compare
        theirs = read_config(_hf_explicit(family, config), part=part(family))
        if (ours.cfg, ours.num_layers, ours.final_norm) != (theirs.cfg, theirs.num_layers, theirs.final_norm):
            differ[key] = (ours.cfg, theirs.cfg)
    assert differ == {}


def test_the_defaults_audit_catches_a_changed_default(monkeypatch):
    """StableLM's partial rotary default moved from 0.25 to 0.5 in the reader: the audit fails."""
    from flax_blocks.checkpoints import family as hf_families

    stable = FAMILIES["stablelm"]
    original = stable.reader

    def wrong(c):  # the reader's own default (the file names the factor nowhere) moved to 0.5
        out = original(c)
        params = c["rope_scaling"] or c["rope_parameters"] or {}
        if not c.given("partial_rotary_factor") and "partial_rotary_factor" not in params:
            out = {**out, "partial_rotary_factor": 0.5}
        return out

    monkeypatch.setitem(hf_families.FAMILIES, "stablelm", dataclasses.replace(stable, reader=wrong))
    with pytest.raises(AssertionError):
        test_every_read_key_left_out_reads_as_transformers_default(hf_families.FAMILIES["stablelm"])


@pytest.mark.parametrize("value,want", [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                                        ("float64", "float64"), ("float", "float32"), ("half", "float16"),
                                        ("double", "float64"), ("auto", None), (None, None)])
def test_every_dtype_transformers_accepts_in_a_config_is_read(value, want):
    from flax_blocks.checkpoints.checkpoint import config_dtype

    assert config_dtype({"torch_dtype": value}) == want
    if value != "auto":
        assert config_dtype({"dtype": value, "torch_dtype": "float64"}) == (want or "float64")  # dtype wins, as HF
    if value not in (None, "auto"):
        import torch as _torch

        assert transformers.LlamaConfig(dtype=value).dtype == getattr(_torch, want)
