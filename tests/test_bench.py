"""experiments.bench: a quick smoke run writes its JSON and markdown table; the analytic
FLOP count agrees with XLA's own count of the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from experiments.bench import blocks as bench  # noqa: E402


def test_quick_run_writes_json_and_table(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # A fresh process, as a user runs it (XLA's own flags). One torch
    # thread: the suite runs beside another worker, where torch's two spinning threads made
    # its tiny steps up to 60x slower (cached generation 13-125 positions/s against 880).
    # No time budget: the bench skips lower-priority sections past its budget, and a busy
    # machine must make this test slower, never red (the sections are asserted below).
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--quick", "--torch-threads", "1", "--budget", "1e9",
         "--out", str(tmp_path)],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    table = (tmp_path / "bench.md").read_text()
    sections = {r["section"] for r in result["rows"]}
    assert {"peak", "block", "seeds", "depth", "remat"} <= sections, (sections, result["skipped"])
    contenders = {r["contender"] for r in result["rows"] if r["section"] == "block"}
    assert {"jax fwd", "jax train"} <= contenders
    for row in result["rows"]:
        if "median_ms" in row:
            assert row["median_ms"] > 0 and row["p25_ms"] <= row["median_ms"] <= row["p75_ms"]
    assert result["peak_flops"]["float32"] > 0
    assert result["targets"], "no target was evaluated"
    assert "## Block" in table and "## Targets (this run)" in table and "## Rematerialisation" in table
    temp = {r["remat"]: r["xla_temp_bytes"] for r in result["rows"] if r["section"] == "remat" and "remat" in r}
    assert set(temp) == {"none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"}, temp
    assert temp["full"] < temp["none"], temp  # recomputing each layer keeps fewer residuals
    assert result["meta"]["wall_s"] > 0 and not result["skipped"], result["skipped"]
    assert bench.CPU_DOT_FLAG not in result["meta"]["xla_flags"]  # XLA's defaults since the flag study
    assert result["meta"]["torch_threads"] == 1


def test_flop_count_matches_xla():
    size = bench.Size("t", 32, 4, 64, 2, 16)
    graphdef, params, rest = bench.jax_model(size, "float32")
    forward, _ = bench.jax_step_fns(graphdef, rest)
    x = jnp.ones((size.batch, size.seq, size.d_model))
    cost = jax.jit(forward).lower(params, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla = cost["flops"]
    ours = size.flops(train=False)
    # XLA also counts the elementwise work (softmax, LayerNorm, bias): a little more than the matmuls
    assert ours <= xla <= 1.35 * ours, (ours, xla)
    assert size.flops(train=True) == 3 * ours


def test_generation_bench_quick_run_checks_its_tokens(tmp_path):
    """experiments.bench.generate --quick: every row's fb.generate tokens equal HF generate's
    and the torch twin's (the bench compares them before it times anything), its JSON and
    table are written, and the speeds are positive."""
    pytest.importorskip("transformers")
    from experiments.bench import generate as generate_bench

    result = generate_bench.main(["--quick", "--torch-threads", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert rows == result["rows"] and rows
    for row in rows:
        assert all(row["same_tokens"].values()) if isinstance(row["same_tokens"], dict) else row["same_tokens"], row
        assert (all(row[k] > 0 for k in row if k.endswith("_tok_s"))
                and row.get("cached_speedup", {"median": 1})["median"] > 0)
    assert "| fb / HF |" in (tmp_path / "generate.md").read_text()


def test_lab_bench_torch_loop_trains_the_labs_model():
    """The loop the lab is measured against learns the lab's task (its held-out loss falls well
    below ln(vocab), the loss at initialisation), with and without warmup."""
    import math

    from experiments.bench import lab as lab_bench

    out = lab_bench.torch_loop(runs=[(3e-3, 0, 0), (3e-3, 5, 1)], steps=40)
    assert out["seconds"] > 0 and len(out["heldout"]) == 2
    assert all(h < math.log(32) - 0.5 for h in out["heldout"]), out


def test_moe_bench_quick_run_writes_summary_and_ratios(tmp_path):
    """experiments.bench.moe --quick (tiny sizes, 4 and 8 experts): the torch twin's and HF's
    Mixtral block's outputs equal the Flax module's (float32), every contender is timed in both
    steps, the 64/8-style and MoE/dense ratios are computed, and the summary names its command."""
    pytest.importorskip("transformers")
    from experiments.bench import moe as moe_bench

    result = moe_bench.main(["--quick", "--torch-threads", "1", "--reps", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "moe.json").read_text())
    assert saved["rows"] == result["rows"] and saved["ratios"] == result["ratios"]
    assert all(err < 1e-5 for err in result["agree_max_rel_err"].values()), result["agree_max_rel_err"]
    names = {r["contender"] for r in result["rows"]}
    assert {"flax 4", "flax 8", "flax dense", "twin 8", "torch dense", "hf-eager 8", "hf-grouped_mm 8"} <= names
    assert {r["step"] for r in result["rows"]} == {"forward", "forward+backward"}
    assert all(r["median_ms"] > 0 for r in result["rows"])
    ratios = {(r["step"], r["ratio"]) for r in result["ratios"]}
    assert ("forward+backward", "flax 8 / flax 4") in ratios and ("forward", "flax 8 / flax dense") in ratios
    assert {p["piece"] for p in result["profile"]} == {"route + layout + scatter", "loops over blocks",
                                                      "gather + weighted sum"}
    wide = result["wide"]  # top-4 of 16 against top-4 of 4, wall and CPU clocks, an op profile each
    assert {(r["step"], r["clock"]) for r in wide["ratios"]} == {(s, c) for s in ("forward", "forward+backward")
                                                                 for c in ("wall", "cpu")}
    assert all(r["median"] > 0 for r in wide["ratios"] + result["cpu_ratios"])
    assert set(wide["op_profile"]) == {"flax 4 top-4", "flax 16 top-4"}
    assert all(p["dots"] > 0 for p in [*wide["op_profile"].values(), *result["op_profile"].values()])
    summary_md = (tmp_path / "summary.md").read_text()
    assert "python -m experiments.bench.moe --quick" in summary_md and "## Ratios" in summary_md
    assert "## Top-4 of 16 experts against top-4 of 4" in summary_md and "by op kind" in summary_md


def test_moe_table_in_speed_doc_is_the_committed_run(tmp_path, monkeypatch):
    """docs/speed.md's experts table is what `experiments.bench.moe --from-json ... --doc` writes
    from the committed moe.json: measured, not typed."""
    from pathlib import Path

    from experiments.bench import moe as moe_bench

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the table names the JSON by its path in the repository
    doc = (root / "docs" / "speed.md").read_text()
    copy = tmp_path / "speed.md"
    copy.write_text(doc)
    moe_bench.main(["--from-json", "experiments/bench/results/moe/moe.json", "--doc", str(copy)])
    assert copy.read_text() == doc, "docs/speed.md's experts table differs from the committed moe.json's"
    assert "| flax 64 / flax 8 |" in doc
