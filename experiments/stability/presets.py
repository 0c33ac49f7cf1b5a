"""The sweeps: `Sweep` (a grid of runs) and the named presets `make run` and
`python -m experiments.stability --preset NAME` take (quick, cpu, depth, outward-*, full, full-text). Read by the runner
(experiments.stability) and by the report (experiments.stability.report) alike."""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

from .model import VARIANTS


@dataclass(frozen=True)
class Sweep:
    """A grid of runs. `extra` adds (variant, depth) pairs outside variants x depths
    (the quick preset runs the no-skip ablation only at 6 layers). `warmup_variants`: the
    variants that run the nonzero `warmups` too (None: every variant); the others run
    warmup 0 only (warmup is a claim about post-LN; the `cpu` preset saves its time)."""

    name: str
    task: str = "markov"
    variants: tuple[str, ...] = ("post", "pre")
    depths: tuple[int, ...] = (6, 24)
    extra: tuple[tuple[str, int], ...] = ()
    lrs: tuple[float, ...] = (1e-3,)
    warmups: tuple[int, ...] = (0,)
    warmup_variants: tuple[str, ...] | None = None
    seeds: int = 3
    # task and model
    vocab: int = 32
    seq_len: int = 32
    task_seed: int = 0
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256
    # optimisation (see train.TrainConfig)
    steps: int = 300
    batch: int = 32
    chunk: int = 50
    heldout: int = 16
    router_aux_coef: float = 0.0  # the experts variants' load-balancing loss weight (0: off; train.TrainConfig)

    def pairs(self) -> list[tuple[str, int]]:
        """(variant, depth) groups, shallow first, each once."""
        pairs = list(itertools.product(self.variants, self.depths)) + list(self.extra)
        seen: dict[tuple[str, int], None] = {}
        for p in pairs:
            seen.setdefault((p[0], int(p[1])), None)
        order = {v: i for i, v in enumerate(VARIANTS)}
        return sorted(seen, key=lambda p: (p[1], order[p[0]]))

    def warmups_of(self, variant: str) -> tuple[int, ...]:
        """The warmups this variant runs."""
        if self.warmup_variants is None or variant in self.warmup_variants:
            return self.warmups
        return tuple(w for w in self.warmups if w == 0) or self.warmups[:1]

    def runs(self) -> list[tuple[str, int, float, int, int]]:
        """Every run as (variant, depth, lr, warmup, seed), group by group."""
        return [(v, L, lr, w, seed) for v, L in self.pairs()
                for lr, w, seed in itertools.product(self.lrs, self.warmups_of(v), range(self.seeds))]

    def group_sizes(self) -> list[int]:
        """The number of runs of each (variant, depth) group, in `pairs` order (counted from `runs`)."""
        count = collections.Counter((v, L) for v, L, *_ in self.runs())
        return [count[p] for p in self.pairs()]

    def work(self) -> dict[str, float]:
        """Size of the sweep: runs, run-layer-steps and training FLOPs (analytic, see `step_flops`)."""
        runs = self.runs()
        layer_steps = sum(L for _, L, *_ in runs) * self.steps
        return {"runs": len(runs), "groups": len(self.pairs()), "run_layer_steps": layer_steps,
                "flops": layer_steps * self.layer_step_flops()}

    def layer_step_flops(self) -> float:
        """FLOPs of one layer in one training step of one run: forward + backward (3 x forward)
        on batch x seq_len tokens, plus the forward on the held-out batch after the update.
        Forward multiply-adds per token: 4 E^2 (q, k, v, out) + 2 E F (FFN) + 2 T E (scores, mix)."""
        e, f, t = self.d_model, self.d_ff, self.seq_len
        per_token = 2 * (4 * e * e + 2 * e * f + 2 * t * e)
        return per_token * t * (3 * self.batch + self.heldout)


