"""The parity report generator (`python -m parity_tests.twins.report`): its table is computed,
and spliced between the page's markers."""

from __future__ import annotations

import pytest

from .cases import CASES
from .report import END, START, build, splice


def test_report_table_is_computed():
    text = build(CASES[:2], trajectories=False)
    rows = [line for line in text.splitlines() if line.startswith("| ResidualMHA") or line.startswith("| FeedForward")]
    assert len(rows) == 2
    f64 = float(rows[0].split("|")[4])
    assert 0 < f64 <= 1e-12


def test_readme_table_is_spliced_between_markers():
    doc = f"intro\n{START}\nold table\n{END}\noutro\n"
    out = splice(doc, "| new |\n")
    assert out == f"intro\n{START}\n| new |\n{END}\noutro\n"
    assert splice(out, "| newer |\n").count(START) == 1  # idempotent markers
    with pytest.raises(ValueError, match="no parity-report markers"):
        splice("no markers here", "| t |\n")
