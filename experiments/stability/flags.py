"""The lab's command line refuses what cannot run, before anything runs (`--estimate` too).

An impossible setting (`--lrs=-1e-3`, `--lrs abc`, `--depths 0`, `--d-model 30 --num-heads 4`,
...) ends the command with exit status 2 and one line on stderr naming the flag, the value
and what is allowed:

    python -m experiments.stability: --lrs -0.001: each learning rate must be a finite number > 0

`LabParser` is an argparse parser whose errors are that one line (no usage block); the list
types (`floats`, `ints`, `pairs`) say what they expected; `check_sweep` checks the grid a
preset and the flags make together (a width the heads do not divide, steps that are not a
multiple of the chunk, a vocabulary too small for the task)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, NoReturn

from .model import MOE_TOP_K, MOE_VARIANTS, VARIANTS, ModelConfig
from .presets import Sweep

PROG = "python -m experiments.stability"
MARKOV_BRANCHING = 8  # tasks.markov_task's successors per symbol: the markov task needs vocab >= this


class LabParser(argparse.ArgumentParser):
    """argparse, with every error as one line on stderr and exit status 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def refuse(flag: str, value: Any, allowed: str) -> NoReturn:
    """Exit with status 2 and one line: the flag, the value given and what is allowed."""
    shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) \
        if isinstance(value, tuple) else value
    print(f"{PROG}: {flag} {shown}: {allowed}", file=sys.stderr)
    raise SystemExit(2)


def floats(s: str) -> tuple[float, ...]:
    """A comma list of numbers, e.g. "1e-3,1e-2"."""
    try:
        return tuple(float(x) for x in s.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma list of numbers (e.g. 1e-3,1e-2)") from None


def ints(s: str) -> tuple[int, ...]:
    """A comma list of integers, e.g. "6,12"."""
    try:
        return tuple(int(x) for x in s.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma list of integers (e.g. 6,12)") from None


def pairs(s: str) -> tuple[tuple[str, int], ...]:
    """A comma list of variant:depth, e.g. "noskip:6" ("" for none)."""
    out = []
    for item in filter(None, s.split(",")):
        v, _, d = item.partition(":")
        if not d.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} is not variant:depth (e.g. noskip:6)")
        out.append((v, int(d)))
    return tuple(out)


def check_args(args: argparse.Namespace) -> None:
    """The flags that do not shape the grid: device counts, the XLA level, the processes."""
    if args.cpu_devices is not None and args.cpu_devices < 0:
        refuse("--cpu-devices", args.cpu_devices, "a count of CPU devices, or 0 for JAX's default of one")
    if args.xla_opt_level not in (-1, 0, 1, 2, 3):
        refuse("--xla-opt-level", args.xla_opt_level, "one of 0, 1, 2, 3, or -1 for XLA's default")
    if args.num_processes is not None and args.num_processes < 1:
        refuse("--num-processes", args.num_processes, "a number of processes >= 1")
    if args.process_id is not None and not 0 <= args.process_id < (args.num_processes or sys.maxsize):
        refuse("--process-id", args.process_id, f"an index in 0..{(args.num_processes or 0) - 1} "
               "(0..N-1 for --num-processes N)" if args.num_processes else "an index >= 0")
    if args.max_groups is not None and args.max_groups < 1:
        refuse("--max-groups", args.max_groups, "a number of groups >= 1")


def _check_lists(sweep: Sweep) -> None:
    known = f"each one of {', '.join(VARIANTS)}"
    for flag, names in (("--variants", sweep.variants), ("--warmup-variants", sweep.warmup_variants or ()),
                        ("--extra", tuple(v for v, _ in sweep.extra))):
        if any(v not in VARIANTS for v in names):
            refuse(flag, ",".join(names), known)
    if not sweep.pairs():
        refuse("--variants", ",".join(sweep.variants), "at least one variant at one depth (or an --extra group)")
    if any(d < 1 for d in sweep.depths):
        refuse("--depths", sweep.depths, "each depth a number of layers >= 1")
    if any(d < 1 for _, d in sweep.extra):
        refuse("--extra", ",".join(f"{v}:{d}" for v, d in sweep.extra), "each depth a number of layers >= 1")
    if not sweep.lrs or any(not (math.isfinite(x) and x > 0) for x in sweep.lrs):
        refuse("--lrs", sweep.lrs, "each learning rate must be a finite number > 0 (at least one)")
    if not sweep.warmups or any(w < 0 for w in sweep.warmups):
        refuse("--warmups", sweep.warmups, "each warmup a number of steps >= 0 (0 = none; at least one)")


def _check_sizes(sweep: Sweep) -> None:
    for name in ("seeds", "steps", "batch", "chunk", "heldout", "d_model", "num_heads", "d_ff", "seq_len"):
        if getattr(sweep, name) < 1:
            refuse(f"--{name.replace('_', '-')}", getattr(sweep, name), "a whole number >= 1")
    if sweep.steps % sweep.chunk:
        refuse("--steps", sweep.steps, f"a multiple of --chunk ({sweep.chunk})")
    if sweep.d_model % sweep.num_heads:
        refuse("--num-heads", sweep.num_heads, f"a divisor of --d-model ({sweep.d_model})")
    if sweep.d_ff % MOE_TOP_K and any(v in MOE_VARIANTS for v, _ in sweep.pairs()):
        refuse("--d-ff", sweep.d_ff, f"a multiple of {MOE_TOP_K} for the experts variants (their top-{MOE_TOP_K} "
               "experts share the width)")
    if sweep.task == "markov" and sweep.vocab < MARKOV_BRANCHING:
        refuse("--vocab", sweep.vocab, f"at least {MARKOV_BRANCHING} for the markov task (each symbol has "
               f"{MARKOV_BRANCHING} successors)")
    if sweep.task == "copy" and (sweep.vocab < 2 or sweep.seq_len < 3):
        refuse("--vocab" if sweep.vocab < 2 else "--seq-len", sweep.vocab if sweep.vocab < 2 else sweep.seq_len,
               "the copy task needs --vocab >= 2 and --seq-len >= 3")
    if not (math.isfinite(sweep.router_aux_coef) and sweep.router_aux_coef >= 0):
        refuse("--router-aux-coef", sweep.router_aux_coef, "a finite weight >= 0 (0 = off)")


def check_sweep(sweep: Sweep) -> None:
    """Refuse (exit 2, one line) a grid that cannot run; then each variant's block config is
    built (shapes only, nothing computed) so that what the blocks refuse is refused here."""
    _check_lists(sweep)
    _check_sizes(sweep)
    for variant, depth in sweep.pairs():
        try:
            ModelConfig(variant=variant, num_layers=depth, vocab=max(sweep.vocab, 1), seq_len=sweep.seq_len,
                        d_model=sweep.d_model, num_heads=sweep.num_heads, d_ff=sweep.d_ff).block_config()
        except ValueError as err:
            refuse("--variants", variant, f"this model size is refused by the blocks: {err}")
