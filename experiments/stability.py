"""Depth-stability sweep: which residual placements train as the stack gets deeper.

    python -m experiments.stability                      # quick preset -> experiments/results/
    python -m experiments.stability --preset cpu           # ~15 min -> experiments/results/cpu/
    python -m experiments.stability --preset full          # accelerator -> experiments/runs/full/
    python -m experiments.stability --preset full --estimate   # its size and time estimates
    python -m experiments.stability --depths 6,24 --variants post,pre --lrs 1e-3,1e-2 \\
        --warmups 0,100 --seeds 3 --out /tmp/sweep

The grid is task x variant x depth x learning rate x warmup x seed; the task is a random
Markov chain (markov, the default), a copy task, or real text (--task text: characters of
CPython's documentation, experiments/text.py). Runs that share a
(variant, depth) are compiled together (three programs: the fresh models, the held-out
probe, a chunk of steps), vmapped over their (lr, warmup, seed) and
sharded over the devices (see experiments/train.py). Every finished run ("cell") is written
at once to OUT/cells/<name>-<hash>.json with its config, metrics and environment; a rerun
skips cells already on disk, so an interrupted sweep resumes where it stopped and gives the
same numbers. Diverged runs are results (status "diverged"), not errors. At the end: a
summary table on stdout, and OUT/report.md with PNG plots (experiments/report.py).

On CPU, each group's runs are split over one simulated CPU device per core (at most 8;
--cpu-devices N): XLA:CPU keeps about one core busy per device on these small programs, so
two devices on two cores train a 20-run group ~1.9x faster than one. By default a group is
split only as far as each device keeps MIN_RUNS_PER_DEVICE of its runs, and narrower groups
train side by side on their own devices (place_groups). A run's numbers depend in their last
bits on how many runs share its device; the cells record the device count.
On CPU, programs are compiled at XLA/LLVM optimisation level 1 (--xla-opt-level): ~3x
faster to compile than the default and as fast to run for these small models. Programs are
traced and compiled on two worker threads, in order, while earlier groups train (the task's
pools are sampled beside them), and kept in the lab's program cache (JAX_COMPILATION_CACHE_DIR,
else ~/.cache/twin_blocks/jax; --no-compile-cache turns it off; experiments/program_cache.py):
a second run loads its programs and pools from there without tracing anything.
Several processes or hosts: start the same command in each with --coordinator HOST:PORT
--num-processes N --process-id I (or --distributed where jax detects the cluster); each
group's runs are sharded over every process's devices, and process 0 writes the cells.
"""

from __future__ import annotations

import time

_START = time.time()  # before JAX is imported, for the total wall time

import argparse
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .analysis import failure
from .model import VARIANTS
from .presets import PRESETS, Sweep
from .tasks import TASKS

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------
# Cells on disk
# ------------------------------------------------------------------------------------


CELL_VERSION = 4  # bump when a code change alters results, so old cells are not reused
# (4: each group's runs split over one CPU device per core by default, see cpu_devices)


def cell_config(sweep: Sweep, variant: str, depth: int, lr: float, warmup: int, seed: int) -> dict:
    """Everything that determines one run's result (and nothing else); the text task's
    corpus by its hash (another Python's documentation is another cell)."""
    cfg = {
        "version": CELL_VERSION, "task": sweep.task, "vocab": sweep.vocab, "seq_len": sweep.seq_len,
        "task_seed": sweep.task_seed, "variant": variant, "depth": depth, "d_model": sweep.d_model,
        "num_heads": sweep.num_heads, "d_ff": sweep.d_ff, "lr": float(lr), "warmup": int(warmup),
        "seed": int(seed), "steps": sweep.steps, "batch": sweep.batch, "chunk": sweep.chunk,
        "heldout": sweep.heldout,
    }
    if sweep.task == "text":
        from .text import load_corpus

        cfg["corpus"] = load_corpus().sha256
    return cfg


def resolve_task(sweep: Sweep) -> Sweep:
    """The sweep with its task's own vocabulary: the text task's is its corpus's alphabet
    (a preset says 0); another number is refused. Synthetic tasks: unchanged."""
    if sweep.task != "text":
        return sweep
    from .text import CorpusError, load_corpus

    try:
        vocab = load_corpus().vocab
    except CorpusError as err:  # one line, not a traceback: the message says what to install
        raise SystemExit(f"--task text: {err}") from None
    if sweep.vocab not in (0, vocab):
        raise SystemExit(f"--task text: the vocabulary is the corpus's alphabet ({vocab} symbols); "
                         f"got --vocab {sweep.vocab} (leave it out)")
    return replace(sweep, vocab=vocab)


