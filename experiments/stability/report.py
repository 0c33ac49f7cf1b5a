"""Markdown report and plots of a finished sweep, with findings computed from the data.

    python -m experiments.stability.report DIR      # regenerate DIR/report.md + PNGs from DIR's cells

Reads OUT/sweep.json (the cells of the sweep) and OUT/cells/*.json. Every verdict below is
computed by a rule fixed in this file (the constants after the imports), not chosen after
looking at the numbers; where a claim's data is not in the sweep, the report says what to
run instead. Verdicts are "agrees", "partly agrees", "does not agree", "not measured", or
"inconclusive" (an outcome-based rule whose control variants did not train at all, e.g. a run
too short for anything to learn: failing to train then says nothing about the claim).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import plots
from .analysis import (
    PLATEAU_FRACTION,
    clipped_loss,
    growth_factor,
    linear_fit,
    lr_sensitivity,
    power_law_exponent,
    trajectory_max,
)
from .model import DENSE_TWIN, MOE_EXPERTS, MOE_TOP_K, MOE_VARIANTS, VARIANT_NOTES, VARIANTS
from .presets import PRESETS, Sweep

LEVEL = 4 / 3  # a per-layer profile is "level" if its fitted end-to-end factor is in [1/LEVEL, LEVEL]
EXPONENT_TOL = 0.25  # |fitted exponent - predicted exponent| allowed for the depth scaling claims
LINEAR_R2 = 0.9  # R^2 of a straight-line fit needed to call a growth "linear"
EARLY_STEPS = 20  # "early" update size: mean over the first EARLY_STEPS updates
# Rules of the second edition (Wortsman, Peri-LN, NormFormer), written before any sweep with
# these variants or a learning-rate grid was run:
LOGIT_GROWTH = 2.0  # the largest attention logit "grows" if its max over training > 2x its value at init
DEGRADE = 0.1  # "training degrades" at the highest LR: clipped final loss > best over the grid + 0.1 nats
# Rules of the third edition (DyT, LayerNorm Scaling, the report's answer), written on
# 2026-12-01 before the `depth` preset (the first sweep with these variants) was run:
MATCH = 0.05  # nats: two variants' best-LR final losses "match" if within this (~ the held-out loss's noise)
# Every change to a rule after its data had been seen, as (date, rule, change, why); the
# report prints this list (empty: no rule has been changed after seeing data).
TARGET_EXCESS = 0.15  # the `cpu` preset is sized so that trained variants end this close to H (reported, not a verdict)
# Rules of the experts edition (the `cpu-moe` preset), written on 2026-12-06 before that preset
# was run (seen before: one pilot group, pre-moe at 6 layers, 50 steps, to time it):
COLLAPSE = (1 + MOE_EXPERTS / MOE_TOP_K) / 2  # a layer's routing "collapsed": load balance past half-way from
# balanced (1) to every token on the same k experts (X / k)
RULE_CHANGES: list[tuple[str, str, str, str]] = []
ORDER = {v: i for i, v in enumerate(VARIANTS)}


def _arr(x) -> np.ndarray:
    return plots._arr(x)


def load(out: Path) -> tuple[dict, list[dict]]:
    """(sweep description, records of the sweep's finished cells)."""
    meta = json.loads((out / "sweep.json").read_text())
    records = []
    for name in meta["cells"]:
        path = out / "cells" / f"{name}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
    return meta, records


def _fmt(x: float, nd: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _rate(recs: list[dict]) -> float:
    return float(np.mean([r["summary"]["status"] != "trained" for r in recs])) if recs else float("nan")


def _mean_final(recs: list[dict]) -> float:
    """Mean final held-out loss over the runs that stayed finite (NaN if none did)."""
    finals = [r["summary"]["final_loss"] for r in recs if r["summary"]["final_loss"] is not None]
    return float(np.mean(finals)) if finals else float("nan")


def _outcome(rate: float) -> str:
    """Majority over seeds: "trains" (< half failed), "fails" (> half), "mixed" (exactly half)."""
    if math.isnan(rate):
        return "not run"
    return "trains" if rate < 0.5 else "fails" if rate > 0.5 else "mixed"


class Data:
    """Indexing helpers over the records."""

    def __init__(self, records: list[dict]):
        self.records = records
        self.by: dict[tuple, list[dict]] = defaultdict(list)
        for r in records:
            c = r["config"]
            self.by[(c["variant"], c["depth"], c["lr"], c["warmup"])].append(r)
        self.variants = sorted({k[0] for k in self.by}, key=ORDER.get)
        self.depths = sorted({k[1] for k in self.by})
        self.lrs = sorted({k[2] for k in self.by})
        self.warmups = sorted({k[3] for k in self.by})
        self.lr0, self.w0 = plots.default_lr_warmup(records) if records else (None, None)

    def get(self, variant: str, depth: int, lr: float | None = None, warmup: int | None = None) -> list[dict]:
        return self.by.get((variant, depth, self.lr0 if lr is None else lr, self.w0 if warmup is None else warmup), [])

    def depths_of(self, variant: str) -> list[int]:
        return sorted({k[1] for k in self.by if k[0] == variant and k[2] == self.lr0 and k[3] == self.w0})

    def init_profile(self, variant: str, depth: int, key: str = "w2_grad_norm") -> np.ndarray:
        """Seed-mean of a per-layer quantity at initialisation (first recorded chunk)."""
        return np.mean([_arr(r["metrics"][key])[0] for r in self.get(variant, depth)], axis=0)

    def clipped(self, variant: str, depth: int, lr: float, warmup: int = 0) -> float:
        """Seed mean of min(final held-out loss, held-out loss at init); diverged runs count as
        their loss at init (NaN if the setting was not run)."""
        recs = self.get(variant, depth, lr, warmup)
        vals = [clipped_loss(r["summary"]["final_loss"], float(r["metrics"]["heldout_loss0"])) for r in recs]
        return float(np.mean(vals)) if vals else float("nan")

    def sensitivity(self, variant: str, depth: int, warmup: int = 0) -> float:
        """Wortsman et al.'s LR sensitivity over the sweep's LR grid (NaN unless every LR ran)."""
        return lr_sensitivity([self.clipped(variant, depth, lr, warmup) for lr in self.lrs])

    def logit_growth(self, variant: str, depth: int, lr: float, warmup: int = 0) -> tuple[float, float, float]:
        """(largest attention logit at init, largest over training, their ratio), seed means;
        max over layers, heads and positions of the held-out batch; training = the probes after
        every chunk. NaN when the cells hold no attention logits."""
        inits, peaks, ratios = [], [], []
        for r in self.get(variant, depth, lr, warmup):
            traj = _arr(r["metrics"].get("attn_logit_max", []))  # (probes, L)
            if traj.ndim != 2 or traj.shape[0] < 2:
                continue
            init, peak = trajectory_max(traj[0]), trajectory_max(traj[1:])
            inits.append(init), peaks.append(peak), ratios.append(peak / init)
        def mean(v):
            return float(np.nanmean(v)) if v and np.any(np.isfinite(v)) else float("nan")
        return mean(inits), mean(peaks), mean(ratios)

    def stream_profile(self, variant: str, depth: int, when: int) -> np.ndarray:
        """Seed mean of ||x_l||^2 / d, l = 0..L, at probe `when` (0: init, -1: after training)."""
        rows = [_arr(r["metrics"]["stream_norm_probe"])[when] for r in self.get(variant, depth)
                if "stream_norm_probe" in r["metrics"]]
        if not rows:
            return np.full(depth + 1, np.nan)
        with warnings.catch_warnings():  # layers NaN in every seed stay NaN, quietly
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(np.stack(rows), axis=0)

    def train_grad_profile(self, variant: str, depth: int) -> np.ndarray:
        """Seed mean of each layer's gradient norm averaged over all training steps (L,)."""
        rows = []
        for r in self.get(variant, depth):
            g = _arr(r["metrics"].get("layer_grad_norm_mean", []))  # (chunks, L)
            if g.ndim == 2 and np.all(np.isfinite(g)):  # a run that diverged has no training profile
                rows.append(g.mean(axis=0))
        return np.mean(rows, axis=0) if rows else np.full(depth, np.nan)

    def early_update(self, variant: str, depth: int) -> float:
        vals = [np.nanmean(_arr(r["metrics"]["update"])[:EARLY_STEPS]) for r in self.get(variant, depth)]
        return float(np.mean(vals)) if vals else float("nan")


# ------------------------------------------------------------------------------------
# Claims. Each returns (verdict, markdown body).
# ------------------------------------------------------------------------------------


def _nothing_trained(groups: list[list[dict]]) -> bool:
    """True if the groups hold runs and not one of them trained."""
    recs = [r for g in groups for r in g]
    return bool(recs) and not any(r["summary"]["status"] == "trained" for r in recs)


def _inconclusive(body: str, controls: str) -> tuple[str, str]:
    return "inconclusive", (f"No {controls} run trained in this sweep, so the rule cannot tell the variants apart "
                            "(too few steps, or a learning rate past every variant's edge?): run longer "
                            "(`--steps`) before reading a verdict.\n\n" + body)


def _parts_verdict(parts: list[bool]) -> str:
    return "agrees" if all(parts) else "partly agrees" if any(parts) else "does not agree"


def claim_init_gradients(d: Data) -> tuple[str, str]:
    """Xiong et al. 2020, Fig. 3: post-LN's per-layer gradient norm at init grows toward the
    output; pre-LN's stays level."""
    if not ({"post", "pre"} <= set(d.variants)):
        return "not measured", "Needs both `post` and `pre` in `--variants`."
    rows, rising, level, ratio = [], [], [], []
    for depth in sorted(set(d.depths_of("post")) & set(d.depths_of("pre"))):
        post_w2, pre_w2 = d.init_profile("post", depth), d.init_profile("pre", depth)
        post, pre = growth_factor(post_w2), growth_factor(pre_w2)
        post_l = growth_factor(d.init_profile("post", depth, "layer_grad_norm"))
        pre_l = growth_factor(d.init_profile("pre", depth, "layer_grad_norm"))
        rising.append(post > LEVEL)
        level.append(1 / LEVEL <= pre <= LEVEL)
        ratio.append(float(post_w2[-1] / pre_w2[-1]))
        seeds = [growth_factor(_arr(r["metrics"]["w2_grad_norm"])[0]) for r in d.get("post", depth)]
        rows.append(f"| {depth} | {_fmt(post)} | {_fmt(pre)} | {_fmt(post_l)} | {_fmt(pre_l)} | {_fmt(ratio[-1])} | "
                    f"{_fmt(min(seeds))}-{_fmt(max(seeds))} |")
    if not rows:
        return "not measured", "No depth with both `post` and `pre`."
    pre_says = ("level" if all(level) else
                "falling toward the output" if all(growth_factor(d.init_profile("pre", L)) < 1 / LEVEL
                                                   for L in sorted(set(d.depths_of("post")) & set(d.depths_of("pre"))))
                else "not level at every depth")
    body = (
        "Fitted end-to-end factor of the per-layer gradient norm at initialisation (least squares "
        "of log-norm against layer position; > 1 rises toward the output), seed mean. The rule: "
        f"post-LN's factor for FFN W2 (the matrix of Xiong's Fig. 3) > {LEVEL:.2f} (rising) and "
        f"pre-LN's within [{1 / LEVEL:.2f}, {LEVEL:.2f}] (level); each half is checked at every depth. "
        "Whole-layer factors and the post/pre ratio of the last layer's W2 gradient for reference.\n\n"
        "The last column shows how far single seeds spread (the rule reads the seed mean's profile).\n\n"
        "| depth | post W2 | pre W2 | post whole layer | pre whole layer | last layer post/pre | "
        "post W2, single seeds |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Post-LN rising toward the output: {'reproduced' if all(rising) else 'not reproduced'}. "
        f"Pre-LN level: {'reproduced' if all(level) else f'not reproduced: its profile is {pre_says}'}. "
        "A pre-LN profile falling toward the output is what NormFormer (Shleifer et al. 2021) reports "
        "during training; its row below measures it over training."
        "\n\n![init gradients](init_grad_norms.png)"
    )
    return _parts_verdict([all(rising), all(level)]), body


def claim_last_layer(d: Data) -> tuple[str, str]:
    """Xiong et al. 2020, Theorem 1: the last layer's gradient is ~ flat in L for post-LN and
    ~ 1/sqrt(L) for pre-LN."""
    fits, rows = {}, []
    for v, predicted in (("post", 0.0), ("pre", -0.5)):
        depths = d.depths_of(v)
        if len(depths) < 2:
            continue
        last = [float(d.init_profile(v, L)[-1]) for L in depths]
        fits[v] = power_law_exponent(depths, last)
        rows.append(f"| {v} | {', '.join(map(str, depths))} | {', '.join(_fmt(x, 3) for x in last)} | "
                    f"{_fmt(fits[v])} | {predicted:+.1f} |")
    if len(fits) < 2:
        return "not measured", "Needs `post` and `pre` at two or more depths."
    good_post = abs(fits["post"]) <= EXPONENT_TOL
    good_pre = abs(fits["pre"] + 0.5) <= EXPONENT_TOL
    verdict = _parts_verdict([good_post, good_pre])
    body = (
        "Gradient norm of the last layer's FFN W2 at initialisation against depth, fitted as "
        f"c * L^p (the rule: within {EXPONENT_TOL} of the predicted exponent).\n\n"
        "| variant | depths | last-layer norm | fitted p | predicted p |\n|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n\n![last layer](last_layer_grad.png)"
    )
    return verdict, body


def claim_stream(d: Data) -> tuple[str, str]:
    """Xiong et al. 2020, Lemma 2 / Sec. 3: ||x_l||^2 grows linearly with l in pre-LN and is
    constant in post-LN."""
    if not ({"post", "pre"} <= set(d.variants)):
        return "not measured", "Needs both `post` and `pre`."
    rows, ok = [], []
    for depth in sorted(set(d.depths_of("post")) & set(d.depths_of("pre"))):
        pre = d.init_profile("pre", depth, "stream_norm")
        post = d.init_profile("post", depth, "stream_norm")[1:]  # after each layer
        _, slope, r2 = linear_fit(pre)
        spread = float(post.max() / post.min())
        good = slope > 0 and r2 >= LINEAR_R2 and spread <= 1.1
        ok.append(good)
        rows.append(f"| {depth} | {_fmt(pre[0])} -> {_fmt(pre[-1])} | {_fmt(slope, 3)} | {_fmt(r2, 3)} | "
                    f"{_fmt(spread, 3)} | {'yes' if good else 'no'} |")
    if not rows:
        return "not measured", "No depth with both `post` and `pre`."
    verdict = "agrees" if all(ok) else "partly agrees" if any(ok) else "does not agree"
    body = (
        "||x_l||^2 / d at initialisation, l = 0 (embedded input) .. L, on the held-out batch. "
        f"The rule: pre-LN fits a rising straight line with R^2 >= {LINEAR_R2} (Xiong's bound: slope "
        "between 1/2 and 3/2 per layer when ||x_0||^2/d = 1), and post-LN's max/min over layers <= 1.1.\n\n"
        "| depth | pre: first -> last | pre slope per layer | pre R^2 | post max/min | holds |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n![stream](stream_norm.png)"
    )
    return verdict, body


def claim_warmup(d: Data) -> tuple[str, str]:
    """Xiong et al. 2020, Sec. 3.2 / Fig. 2: post-LN needs learning-rate warmup; pre-LN does not."""
    warm = [w for w in d.warmups if w > 0]
    if 0 not in d.warmups or not warm:
        return "not measured", ("The sweep has no warmup axis; run e.g. `python -m experiments.stability "
                                "--warmups 0,50 --lrs 1e-3,1e-2 --out DIR` (the `full` preset has it).")
    rows, rescued, post_failed = [], [], False
    for depth in d.depths_of("post"):
        for lr in d.lrs:
            no = _rate(d.get("post", depth, lr, 0))
            for w in warm:
                yes = _rate(d.get("post", depth, lr, w))
                pre = _rate(d.get("pre", depth, lr, 0))
                if math.isnan(no) or math.isnan(yes):
                    continue
                post_failed |= no > 0.5
                helped = no > 0.5 and yes < 0.5
                rescued.append(helped)
                rows.append(f"| {depth} | {lr:g} | {_fmt(no)} | {w} | {_fmt(yes)} | {_fmt(pre)} | "
                            f"{'yes' if helped else 'no'} |")
    if not post_failed:
        return "not measured", "Post-LN never failed without warmup in this sweep, so warmup had nothing to fix.\n\n" \
            + "\n".join(rows)
    verdict = "agrees" if any(rescued) else "does not agree"
    nothing = _nothing_trained([d.by[k] for k in d.by if k[0] in ("post", "pre")])
    body = (
        "Failure rate of post-LN without and with warmup at each depth and learning rate. The rule: "
        "agrees if warmup turns at least one failing post-LN setting (rate > 0.5) into a training "
        "one (rate < 0.5).\n\n| depth | lr | post fail, no warmup | warmup | post fail, warmup | "
        "pre fail, no warmup | rescued |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows)
        + "\n\n![failures](failure_heatmap.png)"
    )
    return _inconclusive(body, "post-LN or pre-LN") if nothing else (verdict, body)


def claim_depth(d: Data) -> tuple[str, str]:
    """Liu et al. 2020 (Admin), Fig. 1: post-LN trains at 6 layers but fails deeper (12, 18),
    where pre-LN trains."""
    if not ({"post", "pre"} <= set(d.variants)) or len(d.depths) < 2:
        return "not measured", "Needs `post` and `pre` at two or more depths."
    rows, holds = [], []
    for lr in d.lrs:
        depths = sorted({k[1] for k in d.by if k[0] in ("post", "pre") and k[2] == lr and k[3] == 0})
        if len(depths) < 2:
            continue
        post = {L: _outcome(_rate(d.get("post", L, lr, 0))) for L in depths}
        pre = {L: _outcome(_rate(d.get("pre", L, lr, 0))) for L in depths}
        shallow = depths[0]
        deep_fail = [L for L in depths[1:] if post[L] == "fails" and pre[L] == "trains"]
        ok = post[shallow] == "trains" and bool(deep_fail)
        holds.append(ok)
        rows.append(f"| {lr:g} | " + ", ".join(f"{L}: {post[L]}" for L in depths) + " | "
                    + ", ".join(f"{L}: {pre[L]}" for L in depths) + f" | {'yes' if ok else 'no'} |")
    if not rows:
        return "not measured", "No learning rate with post/pre at two depths without warmup."
    verdict = "agrees" if all(holds) else "partly agrees" if any(holds) else "does not agree"
    body = (
        "Outcome by majority over seeds, without warmup. The rule: post-LN trains at the shallowest "
        "depth and fails at a deeper one where pre-LN trains.\n\n| lr | post-LN | pre-LN | holds |\n"
        "|---|---|---|---|\n" + "\n".join(rows) + "\n\n![loss curves](loss_curves.png)\n\n"
        "![failures](failure_heatmap.png)"
    )
    if _nothing_trained([d.by[k] for k in d.by if k[0] in ("post", "pre") and k[3] == 0]):
        return _inconclusive(body, "post-LN or pre-LN")
    return verdict, body


def claim_amplification(d: Data) -> tuple[str, str]:
    """Liu et al. 2020, Sec. 4: post-LN's output change after an update is amplified and grows
    with depth (much faster than pre-LN's)."""
    common = sorted(set(d.depths_of("post")) & set(d.depths_of("pre")))
    if len(common) < 2:
        return "not measured", "Needs `post` and `pre` at two or more depths."
    lo, hi = common[0], common[-1]
    post = [d.early_update("post", L) for L in (lo, hi)]
    pre = [d.early_update("pre", L) for L in (lo, hi)]
    g_post, g_pre = post[1] / post[0], pre[1] / pre[0]
    good = post[1] > pre[1] and g_post > 1 and g_post > g_pre
    verdict = "agrees" if good else "does not agree"
    body = (
        f"Mean update size ||F(x;θ_t) − F(x;θ_0)|| over the first {EARLY_STEPS} updates at lr {d.lr0:g}, "
        f"warmup {d.w0}, seed mean (held-out "
        "inputs, encoder output, per-token L2; both variants end in a LayerNorm so the scales "
        "compare). The rule: post-LN's is larger than pre-LN's at the deepest depth and grows "
        "more from the shallowest to the deepest.\n\n"
        f"| variant | {lo} layers | {hi} layers | growth |\n|---|---|---|---|\n"
        f"| post | {_fmt(post[0])} | {_fmt(post[1])} | {_fmt(g_post)} |\n"
        f"| pre | {_fmt(pre[0])} | {_fmt(pre[1])} | {_fmt(g_pre)} |\n\n![update](update_size.png)"
    )
    return verdict, body


def claim_deepnorm(d: Data) -> tuple[str, str]:
    """Wang et al. 2022 (DeepNet), Fig. 5: the early update of post-LN explodes and grows with
    depth; DeepNorm keeps it small and flat."""
    common = sorted(set(d.depths_of("post")) & set(d.depths_of("deepnorm")))
    if not common:
        return "not measured", ("Needs `deepnorm` and `post` at the same depths, e.g. `python -m experiments.stability "
                                "--variants post,pre,deepnorm --depths 6,12 --out DIR` (the `full` preset has them).")
    rows = []
    for L in common:
        rows.append(f"| {L} | {_fmt(d.early_update('post', L))} | {_fmt(d.early_update('deepnorm', L))} | "
                    f"{_outcome(_rate(d.get('post', L)))} | {_outcome(_rate(d.get('deepnorm', L)))} |")
    smaller = all(d.early_update("deepnorm", L) < d.early_update("post", L) for L in common)
    if len(common) >= 2:
        g_post = d.early_update("post", common[-1]) / d.early_update("post", common[0])
        g_deep = d.early_update("deepnorm", common[-1]) / d.early_update("deepnorm", common[0])
        flatter = g_deep < g_post
        growth = f"Growth from {common[0]} to {common[-1]} layers: post {_fmt(g_post)}, DeepNorm {_fmt(g_deep)}. "
    else:
        flatter, growth = None, "Only one depth, so growth with depth is not measured. "
    if flatter is None:
        verdict = "partly agrees" if smaller else "does not agree"
    else:
        verdict = "agrees" if smaller and flatter else "partly agrees" if smaller or flatter else "does not agree"
    body = (
        f"Mean early update size (first {EARLY_STEPS} updates, lr {d.lr0:g}, warmup {d.w0}, seed mean). "
        "The rule: DeepNorm's is smaller than "
        "post-LN's at every depth and grows less with depth. " + growth + "\n\n"
        "| depth | post update | DeepNorm update | post outcome | DeepNorm outcome |\n|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n\n![update](update_size.png)"
    )
    return verdict, body


def claim_skip(d: Data) -> tuple[str, str]:
    """Skip ablation: without the identity path a 6-layer stack fails where post-LN and
    pre-LN train."""
    depths = d.depths_of("noskip")
    if not depths:
        return "not measured", "Needs the `noskip` variant (e.g. `--extra noskip:6`)."
    rows, holds = [], []
    for L in depths:
        ns, post, pre = (_outcome(_rate(d.get(v, L))) for v in ("noskip", "post", "pre"))
        ok = ns == "fails" and post == "trains" and pre == "trains"
        holds.append(ok)
        rows.append(f"| {L} | {ns} ({_fmt(_mean_final(d.get('noskip', L)))}) | {post} | {pre} | "
                    f"{'yes' if ok else 'no'} |")
    verdict = "agrees" if all(holds) else "partly agrees" if any(holds) else "does not agree"
    body = (f"Outcome by majority over seeds at lr {d.lr0:g}, warmup {d.w0} (mean final held-out loss of "
            "no-skip in brackets). The rule: no-skip fails while both skip variants train.\n\n"
            "| depth | no-skip | post | pre | holds |\n|---|---|---|---|---|\n" + "\n".join(rows))
    if _nothing_trained([d.get(v, L) for L in depths for v in ("post", "pre")]):
        return _inconclusive(body, "post-LN or pre-LN (the variants with a skip path)")
    return verdict, body


def _depth_verdict(holds: list[list[bool]]) -> str:
    """holds[depth][part]: agrees if every part holds at every depth, does not agree if no part
    holds at any depth, else partly agrees."""
    return _parts_verdict([x for row in holds for x in row])


def _yn(x: bool) -> str:
    return "yes" if x else "no"


def claim_wortsman(d: Data) -> tuple[str, str]:
    """Wortsman et al. 2023: without QK-norm the largest attention logit grows at high learning
    rates and training degrades; QK-norm keeps it bounded and lowers LR sensitivity."""
    common = sorted(set(d.depths_of("pre")) & set(d.depths_of("pre-qknorm")))
    if not common or len(d.lrs) < 3 or 0 not in d.warmups:
        return "not measured", ("Needs `pre` and `pre-qknorm` at the same depth and a grid of three or more "
                                "learning rates without warmup (the `cpu` preset has them).")
    lo, hi = d.lrs[0], d.lrs[-1]
    if all(math.isnan(d.logit_growth(v, L, hi)[1]) for v in ("pre", "pre-qknorm") for L in common):
        return "not measured", ("The cells hold no attention logits: the flax_blocks Encoder that ran them did not "
                                "report `attention_logits_max`.")
    rows, holds = [], []
    for L in common:
        g_pre_hi, g_pre_lo = d.logit_growth("pre", L, hi), d.logit_growth("pre", L, lo)
        g_qk = d.logit_growth("pre-qknorm", L, hi)
        s_pre, s_qk = d.sensitivity("pre", L), d.sensitivity("pre-qknorm", L)
        best_pre = min(d.clipped("pre", L, lr) for lr in d.lrs)
        drop = d.clipped("pre", L, hi) - best_pre
        parts = [g_pre_hi[2] > LOGIT_GROWTH and g_pre_hi[2] > g_pre_lo[2], drop > DEGRADE,
                 g_qk[2] <= LOGIT_GROWTH, s_qk < s_pre]
        holds.append(parts)
        rows.append(f"| {L} | {_fmt(g_pre_hi[0])} -> {_fmt(g_pre_hi[1])} ({_fmt(g_pre_hi[2])}x) | "
                    f"{_fmt(g_pre_lo[2])}x | {_fmt(drop, 3)} | {_fmt(g_qk[0])} -> {_fmt(g_qk[1])} ({_fmt(g_qk[2])}x) | "
                    f"{_fmt(s_pre, 3)} | {_fmt(s_qk, 3)} | " + ", ".join(_yn(x) for x in parts) + " |")
    body = (
        f"Largest attention logit (scaled q.k before softmax; max over layers, heads and held-out positions) at "
        f"initialisation -> its maximum over the probes after every chunk, seed mean, without warmup, at the "
        f"highest learning rate {hi:g} (growth factor in brackets) and, for pre-LN, the factor at the lowest "
        f"{lo:g}. LR sensitivity (Wortsman et al.): the mean over the LR grid of [min(final loss, initial "
        "loss) - best final loss over the grid], from seed-mean clipped losses (a diverged run counts as its "
        "initial loss). The rule, four parts checked at every depth: (1) pre-LN's logit grows by more than "
        f"{LOGIT_GROWTH:g}x at the highest LR and more than at the lowest; (2) pre-LN's clipped final loss at the "
        f"highest LR is more than {DEGRADE} nats above its best over the grid; (3) with QK-norm the growth at the "
        f"highest LR is at most {LOGIT_GROWTH:g}x; (4) QK-norm's LR sensitivity is lower than pre-LN's.\n\n"
        "| depth | pre-LN logit at top LR | pre-LN growth at lowest LR | pre-LN degradation | pre-QK-norm logit "
        "at top LR | pre-LN sensitivity | pre-QK-norm sensitivity | parts 1-4 hold |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
        + "\n\n![attention logits](attn_logit_max.png)\n\n![final loss vs lr](lr_sweep.png)"
    )
    if _nothing_trained([d.get(v, L, lr, 0) for v in ("pre", "pre-qknorm") for L in common for lr in d.lrs]):
        return _inconclusive(body, "pre-LN or pre-QK-norm")
    return _depth_verdict(holds), body


def claim_peri(d: Data) -> tuple[str, str]:
    """Peri-LN (Kim et al. 2025): pre-LN's hidden-state magnitude grows with depth during
    training; Peri-LN's stays flat."""
    common = sorted(set(d.depths_of("pre")) & set(d.depths_of("peri")))
    if not common:
        return "not measured", "Needs `pre` and `peri` at the same depth."
    rows, holds = [], []
    for L in common:
        stats = {}
        for v in ("pre", "peri"):
            init, after = d.stream_profile(v, L, 0)[1:], d.stream_profile(v, L, -1)[1:]  # layers 1..L
            stats[v] = (float(np.max(init)), float(np.max(after)), float(np.max(after) / np.max(init)),
                        growth_factor(after))
        pre, peri = stats["pre"], stats["peri"]
        parts = [pre[2] > LEVEL and pre[3] > LEVEL, 1 / LEVEL <= peri[2] <= LEVEL and peri[3] < pre[3]]
        holds.append(parts)
        rows.append(f"| {L} | {_fmt(pre[0])} -> {_fmt(pre[1])} ({_fmt(pre[2])}x) | {_fmt(pre[3])} | "
                    f"{_fmt(peri[0])} -> {_fmt(peri[1])} ({_fmt(peri[2])}x) | {_fmt(peri[3])} | "
                    + ", ".join(_yn(x) for x in parts) + " |")
    body = (
        f"Hidden-state magnitude ||x_l||^2 / d of the residual stream after each layer (l = 1..L) on the held-out "
        f"batch, seed mean, lr {d.lr0:g}, warmup {d.w0}: its largest value over the layers at initialisation -> "
        "after training (growth during training in brackets), and the depth factor after training (fitted "
        "end-to-end factor over the layers, > 1 rises toward the output). The rule, at every depth: (1) pre-LN's "
        f"largest magnitude grows during training by more than {LEVEL:.2f}x and rises with depth after training "
        f"(factor > {LEVEL:.2f}); (2) Peri-LN's stays flat during training (growth within [{1 / LEVEL:.2f}, "
        f"{LEVEL:.2f}]) and rises with depth less than pre-LN's. Peri-LN's output norms make each sublayer add "
        "a unit-scale vector, so its stream grows with depth at initialisation already.\n\n"
        "| depth | pre-LN largest magnitude | pre-LN depth factor after | Peri-LN largest magnitude | Peri-LN depth "
        "factor after | parts 1-2 hold |\n|---|---|---|---|---|---|\n" + "\n".join(rows)
        + "\n\n![hidden states after training](stream_norm_trained.png)"
    )
    if _nothing_trained([d.get(v, L) for v in ("pre", "peri") for L in common]):
        return _inconclusive(body, "pre-LN or Peri-LN")
    return _depth_verdict(holds), body


def claim_normformer(d: Data) -> tuple[str, str]:
    """NormFormer (Shleifer et al. 2021), Fig. 2: during training pre-LN's gradient norms are
    larger in early layers than in late ones."""
    depths = d.depths_of("pre")
    if not depths:
        return "not measured", "Needs `pre`."
    rows, holds = [], []
    for L in depths:
        factors = {v: growth_factor(d.train_grad_profile(v, L)) for v in d.variants if L in d.depths_of(v)}
        falls = factors["pre"] < 1 / LEVEL
        holds.append([falls])
        rows.append(f"| {L} | " + " | ".join(_fmt(factors.get(v, float("nan"))) for v in d.variants)
                    + f" | {_yn(falls)} |")
    body = (
        "Per-layer gradient norm (whole layer) averaged over every training step (the chunk means), seed mean, "
        f"lr {d.lr0:g}, warmup {d.w0}; fitted end-to-end factor over the layers (< 1 falls toward the output). "
        f"The rule: pre-LN's factor < {1 / LEVEL:.2f} at every depth. Other variants for reference. Xiong's "
        "Fig. 3 row above measures the same profile at initialisation.\n\n"
        f"| depth | {' | '.join(d.variants)} | pre-LN falls |\n|{'---|' * (len(d.variants) + 2)}\n"
        + "\n".join(rows) + "\n\n![gradient norms during training](train_grad_norms.png)"
    )
    if _nothing_trained([d.get("pre", L) for L in depths]):
        return _inconclusive(body, "pre-LN")
    return _depth_verdict(holds), body


def _best(d: Data, variant: str, depth: int, warmup: int = 0) -> tuple[float, float]:
    """(best learning rate, its clipped final loss, seed mean) over the sweep's LR grid; NaN if not run."""
    ran = {lr: x for lr in d.lrs if not math.isnan(x := d.clipped(variant, depth, lr, warmup))}
    if not ran:
        return float("nan"), float("nan")
    lr = min(ran, key=ran.get)
    return lr, ran[lr]


def claim_dyt(d: Data) -> tuple[str, str]:
    """Zhu et al. 2025 (DyT): replacing every norm by DyT(x) = w tanh(alpha x) + b matches the
    normalised Transformer."""
    common = sorted(set(d.depths_of("pre")) & set(d.depths_of("pre-dyt")))
    if not common:
        return "not measured", "Needs `pre` and `pre-dyt` at the same depth (the `depth` preset has them)."
    rows, holds = [], []
    for L in common:
        (lr_pre, pre), (lr_dyt, dyt) = _best(d, "pre", L), _best(d, "pre-dyt", L)
        trains = _outcome(_rate(d.get("pre-dyt", L, lr_dyt, 0))) == "trains"
        parts = [trains and dyt <= pre + MATCH]
        holds.append(parts)
        rows.append(f"| {L} | {_fmt(pre, 3)} (lr {lr_pre:g}) | {_fmt(dyt, 3)} (lr {lr_dyt:g}) | "
                    f"{_fmt(dyt - pre, 3)} | {_yn(parts[0])} |")
    body = (
        "Best clipped final loss over the LR grid without warmup, seed mean, pre-LN with LayerNorm against "
        f"pre-LN with DyT in place of every norm (alpha = 0.5 at init). The rule: at every depth DyT trains at "
        f"its best LR and ends within {MATCH} nats of LayerNorm's best (or below it).\n\n"
        "| depth | pre-LN best | pre-DyT best | DyT - LN | holds |\n|---|---|---|---|---|\n" + "\n".join(rows)
        + "\n\n![final loss vs depth](depth_loss.png)"
    )
    if _nothing_trained([d.get(v, L, lr, 0) for v in ("pre", "pre-dyt") for L in common for lr in d.lrs]):
        return _inconclusive(body, "pre-LN or pre-DyT")
    return _depth_verdict(holds), body


def claim_lns(d: Data) -> tuple[str, str]:
    """Sun et al. 2025 (The Curse of Depth): scaling each pre-norm output by 1/sqrt(l) improves
    pre-LN, and more so the deeper the model."""
    common = sorted(set(d.depths_of("pre")) & set(d.depths_of("pre-lns")))
    if len(common) < 2:
        return "not measured", "Needs `pre` and `pre-lns` at two or more depths (the `depth` preset has them)."
    rows, gain = [], {}
    for L in common:
        (lr_pre, pre), (lr_lns, lns) = _best(d, "pre", L), _best(d, "pre-lns", L)
        gain[L] = pre - lns
        rows.append(f"| {L} | {_fmt(pre, 3)} (lr {lr_pre:g}) | {_fmt(lns, 3)} (lr {lr_lns:g}) | {_fmt(gain[L], 3)} |")
    lo, hi = common[0], common[-1]
    parts = [gain[hi] > MATCH, gain[hi] > gain[lo]]
    body = (
        "Best clipped final loss over the LR grid without warmup, seed mean, pre-LN against pre-LN with LayerNorm "
        f"Scaling; gain = pre-LN - LNS (> 0: LNS better). The rule, two parts: (1) at the deepest depth ({hi}) "
        f"LNS is better by more than {MATCH} nats; (2) its gain there is larger than at the shallowest ({lo}). "
        f"Parts hold: {_yn(parts[0])}, {_yn(parts[1])}.\n\n"
        "| depth | pre-LN best | pre-LNS best | gain |\n|---|---|---|---|\n" + "\n".join(rows)
        + "\n\n![final loss vs depth](depth_loss.png)"
    )
    if _nothing_trained([d.get(v, L, lr, 0) for v in ("pre", "pre-lns") for L in common for lr in d.lrs]):
        return _inconclusive(body, "pre-LN or pre-LNS")
    return _parts_verdict(parts), body


# ------------------------------------------------------------------------------------
# The experts variants (model.MOE_VARIANTS): claims and tables, in a report only when its
# sweep ran them (the other presets' reports stay as they were).
# ------------------------------------------------------------------------------------


def _moe_pairs(d: Data) -> list[tuple[str, str]]:
    """(experts variant, its dense twin) pairs both in the sweep."""
    return [(m, DENSE_TWIN[m]) for m in MOE_VARIANTS if m in d.variants and DENSE_TWIN[m] in d.variants]


def _router(d: Data, variant: str, depth: int, lr: float, key: str, when: int) -> float:
    """Seed mean (runs with a finite value) of the max over layers of a router measure
    (`train.ROUTER`) at probe `when` (0: init, -1: after training); NaN where none is finite."""
    vals = []
    for r in d.get(variant, depth, lr, 0):
        a = _arr(r["metrics"].get(key, []))
        if a.ndim >= 1 and a.shape[0]:
            v = trajectory_max(a[when])
            if math.isfinite(v):
                vals.append(v)
    return float(np.mean(vals)) if vals else float("nan")


def _router_peak(d: Data, variant: str, depth: int, lr: float) -> float:
    """Seed mean of the largest |router logit| over training (after every chunk), max over layers."""
    vals = [trajectory_max(_arr(r["metrics"]["router_logit_max"])[1:]) for r in d.get(variant, depth, lr, 0)
            if "router_logit_max" in r["metrics"]]
    vals = [v for v in vals if math.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


def claim_moe_post(d: Data) -> tuple[str, str]:
    """An experts MLP leaves where post-LN fails unchanged (Liu et al.'s amplification is the
    residual branch's, whatever the MLP)."""
    pairs = _moe_pairs(d)
    if ("post-moe", "post") not in pairs:
        return "not measured", "Needs `post` and `post-moe` (the `cpu-moe` preset has them)."
    rows, same = [], {}
    for moe, dense in pairs:
        for L in d.depths:
            for lr in d.lrs:
                a, b = _outcome(_rate(d.get(dense, L, lr, 0))), _outcome(_rate(d.get(moe, L, lr, 0)))
                if "not run" in (a, b):
                    continue
                same[(moe, L, lr)] = a == b
                rows.append(f"| {dense} / {moe} | {L} | {lr:g} | {a} | {b} | {_yn(a == b)} |")
    post = [v for (m, _, _), v in same.items() if m == "post-moe"]
    verdict = "agrees" if all(post) else "partly agrees" if sum(post) > len(post) / 2 else "does not agree"
    body = ("Outcome (majority of seeds, no warmup) of each dense placement and its experts twin at every depth "
            "and learning rate. The rule, on post-LN: the outcomes are the same in every setting (agrees), in more "
            f"than half (partly agrees), or not (does not agree); post-LN: {sum(post)} of {len(post)} the same; "
            f"pre-LN (reported, not part of the verdict): "
            f"{sum(v for (m, _, _), v in same.items() if m == 'pre-moe')} of "
            f"{sum(m == 'pre-moe' for (m, _, _) in same)}.\n\n"
            "| dense / experts | depth | lr | dense | experts | same |\n|---|---|---|---|---|---|\n" + "\n".join(rows))
    return verdict, body


def claim_moe_quality(d: Data) -> tuple[str, str]:
    """Switch Transformer: at equal FLOPs per token (here: equal active width), the experts MLP
    reaches a lower loss in the same number of steps than the dense MLP."""
    pairs = _moe_pairs(d)
    if ("pre-moe", "pre") not in pairs:
        return "not measured", "Needs `pre` and `pre-moe` (the `cpu-moe` preset has them)."
    rows, better = [], []
    for moe, dense in pairs:
        for L in d.depths:
            (lr_d, x_d), (lr_m, x_m) = _best(d, dense, L), _best(d, moe, L)
            if math.isnan(x_d) or math.isnan(x_m):
                continue
            diff = x_m - x_d
            word = "better" if diff < -MATCH else "worse" if diff > MATCH else "matches"
            if moe == "pre-moe":
                better.append(diff < -MATCH)
            rows.append(f"| {dense} / {moe} | {L} | {_fmt(x_d, 3)} (lr {lr_d:g}) | {_fmt(x_m, 3)} (lr {lr_m:g}) | "
                        f"{_fmt(diff, 3)} | {word} |")
    body = (f"Best clipped final loss over the LR grid without warmup, seed mean, each dense placement against its "
            f"experts twin ({MOE_EXPERTS} experts of width d_ff / {MOE_TOP_K}, top-{MOE_TOP_K}: the same active "
            f"width, {MOE_EXPERTS // MOE_TOP_K}x the MLP parameters). \"better\" / \"worse\": by more than {MATCH} "
            f"nats. The rule, on pre-LN (where both train): the experts MLP is better at every depth (agrees), at "
            "some (partly agrees), at none (does not agree). Post-LN's rows are reported, not part of the verdict.\n\n"
            "| dense / experts | depth | dense best | experts best | experts - dense | |\n|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n\n![final loss vs depth](depth_loss.png)")
    if _nothing_trained([d.get(v, L, lr, 0) for v in ("pre", "pre-moe") for L in d.depths for lr in d.lrs]):
        return _inconclusive(body, "pre-LN or pre-MoE")
    return _parts_verdict(better), body


def claim_moe_router_logits(d: Data) -> tuple[str, str]:
    """ST-MoE (Zoph et al. 2022): router logits grow large in training (what its router z-loss
    is for), more so at higher learning rates."""
    moes = [m for m in MOE_VARIANTS if m in d.variants]
    if not moes:
        return "not measured", "Needs an experts variant (the `cpu-moe` preset has them)."
    top = max(d.lrs)
    rows, rises, grows = [], [], []
    for m in moes:
        for L in d.depths:
            if not any(d.get(m, L, lr, 0) for lr in d.lrs):
                continue
            init = _router(d, m, L, d.lrs[0], "router_logit_max", 0)
            final = {lr: _router(d, m, L, lr, "router_logit_max", -1) for lr in d.lrs}
            ran = [final[lr] for lr in d.lrs if not math.isnan(final[lr])]
            rise = len(ran) >= 2 and all(b >= a for a, b in zip(ran, ran[1:], strict=False))
            grow = _router_peak(d, m, L, top) / _router(d, m, L, top, "router_logit_max", 0)
            rises.append(rise)
            grows.append(grow > LOGIT_GROWTH)
            rows.append(f"| {m} | {L} | {_fmt(init)} | " + " | ".join(_fmt(final[lr]) for lr in d.lrs)
                        + f" | {_fmt(grow)} | {_yn(rise)} |")
    parts = [all(rises), all(grows)]
    body = ("The largest |router logit| (max over layers and held-out tokens), seed mean: at initialisation and "
            "after training at each learning rate, and its growth over training (max over the probes / at init) at "
            f"the highest learning rate ({top:g}). The rule, two parts, each over every experts variant and depth: "
            "(1) the final largest logit does not fall as the learning rate rises (over the learning rates where a "
            f"run stayed finite); (2) at the highest learning rate it grows more than {LOGIT_GROWTH:g}x over "
            f"training. Parts hold: {_yn(parts[0])}, {_yn(parts[1])}.\n\n"
            "| variant | depth | at init | " + " | ".join(f"after, lr {lr:g}" for lr in d.lrs)
            + f" | growth at lr {top:g} | rises with lr |\n|---|---|---|" + "---|" * len(d.lrs) + "---|---|\n"
            + "\n".join(rows) + "\n\n![router](router.png)")
    return _parts_verdict(parts), body


def claim_moe_collapse(d: Data, aux_coef: float) -> tuple[str, str]:
    """Shazeer et al. 2017: without a balancing loss the gate converges to always favour the same
    few experts (a self-reinforcing imbalance)."""
    moes = [m for m in MOE_VARIANTS if m in d.variants]
    if not moes:
        return "not measured", "Needs an experts variant (the `cpu-moe` preset has them)."
    rows, flags = [], []
    for m in moes:
        for L in d.depths:
            for lr in d.lrs:
                recs = d.get(m, L, lr, 0)
                if not recs:
                    continue
                n_collapsed = []
                for r in recs:
                    bal = _arr(r["metrics"]["expert_balance"])[-1]  # (L,) after training
                    n = int(np.sum(bal >= COLLAPSE)) if np.all(np.isfinite(bal)) else None
                    n_collapsed.append(n)
                    if r["summary"]["status"] == "trained" and n is not None:
                        flags.append(n > 0)
                mean_final = float(np.nanmean([np.nanmean(_arr(r["metrics"]["expert_balance"])[-1]) for r in recs]))
                rows.append(f"| {m} | {L} | {lr:g} | {_fmt(_router(d, m, L, lr, 'expert_balance', 0))} | "
                            f"{_fmt(mean_final)} | {_fmt(_router(d, m, L, lr, 'expert_balance', -1))} | "
                            f"{', '.join('n/a' if n is None else str(n) for n in n_collapsed)} | "
                            f"{_fmt(float(np.nanmean([_arr(r['metrics']['router_aux'])[-1] for r in recs])))} |")
    verdict = ("not measured" if aux_coef else "agrees" if flags and sum(flags) > len(flags) / 2
               else "partly agrees" if any(flags) else "does not agree")
    body = (f"Load balance of a layer = X * the largest share of the top-k picks any one expert gets, on the "
            f"held-out batch (X = {MOE_EXPERTS}, k = {MOE_TOP_K}: 1 when every expert gets 1/{MOE_EXPERTS} of the "
            f"picks, {MOE_EXPERTS / MOE_TOP_K:g} when every token picks the same {MOE_TOP_K}); a layer's routing "
            f"\"collapsed\" at {COLLAPSE:g} or more (past half-way). Seed means; balance at init and after training "
            "is the busiest layer's (the max over layers), \"mean\" over layers; \"collapsed layers\": per seed; HF's "
            f"load-balancing loss after training over the whole stack ({MOE_TOP_K} when balanced). The rule (the "
            "claim is about training without a balancing loss: \"not measured\" when --router-aux-coef > 0): "
            "among the runs that trained, more than half have a collapsed layer (agrees), some do (partly agrees), "
            f"none (does not agree); {sum(flags)} of {len(flags)} trained runs have one. Router auxiliary loss "
            f"coefficient in this sweep: {aux_coef:g}" + (" (off)" if not aux_coef else "") + ".\n\n"
            "| variant | depth | lr | balance at init | mean after | busiest layer after | collapsed layers "
            "| load-balancing loss after |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
            + "\n\n![router](router.png)")
    return verdict, body


def moe_answer(d: Data, aux_coef: float) -> str:
    """The experts section's opening paragraph, computed from the cells: where each experts
    variant trains against its dense twin, the best losses, the router logits by learning rate
    and the load balance after training."""
    parts = []
    for moe, dense in _moe_pairs(d):
        where = []
        for L in d.depths:
            ok = {v: [lr for lr in d.lrs if _outcome(_rate(d.get(v, L, lr, 0))) == "trains"] for v in (dense, moe)}
            ran = {v: any(d.get(v, L, lr, 0) for lr in d.lrs) for v in (dense, moe)}
            where.append(f"{L}: " + " vs ".join((", ".join(f"{lr:g}" for lr in ok[v]) or "none") if ran[v]
                                                else "not run" for v in (dense, moe)))
        best = "; ".join(f"{L}: {_fmt(_best(d, dense, L)[1], 3)} vs {_fmt(_best(d, moe, L)[1], 3)}" for L in d.depths)
        parts.append(f"`{dense}` vs `{moe}` train at learning rates ({'; '.join(where)}), best final loss by depth "
                     f"({best})")
    logits, balance = [], []
    for m in (m for m in MOE_VARIANTS if m in d.variants):
        for L in d.depths:
            logits.append(f"`{m}` {L}: " + " / ".join(_fmt(_router(d, m, L, lr, "router_logit_max", -1), 1)
                                                     for lr in d.lrs))
            balance.append(f"`{m}` {L}: " + " / ".join(_fmt(_router(d, m, L, lr, "expert_balance", -1))
                                                      for lr in d.lrs))
    lrs = " / ".join(f"{lr:g}" for lr in d.lrs)
    return (f"Router auxiliary loss coefficient {aux_coef:g}" + (" (off: the routers trained on the cross-entropy "
            "alone)" if not aux_coef else "") + ". " + ". ".join(parts) + ". The largest |router logit| after "
            f"training at lr {lrs} (max over layers, seed mean): " + "; ".join(logits) + ". The load balance after "
            f"training (X * the busiest expert's share of the picks in the busiest layer; 1 = balanced, "
            f"{MOE_EXPERTS / MOE_TOP_K:g} = every token on the same {MOE_TOP_K} experts; collapsed from "
            f"{COLLAPSE:g}) at lr {lrs}: " + "; ".join(balance) + ". Each question's verdict, by its rule, is under "
            "Findings.")


def moe_claims(d: Data, aux_coef: float) -> list[tuple[str, str, Callable[[Data], tuple[str, str]]]]:
    """The experts variants' claims as CLAIMS' (source, claim, function of Data) rows; none
    unless the sweep ran an experts variant."""
    if not any(m in d.variants for m in MOE_VARIANTS):
        return []
    return [
        ("Liu et al. 2020 (Admin), with experts",
         "An experts MLP leaves where post-LN fails unchanged: post-LN-MoE fails where post-LN fails.",
         claim_moe_post),
        ("Fedus et al. 2022 (Switch Transformer), Sec. 2 / Fig. 1",
         "At equal FLOPs per token (equal active width), the experts MLP reaches a lower loss in as many steps.",
         claim_moe_quality),
        ("Zoph et al. 2022 (ST-MoE), Sec. 3.3",
         "Router logits grow large during training, more so at higher learning rates.",
         claim_moe_router_logits),
        ("Shazeer et al. 2017, Sec. 4",
         "Without a balancing loss, routing collapses onto a few experts.",
         lambda d: claim_moe_collapse(d, aux_coef)),
    ]


CLAIMS = [
    ("Xiong et al. 2020, Fig. 3",
     "At initialisation post-LN's per-layer gradient norm grows toward the output; pre-LN's is level.",
     claim_init_gradients),
    ("Xiong et al. 2020, Theorem 1",
     "The last layer's gradient is flat in depth for post-LN and shrinks like 1/sqrt(L) for pre-LN.",
     claim_last_layer),
    ("Xiong et al. 2020, Lemma 2",
     "Activations' squared norm grows linearly with the layer index in pre-LN and stays constant in post-LN.",
     claim_stream),
    ("Xiong et al. 2020, Fig. 2 / Sec. 3.2", "Post-LN needs learning-rate warmup.", claim_warmup),
    ("Liu et al. 2020 (Admin), Fig. 1",
     "Post-LN trains at 6 layers and fails deeper (12, 18) where pre-LN trains.",
     claim_depth),
    ("Liu et al. 2020 (Admin), Sec. 4",
     "Post-LN amplifies the output change of an update, more so as depth grows.",
     claim_amplification),
    ("Wang et al. 2022 (DeepNet), Fig. 5",
     "Post-LN's early model update explodes and grows with depth; DeepNorm keeps it small and flat.",
     claim_deepnorm),
    ("Skip ablation", "Without the identity path a 6-layer stack fails where post-LN and pre-LN train.", claim_skip),
    ("Wortsman et al. 2023",
     "Without QK-norm the largest attention logit grows at high learning rates and training degrades; QK-norm keeps "
     "it bounded and lowers LR sensitivity.",
     claim_wortsman),
    ("Peri-LN (Kim et al. 2025)",
     "Pre-LN's hidden-state magnitude grows with depth during training; Peri-LN's stays flat.",
     claim_peri),
    ("NormFormer (Shleifer et al. 2021), Fig. 2",
     "During training pre-LN's gradient norms are larger in early layers than in late ones.",
     claim_normformer),
    ("Zhu et al. 2025 (DyT)", "Dynamic Tanh in place of every norm matches the normalised Transformer.", claim_dyt),
    ("Sun et al. 2025 (Curse of Depth)",
     "LayerNorm Scaling (pre-norm output / sqrt(l)) improves pre-LN, more so at depth.",
     claim_lns),
]


PLAIN = {"post": "post-LN", "pre": "pre-LN"}  # the question's two placements, in words


def _cell(d: Data, variant: str, depth: int) -> list[tuple[float, int, int]]:
    """(lr, seeds trained, seeds run) for each learning rate of the grid that ran, without warmup."""
    return [(lr, sum(r["summary"]["status"] == "trained" for r in recs), len(recs))
            for lr in d.lrs if (recs := d.get(variant, depth, lr, 0))]


def _depths(depths: list[int]) -> str:
    return "no depth" if not depths else " and ".join([", ".join(map(str, depths[:-1])), str(depths[-1])]
                                                       if len(depths) > 1 else [str(depths[0])]) + " layers"


def _headline(d: Data, trains: dict[str, list[int]], ran: dict[str, list[int]]) -> str:
    """The question's answer in one or two sentences: where post-LN and pre-LN train."""
    if not ({"post", "pre"} <= set(trains)):
        return ("**Pre-LN or post-LN at depth?** Not asked by this sweep (it runs "
                + ", ".join(f"`{v}`" for v in trains) + "); where each placement trains:")
    said = "; ".join(f"{PLAIN[v]} trains at {_depths(trains[v])}"
                     + (f" and fails at {_depths(sorted(set(ran[v]) - set(trains[v])))}"
                        if set(ran[v]) - set(trains[v]) else "") for v in ("post", "pre"))
    deep = max(set(ran["post"]) & set(ran["pre"]), default=None)
    if deep is None:
        return f"**Pre-LN or post-LN at depth?** {said[0].upper() + said[1:]}."
    post, pre = deep in trains["post"], deep in trains["pre"]
    end = (f"at {deep} layers pre-LN trains and post-LN does not" if pre and not post else
           f"at {deep} layers post-LN trains and pre-LN does not" if post and not pre else
           f"at {deep} layers both train" if post else
           f"at {deep} layers neither trains: this sweep cannot tell them apart there")
    return f"**Pre-LN or post-LN at depth?** {said[0].upper() + said[1:]}: {end}."


def opening(d: Data) -> str:
    """The report's opening, computed from the cells: which placement trains at which depth
    (a table of every variant and depth), and how sure (the rule, the seeds behind each cell,
    which cells the seeds split)."""
    trains: dict[str, list[int]] = {}
    ran: dict[str, list[int]] = {}
    rows, cells, split = [], 0, []
    for v in d.variants:
        row = []
        for L in d.depths:
            cell = _cell(d, v, L)
            if not cell:
                row.append("-")
                continue
            ok = [lr for lr, k, n in cell if 2 * k > n]  # most of the seeds trained (`_outcome`)
            ran.setdefault(v, []).append(L)
            trains.setdefault(v, []).extend([L] if ok else [])
            lrs = "" if len(d.lrs) == 1 else f" at lr {', '.join(f'{x:g}' for x in ok)}" if ok else " at every lr"
            row.append(f"{'trains' if ok else 'fails'}{lrs} ({', '.join(f'{k}/{n}' for _, k, n in cell)} "
                       "seeds trained)")
            cells += len(cell)
            split += [f"`{v}` at {L} layers, lr {lr:g} ({k}/{n})" for lr, k, n in cell if 0 < k < n]
        rows.append(f"| `{v}` {VARIANT_NOTES.get(v, '')} | " + " | ".join(row) + " |")
    seeds = sorted({len(r) for r in d.by.values()})
    grid = f"lr {d.lrs[0]:g}" if len(d.lrs) == 1 else f"each learning rate of {', '.join(f'{x:g}' for x in d.lrs)}"
    sure = (f"How sure: each cell is {'-'.join(map(str, seeds))} seeds at {grid}, without warmup. The rule (fixed "
            "before the runs): a run fails when its loss goes non-finite or its final held-out loss stays above "
            f"half-way ({PLATEAU_FRACTION:g}) from its loss at init to H; a placement trains at a depth when more "
            f"than half of its seeds train (at some learning rate). The seeds agreed in {cells - len(split)} of "
            f"{cells} (variant, depth, lr) cells" + (f"; they split in {'; '.join(split)}." if split else "."))
    table = ("| placement | " + " | ".join(f"{L} layers" for L in d.depths) + " |\n|---|"
             + "---|" * len(d.depths) + "\n" + "\n".join(rows))
    return _headline(d, trains, ran) + "\n\n" + table + "\n\n" + sure


def answer(d: Data, verdicts: list[tuple[str, str, str, str]]) -> str:
    """The report's first screen: which placements train at which depth and learning rate in
    this sweep, the best loss at the deepest depth, and where that agrees with the papers; one
    paragraph computed from the cells."""
    h = d.records[0]["task"]["optimal_loss"]
    parts = []
    for v in d.variants:
        where = []
        for L in sorted({k[1] for k in d.by if k[0] == v}):
            ok = [lr for lr in d.lrs if _outcome(_rate(d.get(v, L, lr, 0))) == "trains"]
            where.append(f"{L}: " + (", ".join(f"{lr:g}" for lr in ok) if ok else "none"))
        parts.append(f"`{v}` ({'; '.join(where)})")
    deepest = max(d.depths)
    best = {v: _best(d, v, deepest) for v in d.variants if deepest in {k[1] for k in d.by if k[0] == v}}
    ranked = sorted((x for x in best.items() if not math.isnan(x[1][1])), key=lambda x: x[1][1])
    by_verdict: dict[str, list[str]] = defaultdict(list)
    for ref, _, verdict, _ in verdicts:
        by_verdict[verdict].append(ref)
    said = " ".join(f"**{k.capitalize()}**: {'; '.join(by_verdict[k])}." for k in
                     ("agrees", "partly agrees", "does not agree", "inconclusive", "not measured") if by_verdict[k])
    return (
        "Which placements train here (held-out loss past half-way to H by the failure rule under Setup, "
        "majority of seeds, no warmup), "
        "by depth: the learning rates at which each trains -- " + "; ".join(parts) + ". "
        f"At {deepest} layers, the best final loss over the LR grid (H = {h:.3f}): "
        + ", ".join(f"`{v}` {x:.3f} (lr {lr:g})" for v, (lr, x) in ranked) + ". "
        "Against the literature (each verdict computed by the rule in its section below): " + said
    )


# ------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------


def results_table(d: Data) -> str:
    lines = ["| variant | depth | lr | warmup | seeds | failed | statuses (fail step) | final held-out loss "
             "| excess over H |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(d.by, key=lambda k: (ORDER[k[0]], k[1], k[2], k[3])):
        recs = d.by[key]
        h = recs[0]["task"]["optimal_loss"]
        mean = _mean_final(recs)
        status = ", ".join(f"{r['summary']['status']}"
                           + (f" ({r['summary']['step']})" if r["summary"]["step"] is not None else "")
                           for r in sorted(recs, key=lambda r: r["config"]["seed"]))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {key[3]} | {len(recs)} | "
                     f"{sum(r['summary']['status'] != 'trained' for r in recs)} | "
                     f"{status} | {_fmt(mean, 3)} | {_fmt(mean - h, 3)} |")
    return "\n".join(lines)


def lr_sensitivity_table(d: Data) -> str:
    """Per variant, depth and warmup: clipped final loss at each LR, the best LR, Wortsman et
    al.'s LR sensitivity and the LRs that fail (majority of seeds)."""
    if len(d.lrs) < 2:
        return f"Only one learning rate ({d.lrs[0]:g}) in this sweep; run `--lrs` with several to measure sensitivity."
    lines = [
        "min(final held-out loss, loss at init), seed mean (a diverged run counts as its loss at init), at each "
        "learning rate; sensitivity = mean over the grid of [that loss - the best over the grid] (Wortsman et al. "
        "2023); lower is better. A dash: not run.", "",
        "| variant | depth | warmup | " + " | ".join(f"lr {lr:g}" for lr in d.lrs)
        + " | best lr | best - H | sensitivity | lrs that fail |",
        "|---|---|---|" + "---|" * len(d.lrs) + "---|---|---|---|"]
    h = d.records[0]["task"]["optimal_loss"]
    near, far = [], []
    for v in d.variants:
        for L in d.depths:
            for w in d.warmups:
                losses = {lr: d.clipped(v, L, lr, w) for lr in d.lrs}
                if all(math.isnan(x) for x in losses.values()):
                    continue
                ran = {lr: x for lr, x in losses.items() if not math.isnan(x)}
                best = min(ran, key=ran.get)
                bad = [f"{lr:g}" for lr in d.lrs if _outcome(_rate(d.get(v, L, lr, w))) in ("fails", "mixed")]
                cells = " | ".join("-" if math.isnan(x) else _fmt(x, 3) for x in losses.values())
                lines.append(f"| {v} | {L} | {w} | {cells}"
                             + f" | {best:g} | {_fmt(ran[best] - h, 3)} | {_fmt(d.sensitivity(v, L, w), 3)} | "
                             f"{', '.join(bad) or '-'} |")
                if w == 0 and _outcome(_rate(d.get(v, L, best, w))) == "trains":
                    (near if ran[best] - h <= TARGET_EXCESS else far).append(f"{v} L{L}")
    lines += ["", f"At its best learning rate without warmup, within {TARGET_EXCESS} nats of H: "
              f"{', '.join(near) or 'none'}; further: {', '.join(far) or 'none'}."]
    return "\n".join(lines)


def logit_table(d: Data) -> str:
    """Largest attention logit over training and the output logits' RMS after training, per
    variant and depth (rows) and LR (columns), warmup 0 if run; seed means."""
    w = 0 if 0 in d.warmups else d.warmups[0]
    head = " | ".join(f"lr {lr:g}" for lr in d.lrs)
    attn = [f"| variant | depth | at init | {head} |", "|---|---|---|" + "---|" * len(d.lrs)]
    out = list(attn)
    for v in d.variants:
        for L in d.depths:
            recs = {lr: d.get(v, L, lr, w) for lr in d.lrs}
            if not any(recs.values()) or "logit_rms" not in next(r for r in recs.values() if r)[0]["metrics"]:
                continue
            growth = {lr: d.logit_growth(v, L, lr, w) for lr in d.lrs}
            init = next((g[0] for g in growth.values() if not math.isnan(g[0])), float("nan"))
            attn.append(f"| {v} | {L} | {_fmt(init)} | " + " | ".join(
                _fmt(growth[lr][1]) if recs[lr] else "-" for lr in d.lrs) + " |")
            with warnings.catch_warnings():  # every seed diverged: NaN, quietly
                warnings.simplefilter("ignore", RuntimeWarning)
                rms = {lr: float(np.nanmean([_arr(r["metrics"]["logit_rms"])[-1] for r in rs])) if rs else None
                       for lr, rs in recs.items()}
                rms0 = float(np.nanmean([_arr(r["metrics"]["logit_rms"])[0] for rs in recs.values() for r in rs]))
            out.append(f"| {v} | {L} | {_fmt(rms0)} | " + " | ".join(
                "-" if x is None else _fmt(x) for x in rms.values()) + " |")
    return "\n".join([
        f"Warmup {w}; seed means. The largest attention logit (scaled q.k before softmax, max over layers, heads "
        "and held-out positions) at initialisation and its maximum over training (n/a: not recorded by the "
        "Encoder that ran the cells):", "", *attn, "",
        "RMS of the LM head's output logits on the held-out batch at initialisation and after training "
        "(n/a: diverged):", "", *out])


def rule_changes() -> str:
    if not RULE_CHANGES:
        return ("No rule has been changed after its data was seen. The rules of the 2020-2022 claims are those of "
                "the first edition; those of Wortsman et al., Peri-LN and NormFormer (and the learning-rate "
                "sensitivity) were written in `experiments/stability/report.py` before a sweep with a learning-rate "
                "grid or these variants had been run; those of DyT and LayerNorm Scaling (`MATCH`) and the answer "
                "above before the `depth` preset, the first sweep with those variants, had been run.")
    return "\n".join(["| date | rule | change | why |", "|---|---|---|---|"]
                     + [f"| {a} | {b} | {c} | {e} |" for a, b, c, e in RULE_CHANGES])


def entropy_table(d: Data) -> str:
    lines = ["| variant | depth | attention entropy at init | at the last recorded chunk | final grad norm |",
             "|---|---|---|---|---|"]
    for v in d.variants:
        for L in d.depths_of(v):
            recs = d.get(v, L)
            ent = np.array([_arr(r["metrics"]["attn_entropy"]) for r in recs])  # (seeds, chunks, L)
            gn = [np.nanmean(_arr(r["metrics"]["grad_norm"])[-10:]) for r in recs]
            lines.append(f"| {v} | {L} | {_fmt(float(np.nanmean(ent[:, 0])))} | "
                         f"{_fmt(float(np.nanmean(ent[:, -1])))} | "
                         f"{_fmt(float(np.nanmean(gn)), 3)} |")
    return "\n".join(lines)


def task_line(sweep: dict, task: dict) -> str:
    """The setup's line on the task: what H is, and the unigram loss."""
    if sweep["task"] == "text":
        return (f"- Task `text`: characters of CPython {task.get('python', '?')}'s documentation "
                f"(`pydoc_data.topics`, sha256 {task.get('corpus_sha256', '?')[:12]}...), "
                f"{task.get('train_chars', '?')} training and {task.get('heldout_chars', '?')} held-out characters "
                f"from topics split apart (held out: {', '.join(task.get('heldout_topics', []))}); vocabulary "
                f"{sweep['vocab']} symbols, context {sweep['seq_len']}. Its optimum is unknown; H below is a "
                f"reference, the held-out cross-entropy of a {task.get('reference', 'n-gram')} model trained on "
                f"the training text ({task['optimal_loss']:.3f} nats/char; a model can beat it), and the add-one "
                f"unigram's is {task['unigram_loss']:.3f} (ln {sweep['vocab']} = {math.log(sweep['vocab']):.3f}).")
    return (f"- Task `{sweep['task']}`: vocabulary {sweep['vocab']}, context {sweep['seq_len']}; optimal loss "
            f"H = {task['optimal_loss']:.3f} nats (the chain's entropy rate), context-free (unigram) loss "
            f"{task['unigram_loss']:.3f}" + (f"; the true chain scores {task['heldout_optimal_loss']:.3f} on the "
            f"held-out batch ({sweep['heldout']} sequences), the sampling noise of every held-out loss below"
            if task.get("heldout_optimal_loss") is not None else "") + ".")


def _timing(last: dict | None, env: dict) -> str:
    """The Setup's words on how long the last invocation took, and on what machine load."""
    timing = "timing not recorded"
    if last:
        cpu = f" and {last['cpu_seconds']:.0f} s of CPU time" if last.get("cpu_seconds") is not None else ""
        timing = (f"the last invocation computed {last['cells_computed']} of them in {last['wall_seconds']:.0f} s "
                  f"wall-clock{cpu} (compiling, training and writing; not counting imports and this report)")
        cc = last.get("compile_cache")
        if cc and cc.get("programs"):  # the lab's program cache (one process)
            p = cc["programs"]
            timing += (f"; {p['loaded']} of the {p['loaded'] + p['compiled']} compiled programs came from the "
                       "program cache (loaded without tracing)")
        elif cc and cc.get("dir"):  # JAX's persistent cache (several processes)
            timing += (f"; {cc['hits']} of the {cc['requests']} compiled programs came from the persistent "
                       "compilation cache")
        if last.get("interrupted"):
            timing += f"; it was interrupted ({last['interrupted']})"
        loads = [x for x in (last.get("load_average_before"), last.get("load_average_after")) if x]
        if loads:
            timing += (f"; the machine's 1-minute load average was {loads[0][0]:.1f} before and "
                       f"{loads[-1][0]:.1f} after (other processes competing for its {env.get('cpu_count')} CPUs "
                       "slow the wall-clock time)")
    return timing


def _experts_setup(sweep: dict, aux_coef: float) -> str:
    """The Setup's bullet on the experts variants' MLP."""
    return (f"- Experts variants: the MLP sublayer is `flax_blocks`' experts MLP (`BlockConfig(num_experts="
            f"{MOE_EXPERTS}, num_experts_per_tok={MOE_TOP_K}, expert_d_ff=d_ff / {MOE_TOP_K}, norm_topk_prob=True)`): "
            f"a bias-free router, softmax over the {MOE_EXPERTS} experts, the top {MOE_TOP_K} renormalised; each "
            f"expert the lab's ReLU MLP of width {sweep['d_ff'] // MOE_TOP_K} without biases, so a token's active "
            f"width is the dense d_ff {sweep['d_ff']} ({MOE_EXPERTS // MOE_TOP_K}x the MLP's parameters); no "
            "capacity limit, no token dropped; xavier-uniform router and experts. Router auxiliary (load-balancing) "
            f"loss coefficient {aux_coef:g}" + (" (off, the default; `--router-aux-coef`)" if not aux_coef else
                                                 " (HF's Switch-style loss added to the objective)") + ". Measured "
            "at init and after every chunk on the held-out batch, per layer: the largest |router logit| and their "
            "RMS, each expert's share of the top-k picks and the load balance (X * the largest share), and HF's "
            "load-balancing loss over the stack; the FFN W2 gradient norm is the experts' down projections'.")


def _failure_rule(sweep: dict) -> str:
    """The Setup's bullet on when a run counts as failed (the text task's reference is the n-gram model)."""
    rule = (f"- Failure: a non-finite loss (\"diverged\"), or a final held-out loss above "
            f"U − {PLATEAU_FRACTION} (U − H) with U the unigram loss and H the n-gram reference (\"plateau\"): "
            "a run must cover half of the way from a context-free model to the n-gram model"
            if sweep["task"] == "text" else
            f"- Failure: a non-finite loss (\"diverged\"), or a final held-out loss above "
            f"l0 − {PLATEAU_FRACTION} (l0 − H) with l0 the held-out loss at init (\"plateau\")")
    return rule + (". The fail step is the first non-finite step, or the step from which the loss stayed above "
                   "that line.")


def _preset_note(sweep: dict) -> str:
    """", modified" when the sweep is not its preset's own grid (a field newer than the sweep.json: its default)."""
    from dataclasses import asdict, fields

    preset = PRESETS.get(sweep["name"])
    resolved = {**sweep, "vocab": 0} if preset is not None and preset.vocab == 0 else sweep  # text: the corpus's
    defaults = {f.name: f.default for f in fields(Sweep)}  # a field newer than the sweep.json: its default
    resolved = {**{k: v for k, v in defaults.items() if k not in resolved}, **resolved}
    same = preset is not None and json.loads(json.dumps(asdict(preset))) == resolved
    return "" if same else ", modified"


def write_report(out: Path) -> Path:
    """Write OUT/report.md and the PNG plots next to it; returns the report's path."""
    out = Path(out)
    meta, records = load(out)
    if not records:
        raise SystemExit(f"no finished cells for the sweep in {out}")
    sweep = meta["sweep"]
    d = Data(records)
    plots.write_all(records, out)
    env = records[0]["environment"]
    task = records[0]["task"]
    preset_note = _preset_note(sweep)
    timing = _timing(meta.get("last_run"), env)
    aux_coef = float(sweep.get("router_aux_coef", 0.0))
    verdicts = [(ref, claim, *fn(d)) for ref, claim, fn in CLAIMS + moe_claims(d, aux_coef)]

    lines = [
        f"# Depth stability: pre-LN vs post-LN and friends (`{sweep['name']}` preset{preset_note})",
        "",
        "## Verdict",
        "",
        opening(d),
        "",
        f"Generated by `{meta.get('command') or 'python -m experiments.stability'}` (the text and plots "
        "alone can be regenerated from the saved cells with `python -m experiments.stability.report DIR`). Every "
        "verdict is computed from the data by a rule written in `experiments/stability/report.py`; no threshold or "
        "seed was tuned to make a claim pass.",
        "",
        "## The answer in this sweep",
        "",
        answer(d, verdicts),
        "",
        "![final loss vs depth](depth_loss.png)",
        "",
        *(["## The experts MLP", "", moe_answer(d, aux_coef), "", "![router](router.png)", ""]
          if any(m in d.variants for m in MOE_VARIANTS) else []),
        "## Setup",
        "",
        task_line(sweep, task),
        f"- Model: token + learned position embedding, causal `flax_blocks.Encoder`, linear head; "
        f"d_model {sweep['d_model']}, {sweep['num_heads']} heads, d_ff {sweep['d_ff']}, ReLU, no dropout. "
        "Init for every variant: xavier-uniform matrices, zero biases (`BlockConfig(init='xavier')`; "
        "DeepNorm's own beta-scaled xavier-normal on v/out/FFN), embeddings N(0, 1/2) each.",
        "- Variants: " + "; ".join(f"`{v}` {VARIANT_NOTES.get(v, '')}" for v in d.variants) + ". Norms are "
        "LayerNorm unless named (eps 1e-5).",
        *([_experts_setup(sweep, aux_coef)] if any(m in d.variants for m in MOE_VARIANTS) else []),
        f"- Depths {', '.join(map(str, d.depths))}; learning rates "
        f"{', '.join(f'{x:g}' for x in d.lrs)}; warmup {', '.join(map(str, d.warmups))} steps"
        + (f" (nonzero warmup for {', '.join(sweep['warmup_variants'])} only)" if sweep.get("warmup_variants")
           and len(d.warmups) > 1 else "") + "; "
        f"{sweep['seeds']} seeds; {sweep['steps']} steps of Adam (0.9, 0.98, eps 1e-9), batch "
        f"{sweep['batch']} x {sweep['seq_len']} tokens, no clipping, no weight decay.",
        _failure_rule(sweep),
        f"- Measured per run: training and held-out loss, gradient global norm and update size every step; "
        "per-layer gradient norms (whole layer, FFN W2, attention) at the first step of every chunk of "
        f"{sweep['chunk']} steps and their means over the chunk; on the held-out batch, at the start of every "
        "chunk the attention entropy, and at init and after every chunk ||x_l||^2 / d per layer, the largest "
        "attention logit per layer and the RMS and largest |value| of the output logits.",
        "- Everything jitted: three compiled programs per (variant, depth) (the fresh models, the held-out "
        "probe, a chunk of steps), steps under `lax.scan`, layers under the Encoder's scan, runs (lr x warmup "
        "x seed) under `vmap`, sharded over the devices. A run is a pure function of its config: a resumed "
        "sweep gives the same numbers bit for bit; runs computed in a group of another size or on another "
        "device count agree up to float32 rounding (XLA may sum in another order).",
        f"- Ran on {env['device_count']} x {env['device_kind']} ({env['platform']}), jax {env['jax']}, "
        f"flax {env['flax']}; {len(records)} runs"
        + (f" of the sweep's {len(meta['cells'])} (the others not finished: rerunning the command above computes "
           "only them)" if len(records) < len(meta["cells"]) else "") + f"; {timing}.",
        "",
        "## Findings against the literature",
        "",
        "| claim | source | verdict |",
        "|---|---|---|",
    ]
    lines += [f"| {claim} | {ref} | **{verdict}** |" for ref, claim, verdict, _ in verdicts]
    for ref, claim, verdict, body in verdicts:
        lines += ["", f"### {ref}: {verdict}", "", f"*{claim}*", "", body]
    lines += _tables(d)
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _tables(d: Data) -> list[str]:
    """The report's closing sections: every run, the learning-rate sensitivity, the logits,
    the attention entropy and the rules changed after seeing data."""
    return [
        "", "## All runs", "", results_table(d),
        "", "## Learning-rate sensitivity", "", lr_sensitivity_table(d), "", "![final loss vs lr](lr_sweep.png)",
        "", "## Attention and output logits", "", logit_table(d),
        "", "## Attention entropy and gradient norm", "",
        "Mean attention entropy over layers, heads and positions (nats; uniform attention over t "
        "keys has log t), and the gradient global norm over the last 10 steps.", "", entropy_table(d),
        "", "![gradient norm](grad_norm.png)",
        "", "## Rules changed after seeing data", "", rule_changes(), "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.stability.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", type=Path, default=Path(__file__).resolve().parent / "runs" / "quick",
                   help="a sweep's results folder, holding sweep.json and cells/ (default: "
                        "experiments/stability/runs/quick, what make run writes)")
    args = p.parse_args(argv)
    if (args.out / "init.json").exists():  # the initialisation study's folder: its own report
        print(f"error: {args.out} is the initialisation study's: python -m experiments.init_study.report "
              f"{args.out}", file=sys.stderr)
        return 1
    if not (args.out / "sweep.json").exists():
        print(f"error: {args.out / 'sweep.json'} not found: pass the folder a sweep wrote "
              "(python -m experiments.stability --out DIR)", file=sys.stderr)
        return 1
    print(write_report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
