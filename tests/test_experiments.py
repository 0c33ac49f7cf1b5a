"""Tests of the depth-stability experiments on tiny configurations.

The end-to-end test runs one tiny sweep (2 compiled groups, 8 cells, 4 steps) as the
reference, and compares against it: a rerun (skips every cell), a sweep killed with SIGKILL
after its first group and rerun (same numbers, finished cells untouched), the same sweep on
4 simulated CPU devices (same numbers up to float32 rounding) and the report. It is one
test so that pytest-xdist does not run the reference twice; its processes share compiled
programs through JAX's persistent compilation cache in a temporary folder.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.analysis import failure, growth_factor, linear_fit, power_law_exponent
from experiments.stability import PRESETS, Sweep, cell_config, cell_name, run_sweep
from experiments.tasks import copy_task, markov_task
from experiments.train import compiler_options, sample_pool

ROOT = Path(__file__).resolve().parents[1]

# Two groups (post and pre at 2 layers), two learning rates (one absurd, so it diverges),
# two seeds: 8 cells, 4 steps each.
TINY = Sweep(
    name="tiny", variants=("post", "pre"), depths=(2,), lrs=(1e-2, 1e30), warmups=(0,), seeds=2,
    vocab=8, seq_len=8, d_model=8, num_heads=2, d_ff=16, steps=4, batch=4, chunk=2, heldout=4,
)
TINY_ARGS = ["--variants", "post,pre", "--depths", "2", "--extra", "", "--lrs", "1e-2,1e30", "--warmups", "0",
             "--seeds", "2", "--vocab", "8", "--seq-len", "8", "--d-model", "8", "--num-heads", "2",
             "--d-ff", "16", "--steps", "4", "--batch", "4", "--chunk", "2", "--heldout", "4",
             "--no-report", "--no-progress",
             "--xla-opt-level", "0"]  # fastest compile for tiny programs, the same in every process


def _subprocess(args: list[str], cache: Path, devices: int = 1) -> subprocess.Popen:
    """`python -m experiments.stability ARGS` on CPU (`devices` simulated CPU devices), sharing
    compiled programs through JAX's persistent cache."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen([sys.executable, "-m", "experiments.stability", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    return log


def _cells(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))}


def _same_results(a: dict, b: dict, exact: bool = True) -> None:
    """exact: identical JSON (floats kept to 6 significant digits). Otherwise equal up to
    float32 rounding: XLA may sum in another order when the per-device batch of runs has
    another size, so the last bits can differ between device counts."""
    assert a["config"] == b["config"]
    if exact:
        assert a["summary"] == b["summary"] and a["metrics"] == b["metrics"]
        return
    assert a["summary"]["status"] == b["summary"]["status"] and a["summary"]["step"] == b["summary"]["step"]
    assert a["metrics"].keys() == b["metrics"].keys()
    for key in a["metrics"]:
        x = np.array(a["metrics"][key], dtype=float)
        y = np.array(b["metrics"][key], dtype=float)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=key)


# ------------------------------------------------------------------------------------
# Tasks and analysis (no training)
# ------------------------------------------------------------------------------------


def test_markov_task_entropy_rate_is_the_optimal_loss():
    task = markov_task(vocab=16, seq_len=64, branching=4, seed=3)
    assert 0 < task.optimal_loss < task.unigram_loss < math.log(16) + 1e-9
    tokens = sample_pool(task, 256, seed=0, options=compiler_options(0))
    assert tokens.shape == (256, 65) and tokens.dtype == np.int32
    # The true conditional log-likelihood of the samples estimates the entropy rate.
    nll = -task.log_transition[tokens[:, :-1], tokens[:, 1:]].mean()
    assert abs(nll - task.optimal_loss) < 0.05
    # Deterministic from the seed.
    again = markov_task(vocab=16, seq_len=64, branching=4, seed=3)
    np.testing.assert_array_equal(task.log_transition, again.log_transition)
    assert markov_task(vocab=16, seq_len=64, branching=4, seed=4).optimal_loss != task.optimal_loss


def test_copy_task_scores_only_the_copy():
    task = copy_task(vocab=8, seq_len=9)  # 10 tokens: 5 random, then the same 5
    tokens = sample_pool(task, 3, seed=0, options=compiler_options(0))
    np.testing.assert_array_equal(tokens[:, :5], tokens[:, 5:])
    weights = np.asarray(task.weights())  # target j is token j + 1
    np.testing.assert_array_equal(weights, [0, 0, 0, 0, 1, 1, 1, 1, 1])
    assert task.optimal_loss == 0.0


def test_failure_criterion():
    h, l0 = 1.0, 3.0  # threshold = 3 - 0.5 * (3 - 1) = 2
    trained = failure([2.5, 2.1, 1.9, 1.5], [3, 2.5, 2.1, 1.9], l0, h)
    assert trained["status"] == "trained" and trained["final_loss"] == 1.5 and trained["threshold"] == 2.0
    assert failure([2.5, 2.01], [3, 2.5], l0, h)["status"] == "plateau"  # just above the line
    stuck = failure([2.9, 2.8, 2.8], [3, 2.9, 2.8], l0, h)
    assert stuck == {"status": "plateau", "step": 0, "final_loss": 2.8, "threshold": 2.0}
    late = failure([2.5, 1.5, 1.4, 2.6, 2.7], [3] * 5, l0, h)  # trained, then blew up after step 4
    assert late["status"] == "plateau" and late["step"] == 4
    nan = failure([2.5, 2.0, float("nan"), float("nan")], [3, 2.5, 2.0, float("nan")], l0, h)
    assert nan["status"] == "diverged" and nan["step"] == 3 and nan["final_loss"] is None
    assert failure([1.0], [float("inf")], l0, h)["status"] == "diverged"


