"""docs/training.md runs as written: a train step with nnx.Optimizer and optax, train / eval
modes, bfloat16 compute on float32 parameters, Flax's sharding recipe (8 simulated CPU devices),
and an Orbax checkpoint from which training resumes bit for bit (the page asserts each).

Once tests/test_readme.py runs every docs/*.md page itself, this test steps aside (skips),
so the page is not run twice per suite."""

from __future__ import annotations

from pathlib import Path

import pytest

import test_readme  # tests/ is on sys.path under pytest's default import mode

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/training.md"


def test_training_page_runs(tmp_path):
    pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is the optional extra [orbax]")
    if PAGE in getattr(test_readme, "PAGES", ()):
        pytest.skip(f"tests/test_readme.py runs {PAGE}")
    snippets = test_readme.extract((ROOT / PAGE).read_text())
    assert sum(s.kind == "python" for s in snippets) >= 4
    blocks = [s for s in snippets if s.kind == "python"]
    env = test_readme._env(tmp_path)  # PYTHONPATH = the repository, 8 simulated CPU devices
    out = test_readme.run_python_blocks(blocks, tmp_path, env, name=PAGE)
    assert out.returncode == 0 and "ALL BLOCKS RAN" in out.stdout, out.stderr[-4000:]

