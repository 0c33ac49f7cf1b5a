"""The lab outside its toy (issue 38): the text task in the lab, the failure rule measured from
the unigram loss, the outward study's verdicts, and the runs split over CPU devices (issue 37)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from xla_env import xla_flags  # the suite's XLA flags, the device count replaced

from experiments.stability.analysis import failure
from experiments.stability.tasks import make_task
from experiments.stability.text import load_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_text_task_draws_training_and_heldout_windows_from_their_own_topics():
    task = make_task("text", vocab=0, seq_len=16, seed=0)
    corpus = load_corpus()
    assert task.vocab == corpus.vocab and task.optimal_loss < task.unigram_loss < math.log(task.vocab)
    from experiments.stability.train import sample_pool

    train = sample_pool(task, 64, seed=1)
    held = sample_pool(task, 64, seed=2, split="heldout")
    assert train.shape == held.shape == (64, 17) and train.dtype == held.dtype == np.int32
    def text(ids):
        return "".join(corpus.alphabet[i] if i < len(corpus.alphabet) else "?" for i in ids)
    train_text = text(corpus.train)
    held_text = text(corpus.heldout)
    assert all(text(w) in train_text for w in train[:8]) and all(text(w) in held_text for w in held[:8])
    assert sum(text(w) in train_text for w in held) < 16  # held-out windows are mostly not in the training text
    np.testing.assert_array_equal(held, sample_pool(task, 64, seed=2, split="heldout"))  # deterministic
    with pytest.raises(ValueError, match="vocabulary is its corpus's alphabet, 103 symbols|vocabulary is its corpus"):
        make_task("text", vocab=32, seq_len=16, seed=0)
    with pytest.raises(ValueError, match="'train' or 'heldout'"):
        task.windows(4, 0, "test")


def test_failure_measured_from_the_unigram_loss():
    # text: l0 5.0, unigram 3.3, n-gram reference 1.8 -> the line is 3.3 - 0.5 * 1.5 = 2.55
    frequencies_only = failure([4.0, 3.3], [5.0, 4.0], 5.0, 1.8, start=3.3)
    assert frequencies_only["status"] == "plateau" and frequencies_only["threshold"] == pytest.approx(2.55)
    assert failure([3.0, 2.5], [5.0, 3.0], 5.0, 1.8, start=3.3)["status"] == "trained"
    # from l0 (the synthetic tasks' rule) the unigram-only run would pass: the rule matters
    assert failure([4.0, 3.3], [5.0, 4.0], 5.0, 1.8)["status"] == "trained"


def _cell(variant: str, depth: int, lr: float, final: float | None, seed: int = 0) -> dict:
    h, l0 = 1.0, 3.5
    threshold = l0 - 0.5 * (l0 - h)
    status = "diverged" if final is None else "trained" if final <= threshold else "plateau"
    return {"config": {"variant": variant, "depth": depth, "lr": lr, "warmup": 0, "seed": seed},
            "summary": {"status": status, "final_loss": final, "step": None},
            "task": {"optimal_loss": h, "unigram_loss": 3.0},
            "metrics": {"heldout_loss0": l0}}


def _setting(post_fails_at: int, lns_gain: float, dyt_deep: float | None, extra_depth: bool = False) -> list[dict]:
    cells = []
    for L in (6, 12, 24) + ((48,) if extra_depth else ()):
        for lr in (1e-3, 1e-2):
            cells.append(_cell("pre", L, lr, 2.0 if lr == 1e-3 else 2.1))
            cells.append(_cell("post", L, lr, 2.0 if post_fails_at > L else 3.4))
            cells.append(_cell("pre-lns", L, lr, 2.0 - (lns_gain * L / 24 if lr == 1e-3 else 0) + 0.001))
            dyt = dyt_deep if L == 24 else 2.02
            cells.append(_cell("pre-dyt", L, lr, dyt))
    return cells


def test_outward_verdicts_and_flips():
    from experiments.stability.outward import flips, table, verdicts

    base = verdicts(_setting(post_fails_at=12, lns_gain=0.1, dyt_deep=2.02, extra_depth=True))
    assert base["post-LN's failure depth"][0] == "12"
    assert base["trains at every depth"][0] == "pre, pre-dyt, pre-lns"
    assert base["best at the deepest depth"][0] == "pre-lns"  # 24 is the deepest: 48 is left out
    assert base["LayerNorm Scaling's gain with depth"][0] == "agrees"
    assert base["DyT at depth"][0] == "trains to 24"
    same = verdicts(_setting(post_fails_at=12, lns_gain=0.1, dyt_deep=2.02))
    other = verdicts(_setting(post_fails_at=99, lns_gain=0.0, dyt_deep=None))
    assert other["post-LN's failure depth"][0] == "none" and other["DyT at depth"][0] == "trains to 12"
    assert other["LayerNorm Scaling's gain with depth"][0] == "does not agree"
    results = {"Markov d32": base, "Markov d64": same, "text d64": other}
    said = flips(results)
    assert not [s for s in said if s.startswith("Markov d64")]  # identical setting: nothing flips
    assert "text d64: post-LN's failure depth is `none` where Markov d32 has `12`." in said
    md = table(results)
    assert md.count("**flips**") == len(said) and "| post-LN's failure depth | 12 (" in md


def test_text_sweep_through_the_cli_on_two_cpu_devices(tmp_path):
    """--task text at d_model 64 through the lab's CLI, its runs split over 2 CPU devices: the
    cells record the task and the corpus's hash, and the loss at init is near ln(vocab)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu",  # no forced device count: --cpu-devices
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    args = ["--task", "text", "--variants", "pre", "--depths", "1", "--d-model", "64", "--num-heads", "4",
            "--d-ff", "256", "--lrs", "1e-3", "--seeds", "2", "--steps", "2", "--chunk", "1", "--batch", "4",
            "--heldout", "32", "--cpu-devices", "2", "--no-report", "--no-progress", "--xla-opt-level", "0",
            "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "experiments.stability", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = [json.loads(p.read_text()) for p in (tmp_path / "out" / "cells").glob("*.json")]
    corpus = load_corpus()
    assert len(cells) == 2
    for rec in cells:
        assert rec["config"]["task"] == "text" and rec["config"]["corpus"] == corpus.sha256
        assert rec["config"]["vocab"] == corpus.vocab and rec["config"]["d_model"] == 64
        assert rec["task"]["corpus_sha256"] == corpus.sha256 and rec["task"]["python"] == corpus.python
        assert rec["environment"]["device_count"] == 2
        # logits at init have variance ~ d * 2 / (d + V) (xavier head on unit-variance features):
        # the expected loss is ln V + var / 2 = ln V + 0.38 here
        l0 = rec["metrics"]["heldout_loss0"]
        assert abs(l0 - (math.log(corpus.vocab) + 64 / (64 + corpus.vocab))) < 0.25, l0


def test_outward_settings_share_the_depth_studys_grid():
    from dataclasses import replace

    from experiments.stability.outward import DEPTHS
    from experiments.stability.presets import PRESETS

    depth, markov, text = PRESETS["depth"], PRESETS["outward-markov"], PRESETS["outward-text"]
    # text: the same grid, more steps (sized by a pilot of the pre-LN control; presets.py)
    assert text == replace(markov, name="outward-text", task="text", vocab=0, steps=800, chunk=100)
    grid = ("variants", "lrs", "warmups", "seeds", "steps", "batch", "chunk", "heldout", "seq_len")
    assert all(getattr(markov, k) == getattr(depth, k) for k in grid)
    assert markov.depths == DEPTHS and set(DEPTHS) <= set(depth.depths)
    assert (markov.d_model, markov.num_heads, markov.d_ff) == (64, 4, 256)
    assert PRESETS["full-text"].task == "text" and PRESETS["full-text"].d_model == 128


def test_text_task_without_its_corpus_or_with_another_vocab_is_one_clear_line(monkeypatch, capsys):
    from experiments.stability import text
    from experiments.stability.presets import PRESETS
    from experiments.stability.sweep import parse_args, resolve_task, sweep_from_args

    with pytest.raises(SystemExit) as refused:  # the lab's refusals: exit status 2, one line on stderr
        sweep_from_args(parse_args(["--task", "text", "--vocab", "32"]))
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1
    assert re.search("--vocab 32: --task text's vocabulary is the corpus's alphabet", err), err
    assert sweep_from_args(parse_args(["--task", "text"])).vocab == load_corpus().vocab
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # a Python without pydoc_data
    text.load_corpus.cache_clear()
    try:
        with pytest.raises(SystemExit, match="--task text: .*pydoc_data.topics"):
            resolve_task(PRESETS["outward-text"])
    finally:
        text.load_corpus.cache_clear()


def test_outward_report_from_three_settings_on_disk(tmp_path, monkeypatch):
    from experiments.stability import outward

    settings = []
    for i, (label, post_fails_at) in enumerate((("Markov d32", 12), ("Markov d64", 12), ("text d64", 24))):
        folder = tmp_path / ("depth" if i == 0 else f"outward/{label.split()[0].lower()}")
        (folder / "cells").mkdir(parents=True)
        cells = _setting(post_fails_at=post_fails_at, lns_gain=0.1, dyt_deep=2.02)
        names = []
        for j, rec in enumerate(cells):
            rec["config"]["version"] = 4
            rec["environment"] = {"device_count": 2, "device_kind": "cpu"}
            names.append(f"c{j}")
            (folder / "cells" / f"c{j}.json").write_text(json.dumps(rec))
        sweep = {"task": "text" if "text" in label else "markov", "d_model": 64, "num_heads": 4, "d_ff": 256}
        (folder / "sweep.json").write_text(json.dumps({"sweep": sweep, "cells": names}))
        settings.append((label, "x", folder))
    monkeypatch.setattr(outward, "SETTINGS", tuple(settings))
    text = outward.write_report(tmp_path / "outward").read_text()
    assert "text d64: post-LN's failure depth is `24` where Markov d32 has `12`." in text
    assert text.count(" **flips** (") == 1 and "[report](../depth/report.md)" in text  # one table cell flips
    assert "[report](text/report.md)" in text and "(the n-gram reference)" in text


def test_outward_report_without_a_settings_cells_says_what_to_run(tmp_path, monkeypatch):
    from experiments.stability import outward

    monkeypatch.setattr(outward, "SETTINGS", (("Markov d64", "outward-markov", tmp_path / "none"),))
    with pytest.raises(SystemExit, match="no cells for Markov d64 .* run python -m experiments.stability.outward"):
        outward.write_report(tmp_path / "outward")
    # a fresh clone: the committed sweep.json and reports, no cells (they are not committed)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "sweep.json").write_text("{}")
    with pytest.raises(SystemExit, match="no cells for Markov d64 .* run python -m experiments.stability.outward"):
        outward.write_report(tmp_path / "outward")
    with pytest.raises(SystemExit,
                       match="--report: no cells for Markov d64 .* run python -m experiments.stability.outward"):
        outward.main(["--report"])
