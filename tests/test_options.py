"""Options are declared once (flax_blocks/core/options.py); these guards fail when an option is
missing from a place that must know it: BlockConfig, the numpy reference, the parity matrix,
each Hugging Face dialect, the converter CLI, docs/options.md, and the probe config."""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from pathlib import Path

import pytest

from flax_blocks.checkpoints.dialects import DIALECTS
from flax_blocks.core import declarations
from flax_blocks.core.config import BlockConfig
from flax_blocks.core.options import BY_NAME, OPTIONS, PROBE, PROBES, table

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(BlockConfig)]


def test_every_field_is_declared_once():
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names)), "an option declared twice"
    assert names == FIELDS, f"OPTIONS and BlockConfig's fields differ: {sorted(set(names) ^ set(FIELDS))}"


def test_the_reference_knows_every_option():
    from parity_tests.twins import reference as ref

    missing = set(FIELDS) - ref.HANDLED - set(ref.NOT_FORWARD)
    assert not missing, f"options parity_tests/twins/reference.py neither computes nor excuses: {sorted(missing)}"


def _reached(name: str, hint, seen: list) -> list[str]:
    """The values of `name` the cases must reach but do not (Literals, both bools, None and
    a value for optional fields, two values for numbers)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return [repr(v) for v in args if v not in seen]
    if hint is bool:
        return [repr(v) for v in (False, True) if not any(s is v for s in seen)]
    if type(None) in args:
        return [v for v, ok in (("None", any(s is None for s in seen)),
                                ("a value", any(s is not None for s in seen))) if not ok]
    return [] if len(set(seen)) > 1 else ["a second value"]


def test_the_parity_matrix_reaches_every_value():
    from parity_tests.twins.cases import CASES, FLOAT32_CASES

    hints = typing.get_type_hints(BlockConfig)
    missing = [f"{o.name}={v}" for o in OPTIONS if not o.not_in_matrix
               for v in _reached(o.name, hints[o.name], [getattr(c.cfg, o.name) for c in CASES + FLOAT32_CASES])]
    assert not missing, f"option values no case of parity_tests/twins/cases.py runs: {missing}"


@pytest.mark.parametrize("name", [n for n, d in DIALECTS.items() if d.rules is not None])
def test_every_hf_dialect_fixes_or_reads_each_computing_option(name):
    d = DIALECTS[name]
    defaults = {f.name: f.default for f in dataclasses.fields(BlockConfig)}
    loose = [o.name for o in OPTIONS if o.kind == "compute" and o.name not in d.settings and o.name not in d.reads
             and not (o.only_with and d.settings.get(o.only_with[0], defaults[o.only_with[0]]) != o.only_with[1])]
    assert not loose, (f"{name}: options neither fixed (settings) nor read from the family's config (reads): "
                       f"{loose}; a config using them could be written as a {name} checkpoint that computes otherwise")
    assert not set(d.settings) & set(d.reads)


def test_the_cli_takes_every_cli_option_with_its_help():
    from flax_blocks.checkpoints.convert.cli import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    for o in OPTIONS:
        if o.name == "num_heads":  # its own flag (--num-heads, required: not in the tensors)
            continue
        assert (o.name in actions) == o.cli, o.name
        if o.cli:
            assert actions[o.name].help.startswith(o.help), o.name


def test_docs_options_table_is_generated():
    assert (ROOT / "docs" / "options.md").read_text() == table(), \
        "docs/options.md is stale: python -m flax_blocks.core.options > docs/options.md"


def test_adds_is_true_of_the_declarations():
    """An option declared to add parameters adds some (PROBE has names the default lacks
    after switching it off), and one declared not to adds none under any of its values."""
    def names(cfg):
        return {t for t, _, _ in declarations.flatten(declarations.block(cfg, "DecoderBlock"))}

    hints = typing.get_type_hints(BlockConfig)
    full = names(PROBE)
    for o in OPTIONS:
        if o.kind in ("size", "dtype"):
            continue
        hint = hints[o.name]
        default = {f.name: f.default for f in dataclasses.fields(BlockConfig)}[o.name]
        vals = (typing.get_args(hint) if typing.get_origin(hint) is typing.Literal
                else (False, True) if hint in (bool, bool | None)
                else (default, o.adds) if hint is int and o.adds is not None else ())  # a count: off and on
        changed = []
        for v in vals:
            try:
                cfg = dataclasses.replace(PROBE, **{o.name: v})
            except ValueError:
                continue  # a value PROBE's other options forbid (relu with swiglu)
            if names(cfg) != full:
                changed.append(v)
        if o.adds is None:
            assert not changed, f"{o.name} changes parameter names with {changed} but declares adds=None"
        else:
            assert changed, f"{o.name} declares adds={o.adds!r} but no value changes the parameter names"
    assert BY_NAME["qk_norm"].adds is True


def test_the_probes_have_every_name_an_adds_value_brings():
    """Each option at its `adds` value, on top of whichever probe allows it, has no parameter
    name the probes lack (an `adds` refused beside another option's needs PROBE_EXCLUDED)."""
    def names(cfg):
        return {t for t, _, _ in declarations.flatten(declarations.block(cfg, "DecoderBlock"))}

    every = set().union(*(names(p) for p in PROBES))
    for o in OPTIONS:
        if o.adds is None:
            continue
        allowed = []
        for probe in PROBES:
            with contextlib.suppress(ValueError):
                allowed.append(dataclasses.replace(probe, **{o.name: o.adds}))
        assert allowed, f"{o.name}={o.adds!r} fits no probe: add it to PROBE_EXCLUDED in flax_blocks/core/options.py"
        assert all(names(cfg) <= every for cfg in allowed), o.name


def test_the_cli_records_no_implementation_choice():
    from flax_blocks.checkpoints.convert.cli import _NOT_RECORDED

    assert {o.name for o in OPTIONS if o.kind == "implementation"} <= _NOT_RECORDED
