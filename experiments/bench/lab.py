"""The lab against the loop it replaces: one group of the `cpu` preset through the lab, and the
torch twin trained run after run, side by side in one invocation.

    python -m experiments.bench.lab [--out experiments/bench/results/lab] [--rounds 2] [--no-make-run]

The group: pre-LN, 6 layers, the `cpu` preset's model (d_model 32, 2 heads, d_ff 128, context
16, batch 16, held-out batch 32) and its 5 learning rates x 2 warmups x 2 seeds = 20 runs, 100
steps each (a slice of the preset's 400).
  lab cold   `python -m experiments.stability --preset cpu --variants pre --depths 6 --steps 100`
             in a fresh process with an empty cache folder (JAX_COMPILATION_CACHE_DIR, the
             lab's program cache; tracing and compiling included), wall time of the process;
             the lab's default layout (the runs split over one CPU device per core);
  lab warm   the same command again, into a new folder, with the cache the cold run filled;
  torch      the torch twin (`torch_blocks.LanguageModel`, the lab's config and init
             distributions) trained run after run, as a researcher writes it: Adam (b1 0.9,
             b2 0.98, eps 1e-9, no decay), the linear warmup, a fresh batch of the same task
             pool each step and the same held-out forward pass after every step; no other
             metric; its training time alone (model building included; imports, jax's
             sampling of the task pool and Python start-up excluded: in the lab's favour
             nothing is excluded), the process's wall time recorded beside it.
Each contender runs in its own process, in an interleaved order each round (lab cold, torch,
lab warm), so slow drifts of the machine hit all three. The matmul-peak share of each is the
group's analytic FLOPs (`Sweep.layer_step_flops`) over its median time, over this machine's
float32 matmul peak measured in the same invocation. `make run`: the quick preset's wall time,
cold (empty cache) and warm.
Writes <out>/summary.md and <out>/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository's: the lab's commands run there
GROUP = ["--preset", "cpu", "--variants", "pre", "--depths", "6", "--steps", "100", "--no-report", "--no-progress"]
STEPS = 100


def group_sweep():
    """The benchmarked group as a Sweep (its runs, model and FLOPs)."""
    from experiments.stability.presets import PRESETS

    return replace(PRESETS["cpu"], variants=("pre",), depths=(6,), steps=STEPS)


def torch_loop(runs: list[tuple[float, int, int]] | None = None, steps: int = STEPS,
               threads: int | None = None) -> dict:
    """Train the group's runs (lr, warmup, seed) one after another with the torch twin;
    returns {"seconds": training time (model building included, imports excluded),
    "heldout": each run's last held-out loss}."""
    import numpy as np
    import torch

    import torch_blocks as tb
    from experiments.stability.model import ModelConfig
    from experiments.stability.tasks import make_task
    from experiments.stability.train import TrainConfig, sample_data

    if threads:
        torch.set_num_threads(threads)
    sw = group_sweep()
    runs = runs if runs is not None else [(lr, w, s) for _, _, lr, w, s in sw.runs()]
    task = make_task(sw.task, vocab=sw.vocab, seq_len=sw.seq_len, seed=sw.task_seed)
    cfg = ModelConfig("pre", 6, vocab=sw.vocab, seq_len=sw.seq_len, d_model=sw.d_model, num_heads=sw.num_heads,
                      d_ff=sw.d_ff)
    tc = TrainConfig(steps=steps, batch=sw.batch, chunk=steps, heldout=sw.heldout)
    rng = np.random.default_rng(0)  # batch indices into the task's pool (the lab draws them with JAX)
    pool, heldout = (torch.from_numpy(np.array(x)).long() for x in sample_data(task, tc))
    weights = torch.from_numpy(np.array(task.weights(), np.float32))
    start, last = time.perf_counter(), []
    for lr, warmup, seed in runs:
        torch.manual_seed(seed)
        model = tb.LanguageModel(cfg.block_config(), cfg.lm_config())
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(tc.b1, tc.b2), eps=tc.eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t, w=warmup: min(1.0, (t + 1) / w) if w else 1.0)
        for _ in range(steps):
            tokens = pool[torch.from_numpy(rng.integers(0, len(pool), tc.batch))]
            logits = model(tokens[:, :-1])
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
            loss = (ce * weights).sum() / (tc.batch * weights.sum())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():  # the held-out pass after every step, as the lab's
                hl = model(heldout[:, :-1])
                ce = torch.nn.functional.cross_entropy(hl.transpose(1, 2), heldout[:, 1:], reduction="none")
                heldout_loss = float((ce * weights).sum() / (len(heldout) * weights.sum()))
        last.append(heldout_loss)
    return {"seconds": time.perf_counter() - start, "heldout": last}


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - t, proc.stdout