# Cost model used to size the presets (short runs of one group on this project's 2-core
# CPU, extrapolated): training time ~ run-layer-steps x CPU_MS_PER_LAYER_STEP_D32 at the
# quick/cpu model size (d_model 32, T 16, batch 16), plus ~5-11 s to compile each
# (variant, depth) program on one of two threads while others train.
# Small models are overhead-bound on CPU: ~20 GFLOP/s achieved, well below the GEMM peak.
PRESETS: dict[str, Sweep] = {
    # The default of `make run`: under 2 minutes on an idle 2-core machine. Nine compiled
    # programs (post, pre, Peri-LN and DeepNorm at 6 and 12 layers, no-skip at 6), three
    # seeds each, vmapped; one learning rate and no warmup (the LR axis is the `cpu` preset's).
    "quick": Sweep(
        name="quick", variants=("post", "pre", "peri", "deepnorm"), depths=(6, 12), extra=(("noskip", 6),),
        lrs=(1e-3,), warmups=(0,), seeds=3,
        seq_len=16, d_model=32, num_heads=2, d_ff=128, steps=150, batch=16, chunk=25, heldout=8,
    ),
    # A real study in at most 20 minutes on an idle 2-core CPU (`--preset cpu`). The quick
    # model size (d_model 32, 2 heads, d_ff 128, context 16, batch 16), measured with short
    # runs of one group on a shared machine: 1.6 ms per run-layer-step (wall) with a held-out
    # batch of 16 at load 3; with the held-out batch of 32 used here (the final loss's
    # sampling noise ~0.04 nats) 2.0 ms of CPU time and 2.25 ms wall at load 5.5, i.e.
    # ~1.1-1.4 ms wall when the two cores are ours. Pre-LN at 12 layers ended 0.07-0.09 nats
    # above H after 400 steps at lr 3e-3..1e-2 (0.12 at 1e-3 and 3e-2), inside the 0.15-nat
    # target. LR grid 1e-3..1e-1 (100x, half-decades): pre-LN trains from 1e-3 to 3e-2 and
    # fails at 1e-1, so the grid brackets its edge of stability; post-LN at 12 layers failed
    # on the whole grid (300 steps), with or without a 50-step warmup.
    # Warmup 100 steps (Xiong's warmup claim; the DESIGN prototype saw a 100-step warmup
    # rescue 6-layer post-LN at lr 1e-2) runs for post-LN and its pre-LN control only, which
    # keeps the work at 1,440 run-layers x 400 steps = 576k run-layer-steps: ~11-13.5 min of
    # training at 1.1-1.4 ms, plus ~1-2 min for the 12 compiles (5-11 s each, on two threads
    # beside the training), so ~13-16 min idle (`--estimate` prints the range from the
    # constants below). Cross-check: a 100-step slice of this preset (post and Peri-LN at
    # 6 and 12 layers, 60 runs, 54k run-layer-steps, 4 compiles) took 181 s of CPU time at
    # load 5.5-6.7, i.e. ~2.6 ms of CPU per run-layer-step under contention; scaled to the
    # whole preset ~1,600 CPU-s, 15-18 min of wall time on two otherwise idle cores.
    # Two seeds (a third would need ~20-27 min).
    "cpu": Sweep(
        name="cpu", variants=("post", "pre", "peri", "pre-rms", "pre-qknorm", "deepnorm"), depths=(6, 12),
        lrs=(1e-3, 3e-3, 1e-2, 3e-2, 1e-1), warmups=(0, 100), warmup_variants=("post", "pre"), seeds=2,
        seq_len=16, d_model=32, num_heads=2, d_ff=128, steps=400, batch=16, chunk=50, heldout=32,
    ),
    # The depth study: the six placements the question is about -- post-LN, pre-LN,
    # DeepNorm, Peri-LN and the two 2025 answers, pre-LN with DyT and with LayerNorm Scaling --
    # at 6, 12, 24 and 48 layers, three learning rates (half-decades around where the `cpu`
    # preset saw pre-LN train and post-LN fail at 12 layers), two seeds, no warmup. The quick
    # model size; 200 steps so that the whole grid (3,240 run-layers, 648k run-layer-steps)
    # fits in 30 minutes of this 2-core CPU with room to spare: ~12-15 min of training at
    # 1.1-1.4 ms per run-layer-step plus 24 compiles (`--estimate`). Sized before it was run.
    "depth": Sweep(
        name="depth", variants=("post", "pre", "deepnorm", "peri", "pre-dyt", "pre-lns"), depths=(6, 12, 24, 48),
        lrs=(1e-3, 3e-3, 1e-2), warmups=(0,), seeds=2,
        seq_len=16, d_model=32, num_heads=2, d_ff=128, steps=200, batch=16, chunk=25, heldout=32,
    ),
    # The outward study (outward.py): the depth study's six placements,
    # learning rates, seeds, steps and batch at 6, 12 and 24 layers, at d_model 64 (4 heads,
    # d_ff 256), once on the Markov task and once on real text (characters of CPython's
    # documentation; vocab 0 = the corpus's alphabet). Sized before it was run: 108 runs,
    # 302k run-layer-steps per setting, ~3.8 ms each at d64 with the runs split over the two
    # cores (measured on one group under load and scaled): ~19 min per setting on this CPU.
    # Ran (2026-12-02, the machine shared with test runs part of the time): Markov d64 in
    # 970 s, text at 800 steps (1.21 M run-layer-steps) in 3,766 s, ~3.1 ms per
    # run-layer-step; `--estimate`'s FLOP scaling from d32 says 4.3-7.7 ms (too slow at d64).
    "outward-markov": Sweep(
        name="outward-markov", variants=("post", "pre", "deepnorm", "peri", "pre-dyt", "pre-lns"),
        depths=(6, 12, 24), lrs=(1e-3, 3e-3, 1e-2), warmups=(0,), seeds=2,
        seq_len=16, d_model=64, num_heads=4, d_ff=256, steps=200, batch=16, chunk=25, heldout=32,
    ),
    # Text at 800 steps, sized before the sweep by a pilot of its control alone (pre-LN, 6 layers,
    # the three learning rates, 2 seeds, 1,000 steps; the learning rate is constant, so one run
    # holds every shorter budget): at 200 steps no learning rate trained (held-out 2.77-2.99
    # nats/char against the 2.54 line); at its best rate it first passed the line in both seeds
    # at 500 steps (2.48, 2.51), at 800 at 1e-3 and 3e-3 in both seeds (2.36-2.51). A setting in
    # which the control cannot train answers nothing, so text gets 800 steps (a budget no
    # other placement was looked at for); the Markov settings keep the depth study's 200.
    "outward-text": Sweep(
        name="outward-text", task="text", vocab=0, variants=("post", "pre", "deepnorm", "peri", "pre-dyt", "pre-lns"),
        depths=(6, 12, 24), lrs=(1e-3, 3e-3, 1e-2), warmups=(0,), seeds=2,
        seq_len=16, d_model=64, num_heads=4, d_ff=256, steps=800, batch=16, chunk=100, heldout=32,
    ),
    # The experts MLP as a variant of the depth study's blocks (issue 53, item 6): post-LN and
    # pre-LN with their MLP a mixture of 8 experts, top-2 (model.MOE_VARIANTS; each expert d_ff / 2
    # wide, so a token's active width is the dense d_ff), beside the dense post-LN and pre-LN, at
    # 6, 12 and 24 layers, the depth study's width, learning rates, seeds and held-out batch. The
    # router auxiliary loss is off (router_aux_coef 0; `--router-aux-coef`). 100 steps, half the
    # depth study's: sized after a pilot and a first start. One pre-moe group at 6 layers (6 runs,
    # 50 steps) trained at ~37 ms per group-layer-step at load ~1.2 (~6 ms per run-layer-step,
    # 3-5x the dense model's: the library's grouped dispatch is a scan over 24 blocks per
    # projection, whatever the token count, and `--estimate`'s FLOP count does not see it); the
    # first start at 200 steps, on a machine at load 9-12, did post-moe at 6 layers at ~1.2 s per
    # step: ~70 min for the preset. At 100 steps ~5 min of experts training idle, ~25 min at that
    # load. Its dense cells at 200 steps (post and pre at 6 layers) were the depth study's to the
    # last digit of its report.
    "cpu-moe": Sweep(
        name="cpu-moe", variants=("post", "pre", "post-moe", "pre-moe"), depths=(6, 12, 24),
        lrs=(1e-3, 3e-3, 1e-2), warmups=(0,), seeds=2,
        seq_len=16, d_model=32, num_heads=2, d_ff=128, steps=100, batch=16, chunk=25, heldout=32,
    ),
    # For an accelerator: every variant, 6-48 layers, the model of the DESIGN prototype
    # (d_model 64, 4 heads, d_ff 256, context 32, batch 32), 2,000 steps, six learning rates
    # over 333x, warmup 0 / 500, three seeds: 1,584 runs in 44 programs, 71 M run-layer-steps,
    # ~31 PFLOP (`python -m experiments.stability --preset full --estimate`). That is 2-3 weeks
    # of this CPU (~20 GFLOP/s achieved); on one GPU an estimate of 0.5-1.8 h (5-20 TFLOP/s
    # achieved on these small batched matmuls, plus a per-layer-step launch floor), not measured.
    "full": Sweep(
        name="full", variants=("post", "pre", "peri", "pre-rms", "pre-qknorm", "deepnorm", "noskip", "rezero",
                               "layerscale", "pre-dyt", "pre-lns"),
        depths=(6, 12, 24, 48), lrs=(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1), warmups=(0, 500), seeds=3,
        d_model=64, num_heads=4, d_ff=256, steps=2000, batch=32, chunk=100, heldout=32,
    ),
    # The `full` grid on the text task at d_model 128 (8 heads, d_ff 512), for an accelerator:
    # the outward study's question (do the verdicts hold on real text at a width people train?)
    # at the full grid's depths, learning rates, warmups and seeds; vocab 0 = the corpus's.
    "full-text": Sweep(
        name="full-text", task="text", vocab=0,
        variants=("post", "pre", "peri", "pre-rms", "pre-qknorm", "deepnorm", "noskip", "rezero",
                  "layerscale", "pre-dyt", "pre-lns"),
        depths=(6, 12, 24, 48), lrs=(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1), warmups=(0, 500), seeds=3,
        seq_len=32, d_model=128, num_heads=8, d_ff=512, steps=2000, batch=32, chunk=100, heldout=32,
    ),
}