def cell_name(cfg: dict) -> str:
    """Readable name plus a hash of the whole config: markov_post_L6_lr1e-03_w0_s0-1a2b3c4d5e."""
    digest = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
    return (f"{cfg['task']}_{cfg['variant']}_L{cfg['depth']}_lr{cfg['lr']:.0e}_w{cfg['warmup']}"
            f"_s{cfg['seed']}-{digest}")


def _jsonable(x: Any) -> Any:
    """numpy -> lists of Python floats (6 significant digits); non-finite floats -> None."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return float(f"{x:.6g}") if math.isfinite(x) else None
    return x


def write_cell(path: Path, record: dict) -> None:
    """Write atomically: a killed process leaves either no file or a complete one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(record), separators=(",", ":")))
    os.replace(tmp, path)


def read_cell(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _load() -> list[float] | None:
    """1, 5 and 15 minute load averages (other processes competing for the CPUs), if known."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment() -> dict:
    """Where the numbers came from."""
    import jax

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    devices = jax.devices()
    return {
        "jax": jax.__version__, "jaxlib": version("jaxlib"), "flax": version("flax"),
        "optax": version("optax"), "numpy": np.__version__, "python": platform.python_version(),
        "platform": jax.default_backend(), "device_kind": devices[0].device_kind,
        "device_count": len(devices), "process_count": jax.process_count(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


# ------------------------------------------------------------------------------------
# Progress
# ------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: float, enabled: bool = True):
        self.total, self.done, self.enabled = max(total, 1e-9), 0.0, enabled
        self.start = time.time()
        self.tty = sys.stderr.isatty()
        self._last_line = 0.0

    def update(self, done: float, text: str, force: bool = False) -> None:
        self.done = done
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        frac = min(self.done / self.total, 1.0)
        eta = elapsed / frac - elapsed if frac > 0.02 else float("nan")
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        eta_s = "?" if math.isnan(eta) else f"{eta:4.0f}s"
        line = f"[{bar}] {100 * frac:5.1f}% {elapsed:5.0f}s elapsed, ~{eta_s} left | {text}"
        if self.tty:  # one line, no wider than the terminal (a wrapped line would not be overwritten)
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stderr.write("\r" + line[:width].ljust(width))
            sys.stderr.flush()
        elif force or time.time() - self._last_line > 10:
            print(line, file=sys.stderr, flush=True)
            self._last_line = time.time()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


# ------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------


@dataclass
class Group:
    variant: str
    depth: int
    todo: list[dict] = field(default_factory=list)  # cell configs still to run
    names: list[str] = field(default_factory=list)


def plan(sweep: Sweep, cells_dir: Path) -> tuple[list[Group], list[str]]:
    """Groups with the cells still missing on disk, and the names of every cell of the sweep.

    Multi-process: process 0's disk decides (it alone writes cells), and every process gets
    its answer, so all of them compile and run the same groups."""
    configs = [(variant, depth, cell_config(sweep, variant, depth, lr, warmup, seed))
               for variant, depth, lr, warmup, seed in sweep.runs()]
    all_names = [cell_name(c) for _, _, c in configs]
    done = np.array([read_cell(cells_dir / f"{name}.json") is not None for name in all_names])
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        done = np.asarray(multihost_utils.broadcast_one_to_all(done))
    groups: dict[tuple[str, int], Group] = {}
    for (variant, depth, cfg), name, skip in zip(configs, all_names, done, strict=True):
        g = groups.setdefault((variant, depth), Group(variant, depth))
        if not skip:
            g.todo.append(cfg)
            g.names.append(name)
    return [g for g in groups.values() if g.todo], all_names


MAX_CPU_DEVICES = 8


MIN_RUNS_PER_DEVICE = 3  # a group is split only as far as every device gets this many runs


def place_groups(sweep: Sweep, groups: list[Group], devices: list,
                 min_runs: int | None = MIN_RUNS_PER_DEVICE) -> list[list]:
    """The devices each group's runs are split over. On CPU (one process), with min_runs: a
    group of R runs (R of the whole sweep's group, so a resumed sweep keeps its layout) gets
    min(len(devices), R // min_runs) devices, at least one (measured, the quick preset's 3-run
    groups on two devices carried a padding run and cross-device work, and took more time
    and a quarter more CPU than on one). Groups narrower than the devices take disjoint slices
    in turn, so they train side by side. Elsewhere, with several processes or min_runs None
    (a device count the user chose): every group over every device."""
    size = dict(zip(sweep.pairs(), sweep.group_sizes(), strict=True))
    placed, turn = [], 0
    for g in groups:
        width = len(devices)
        if min_runs and devices[0].platform == "cpu" and len({d.process_index for d in devices}) == 1:
            width = max(1, min(len(devices), size[(g.variant, g.depth)] // min_runs))
        slices = len(devices) // width
        placed.append(devices[(turn % slices) * width:(turn % slices + 1) * width])
        turn += width < len(devices)
    return placed


def forced_device_count() -> bool:
    """True if XLA_FLAGS forces a simulated CPU device count (it wins over --cpu-devices)."""
    return "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")


def cpu_devices(requested: int | None = None) -> int | None:
    """Split each group's runs over several CPU devices; call before JAX's first computation.

    XLA:CPU runs one device's program on one stream of small kernels, which keeps about one
    core busy on these models (measured: one group, 2 cores, 2.7 ms per run-layer-step on one
    device, 1.4 ms on two); with one device per core the runs' shards run side by side.
    requested: the count (0: leave JAX's default); None: one per usable core, at most
    MAX_CPU_DEVICES. A group smaller than MIN_RUNS_PER_DEVICE runs a device is split over
    fewer (`place_groups`). XLA_FLAGS=--xla_force_host_platform_device_count=N, when set, wins.
    Returns the count set, or None. A group's numbers depend in their last bits on how many
    runs share a device (XLA sums in another order), so cells record the device count."""
    import jax

    if forced_device_count() or requested == 0:
        return None
    if requested is None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        requested = min(usable, MAX_CPU_DEVICES)
    jax.config.update("jax_num_cpu_devices", int(requested))
    return int(requested)


def compile_cache(enabled: bool = True, jax_cache: bool = False) -> str | None:
    """The folder of the lab's persistent caches; returns it (None when `enabled` is False,
    --no-compile-cache).

    JAX_COMPILATION_CACHE_DIR wins when set; else the user's cache folder ($XDG_CACHE_HOME or
    ~/.cache, then twin_blocks/jax), shared by every checkout, so a second `make run` (or a
    fresh clone on the same machine) loads its programs instead of compiling them. One process
    keeps its programs and task pools in the lab's program cache, <folder>/programs
    (experiments/program_cache.py), which loads them without tracing. With `jax_cache` (several
    processes, which trace in lockstep for their collectives) JAX's own persistent cache is
    turned on in the folder instead, keeping every program however quickly it compiled (JAX
    keeps only those over 1 s by default). The two are not mixed: an executable JAX loaded
    from its cache cannot be serialized again (XLA:CPU writes it without its compiled
    functions; measured, the next process fails with "Function ... not found")."""
    import jax

    if not enabled:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "twin_blocks" / "jax")
    # JAX_COMPILATION_CACHE_DIR alone would turn JAX's on: one process has the program cache instead
    jax.config.update("jax_enable_compilation_cache", jax_cache)
    jax.config.update("jax_compilation_cache_dir", folder if jax_cache else None)
    if jax_cache:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


class CacheCount:
    """How many compiled programs asked the persistent cache, and how many it held (JAX's
    monitoring events), from its creation on."""

    def __init__(self) -> None:
        from jax import monitoring

        self.requests = self.hits = 0
        monitoring.register_event_listener(self._event)

    def _event(self, event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            self.requests += 1
        elif event == "/jax/compilation_cache/cache_hits":
            self.hits += 1


def run_sweep(sweep: Sweep, out: Path, *, progress: bool = True, max_groups: int | None = None,
              opt_level: int | None = 1, xla_options: dict[str, Any] | None = None,
              command: str | None = None, min_runs_per_device: int | None = MIN_RUNS_PER_DEVICE,
              cache_dir: str | Path | None = None) -> list[str]:
    """Run every missing cell of `sweep`, writing each to out/cells as its group finishes.

    max_groups: stop after that many groups. opt_level, xla_options: how XLA compiles
    (train.compiler_options). min_runs_per_device: see `place_groups`. cache_dir: the folder
    of `compile_cache`; one process keeps its programs and pools in the program cache there.
    Returns the names of all the sweep's cells.
    """
    import jax
    from jax.sharding import Mesh

    from .model import ModelConfig
    from .program_cache import ProgramCache
    from .tasks import Task, make_task
    from .train import PROGRAMS, RunSpec, TrainConfig, Trainer, compiler_options, sample_data, sample_pool

    sweep = resolve_task(sweep)
    start, cpu_start, load_before = time.time(), time.process_time(), _load()
    cache = CacheCount()
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    groups, names = plan(sweep, cells_dir)
    meta = {"sweep": asdict(sweep), "command": command, "cells": names}
    if jax.process_index() == 0:
        (out / "sweep.json").write_text(json.dumps(meta, indent=1))
    skipped = len(names) - sum(len(g.todo) for g in groups)
    if max_groups is not None:
        groups = groups[:max_groups]
    if not groups:
        print(f"all {len(names)} cells already in {cells_dir}", file=sys.stderr)
        return names

    task = make_task(sweep.task, vocab=sweep.vocab, seq_len=sweep.seq_len, seed=sweep.task_seed)
    train_cfg = TrainConfig(steps=sweep.steps, batch=sweep.batch, chunk=sweep.chunk, heldout=sweep.heldout)
    options = compiler_options(opt_level, xla_options)
    env = {**environment(), "xla_compile_options": options}
    # The program cache (one process): a warm run loads every program and the task's pools
    # from it without tracing anything.
    programs = ProgramCache(Path(cache_dir) / "programs") if cache_dir and jax.process_count() == 1 else None

    def cached_sample(task: Task, n: int, seed: int, options: dict[str, Any], split: str = "train") -> np.ndarray:
        what = {"task": task.identity(), "n": n, "seed": seed, "split": split, "options": options}
        return programs.array(what, lambda: sample_pool(task, n, seed, options, split=split))

    # The pools are sampled on their own thread while the programs are traced and compiled.
    data_ex = ThreadPoolExecutor(max_workers=1)
    data = data_ex.submit(sample_data, task, train_cfg, options, cached_sample if programs else sample_pool)
    print(f"{len(names)} cells ({skipped} already done) in {len(groups)} compiled groups on "
          f"{env['device_count']} x {env['device_kind']} ({env['platform']}); task {sweep.task}: "
          f"H = {task.optimal_loss:.3f}, unigram = {task.unigram_loss:.3f} nats", file=sys.stderr)

    # Trace and compile every group's three programs (train.PROGRAMS) on two worker threads,
    # in order (XLA compiles without the GIL), while earlier groups train: the first group
    # starts as soon as its own programs are ready, not after every program is traced.
    # Several processes trace here, in one order, so that their collectives meet.
    cost = [g.depth * len(g.todo) for g in groups]  # work ~ layers x runs
    bar = Progress(sum(cost) * sweep.steps, enabled=progress)
    pool_ex = ThreadPoolExecutor(max_workers=2)
    trainers: list[Trainer] = []
    specs: list[list[RunSpec]] = []
    compiled: list[list[Future]] = []  # each group's programs
    placed = place_groups(sweep, groups, jax.devices(), min_runs_per_device)
    for g, devices in zip(groups, placed, strict=True):
        mcfg = ModelConfig(g.variant, g.depth, vocab=sweep.vocab, seq_len=sweep.seq_len,
                           d_model=sweep.d_model, num_heads=sweep.num_heads, d_ff=sweep.d_ff)
        tr = Trainer(mcfg, task, train_cfg, options=options, mesh=Mesh(np.array(devices), ("runs",)),
                     program_cache=programs)
        sp = [RunSpec(c["lr"], c["warmup"], c["seed"]) for c in g.todo]
        compiled.append([])
        for program in PROGRAMS:  # the largest first: the two threads compile a group's programs at once
            if jax.process_count() > 1:  # every process traces in the same order (collectives in lockstep)
                lowered = tr.trace(sp, program).lower()
                compiled[-1].append(pool_ex.submit(tr.keep, program, lowered))
            else:  # traced there too
                compiled[-1].append(pool_ex.submit(tr.compile, sp, program))
        trainers.append(tr)
        specs.append(sp)
    try:
        pool, heldout = data.result()
    except BaseException:  # a failed sampling stops the compiles it was beside
        pool_ex.shutdown(cancel_futures=True)
        raise
    finally:
        data_ex.shutdown()
    task_info = {"optimal_loss": task.optimal_loss, "unigram_loss": task.unigram_loss,
                 "heldout_optimal_loss": task.nll(heldout)}  # the same for every cell
    if task.name == "text":
        from .text import REFERENCE_ORDER

        c = task.corpus
        task_info.update(reference=f"Witten-Bell {REFERENCE_ORDER}-gram", corpus_sha256=c.sha256,
                         python=c.python, train_chars=len(c.train), heldout_chars=len(c.heldout),
                         heldout_topics=list(c.heldout_topics))
    for tr in trainers:
        tr.use_data(pool, heldout)

    # Train: a group waits for the groups before it on any of its devices, so groups on
    # disjoint devices (small groups, one device each) train side by side; each group's cells
    # are written as soon as it ends. An error or an interrupt stops the others at their next
    # chunk; the cells already written stay.
    steps_of = [0] * len(groups)
    lock, stop = threading.Lock(), threading.Event()

    def progress_to(text: str, force: bool = False) -> None:
        with lock:
            bar.update(sum(c * s for c, s in zip(cost, steps_of, strict=True)), text, force=force)

    def train(i: int, after: list[Future]) -> None:
        for f in after:
            f.result()
        g = groups[i]
        label = f"{g.variant} L{g.depth} x{len(specs[i])} runs"
        progress_to(f"{label}: compiling", force=True)
        for f in compiled[i]:
            f.result()
        t0 = time.time()
        for steps_done, results in trainers[i].run(specs[i]):  # noqa: B007 (the last yield carries the results)
            if stop.is_set():
                raise RuntimeError(f"{label}: stopped (another group failed or the sweep was interrupted)")
            steps_of[i] = steps_done
            progress_to(f"{label}: step {steps_done}/{sweep.steps}")
        seconds = time.time() - t0
        for cfg, name, metrics in zip(g.todo, g.names, results, strict=True):
            summary = failure(metrics["heldout_loss"], metrics["loss"], float(metrics["heldout_loss0"]),
                              task.optimal_loss, start=task.unigram_loss if task.name == "text" else None)
            record = {
                "name": name, "config": cfg, "summary": summary,
                "task": task_info,
                "metrics": metrics,
                "environment": {**env, "group_seconds": round(seconds, 2), "group_runs": len(specs[i]),
                                "group_devices": len(placed[i])},
            }
            if jax.process_index() == 0:  # multi-host: every process holds the results; one writes
                write_cell(cells_dir / f"{name}.json", record)
        progress_to(f"{label}: written", force=True)

    train_ex = ThreadPoolExecutor(max_workers=len(jax.devices()))  # FIFO: a group starts after every earlier one
    last: dict[Any, Future] = {}
    running: list[Future] = []
    try:
        for i, devices in enumerate(placed):
            running.append(train_ex.submit(train, i, [last[d] for d in devices if d in last]))
            last.update({d: running[i] for d in devices})
        for f in running:
            f.result()
    finally:
        stop.set()
        train_ex.shutdown(cancel_futures=True)
        pool_ex.shutdown(cancel_futures=True)
    bar.close()
    if jax.process_index() == 0:
        meta["last_run"] = {"cells_computed": sum(len(g.todo) for g in groups),
                            "wall_seconds": round(time.time() - start, 1),
                            "cpu_seconds": round(time.process_time() - cpu_start, 1),
                            "load_average_before": load_before, "load_average_after": _load(),
                            "compile_cache": {"dir": str(cache_dir) if cache_dir else None,
                                              "requests": cache.requests, "hits": cache.hits,  # JAX's cache
                                              "programs": programs and {"loaded": programs.loaded["program"],
                                                                         "compiled": programs.made["program"]},
                                              "pools_loaded": programs.loaded["array"] if programs else 0},
                            "environment": env}
        (out / "sweep.json").write_text(json.dumps(meta, indent=1))
    return names


# ------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _xla_option(s: str) -> tuple[str, Any]:
    name, eq, value = s.partition("=")
    if not eq or not name.strip():
        raise argparse.ArgumentTypeError(f"NAME=VALUE, e.g. xla_cpu_parallel_codegen_split_count=1; got {s!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value)
    except ValueError:
        return name, value


def _pairs(s: str) -> tuple[tuple[str, int], ...]:
    out = []
    for item in filter(None, s.split(",")):
        v, _, d = item.partition(":")
        out.append((v, int(d)))
    return tuple(out)


def _describe(sweep: Sweep) -> str:
    extra = f" + {','.join(f'{v}:{d}' for v, d in sweep.extra)}" if sweep.extra else ""
    return (f"{','.join(sweep.variants)} at depths {','.join(map(str, sweep.depths))}{extra}, "
            f"lrs {','.join(f'{x:g}' for x in sweep.lrs)}, warmups {','.join(map(str, sweep.warmups))}, "
            f"{sweep.seeds} seeds, {sweep.steps} steps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.stability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="the grid to start from; the options below change it (default: quick). "
                        + "; ".join(f"{k}: {_describe(v)}" for k, v in PRESETS.items()))
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: experiments/results for the unmodified quick preset, "
                        "experiments/results/cpu for the unmodified cpu preset, "
                        "else experiments/runs/<preset>[-custom])")
    p.add_argument("--task", choices=TASKS,
                   help="training task (default: the preset's, markov); text: characters of CPython's "
                        "documentation (pydoc_data), its vocabulary the corpus's alphabet")
    p.add_argument("--variants", type=lambda s: tuple(s.split(",")), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--depths", type=_ints, help="comma list of layer counts, e.g. 6,12")
    p.add_argument("--extra", type=_pairs,
                   help="extra variant:depth groups outside variants x depths, e.g. noskip:6 ('' for none). "
                        "Default: the preset's (quick: noskip:6), dropped when --variants or --depths is given")
    p.add_argument("--lrs", type=_floats, help="comma list of peak learning rates, e.g. 1e-3,1e-2")
    p.add_argument("--warmups", type=_ints, help="warmup steps, 0 = none, e.g. 0,100")
    p.add_argument("--warmup-variants", metavar="LIST",
                   help="variants that also run the nonzero warmups (default: the preset's; '' = every variant)")
    p.add_argument("--seeds", type=int, help="seeds per (variant, depth, lr, warmup)")
    sizes = {"steps": "training steps per run", "batch": "sequences per batch",
             "chunk": "steps per compiled chunk (one lax.scan; per-layer metrics are taken at each chunk's "
                      "first step and averaged over it; --steps must be a multiple)",
             "heldout": "held-out sequences for the evaluation loss", "d_model": "model width",
             "num_heads": "attention heads", "d_ff": "feed-forward width", "seq_len": "tokens per sequence",
             "vocab": "vocabulary size of the task"}
    for name, text in sizes.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name, help=f"{text} (default: the preset's)")
    p.add_argument("--no-report", action="store_true", help="skip report.md and the plots")
    p.add_argument("--estimate", action="store_true",
                   help="print the sweep's size (runs, run-layer-steps, FLOPs) and time estimates, run nothing")
    p.add_argument("--no-progress", action="store_true", help="no per-group progress lines")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="no persistent compilation cache (default: JAX_COMPILATION_CACHE_DIR, else "
                        "~/.cache/twin_blocks/jax, shared by every checkout)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="on CPU, split each group's runs over N devices (default: one per core, at most "
                        f"{MAX_CPU_DEVICES}, at most one per {MIN_RUNS_PER_DEVICE} runs of the smallest group; "
                        "0: JAX's default of one; XLA_FLAGS' forced device count wins)")
    p.add_argument("--xla-opt-level", type=int, default=1,
                   help="XLA CPU (LLVM) optimisation level; 1 compiles ~3x faster than XLA's default "
                        "3 at equal speed for these models; -1 = XLA's default. Ignored off CPU.")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE", type=_xla_option,
                   help="extra XLA compile option, e.g. xla_cpu_parallel_codegen_split_count=1 (repeatable; "
                        "a name this XLA build does not know is an error)")
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (auto-detected cluster, or the three flags below)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-process: address of process 0's coordinator service (implies --distributed)")
    p.add_argument("--num-processes", type=int, help="multi-process: number of processes (implies --distributed)")
    p.add_argument("--process-id", type=int, help="multi-process: this process's index, 0..N-1 (implies --distributed)")
    p.add_argument("--max-groups", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_devices is not None and args.cpu_devices < 0:
        p.error(f"--cpu-devices: a count of CPU devices, or 0 for JAX's default of one; got {args.cpu_devices}")
    return args


def sweep_from_args(args: argparse.Namespace) -> Sweep:
    sweep = PRESETS[args.preset]
    changes = {k: getattr(args, k) for k in (
        "task", "variants", "depths", "extra", "lrs", "warmups", "seeds", "steps", "batch", "chunk",
        "heldout", "d_model", "num_heads", "d_ff", "seq_len", "vocab") if getattr(args, k) is not None}
    if args.warmup_variants is not None:  # '' -> None: every variant runs every warmup
        changes["warmup_variants"] = tuple(filter(None, args.warmup_variants.split(","))) or None
    if args.extra is None and (args.variants is not None or args.depths is not None):
        changes["extra"] = ()  # the preset's extra groups belong to its own grid, not to one you chose
    if args.task == "copy" and args.seq_len is None:
        changes["seq_len"] = sweep.seq_len - 1  # copy: seq_len + 1 tokens split into two halves
    sweep = replace(sweep, **changes)
    if sweep.task == "text" and "vocab" not in changes:
        sweep = replace(sweep, vocab=0)  # the corpus's alphabet (resolve_task)
    sweep = resolve_task(sweep)
    bad = [v for v in sweep.variants + tuple(v for v, _ in sweep.extra) + (sweep.warmup_variants or ())
           if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    if sweep.steps % sweep.chunk:
        raise SystemExit(f"--steps ({sweep.steps}) must be a multiple of --chunk ({sweep.chunk})")
    return sweep


def summary_table(names: list[str], cells_dir: Path) -> str:
    """One row per (variant, depth, lr, warmup): seeds, failures, final held-out loss."""
    rows: dict[tuple, list[dict]] = {}
    for name in names:
        rec = read_cell(cells_dir / f"{name}.json")
        if rec is None:
            continue
        c = rec["config"]
        rows.setdefault((c["variant"], c["depth"], c["lr"], c["warmup"]), []).append(rec)
    order = {v: i for i, v in enumerate(VARIANTS)}
    lines = [f"{'variant':<11}{'depth':>6}{'lr':>9}{'warmup':>8}{'seeds':>7}{'failed':>8}"
             f"{'final loss':>12}{'excess':>9}  statuses"]
    for key in sorted(rows, key=lambda k: (order[k[0]], k[1], k[2], k[3])):
        recs = rows[key]
        finals = [r["summary"]["final_loss"] for r in recs if r["summary"]["final_loss"] is not None]
        fails = sum(r["summary"]["status"] != "trained" for r in recs)
        h = recs[0]["task"]["optimal_loss"]
        mean = float(np.mean(finals)) if finals else float("nan")
        statuses = ",".join(sorted({r["summary"]["status"] for r in recs}))
        lines.append(f"{key[0]:<11}{key[1]:>6}{key[2]:>9.0e}{key[3]:>8}{len(recs):>7}{fails:>8}"
                     f"{mean:>12.3f}{mean - h:>9.3f}  {statuses}")
    return "\n".join(lines)


# Throughputs behind `--estimate` (see the comments above PRESETS). CPU: measured here.
# GPU: assumed (small batched matmuls reach a small fraction of a GPU's peak), not measured.
CPU_MS_PER_LAYER_STEP_D32 = (0.9, 1.6)  # ms per run-layer-step at d_model 32, T 16, batch 16, held-out 16:
# 1.6 measured at load 3; 0.9 = 2.0 ms of CPU time at held-out 32 (scaled to 16) on two busy cores
CPU_GFLOPS = 20.0  # achieved on this 2-core CPU by these overhead-bound programs
GPU_TFLOPS = (5.0, 20.0)  # assumed achieved range on one recent GPU
GPU_LAUNCH_MS_PER_LAYER_STEP = 0.2  # assumed floor: ~40 kernels of ~5 us per layer per step, whatever the runs


def estimate(sweep: Sweep) -> str:
    """Size of a sweep and time estimates on this CPU and on one GPU (estimates, see above)."""
    w = sweep.work()
    # A group's layer-steps run one after another however many runs it vmaps: the GPU floor.
    serial = sum(L for _, L in sweep.pairs()) * sweep.steps
    gpu = [w["flops"] / (t * 1e12) + serial * GPU_LAUNCH_MS_PER_LAYER_STEP / 1e3 for t in reversed(GPU_TFLOPS)]
    ref = replace(sweep, d_model=32, d_ff=128, seq_len=16, batch=16, heldout=16).layer_step_flops()
    cpu_ms = [ms * sweep.layer_step_flops() / ref for ms in CPU_MS_PER_LAYER_STEP_D32]
    cpu = [w["run_layer_steps"] * ms / 1e3 for ms in cpu_ms]
    def span(a: float, b: float) -> str:  # seconds -> "a-b min" or "a-b h"
        return f"{a / 60:.1f}-{b / 60:.1f} min" if b < 7200 else f"{a / 3600:.0f}-{b / 3600:.0f} h"

    return (f"sweep '{sweep.name}': {w['runs']} runs in {w['groups']} compiled groups, "
            f"{w['run_layer_steps'] / 1e6:.3g} M run-layer-steps, {w['flops'] / 1e15:.3g} PFLOP "
            f"({sweep.layer_step_flops() / 1e6:.3g} MFLOP per run-layer-step)\n"
            f"estimate on this 2-core CPU: {span(*cpu)} of training "
            f"(at {cpu_ms[0]:.2f}-{cpu_ms[1]:.2f} ms per run-layer-step, scaled by FLOPs from the measured "
            f"d_model-32 cost; larger models run closer to {CPU_GFLOPS:.0f} GFLOP/s: "
            f"{w['flops'] / CPU_GFLOPS / 1e9 / 3600:.2g} h), plus ~5-9 s per group to compile\n"
            f"estimate on one GPU (not measured): {span(*gpu)} "
            f"({GPU_TFLOPS[0]:g}-{GPU_TFLOPS[1]:g} TFLOP/s achieved, plus {GPU_LAUNCH_MS_PER_LAYER_STEP} ms of "
            f"kernel launches per layer-step of each group: {serial * GPU_LAUNCH_MS_PER_LAYER_STEP / 60e3:.1f} min)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    distributed = args.distributed or args.coordinator or args.num_processes or args.process_id is not None
    cache_dir = compile_cache(not args.no_compile_cache, jax_cache=bool(distributed))
    sweep = sweep_from_args(args)
    if args.cpu_devices is not None or not distributed:  # several processes: their own XLA_FLAGS
        cpu_devices(args.cpu_devices)
    chosen = args.cpu_devices is not None or forced_device_count()

    if distributed:
        # On CPU the processes exchange data with gloo collectives over TCP (jax's default
        # CPU collectives, set here explicitly); each process brings its own local devices
        # (XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N CPU devices).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    if args.estimate:
        print(estimate(sweep))
        return 0
    if args.out is not None:
        out = args.out
    elif sweep == resolve_task(PRESETS[args.preset]) and args.preset in ("quick", "cpu"):
        # the committed results are exactly these presets' (quick's at the top, cpu's beside it)
        out = DEFAULT_OUT if args.preset == "quick" else DEFAULT_OUT / args.preset
    else:
        custom = "" if sweep == resolve_task(PRESETS[args.preset]) else "-custom"
        out = DEFAULT_OUT.parent / "runs" / f"{args.preset}{custom}"
    from .train import UnknownCompileOption

    try:
        names = run_sweep(sweep, out, progress=not args.no_progress, max_groups=args.max_groups,
                          opt_level=None if args.xla_opt_level < 0 else args.xla_opt_level,
                          min_runs_per_device=None if chosen else MIN_RUNS_PER_DEVICE,
                          xla_options=dict(args.xla_option), cache_dir=cache_dir,
                          command=" ".join(["python -m experiments.stability",
                                            *map(shlex.quote, argv or sys.argv[1:])]))
    except UnknownCompileOption as err:
        raise SystemExit(f"--xla-option: {err}") from None
    if jax.process_index() != 0:
        return 0
    print(f"\nsweep '{sweep.name}': cells in {out / 'cells'}\n")
    print(summary_table(names, out / "cells"))
    if not args.no_report:
        from .report import write_report

        print(f"\nreport: {write_report(out)}")
    print(f"total wall time {time.time() - _START:.0f}s (from import, Python start-up excluded)")
    return 0


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the interpreter's last collection would walk JAX's whole object graph: 0.3 s of every exit
    sys.exit(status)