def matmul_peak(n: int = 1024, reps: int = 5) -> float:
    """This machine's float32 matmul rate (FLOP/s), the best of `reps` (JAX, one process)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "lab")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-make-run", action="store_true", help="skip timing the quick preset (make run)")
    p.add_argument("--_torch", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._torch:  # the torch contender's process
        print(json.dumps({"train_seconds": torch_loop()["seconds"]}))
        return {}
    torch_train: list[float] = []
    torch_wall: list[float] = []
    py = [sys.executable]
    times: dict[str, list[float]] = {"lab cold": [], "lab warm": [], "torch loop": []}
    make: dict[str, list[float]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            cache = Path(tmp) / f"cache{r}"
            env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu")
            stab = [*py, "-m", "experiments.stability", *GROUP]
            times["lab cold"].append(_timed([*stab, "--out", f"{tmp}/cold{r}"], env)[0])
            wall, out = _timed([*py, "-m", "experiments.bench.lab", "--_torch"], env)
            torch_train.append(json.loads(out.strip().splitlines()[-1])["train_seconds"])
            times["torch loop"].append(torch_train[-1])
            torch_wall.append(wall)
            times["lab warm"].append(_timed([*stab, "--out", f"{tmp}/warm{r}"], env)[0])
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), file=sys.stderr)
        if not args.no_make_run:
            env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=f"{tmp}/make-cache", JAX_PLATFORMS="cpu")
            for kind in ("cold", "warm"):
                make[kind].append(_timed([*py, "-m", "experiments.stability", "--out", f"{tmp}/make-{kind}",
                                          "--no-progress"], env)[0])
                print(f"make run ({kind} cache): {make[kind][-1]:.1f} s", file=sys.stderr)
    sw = group_sweep()
    flops = sw.work()["flops"]
    peak = matmul_peak()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"group": {"runs": sw.work()["runs"], "depth": 6, "steps": STEPS, "flops": flops},
              "seconds": times, "median": med, "matmul_peak_flops": peak,
              "peak_share": {k: flops / v / peak for k, v in med.items()},
              "speedup_over_torch": {k: med["torch loop"] / med[k] for k in ("lab cold", "lab warm")},
              "torch_process_seconds": torch_wall, "make_run_seconds": make, "cpu_count": os.cpu_count()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    (args.out / "summary.md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    g = r["group"]
    lines = ["# The lab against the torch loop it replaces", "",
             f"One `cpu`-preset group: pre-LN, {g['depth']} layers, {g['runs']} runs x {g['steps']} steps "
             f"({g['flops'] / 1e9:.1f} GFLOP of matmuls, analytic), each contender a fresh process, "
             f"interleaved over {len(r['seconds']['lab cold'])} rounds on {r['cpu_count']} CPUs. "
             f"Matmul peak of this machine (float32, JAX, measured in the same run): "
             f"{r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s. The lab's seconds are its whole process "
             "(imports, tracing, compiling, training, writing cells); the torch loop's are its training "
             "alone (its process took " + " / ".join(f"{x:.1f}" for x in r["torch_process_seconds"]) + " s).", "",
             "| contender | seconds (each round) | median | share of matmul peak | torch loop / it |",
             "|---|---|---|---|---|"]
    for k, v in r["seconds"].items():
        ratio = r["median"]["torch loop"] / r["median"][k]
        lines.append(f"| {k} | {' / '.join(f'{x:.1f}' for x in v)} | {r['median'][k]:.1f} | "
                     f"{100 * r['peak_share'][k]:.1f}% | {ratio:.2f}x |")
    m = r["make_run_seconds"]
    if m["cold"]:
        lines += ["", f"`make run` (the quick preset, 27 runs, report and plots): {m['cold'][0]:.1f} s with an "
                      f"empty compilation cache, {m['warm'][0]:.1f} s with the cache it filled."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
