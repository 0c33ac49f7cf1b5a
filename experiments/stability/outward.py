"""The outward study: does each verdict of the depth study hold at a wider model and
on real text?

    python -m experiments.stability.outward             # run what is missing -> experiments/stability/runs/outward/
    python -m experiments.stability.outward --estimate  # sizes and time estimates, run nothing
    python -m experiments.stability.outward --report    # the tables again from the cells on disk
    python -m experiments.stability.outward --out experiments/stability/results/outward   # the committed one

Three settings, one grid: the depth study's six placements (post-LN, pre-LN, DeepNorm, Peri-LN,
pre-LN with DyT, pre-LN with LayerNorm Scaling) at 6, 12 and 24 layers, learning rates 1e-3,
3e-3, 1e-2, 2 seeds, batch 16 x 16 tokens, held-out batch 32, 200 steps (text: 800, sized by a
pilot of the pre-LN control alone before the sweep; presets.py):
  Markov d32   the depth study's preset at 6, 12 and 24 layers (`--preset depth --depths
               6,12,24`) -> outward/markov-d32: the depth study's own runs (same groups of six
               runs over the same devices), its 48-layer groups left out so that every column
               has the same depths, re-run here because the depth study's cells are not
               committed. On one machine a re-run gives the same numbers bit for bit; on
               another CPU the last bits can differ and chaos amplifies them (outward's report
               says by how much against the committed depth report);
  Markov d64   the `outward-markov` preset: d_model 64, 4 heads, d_ff 256 -> outward/markov;
  text d64     the `outward-text` preset: the same model on characters of CPython's
               documentation (text.py) -> outward/text.
Each setting also gets the depth study's full report (its folder's report.md).

The verdicts, rules written before the runs (`verdicts`; "trains": majority of seeds trained,
by the failure rule of analysis.py, text measured from its unigram loss):
  1. trains at every depth: the placements that train at some learning rate of the grid at
     every depth;
  2. post-LN's failure depth: the shallowest depth at which post-LN trains at no learning rate
     ("none" when it trains at every depth);
  3. best at the deepest depth: the placement with the lowest best-LR clipped final loss at the
     deepest depth, with every placement within MATCH nats of it;
  4. LayerNorm Scaling's gain with depth: the Curse of Depth rule of report.py
     (claim_lns: better than pre-LN by more than MATCH at the deepest depth, and by more than at
     the shallowest), with the gains;
  5. DyT at depth: the deepest depth at which pre-LN with DyT trains at some learning rate, and
     the DyT rule of report.py (claim_dyt).
A verdict "flips" in a setting when its value there differs from Markov d32's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from .presets import PRESETS
from .report import MATCH, Data, _best, _outcome, _rate, claim_dyt, claim_lns, load

ROOT = Path(__file__).resolve().parents[2]  # the repository's
OUT = Path(__file__).resolve().parent / "runs" / "outward"  # without --out (untracked)
DEPTHS = (6, 12, 24)
SETTINGS = (  # (label, preset, folder in the study's folder)
    ("Markov d32", "depth", "markov-d32"),
    ("Markov d64", "outward-markov", "markov"),
    ("text d64", "outward-text", "text"),
)
VERDICTS = ("trains at every depth", "post-LN's failure depth", "best at the deepest depth",
            "LayerNorm Scaling's gain with depth", "DyT at depth")


def _trains(d: Data, variant: str, depth: int) -> bool:
    return any(_outcome(_rate(d.get(variant, depth, lr, 0))) == "trains" for lr in d.lrs)


def verdicts(records: list[dict]) -> dict[str, tuple[str, str]]:
    """The five verdicts of one setting from its records (depths in DEPTHS only):
    {verdict: (value compared across settings, detail shown beside it)}."""
    d = Data([r for r in records if r["config"]["depth"] in DEPTHS])
    depths, deepest = d.depths, max(d.depths)
    every = [v for v in d.variants if all(_trains(d, v, L) for L in depths)]
    post_fail = next((L for L in depths if not _trains(d, "post", L)), None)
    best = {v: _best(d, v, deepest) for v in d.variants}
    ranked = sorted((v for v in best if not math.isnan(best[v][1])), key=lambda v: best[v][1])
    top = [v for v in ranked if best[v][1] <= best[ranked[0]][1] + MATCH]
    lns_verdict, _ = claim_lns(d)
    gains = {L: _best(d, "pre", L)[1] - _best(d, "pre-lns", L)[1] for L in depths}
    dyt_depths = [L for L in depths if _trains(d, "pre-dyt", L)]
    dyt_verdict, _ = claim_dyt(d)
    return {
        "trains at every depth": (", ".join(every) or "none", f"of {len(d.variants)}"),
        "post-LN's failure depth": (str(post_fail) if post_fail else "none",
                                    "trains at no LR from there" if post_fail else "trains at every depth"),
        "best at the deepest depth": (", ".join(top), f"{deepest} layers: " + ", ".join(
            f"{v} {best[v][1]:.3f}" for v in ranked)),
        "LayerNorm Scaling's gain with depth": (lns_verdict, "gain " + ", ".join(
            f"{L}: {g:+.3f}" for L, g in gains.items())),
        "DyT at depth": (f"trains to {max(dyt_depths)}" if dyt_depths else "trains at no depth",
                         f"DyT rule: {dyt_verdict}"),
    }


def table(results: dict[str, dict[str, tuple[str, str]]]) -> str:
    """The report's opening table: a row per verdict, a column per setting; a value that
    differs from the first setting's is marked **flips**."""
    labels = list(results)
    lines = ["| verdict | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for v in VERDICTS:
        base = results[labels[0]][v][0]
        cells = []
        for i, label in enumerate(labels):
            value, detail = results[label][v]
            flip = " **flips**" if i and value != base else ""
            cells.append(f"{value}{flip} ({detail})")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flips(results: dict[str, dict[str, tuple[str, str]]]) -> list[str]:
    """One sentence per verdict that differs from the first setting's."""
    labels = list(results)
    said = []
    for label in labels[1:]:
        for v in VERDICTS:
            a, b = results[labels[0]][v][0], results[label][v][0]
            if a != b:
                said.append(f"{label}: {v} is `{b}` where {labels[0]} has `{a}`.")
    return said


def _setting_line(label: str, folder: Path, out: Path) -> str:
    meta, records = load(folder)
    s, task = meta["sweep"], records[0]["task"]
    env = records[0]["environment"]
    return (f"- {label}: task `{s['task']}`, d_model {s['d_model']}, {s['num_heads']} heads, d_ff {s['d_ff']}; "
            f"H = {task['optimal_loss']:.3f}" + (" (the n-gram reference)" if s["task"] == "text" else "")
            + f", unigram {task['unigram_loss']:.3f}; {len(records)} runs on {env['device_count']} x "
            f"{env['device_kind']}, cell version {records[0]['config']['version']}; "
            f"[report]({os.path.relpath(folder / 'report.md', out)})")


def _has_cells(folder: Path) -> bool:
    """Whether a setting's sweep and its cells are on disk (a fresh clone has the committed
    sweep.json and reports but not the cells, which are not committed)."""
    return (folder / "sweep.json").exists() and any((folder / "cells").glob("*.json"))


def write_report(out: Path = OUT) -> Path:
    """out/report.md from the three settings' cells (in out/<setting's folder>); returns its path."""
    results = {}
    for label, _, name in SETTINGS:
        folder = out / name
        _, records = load(folder) if _has_cells(folder) else ({}, [])
        if not records:
            raise SystemExit(f"no cells for {label} in {folder}: run python -m experiments.stability.outward")
        results[label] = verdicts(records)
    said = flips(results)
    text = "\n".join([
        "# The lab's answer outside its toy: a wider model and real text", "",
        f"Generated by `python -m experiments.stability.outward --out {os.path.relpath(out, ROOT)}` from the cells "
        "of three settings of one grid (the depth study's six placements at 6, 12 and 24 layers, learning rates "
        "1e-3, 3e-3, 1e-2, 2 seeds; 200 steps on Markov, 800 on text, sized by a pilot of the pre-LN control "
        "alone before the sweep, since at 200 steps it trained at no learning rate there). "
        "Every verdict is computed by a rule written in `experiments/stability/outward.py` before the runs; a value "
        "that differs from the Markov d32 one (the depth study's) is marked **flips**.", "",
        table(results), "",
        ("Where the answer differs from the d32 Markov one: " + " ".join(said)) if said
        else "Every verdict is the same in the three settings.", "",
        "## Settings", "",
        *[_setting_line(label, out / name, out) for label, _, name in SETTINGS], "",
        "Each setting's report holds its loss curves, its rules' tables and the literature verdicts of the depth "
        "study in that setting. On text, H is not an optimum but a reference measured by the lab on the same "
        "held-out text: a Witten-Bell n-gram model of the training text (experiments/stability/text.py), and a run "
        "'trains' when it covers half of the way from the unigram loss to it.", "",
    ])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    path.write_text(text)
    (out / "verdicts.json").write_text(json.dumps(results, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.stability.outward", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--estimate", action="store_true", help="print each setting's size and time estimate")
    p.add_argument("--report", action="store_true", help="only write the reports from the cells on disk")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=OUT,
                   help="the study's folder, one folder a setting inside (default: experiments/stability/runs/"
                        "outward, untracked; the committed one: experiments/stability/results/outward)")
    args = p.parse_args(argv)
    from . import report as single
    from .sweep import compile_cache, cpu_devices, estimate, resolve_task, run_sweep

    cache_dir = None
    if not args.report and not args.estimate:
        cpu_devices()  # before JAX's first computation
        cache_dir = compile_cache()
    for label, preset, name in SETTINGS:
        folder = args.out / name
        sweep = replace(resolve_task(PRESETS[preset]), depths=DEPTHS)  # depth: its 48 layers left out
        if args.estimate:
            print(f"{label}: " + estimate(sweep))
            continue
        if not args.report:
            run_sweep(sweep, folder, progress=not args.no_progress, cache_dir=cache_dir,
                      command=f"python -m experiments.stability.outward ({label}: --preset {preset} "
                              f"--depths {','.join(map(str, DEPTHS))} --out "
                              f"{os.path.relpath(folder, ROOT)})")
        elif not _has_cells(folder):
            raise SystemExit(f"--report: no cells for {label} in {folder}; run python -m experiments.stability.outward")
        single.write_report(folder)
    if args.estimate:
        return 0
    print(write_report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
