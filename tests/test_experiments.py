"""Tests of the depth-stability experiments on tiny configurations.

The end-to-end test runs one tiny sweep (2 compiled groups, 8 cells, 4 steps) as the
reference, and compares against it: a rerun (skips every cell), a sweep killed with SIGKILL
after its first group and rerun (same numbers, finished cells untouched), the same sweep on
4 simulated CPU devices (same numbers up to float32 rounding) and the report. It is one
test so that pytest-xdist does not run the reference twice; its processes share compiled
programs through the lab's program cache in a temporary folder (so the rerun after the kill also
checks that loaded programs give the same numbers). The reference runs as `make run` does, in
a fresh clone with the runner's default folder and its report, and leaves `git status` empty.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from xla_env import xla_flags  # the suite's XLA flags, the device count replaced

from experiments.stability.analysis import (
    clipped_loss,
    failure,
    growth_factor,
    linear_fit,
    lr_sensitivity,
    power_law_exponent,
    trajectory_max,
)
from experiments.stability.model import VARIANTS
from experiments.stability.sweep import (
    PRESETS,
    Sweep,
    cell_config,
    cell_name,
    parse_args,
    place_groups,
    plan,
    run_sweep,
)
from experiments.stability.tasks import copy_task, markov_task
from experiments.stability.train import compiler_options, sample_pool

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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _subprocess(args: list[str], cache: Path, devices: int = 1, cwd: Path = ROOT) -> subprocess.Popen:
    """`python -m experiments.stability ARGS` on CPU (`devices` simulated CPU devices), sharing
    compiled programs through the lab's program cache (several processes: JAX's persistent cache);
    run in `cwd`, whose `experiments` it imports."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache), XLA_FLAGS=xla_flags(devices),
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen([sys.executable, "-m", "experiments.stability", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com",
                           "-c", "commit.gpgsign=false", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def fresh_clone(dest: Path) -> Path:
    """A repository in `dest` whose one commit holds this checkout's files as they are on disk
    (tracked ones and new ones git does not ignore): what a clone of this checkout, committed,
    holds. Skips where this is no git checkout."""
    try:
        listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # not a file deleted meanwhile
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    _git("init", "-q", cwd=dest)
    _git("add", "-A", cwd=dest)
    _git("commit", "-q", "-m", "the checkout under test", cwd=dest)
    assert _git("status", "--porcelain", cwd=dest) == ""
    return dest


def _finish(proc: subprocess.Popen) -> str:
    log = proc.communicate()[0]
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


def test_lr_sensitivity_and_clipping():
    assert clipped_loss(2.0, 3.0) == 2.0
    assert clipped_loss(4.0, 3.0) == 3.0  # ended worse than it started: counts as l0
    assert clipped_loss(None, 3.0) == 3.0 and clipped_loss(float("nan"), 3.0) == 3.0  # diverged
    # Wortsman et al.: mean over the grid of (loss - best loss over the grid).
    assert lr_sensitivity([2.0, 1.5, 3.0]) == pytest.approx((0.5 + 0.0 + 1.5) / 3)
    assert lr_sensitivity([1.5, 1.5]) == 0.0
    assert math.isnan(lr_sensitivity([1.5, float("nan")]))
    assert trajectory_max([[1.0, float("nan")], [3.0, 2.0]]) == 3.0
    assert math.isnan(trajectory_max([float("nan")]))


def test_cell_names_depend_on_every_setting():
    base = cell_config(TINY, "post", 2, 1e-2, 0, 0)
    assert cell_name(base) == cell_name(dict(base))
    for key, value in [("steps", 8), ("lr", 2e-2), ("seed", 1), ("d_model", 16), ("task_seed", 1)]:
        assert cell_name({**base, key: value}) != cell_name(base)


def test_small_groups_train_side_by_side_on_their_own_devices(tmp_path):
    """A group is split over the devices only as far as each keeps three runs: the quick
    preset's 3-run groups one device each, in turn over the devices (so they train side by
    side); the cpu preset's (10 or 20 runs) and the depth study's (6) over both; a count the
    user chose (min_runs None), several processes or another platform: every device."""
    from types import SimpleNamespace

    two = [SimpleNamespace(platform="cpu", process_index=0, id=i) for i in range(2)]
    groups = {p: plan(PRESETS[p], tmp_path / p)[0] for p in ("quick", "cpu", "depth")}
    assert [len(g.todo) for g in groups["quick"]] == [3] * 9
    quick = place_groups(PRESETS["quick"], groups["quick"], two)
    assert [[d.id for d in ds] for ds in quick] == [[0], [1]] * 4 + [[0]]
    for p in ("cpu", "depth"):
        assert all(ds == two for ds in place_groups(PRESETS[p], groups[p], two))
    assert all(ds == two for ds in place_groups(PRESETS["quick"], groups["quick"], two, min_runs=None))
    hosts = [SimpleNamespace(platform="cpu", process_index=i, id=i) for i in range(2)]
    assert all(ds == hosts for ds in place_groups(PRESETS["quick"], groups["quick"], hosts))
    gpus = [SimpleNamespace(platform="gpu", process_index=0, id=i) for i in range(2)]
    assert all(ds == gpus for ds in place_groups(PRESETS["quick"], groups["quick"], gpus))
    cpu = PRESETS["cpu"]  # warmup runs only for post-LN and pre-LN: their groups are twice the others'
    assert sum(cpu.group_sizes()) == len(cpu.runs()) and sorted(set(cpu.group_sizes())) == [10, 20]


# Impossible settings: (argv, what the one line on stderr says). Each is refused before anything runs.
REFUSED = [
    (["--lrs=-1e-3"], "--lrs -0.001: each learning rate must be a finite number > 0"),
    (["--lrs", "abc"], "argument --lrs: 'abc' is not a comma list of numbers"),
    (["--lrs", "1e-3,nan"], "--lrs 0.001,nan: each learning rate must be a finite number > 0"),
    (["--depths", "0"], "--depths 0: each depth a number of layers >= 1"),
    (["--depths", "6,x"], "argument --depths: '6,x' is not a comma list of integers"),
    (["--d-model", "30", "--num-heads", "4"], "--num-heads 4: a divisor of --d-model (30)"),
    (["--warmups", "-5"], "--warmups -5: each warmup a number of steps >= 0"),
    (["--seeds", "0"], "--seeds 0: a whole number >= 1"),
    (["--batch", "0"], "--batch 0: a whole number >= 1"),
    (["--steps", "100", "--chunk", "30"], "--steps 100: a multiple of --chunk (30)"),
    (["--vocab", "4"], "--vocab 4: at least 8 for the markov task"),
    (["--task", "copy", "--seq-len", "2"], "--seq-len 2: the copy task needs --vocab >= 2 and --seq-len >= 3"),
    (["--variants", "post,bogus"], "--variants post,bogus: each one of post, pre,"),
    (["--extra", "noskip:x"], "argument --extra: 'noskip:x' is not variant:depth"),
    (["--extra", "noskip:0"], "--extra noskip:0: each depth a number of layers >= 1"),
    (["--variants", "pre-moe", "--d-ff", "127"], "--d-ff 127: a multiple of 2 for the experts variants"),
    (["--router-aux-coef", "-1"], "--router-aux-coef -1.0: a finite weight >= 0"),
    (["--cpu-devices", "-1"], "--cpu-devices -1: a count of CPU devices, or 0 for JAX's default of one"),
    (["--xla-opt-level", "7"], "--xla-opt-level 7: one of 0, 1, 2, 3, or -1 for XLA's default"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id 2: an index in 0..1"),
]


@pytest.mark.parametrize("argv, said", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_an_impossible_setting_is_refused_in_one_line_before_anything_runs(argv, said, capsys, tmp_path):
    from experiments.stability.sweep import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--estimate", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("python -m experiments.stability: ") and said in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    assert parse_args(["--cpu-devices", "0", "--lrs", "1e-3,1e-2"]).lrs == (1e-3, 1e-2)  # possible ones pass


def test_the_cli_exits_2_on_an_impossible_setting_with_estimate():
    out = subprocess.run([sys.executable, "-m", "experiments.stability", "--depths", "0", "--estimate"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr == "python -m experiments.stability: --depths 0: each depth a number of layers >= 1\n"


def test_presets_are_valid():
    from experiments.stability.flags import check_sweep

    for sweep in PRESETS.values():
        check_sweep(sweep)  # the checks refuse no preset
        assert sweep.steps % sweep.chunk == 0
        assert sweep.pairs()
        assert set(sweep.variants) | set(sweep.warmup_variants or ()) <= set(VARIANTS)
    quick = PRESETS["quick"]
    assert ("noskip", 6) in quick.pairs() and {"post", "pre"} <= set(quick.variants)
    assert {("peri", d) for d in quick.depths} <= set(quick.pairs()) and len(quick.depths) == 2

    cpu = PRESETS["cpu"]
    assert set(cpu.variants) == {"post", "pre", "peri", "pre-rms", "pre-qknorm", "deepnorm"}
    assert 2 <= len(cpu.depths) <= 3 and 2 <= cpu.seeds <= 3
    assert len(cpu.lrs) >= 5 and 10 <= max(cpu.lrs) / min(cpu.lrs) <= 100 + 1e-9
    assert 0 in cpu.warmups and any(w > 0 for w in cpu.warmups)
    runs = cpu.runs()
    # Post-LN runs every warmup at every lr (Xiong's claim); a variant outside warmup_variants runs warmup 0 only.
    assert {(lr, w) for v, _, lr, w, _ in runs if v == "post"} == {(lr, w) for lr in cpu.lrs for w in cpu.warmups}
    assert {w for v, _, _, w, _ in runs if v == "peri"} == {0}
    assert len(runs) == cpu.work()["runs"] == len(set(runs))
    # Sized for 20 minutes: even at the slow end of the measured per-step cost the training fits.
    from experiments.stability.sweep import CPU_MS_PER_LAYER_STEP_D32

    ref = Sweep(name="ref", d_model=32, d_ff=128, seq_len=16, batch=16, heldout=16)
    slow_ms = CPU_MS_PER_LAYER_STEP_D32[1] * cpu.layer_step_flops() / ref.layer_step_flops()
    assert cpu.work()["run_layer_steps"] * slow_ms / 1e3 < 20 * 60
    assert PRESETS["full"].work()["flops"] > 100 * cpu.work()["flops"]  # the accelerator-sized one


def test_layer_step_flops_counts_forward_backward_and_heldout():
    s = Sweep(name="x", d_model=8, d_ff=16, seq_len=4, batch=2, heldout=1)
    per_token = 2 * (4 * 64 + 2 * 8 * 16 + 2 * 4 * 8)  # q,k,v,out + FFN + scores and mix, 2 FLOPs per MAC
    assert s.layer_step_flops() == per_token * 4 * (3 * 2 + 1)
    small = Sweep(name="y", variants=("post",), depths=(2, 3), lrs=(1e-3,), seeds=2, steps=10)
    assert small.work()["run_layer_steps"] == (2 + 3) * 2 * 10


# ------------------------------------------------------------------------------------
# Verdict rules on synthetic cells (no training)
# ------------------------------------------------------------------------------------


def _cell(variant: str, depth: int, lr: float, *, final: float | None, warmup: int = 0, seed: int = 0,
          logits: tuple[float, float] = (3.0, 3.0), stream: tuple | None = None,
          grads: tuple | None = None, l0: float = 3.5, chunks: int = 2) -> dict:
    """A record shaped like a cell on disk; `final` None = diverged, above the threshold = plateau."""
    h, steps = 1.0, 4
    threshold = l0 - 0.5 * (l0 - h)
    status = "diverged" if final is None else "trained" if final <= threshold else "plateau"
    held = [l0] * (steps - 1) + [final if final is not None else float("nan")]
    stream = stream or (np.arange(1.0, depth + 2), np.arange(1.0, depth + 2))
    grads = grads or np.ones(depth)
    per_layer = [[1.0] * depth] * chunks
    return {
        "config": {"variant": variant, "depth": depth, "lr": lr, "warmup": warmup, "seed": seed},
        "summary": {"status": status, "step": None if status == "trained" else 0,
                    "final_loss": final, "threshold": threshold},
        "task": {"optimal_loss": h, "unigram_loss": 3.0},
        "metrics": {
            "loss": held, "heldout_loss": held, "grad_norm": [1.0] * steps, "update": [0.1] * steps,
            "w2_grad_norm": per_layer, "layer_grad_norm": per_layer, "attn_grad_norm": per_layer,
            "layer_grad_norm_mean": [list(grads)] * chunks, "w2_grad_norm_mean": per_layer,
            "attn_grad_norm_mean": per_layer,
            "stream_norm": [list(stream[0])] * chunks, "attn_entropy": per_layer,
            "attn_logit_max": [[logits[0]] * depth] + [[logits[1]] * depth] * chunks,
            "logit_rms": [1.0] * (chunks + 1), "logit_absmax": [4.0] * (chunks + 1),
            "stream_norm_probe": [list(stream[0])] * chunks + [list(stream[1])],
            "heldout_loss0": l0, "chunk_steps": [0, 2], "probe_steps": [0, 2, 4],
        },
        "environment": {"device_count": 1, "device_kind": "cpu", "platform": "cpu", "jax": "x", "flax": "x",
                        "cpu_count": 2},
    }


LRS = (1e-3, 1e-2, 1e-1)


def _wortsman_cells(qk_like_pre: bool = False, logits: bool = True) -> list[dict]:
    nan = float("nan")
    pre = {1e-3: (2.0, 4.0), 1e-2: (1.9, 6.0), 1e-1: (3.0, 30.0)}  # lr: (final loss, peak attention logit)
    qk = pre if qk_like_pre else {1e-3: (2.0, 3.5), 1e-2: (1.9, 3.6), 1e-1: (2.0, 4.0)}
    return [_cell(v, 2, lr, final=f, logits=(3.0, peak) if logits else (nan, nan))
            for v, table in (("pre", pre), ("pre-qknorm", qk)) for lr, (f, peak) in table.items()]


def test_wortsman_verdict_rule():
    from experiments.stability.report import Data, claim_wortsman

    verdict, body = claim_wortsman(Data(_wortsman_cells()))
    # pre: logit 3 -> 30 (10x) at lr 0.1, 1.33x at 0.001; clipped loss 3.0 vs best 1.9 (degrades);
    # QK-norm: 3 -> 4 (1.33x, bounded) and sensitivity (0.1 + 0 + 0.1) / 3 < pre's (0.1 + 0 + 1.1) / 3.
    assert verdict == "agrees", body
    assert ("| 2 | 3.00 -> 30.00 (10.00x) | 1.33x | 1.100 | 3.00 -> 4.00 (1.33x) | 0.400 | 0.067 | "
            "yes, yes, yes, yes |") in body
    verdict, body = claim_wortsman(Data(_wortsman_cells(qk_like_pre=True)))
    assert verdict == "partly agrees" and "yes, yes, no, no" in body  # QK-norm as bad as pre-LN
    assert claim_wortsman(Data(_wortsman_cells(logits=False)))[0] == "not measured"  # no logits recorded
    assert claim_wortsman(Data([c for c in _wortsman_cells() if c["config"]["lr"] != 1e-2]))[0] == "not measured"


def test_peri_normformer_and_warmup_verdict_rules():
    from experiments.stability.report import Data, claim_normformer, claim_peri, claim_warmup

    def cells(pre_after, peri_after, pre_grads):
        return [_cell("pre", 3, 1e-3, final=2.0, stream=([1, 2, 3, 4], pre_after), grads=pre_grads),
                _cell("peri", 3, 1e-3, final=2.0, stream=([1, 3, 5, 7], peri_after))]

    # pre-LN: largest magnitude 4 -> 16 (4x), rising 2 -> 16 over the layers; Peri-LN: 7 -> 7.5, rising less.
    good = Data(cells([1, 2, 6, 16], [1, 3, 5.5, 7.5], [4.0, 2.0, 1.0]))
    assert claim_peri(good)[0] == "agrees"
    assert claim_normformer(good)[0] == "agrees"  # 4 -> 1: falls toward the output
    bad = Data(cells([1, 2, 3, 4], [1, 6, 10, 14], [1.0, 2.0, 4.0]))
    assert claim_peri(bad)[0] == "does not agree"  # pre-LN did not grow, Peri-LN doubled
    assert claim_normformer(bad)[0] == "does not agree"
    half = Data(cells([1, 2, 6, 16], [1, 6, 10, 14], [1.0, 1.0, 1.0]))
    assert claim_peri(half)[0] == "partly agrees"
    for c in half.records:  # nothing trained: a profile "after training" says nothing
        c["summary"]["status"] = "plateau"
    assert claim_peri(half)[0] == claim_normformer(half)[0] == "inconclusive"

    # Xiong's warmup: post-LN fails without warmup and trains with it at one lr.
    warm = [_cell("post", 2, lr, final=f, warmup=w) for lr, w, f in
            [(1e-3, 0, 1.5), (1e-3, 50, 1.5), (1e-2, 0, 3.4), (1e-2, 50, 1.6)]] + [_cell("pre", 2, 1e-2, final=1.5)]
    assert claim_warmup(Data(warm))[0] == "agrees"
    no_rescue = [c for c in warm if not (c["config"]["lr"] == 1e-2 and c["config"]["warmup"] == 50)]
    no_rescue.append(_cell("post", 2, 1e-2, final=3.4, warmup=50))
    assert claim_warmup(Data(no_rescue))[0] == "does not agree"


def test_dyt_lns_verdict_rules_and_the_answer():
    from experiments.stability.report import MATCH, Data, answer, claim_dyt, claim_lns

    def cells(dyt: dict, lns: dict) -> list[dict]:  # {depth: best final loss}; pre-LN ends at 2.0 everywhere
        out = []
        for L in (2, 8):
            out += [_cell("pre", L, 1e-3, final=2.0), _cell("pre", L, 1e-2, final=2.2),
                    _cell("pre-dyt", L, 1e-3, final=dyt[L]), _cell("pre-dyt", L, 1e-2, final=3.4),
                    _cell("pre-lns", L, 1e-3, final=lns[L]), _cell("pre-lns", L, 1e-2, final=2.5)]
        return out

    good = Data(cells({2: 2.0 + MATCH / 2, 8: 1.9}, {2: 2.0, 8: 2.0 - 2 * MATCH}))
    assert claim_dyt(good)[0] == "agrees" and claim_lns(good)[0] == "agrees"
    # DyT worse by more than MATCH at the deep end; LNS only as good as pre-LN at depth
    bad = Data(cells({2: 2.0, 8: 2.0 + 2 * MATCH}, {2: 1.9, 8: 2.0}))
    assert claim_dyt(bad)[0] == "partly agrees"
    assert claim_lns(bad)[0] == "does not agree"
    assert claim_lns(Data([c for c in good.records if c["config"]["depth"] == 2]))[0] == "not measured"
    text = answer(good, [("Zhu et al. 2025 (DyT)", "", "agrees", ""), ("Xiong", "", "does not agree", "")])
    assert "`pre` (2: 0.001, 0.01; 8: 0.001, 0.01)" in text
    assert "`pre-dyt` 1.900 (lr 0.001), `pre-lns` 1.900 (lr 0.001), `pre` 2.000 (lr 0.001)" in text
    assert "**Agrees**: Zhu et al. 2025 (DyT). **Does not agree**: Xiong." in text


def test_the_report_opens_with_its_verdict_computed_from_the_cells():
    from experiments.stability.report import Data, opening

    def cells(post_deep: float, split: bool) -> list[dict]:  # 3 seeds; pre-LN trains at 2 and 8 layers
        out = [_cell("pre", L, 1e-3, final=1.5, seed=s) for L in (2, 8) for s in range(3)]
        out += [_cell("post", 2, 1e-3, final=3.5 if split and s == 0 else 1.5, seed=s) for s in range(3)]
        return out + [_cell("post", 8, 1e-3, final=post_deep, seed=s) for s in range(3)]

    text = opening(Data(cells(post_deep=3.5, split=True)))
    assert text.startswith("**Pre-LN or post-LN at depth?** Post-LN trains at 2 layers and fails at 8 layers; "
                           "pre-LN trains at 2 and 8 layers: at 8 layers pre-LN trains and post-LN does not.")
    assert "| `post` LN(x + F(x)) | trains (2/3 seeds trained) | fails (0/3 seeds trained) |" in text
    assert "each cell is 3 seeds at lr 0.001, without warmup" in text and "half-way (0.5)" in text
    assert "The seeds agreed in 3 of 4 (variant, depth, lr) cells; they split in `post` at 2 layers, lr 0.001 (2/3)." \
        in text
    both = opening(Data(cells(post_deep=1.5, split=False)))  # the words follow the results
    assert "Post-LN trains at 2 and 8 layers; pre-LN trains at 2 and 8 layers: at 8 layers both train." in both
    assert "The seeds agreed in 4 of 4 (variant, depth, lr) cells." in both
    other = opening(Data([_cell("peri", 2, 1e-3, final=1.5), _cell("peri", 2, 1e-2, final=None)]))
    assert other.startswith("**Pre-LN or post-LN at depth?** Not asked by this sweep (it runs `peri`)")
    assert "| `peri` " in other and "trains at lr 0.001 (1/1, 0/1 seeds trained)" in other


def test_lr_sweep_with_one_learning_rate_has_no_learning_rate_axis(tmp_path, monkeypatch):
    from experiments.stability import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    cells = [_cell(v, L, 1e-3, final=1.5 + s / 10, seed=s) for v in ("post", "pre") for L in (2, 8) for s in range(2)]
    plots.lr_sweep(cells, tmp_path / "lr_sweep.png")
    axes = [ax for ax in figs[0].axes if ax.get_visible()]
    assert len(axes) == 2 and all(ax.get_xscale() == "linear" for ax in axes)
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["post", "pre"]
    assert "0.001" in figs[0]._suptitle.get_text()
    figs.clear()
    plots.lr_sweep(cells + [_cell("pre", 2, 1e-2, final=2.0)], tmp_path / "lr_sweep.png")  # two: the lr axis
    assert figs[0].axes[0].get_xscale() == "log"


def test_plots_of_a_grid_are_written(tmp_path):
    """The plots a grid of learning rates and warmups (one run diverged) changes; the tiny
    sweep's report draws every plot from real cells (test_sweep_resume_devices_and_report)."""
    from experiments.stability import plots
    from experiments.stability.report import Data, logit_table, lr_sensitivity_table

    cells = _wortsman_cells() + [_cell("post", 2, lr, final=None if lr == 1e-1 else 2.5, warmup=w)
                                 for lr in LRS for w in (0, 50)]
    for name in ("depth_loss.png", "lr_sweep.png", "attn_logit_max.png", "stream_norm_trained.png",
                 "failure_heatmap.png", "train_grad_norms.png"):
        path = plots.ALL[name](cells, tmp_path / name)
        assert path.stat().st_size > 1000, path
    table = lr_sensitivity_table(Data(cells))
    assert "| pre | 2 | 0 | 2.000 | 1.900 | 3.000 | 0.01 | 0.900 | 0.400 |" in table
    assert "| post | 2 | 0 | 2.500 | 2.500 | 3.500 |" in table  # diverged at 0.1: counts as l0
    assert "| pre | 2 | 3.00 | 4.00 | 6.00 | 30.00 |" in logit_table(Data(cells))

# ------------------------------------------------------------------------------------
# The tiny sweep, end to end (one test, so pytest-xdist does not run the sweep twice)
# ------------------------------------------------------------------------------------


def test_sweep_resume_devices_and_report(tmp_path):
    cache = tmp_path / "jax_cache"
    # The reference sweep, as `make run` runs: in a fresh clone, into the runner's default
    # folder, with its report (the quick preset's options changed: RUNS/quick-custom, decided
    # by the same default_out as quick's RUNS/quick). At the same time, one group of it on 4
    # simulated devices (two runs on four devices also exercises the padding of the runs axis).
    clone = fresh_clone(tmp_path / "clone")
    ref_dir, four = clone / "experiments" / "stability" / "runs" / "quick-custom", tmp_path / "four"
    proc_ref = _subprocess([a for a in TINY_ARGS if a != "--no-report"], cache, cwd=clone)
    proc_four = _subprocess([*TINY_ARGS, "--variants", "post", "--lrs", "1e-2", "--out", str(four)], cache, devices=4)
    # The whole sweep as two processes on this machine (gloo collectives over 127.0.0.1), two
    # simulated CPU devices each: every group's runs are sharded over the four devices of both.
    two, port = tmp_path / "two", _free_port()
    proc_two = [_subprocess([*TINY_ARGS, "--out", str(two), "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", "2", "--process-id", str(i)], cache, devices=2) for i in range(2)]

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
        assert np.shape(m["layer_grad_norm_mean"]) == np.shape(m["w2_grad_norm_mean"]) == (2, 2)  # chunk means
        assert np.shape(m["attn_logit_max"]) == (3, 2)  # (init + after each chunk, layers)
        assert np.shape(m["stream_norm_probe"]) == (3, 3) and len(m["logit_rms"]) == len(m["logit_absmax"]) == 3
        assert m["probe_steps"] == [0, 2, 4]
        if rec["summary"]["status"] != "diverged":
            # Each chunk's stream norms are the probe at its start: at init, then after the chunk before.
            assert m["stream_norm"] == m["stream_norm_probe"][:2]
            assert 0 < m["logit_rms"][-1] <= m["logit_absmax"][-1]
            assert np.all(np.array(m["layer_grad_norm_mean"]) > 0)
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

    # The probes at init equal a direct forward pass of the model built from the run's seed.
    _check_init_probe(ref[next(n for n in ref if "_post_" in n and "lr1e-02" in n and "_s1-" in n)])

    # 2. A rerun skips every finished cell.
    mtimes = {p.name: p.stat().st_mtime_ns for p in (ref_dir / "cells").glob("*.json")}
    assert sorted(run_sweep(TINY, ref_dir, progress=False)) == sorted(ref)  # same cells as the CLI's
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in (ref_dir / "cells").glob("*.json")}

    # 3. Kill a sweep once its first group is written, rerun it: same results, nothing recomputed.
    out = tmp_path / "killed"
    args = [*TINY_ARGS, "--out", str(out)]
    proc = _subprocess(args, cache)
    while proc.poll() is None and len(list((out / "cells").glob("*.json"))) < 4:  # no clock: it ends or writes
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()  # reap it and close its pipe
    first = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    assert first, "the sweep wrote nothing before it was killed"
    log = _finish(_subprocess(args, cache))
    assert f"({len(first)} already done)" in log or "all 8 cells already" in log, log
    for name, mtime in first.items():
        assert (out / "cells" / name).stat().st_mtime_ns == mtime, f"{name} was recomputed"
    last = json.loads((out / "sweep.json").read_text()).get("last_run")
    if last and last["cells_computed"]:  # its programs were compiled by the first run: loaded from the caches
        cc = last["compile_cache"]
        assert cc["dir"] == str(cache) and cc["programs"]["loaded"] >= 1 and cc["pools_loaded"] == 2, last
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

    # 5. Two processes: the same cells as one process (up to float32 rounding), written once.
    logs = [_finish(p) for p in proc_two]
    got = _cells(two)
    assert got.keys() == ref.keys()
    for name, rec in got.items():
        assert rec["environment"]["process_count"] == 2 and rec["environment"]["device_count"] == 4
        _same_results(ref[name], rec, exact=False)
    assert "total wall time" in logs[0] and "total wall time" not in logs[1]  # process 1 does not report

    # 6. The report and its plots, which the reference run wrote from its cells; the clone's
    # checkout is as it was: no tracked file changed, nothing new that git does not ignore.
    from experiments.stability.report import CLAIMS

    text = (ref_dir / "report.md").read_text()
    assert _git("status", "--porcelain", cwd=clone) == "", "the lab's run changed the checkout"
    for source, claim, _ in CLAIMS:
        assert source in text and claim in text
    for png in ("loss_curves.png", "failure_heatmap.png", "init_grad_norms.png", "stream_norm.png",
                "update_size.png", "last_layer_grad.png", "grad_norm.png", "lr_sweep.png", "attn_logit_max.png",
                "stream_norm_trained.png", "train_grad_norms.png"):
        assert (ref_dir / png).stat().st_size > 1000
    assert "not measured" in text  # one depth only: the depth claims cannot be decided


def _check_init_probe(rec: dict) -> None:
    """Recompute a cell's probes at initialisation (probe 0) from its config alone."""
    import jax
    import jax.numpy as jnp

    from experiments.stability.model import ModelConfig, create_params
    from experiments.stability.train import TrainConfig

    c = rec["config"]
    task = markov_task(vocab=c["vocab"], seq_len=c["seq_len"], seed=c["task_seed"])
    heldout = sample_pool(task, c["heldout"], TrainConfig().heldout_seed, compiler_options(0))
    cfg = ModelConfig(c["variant"], c["depth"], vocab=c["vocab"], seq_len=c["seq_len"], d_model=c["d_model"],
                      num_heads=c["num_heads"], d_ff=c["d_ff"])
    from flax import nnx

    graphdef, params, rest = create_params(cfg, jax.random.fold_in(jax.random.key(c["seed"]), 0))
    logits, inter = nnx.merge(graphdef, params, rest)(jnp.asarray(heldout[:, :-1]), return_intermediates=True)
    m = rec["metrics"]
    assert m["logit_rms"][0] == pytest.approx(float(jnp.sqrt(jnp.mean(logits ** 2))), rel=1e-4)
    assert m["logit_absmax"][0] == pytest.approx(float(jnp.max(jnp.abs(logits))), rel=1e-4)
    x = np.concatenate([np.asarray(inter["embedded"])[None], np.asarray(inter["residual"])])
    np.testing.assert_allclose(m["stream_norm_probe"][0], (x ** 2).sum(-1).mean((1, 2)) / c["d_model"], rtol=1e-4)
    if "attention_logits_max" in inter:  # the catalogue's Encoder reports it: (L,)
        np.testing.assert_allclose(m["attn_logit_max"][0], np.asarray(inter["attention_logits_max"]), rtol=1e-4)
        assert np.all(np.isfinite(m["attn_logit_max"]))
    else:
        assert all(v is None for v in m["attn_logit_max"][0])  # NaN on disk, not a made-up number


def test_xla_options_are_name_value_pairs_and_an_unknown_name_is_an_error():
    from experiments.stability.train import UnknownCompileOption, compile_lowered

    assert parse_args(["--xla-option", "xla_cpu_parallel_codegen_split_count=1"]).xla_option == [
        ("xla_cpu_parallel_codegen_split_count", 1)]
    with pytest.raises(SystemExit):  # argparse: "NAME=VALUE, e.g. ...; got 'nope'"
        parse_args(["--xla-option", "nope"])
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(3))
    with pytest.raises(UnknownCompileOption, match=r"\['xla_nope_option'\] unknown to this XLA build"):
        compile_lowered(lowered, {"xla_nope_option": 1})
    # the options compiler_options sets itself are still dropped where a build does not know them
    assert compile_lowered(lowered, compiler_options(1)) is not None


def test_a_failed_sampling_of_the_pools_is_raised_and_writes_no_cell(tmp_path, monkeypatch):
    """The pools are sampled beside the compiles: an error there is the sweep's error, and the
    compiles beside it stop."""
    import experiments.stability.train

    def broken(*args, **kwargs):
        raise ValueError("the task's sampler failed")

    monkeypatch.setattr(experiments.stability.train, "sample_pool", broken)
    with pytest.raises(ValueError, match="the task's sampler failed"):
        run_sweep(replace(TINY, variants=("pre",)), tmp_path, progress=False, opt_level=0)  # fastest compile
    assert not list((tmp_path / "cells").glob("*.json"))