def test_fits():
    assert growth_factor([1, 2, 4]) == pytest.approx(4.0)
    assert growth_factor([3, 3, 3, 3]) == pytest.approx(1.0)
    assert power_law_exponent([4, 16, 64], [1 / 2, 1 / 4, 1 / 8]) == pytest.approx(-0.5)
    a, b, r2 = linear_fit([1, 2, 3, 4])
    assert (a, b, r2) == pytest.approx((1, 1, 1))


def test_cell_names_depend_on_every_setting():
    base = cell_config(TINY, "post", 2, 1e-2, 0, 0)
    assert cell_name(base) == cell_name(dict(base))
    for key, value in [("steps", 8), ("lr", 2e-2), ("seed", 1), ("d_model", 16), ("task_seed", 1)]:
        assert cell_name({**base, key: value}) != cell_name(base)


def test_presets_are_valid():
    for sweep in PRESETS.values():
        assert sweep.steps % sweep.chunk == 0
        assert sweep.pairs()
    quick = PRESETS["quick"]
    assert ("noskip", 6) in quick.pairs() and {"post", "pre"} <= set(quick.variants)


# ------------------------------------------------------------------------------------
# The tiny sweep, end to end (one test, so pytest-xdist does not run the sweep twice)
# ------------------------------------------------------------------------------------


def test_sweep_resume_devices_and_report(tmp_path):
    cache = tmp_path / "jax_cache"
    # The reference sweep and, at the same time, one group of it on 4 simulated devices
    # (two runs on four devices also exercises the padding of the runs axis).
    ref_dir, four = tmp_path / "ref", tmp_path / "four"
    proc_ref = _subprocess([*TINY_ARGS, "--out", str(ref_dir)], cache)
    proc_four = _subprocess([*TINY_ARGS, "--variants", "post", "--lrs", "1e-2", "--out", str(four)], cache, devices=4)

    # 1. The uninterrupted reference run.
    _finish(proc_ref)
    ref = _cells(ref_dir)
    assert len(ref) == 8
    for rec in ref.values():
        assert set(rec) >= {"config", "summary", "metrics", "environment", "task"}
        assert rec["environment"]["jax"] and rec["environment"]["device_kind"]
        m = rec["metrics"]
        assert len(m["loss"]) == len(m["heldout_loss"]) == len(m["update"]) == len(m["grad_norm"]) == 4
        assert np.shape(m["w2_grad_norm"]) == (2, 2)  # (chunks, layers)
        assert np.shape(m["stream_norm"]) == (2, 3)  # (chunks, layers + 1)
        assert np.shape(m["attn_entropy"]) == (2, 2)
    sane = [r for r in ref.values() if r["config"]["lr"] == 1e-2]
    assert all(r["summary"]["final_loss"] is not None for r in sane)
    absurd = [r for r in ref.values() if r["config"]["lr"] == 1e30]  # diverged runs are results
    assert all(r["summary"]["status"] != "trained" for r in absurd)
    assert any(r["summary"]["status"] == "diverged" for r in absurd)
    # Same seed -> same data and init, whatever the learning rate; another seed differs.
    by = {(r["config"]["variant"], r["config"]["seed"], r["config"]["lr"]): r["metrics"] for r in ref.values()}
    assert by[("post", 0, 1e-2)]["loss"][0] == by[("post", 0, 1e30)]["loss"][0]
    assert by[("post", 0, 1e-2)]["w2_grad_norm"][0] == by[("post", 0, 1e30)]["w2_grad_norm"][0]
    assert by[("post", 0, 1e-2)]["loss"][0] != by[("post", 1, 1e-2)]["loss"][0]

    # 2. A rerun skips every finished cell.
    mtimes = {p.name: p.stat().st_mtime_ns for p in (ref_dir / "cells").glob("*.json")}
    assert sorted(run_sweep(TINY, ref_dir, progress=False)) == sorted(ref)  # same cells as the CLI's
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in (ref_dir / "cells").glob("*.json")}

    # 3. Kill a sweep once its first group is written, rerun it: same results, nothing recomputed.
    out = tmp_path / "killed"
    args = [*TINY_ARGS, "--out", str(out)]
    proc = _subprocess(args, cache)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "cells").glob("*.json"))) >= 4:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()  # reap it and close its pipe
    first = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    assert first, "the sweep wrote nothing before it was killed"
    log = _finish(_subprocess(args, cache))
    assert f"({len(first)} already done)" in log or "all 8 cells already" in log, log
    for name, mtime in first.items():
        assert (out / "cells" / name).stat().st_mtime_ns == mtime, f"{name} was recomputed"
    got = _cells(out)
    assert got.keys() == ref.keys()
    for name in ref:
        _same_results(ref[name], got[name])

    # 4. Four simulated devices: the same numbers as one (up to float32 rounding).
    _finish(proc_four)
    got = _cells(four)
    assert len(got) == 2
    for name, rec in got.items():
        assert rec["environment"]["device_count"] == 4
        _same_results(ref[name], rec, exact=False)

    # 5. The report and its plots, from the cells alone.
    from experiments.report import CLAIMS, write_report

    text = write_report(ref_dir).read_text()
    for source, claim, _ in CLAIMS:
        assert source in text and claim in text
    for png in ("loss_curves.png", "failure_heatmap.png", "init_grad_norms.png", "stream_norm.png",
                "update_size.png", "last_layer_grad.png", "grad_norm.png"):
        assert (ref_dir / png).stat().st_size > 1000
    assert "not measured" in text  # one depth only: the depth claims cannot be decided
