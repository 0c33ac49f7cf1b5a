"""Report of the initialisation study (experiments.init_study): verdicts with intervals, tables, plots.

    python -m experiments.init_study.report experiments/init_study/results    # regenerate report.md + PNGs

Reads OUT/init.json and OUT/cells/*.json only (numpy and matplotlib; no JAX) and writes
OUT/report.md with its PNGs. The claims are Xiong et al. 2020 ("On Layer Normalization in
the Transformer Architecture"), at initialisation:

  Fig. 3     post-LN's FFN W2 gradient norm grows toward the output layer; pre-LN's is level.
  Theorem 1  the last layer's FFN W2 gradient norm is flat in the depth L for post-LN and
             shrinks like L^-1/2 for pre-LN.

Statistics. Draws are i.i.d. (a fresh init and a fresh batch each), n per cell. Every 95 %
interval is a percentile bootstrap over draws (BOOTSTRAP resamples, numpy generator seeded
with BOOT_SEED for every interval, so a report is a pure function of its cells):
  per-layer norm: the mean over draws of g_l, and the interval of that mean;
  end-to-end factor of a profile m_1..m_L (the draw mean): exp(b), b the least-squares slope
    of log m_l against l's position (l - 1) / (L - 1) in [0, 1] (= analysis.growth_factor):
    the fitted m_L / m_1; > 1 rises toward the output. Interval: refit on resampled means;
  depth exponent p: least squares log m(L) = c + p log L over the depths, m(L) the draw mean
    of the last layer's norm at depth L. Interval: each depth's draws resampled on their own,
    then refit (conservative: draw i shares its batch across depths, see exponent_ci).
The verdict rules are the constants below, written before the study's data existed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from experiments.stability.analysis import growth_factor, power_law_exponent  # noqa: E402

# ---- Rules, fixed before any data of this study was seen ---------------------------------
FIG3_DEPTH = 6  # Fig. 3's model has 6 + 6 layers: its verdict reads depth 6 (other depths are shown)
RISE = 4 / 3  # post-LN "grows toward the output": the 95% interval of its end-to-end factor lies above 4/3
LEVEL = (3 / 4, 4 / 3)  # pre-LN "level": the factor's 95% interval lies inside [3/4, 4/3]
PREDICTED = {"post": 0.0, "pre": -0.5}  # Theorem 1's exponents of the last layer's W2 gradient in L
EXPONENT_TOL = 0.15  # an exponent agrees if its 95% interval comes within 0.15 of the prediction ...
EXPONENT_MAX_WIDTH = 0.5  # ... and is at most 0.5 wide (wider cannot tell 0 from -0.5: "unclear")
THEOREM_STACK = {"xiong": "dec", "lab": "lm"}  # "the last layer": the one next to the loss
# A part of a claim is "yes", "no" (its interval excludes the claim) or "unclear" (straddles);
# a claim: all yes -> agrees; all no -> does not agree; no yes but some unclear -> inconclusive;
# else partly agrees. Every change to a rule after its data was seen: (date, rule, change, why).
RULE_CHANGES: list[tuple[str, str, str, str]] = []
BOOTSTRAP = 2000
BOOT_SEED = 0
CI = 0.95

STACK_TITLES = {"enc": "encoder", "dec": "decoder", "lm": "LM stack"}
STACKS = {"xiong": ("enc", "dec"), "lab": ("lm",)}
SUBLAYERS = {"enc": ("self-attn", "FFN"), "dec": ("self-attn", "cross-attn", "FFN"), "lm": ("self-attn", "FFN")}
COLORS = {"post": "tab:red", "pre": "tab:blue"}  # as experiments.stability.plots
MARKERS = {"post": "o", "pre": "s"}


# ------------------------------------------------------------------------------------
# Loading and statistics
# ------------------------------------------------------------------------------------


def _arr(x) -> np.ndarray:
    """JSON lists (None for non-finite) -> float array with NaN."""
    a = np.array(x, dtype=object)
    return np.array([np.nan if v is None else v for v in a.ravel()], dtype=float).reshape(a.shape)


def load(out: Path) -> tuple[dict, dict[tuple[str, str, int], dict]]:
    """(init.json, {(setting, variant, depth): cell record}) of the finished cells."""
    meta = json.loads((out / "init.json").read_text())
    cells = {}
    for name in meta["cells"]:
        path = out / "cells" / f"{name}.json"
        if path.exists():
            rec = json.loads(path.read_text())
            c = rec["config"]
            rec["draws"] = {k: _arr(v) for k, v in rec["draws"].items()}
            cells[(c["setting"], c["variant"], c["depth"])] = rec
    return meta, cells


def _rng() -> np.random.Generator:
    return np.random.default_rng(BOOT_SEED)


def _pct(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = (1 - CI) / 2
    return np.quantile(samples, a, axis=0), np.quantile(samples, 1 - a, axis=0)


def mean_ci(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (n, ...) per-draw values -> (mean, lo, hi) over draws, percentile bootstrap."""
    idx = _rng().integers(0, x.shape[0], size=(BOOTSTRAP, x.shape[0]))
    lo, hi = _pct(x[idx].mean(axis=1))
    return x.mean(axis=0), lo, hi


def _factors(profiles: np.ndarray) -> np.ndarray:
    """profiles (..., L) -> fitted end-to-end factors (...), vectorised analysis.growth_factor."""
    y = np.log(profiles)
    t = np.linspace(0.0, 1.0, profiles.shape[-1])
    tc = t - t.mean()
    return np.exp(np.sum((y - y.mean(axis=-1, keepdims=True)) * tc, axis=-1) / np.sum(tc * tc))


def factor_ci(x: np.ndarray) -> tuple[float, float, float]:
    """x (n, L) per-draw profiles -> the end-to-end factor of the draw mean and its interval."""
    if x.shape[-1] < 2:
        return (float("nan"),) * 3
    idx = _rng().integers(0, x.shape[0], size=(BOOTSTRAP, x.shape[0]))
    lo, hi = _pct(_factors(x[idx].mean(axis=1)))
    return growth_factor(x.mean(axis=0)), float(lo), float(hi)


def exponent_ci(depths: list[int], last: list[np.ndarray]) -> tuple[float, float, float]:
    """Per-draw last-layer norms at each depth (a list of (n_L,) arrays) -> the fitted p of
    mean ~ L^p and its interval: each depth's draws resampled on their own (depths may have
    different numbers of draws; draw i shares its batch across depths, a positive correlation
    that independent resampling ignores, which widens the slope's interval: conservative)."""
    if len(depths) < 2:
        return (float("nan"),) * 3
    rng = _rng()
    means = np.stack([v[rng.integers(0, len(v), size=(BOOTSTRAP, len(v)))].mean(axis=1) for v in last], axis=1)
    lx = np.log(np.asarray(depths, float))
    lxc = lx - lx.mean()
    ly = np.log(means)  # (B, D)
    slopes = np.sum((ly - ly.mean(axis=1, keepdims=True)) * lxc, axis=1) / np.sum(lxc * lxc)
    lo, hi = _pct(slopes)
    return power_law_exponent(depths, [float(v.mean()) for v in last]), float(lo), float(hi)


# ------------------------------------------------------------------------------------
# Verdicts
# ------------------------------------------------------------------------------------


def rise_part(lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "unclear"
    return "yes" if lo > RISE else "no" if hi <= RISE else "unclear"


def level_part(lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "unclear"
    if LEVEL[0] <= lo and hi <= LEVEL[1]:
        return "yes"
    return "no" if hi < LEVEL[0] or lo > LEVEL[1] else "unclear"


def exponent_part(lo: float, hi: float, predicted: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "unclear"
    distance = max(lo - predicted, predicted - hi, 0.0)
    if distance > EXPONENT_TOL:
        return "no"
    return "yes" if hi - lo <= EXPONENT_MAX_WIDTH else "unclear"


def combine(parts: list[str]) -> str:
    if not parts:
        return "not measured"
    if all(p == "yes" for p in parts):
        return "agrees"
    if all(p == "no" for p in parts):
        return "does not agree"
    if "yes" not in parts:
        return "inconclusive"
    return "partly agrees"


class Study:
    """The cells and every statistic the report prints."""

    def __init__(self, meta: dict, cells: dict):
        self.meta, self.cells = meta, cells
        self.settings = [s for s in ("xiong", "lab") if any(k[0] == s for k in cells)]
        self.depths = sorted({k[2] for k in cells})
        # Fig. 3's depth; a study without it (the quick one) reads its shallowest depth instead
        self.rule_depth = FIG3_DEPTH if FIG3_DEPTH in self.depths else self.depths[0]
        study = meta["study"]
        self.titles = {"xiong": f"Xiong's setting (encoder-decoder, d_model {study['xiong']['d_model']}, fairseq init)",
                       "lab": f"the lab's setting (causal LM, d_model {study['lab']['d_model']}, Markov chain)"}

    def get(self, setting: str, variant: str, depth: int) -> dict | None:
        return self.cells.get((setting, variant, depth))

    def draws(self, setting: str, variant: str, depth: int, key: str) -> np.ndarray | None:
        rec = self.get(setting, variant, depth)
        return None if rec is None else rec["draws"][key]

    def depths_of(self, setting: str, variant: str) -> list[int]:
        return [L for L in self.depths if self.get(setting, variant, L) is not None]

    def fig3(self, setting: str, depth: int | None = None) -> tuple[str, list[dict]]:
        """Verdict and one row per (variant, stack): factors with intervals and the part
        (depth None: the rule's depth)."""
        depth = self.rule_depth if depth is None else depth
        rows, parts = [], []
        for v in ("post", "pre"):
            for stack in STACKS[setting]:
                w2 = self.draws(setting, v, depth, f"{stack}_w2")
                if w2 is None:
                    continue
                f = factor_ci(w2)
                fl = factor_ci(self.draws(setting, v, depth, f"{stack}_layer"))
                part = rise_part(f[1], f[2]) if v == "post" else level_part(f[1], f[2])
                parts.append(part)
                rows.append({"variant": v, "stack": stack, "w2": f, "layer": fl, "part": part})
        return combine(parts if {r["variant"] for r in rows} == {"post", "pre"} else []), rows

    def last_layer(self, setting: str, variant: str, stack: str) -> tuple[list[int], list[np.ndarray]]:
        depths = self.depths_of(setting, variant)
        return depths, [self.draws(setting, variant, L, f"{stack}_w2")[:, -1] for L in depths]

    def theorem1(self, setting: str) -> tuple[str, list[dict]]:
        """Verdict and one row per (variant, stack): last-layer means per depth and the exponent."""
        rows, parts = [], []
        for v in ("post", "pre"):
            for stack in STACKS[setting]:
                depths, last = self.last_layer(setting, v, stack)
                if len(depths) < 2:
                    continue
                p = exponent_ci(depths, last)
                counted = stack == THEOREM_STACK[setting]
                part = exponent_part(p[1], p[2], PREDICTED[v])
                if counted:
                    parts.append(part)
                rows.append({"variant": v, "stack": stack, "depths": depths, "last": [mean_ci(x) for x in last],
                             "p": p, "part": part, "counted": counted})
        return combine(parts if len(parts) == 2 else []), rows


# ------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------


def _f(x: float, nd: int = 2, sci: bool = True) -> str:
    """Fixed point with nd decimals; magnitudes (sci) outside [1e-3, 1e3) in scientific notation."""
    if x is None or not math.isfinite(x):
        return "n/a"
    if sci and (abs(x) >= 1000 or 0 < abs(x) < 1e-3):
        return f"{x:.2e}"
    return f"{x:.{nd}f}"


def _ci(t, nd: int = 2, sci: bool = True) -> str:
    m, lo, hi = (float(np.asarray(v)) for v in t)
    return f"{_f(m, nd, sci)} [{_f(lo, nd, sci)}, {_f(hi, nd, sci)}]"


def _where(setting: str, stack: str) -> str:
    return f"{STACK_TITLES[stack]}" if setting == "xiong" else "LM stack"


# ------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------


def _band(ax, x, draws, variant: str, label: str | None = None):
    m, lo, hi = mean_ci(draws)
    ax.plot(x, m, color=COLORS[variant], marker=MARKERS[variant], ms=4, mfc="none", label=label or variant)
    ax.fill_between(x, lo, hi, color=COLORS[variant], alpha=0.25, lw=0)


def _panels(s: Study) -> list[tuple[str, str]]:
    return [(setting, stack) for setting in s.settings for stack in STACKS[setting]]


def plot_profiles(s: Study, path: Path, depth: int) -> Path:
    """Rows: FFN W2, whole layer; columns: (setting, stack); per-layer norm, draw mean and 95% band."""
    panels = _panels(s)
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 5.6), squeeze=False)
    for j, (setting, stack) in enumerate(panels):
        for i, (key, what) in enumerate((("w2", "FFN W2"), ("layer", "whole layer"))):
            ax = axes[i, j]
            for v in ("post", "pre"):
                x = s.draws(setting, v, depth, f"{stack}_{key}")
                if x is not None:
                    _band(ax, np.arange(1, x.shape[1] + 1), x, v)
            ax.set_title(f"{setting}: {STACK_TITLES[stack]}, {what}", fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("layer")
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("gradient norm at init")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"Per-layer gradient norm at initialisation, {depth} layers per stack (mean, 95% bootstrap band)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def plot_profiles_depths(s: Study, path: Path) -> Path:
    """FFN W2 profiles at every depth: rows (setting, stack), columns depths."""
    panels = _panels(s)
    fig, axes = plt.subplots(len(panels), len(s.depths), figsize=(3.0 * len(s.depths), 2.5 * len(panels)),
                             squeeze=False)
    for i, (setting, stack) in enumerate(panels):
        for j, L in enumerate(s.depths):
            ax = axes[i, j]
            for v in ("post", "pre"):
                x = s.draws(setting, v, L, f"{stack}_w2")
                if x is not None:
                    _band(ax, np.arange(1, L + 1), x, v)
            ax.set_yscale("log")
            ax.set_title(f"{setting} {STACK_TITLES[stack]}, L={L}", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if i == len(panels) - 1:
                ax.set_xlabel("layer")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("FFN W2 gradient norm per layer at init, every depth (log scale; mean, 95% band)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path


def plot_last_layer(s: Study, path: Path) -> Path:
    """Last layer's W2 gradient vs depth, log-log, with the fitted and the predicted slopes."""
    fig, axes = plt.subplots(1, len(s.settings), figsize=(4.6 * len(s.settings), 3.8), squeeze=False)
    for ax, setting in zip(axes[0], s.settings, strict=True):
        _, rows = s.theorem1(setting)
        for r in rows:
            if not r["counted"]:
                continue
            v, depths = r["variant"], np.asarray(r["depths"], float)
            m = np.array([float(t[0]) for t in r["last"]])
            err = np.array([[m_ - float(t[1]), float(t[2]) - m_] for m_, t in zip(m, r["last"], strict=True)]).T
            ax.errorbar(depths, m, yerr=err, color=COLORS[v], marker=MARKERS[v], mfc="none", ls="none", capsize=3,
                        label=f"{v}: fitted p = {r['p'][0]:+.2f}")
            anchor = math.exp(np.mean(np.log(m))) / math.exp(r["p"][0] * np.mean(np.log(depths)))
            ax.plot(depths, anchor * depths ** r["p"][0], color=COLORS[v], lw=1)
            mid = math.exp(np.mean(np.log(m)))
            ax.plot(depths, mid * (depths / math.exp(np.mean(np.log(depths)))) ** PREDICTED[v], color=COLORS[v],
                    ls="--", lw=1, label=f"{v}: predicted p = {PREDICTED[v]:+.1f}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(s.depths)
        ax.set_xticklabels([str(L) for L in s.depths])
        ax.minorticks_off()
        ax.set_xlabel("layers per stack L")
        ax.set_ylabel(f"last {STACK_TITLES[THEOREM_STACK[setting]]} layer's W2 gradient")
        ax.set_title(setting, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Theorem 1: the last layer's FFN W2 gradient norm at init vs depth (mean, 95% interval)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def plot_ratios(s: Study, path: Path) -> Path:
    """Per layer, at the rule's depth and the deepest: ||F(x)|| / ||x|| of each sublayer (draw
    mean), and the stream gradient ||dLoss/dx_l|| at each layer boundary (mean, 95% band)."""
    panels = _panels(s)
    depths = sorted({s.rule_depth, s.depths[-1]})
    fig, axes = plt.subplots(2 * len(depths), len(panels), figsize=(3.6 * len(panels), 2.8 * 2 * len(depths)),
                             squeeze=False)
    styles = ("-", "--", ":")
    for i, L in enumerate(depths):
        for j, (setting, stack) in enumerate(panels):
            ax, gx = axes[2 * i, j], axes[2 * i + 1, j]
            for v in ("post", "pre"):
                r = s.draws(setting, v, L, f"{stack}_ratio")
                if r is None:
                    continue
                for k, name in enumerate(SUBLAYERS[stack]):
                    ax.plot(np.arange(1, L + 1), r[:, :, k].mean(axis=0), color=COLORS[v], ls=styles[k],
                            label=f"{v} {name}")
                _band(gx, np.arange(0, L + 1), s.draws(setting, v, L, f"{stack}_gstream"), v)
            ax.set_yscale("log")
            ax.set_title(f"{setting} {STACK_TITLES[stack]}, L={L}: ||F(x)|| / ||x||", fontsize=8)
            gx.set_title(f"{setting} {STACK_TITLES[stack]}, L={L}: ||dLoss/dx_l||", fontsize=8)
            gx.set_yscale("log")
            gx.set_xlabel("layer boundary l (0 = embedded input)")
            for a in (ax, gx):
                a.xaxis.set_major_locator(MaxNLocator(integer=True))
            if i == 0:
                ax.legend(fontsize=6)
                gx.legend(fontsize=6)
    fig.suptitle("Sublayer outputs relative to the stream, and the stream's gradient, at init", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------


def _fig3_section(s: Study) -> list[str]:
    which = "Fig. 3's" if s.rule_depth == FIG3_DEPTH else f"the study has no depth {FIG3_DEPTH}"
    lines = [
        f"The end-to-end factor of each per-layer profile (fitted last / first, see the top of "
        f"`experiments/init_study/report.py`), with its 95% bootstrap interval over draws. Rule (at depth "
        f"{s.rule_depth}, "
        f"{which}): post-LN grows toward the output if the W2 factor's interval lies above {RISE:.2f}; pre-LN is "
        f"level if it lies inside [{LEVEL[0]:.2f}, {LEVEL[1]:.2f}]. Whole-layer factors for reference.", "",
        "| setting | stack | depth | post W2 factor | pre W2 factor | post whole layer | pre whole layer |",
        "|---|---|---|---|---|---|---|"]
    for setting in s.settings:
        for stack in STACKS[setting]:
            for L in s.depths:
                _, rows = s.fig3(setting, L)
                by = {r["variant"]: r for r in rows if r["stack"] == stack}
                if not by:
                    continue

                def cell(v, k, by=by):
                    return _ci(by[v][k], sci=False) if v in by else "-"

                mark = " (rule)" if s.rule_depth == L else ""
                lines.append(f"| {setting} | {STACK_TITLES[stack]} | {L}{mark} | {cell('post', 'w2')} | "
                             f"{cell('pre', 'w2')} | {cell('post', 'layer')} | {cell('pre', 'layer')} |")
    depth = s.rule_depth
    for setting in s.settings:
        for key, what in (("w2", "FFN W2"), ("layer", "whole-layer")):
            cols = [(v, stack) for stack in STACKS[setting] for v in ("post", "pre")
                    if s.get(setting, v, depth) is not None]
            if not cols:
                continue
            lines += ["", f"{what} gradient norm per layer at depth {depth}, {s.titles[setting]}: draw mean "
                      "[95% interval]", "",
                      "| layer | " + " | ".join(f"{v} {STACK_TITLES[st]}" for v, st in cols) + " |",
                      "|---|" + "---|" * len(cols)]
            stats = {c: mean_ci(s.draws(setting, c[0], depth, f"{c[1]}_{key}")) for c in cols}
            for layer in range(depth):
                lines.append(f"| {layer + 1} | " + " | ".join(
                    _ci(tuple(a[layer] for a in stats[c]), 3) for c in cols) + " |")
    lines += ["", f"![profiles](profiles_L{depth}.png)", "", "![profiles at every depth](profiles_depths.png)"]
    return lines


def _theorem_section(s: Study) -> list[str]:
    lines = [
        "Gradient norm of the last layer's FFN W2 at initialisation at each depth (draw mean [95% interval]) and "
        "the exponent p of a least-squares fit mean ~ c L^p with its 95% bootstrap interval. Rule: a "
        f"variant agrees if its interval comes within {EXPONENT_TOL} of the predicted exponent (post 0, pre -0.5) "
        f"and is at most {EXPONENT_MAX_WIDTH} wide. The rule reads the stack next to the loss (Xiong's: the "
        "decoder); the encoder's last layer is shown for reference.", "",
        "| setting | variant | last layer of | " + " | ".join(f"L={L}" for L in s.depths)
        + " | fitted p [95%] | predicted | part |",
        "|---|---|---|" + "---|" * len(s.depths) + "---|---|---|"]
    for setting in s.settings:
        _, rows = s.theorem1(setting)
        for r in rows:
            by = dict(zip(r["depths"], r["last"], strict=True))
            cells = " | ".join(_ci(by[L], 3) if L in by else "-" for L in s.depths)
            part = r["part"] if r["counted"] else f"({r['part']}, not counted)"
            lines.append(f"| {setting} | {r['variant']} | {STACK_TITLES[r['stack']]} | {cells} | "
                         f"{_ci(r['p'], sci=False)} | "
                         f"{PREDICTED[r['variant']]:+.1f} | {part} |")
    lines += ["", "![last layer vs depth](last_layer.png)", "",
              "What the last layer's W2 gradient is made of, against depth (the stack next to the loss): the "
              "exponent in L [95% interval] of the last layer's W2 gradient, of the stream's gradient "
              "||dL/dx_L|| where the last layer's FFN output joins it (before a final norm), of the RMS stream "
              "||x_L|| / sqrt(d) there (a final LayerNorm's backward scales by its inverse), and of their product "
              "(what reaches the final norm from the loss; ~ L^0 if the head's gradient does not change with depth), "
              "with the mean loss at init at each depth.", "",
              "| setting | variant | W2 last layer | ||dL/dx_L|| | ||x_L|| / sqrt(d) | product "
              "| loss at init by depth |",
              "|---|---|---|---|---|---|---|"]
    for setting in s.settings:
        for v in ("post", "pre"):
            parts = theorem_parts(s, setting, v)
            if parts is None:
                continue
            loss = ", ".join(f"{_f(x)} (L={L})" for L, x in parts["loss"])
            lines.append(f"| {setting} | {v} | " + " | ".join(_ci(parts[k], sci=False) for k in
                                                          ("w2", "gstream", "stream", "product")) + f" | {loss} |")
    return lines


def theorem_parts(s: Study, setting: str, v: str) -> dict | None:
    """Depth exponents (p, lo, hi) of the last layer's W2 gradient ("w2"), of ||dL/dx_L||
    ("gstream"), of ||x_L|| / sqrt(d) ("stream") and of their product ("product"), in the stack
    next to the loss, and the mean loss at init per depth ("loss": [(L, loss)])."""
    depths = s.depths_of(setting, v)
    if len(depths) < 2:
        return None
    stack = THEOREM_STACK[setting]
    def get(key):
        return [s.draws(setting, v, L, key) for L in depths]
    g = [a[:, -1] for a in get(f"{stack}_gstream")]
    x = [np.sqrt(a[:, -1]) for a in get(f"{stack}_stream")]
    series = {"w2": [a[:, -1] for a in get(f"{stack}_w2")], "gstream": g, "stream": x,
              "product": [a * b for a, b in zip(g, x, strict=True)]}
    out = {k: exponent_ci(depths, q) for k, q in series.items()}
    out["loss"] = [(L, float(a.mean())) for L, a in zip(depths, get("loss"), strict=True)]
    return out


def _reason_rows(s: Study) -> list[dict]:
    """Per (setting, variant, depth, stack): embedding scale, mean branch ratios, stream growth."""
    rows = []
    for setting in s.settings:
        for v in ("post", "pre"):
            for L in s.depths:
                rec = s.get(setting, v, L)
                if rec is None:
                    continue
                d = rec["draws"]
                for stack in STACKS[setting]:
                    ratio = d[f"{stack}_ratio"].mean(axis=0)  # (L, S)
                    stream = d[f"{stack}_stream"].mean(axis=0)  # (L + 1,)
                    rows.append({"setting": setting, "variant": v, "depth": L, "stack": stack,
                                 "x0": tuple(float(d[k].mean()) for k in ("x0_token_ms", "x0_pos_ms", "x0_ms")),
                                 "ratio_mean": ratio.mean(axis=0), "ratio_first": ratio[0], "ratio_last": ratio[-1],
                                 "stream": (float(stream[0]), float(stream[-1])), "loss": float(d["loss"].mean()),
                                 "gstream": factor_ci(d[f"{stack}_gstream"])})
    return rows


def _reason_section(s: Study) -> list[str]:
    lines = [
        "What each setting feeds its layers at initialisation (draw means). Embedding: mean square per "
        "coordinate of the first stack's input, token part + position part = total (||x_0||^2 / d). "
        "Branch ratio: ||F(x)|| / ||x||, F a sublayer's output before the residual add, x the stream it is added "
        "to (RMS over tokens), averaged over layers, and at the first and last layer. Stream: ||x_l||^2 / d "
        "entering the first layer and leaving the last (before a final norm). Stream gradient: the end-to-end "
        "factor [95% interval] of ||dLoss/dx_l|| over the L + 1 layer boundaries from the input to the output "
        "(> 1: the gradient reaching the stream grows toward the output, as a post-LN W2 profile rising toward the "
        "output would need). Loss: the mean loss at init; a uniform prediction scores log V = "
        + ", ".join(f"{math.log(s.meta['study'][st]['vocab']):.2f} ({st})" for st in s.settings) + ".", "",
        "| setting | variant | depth | stack | loss | embedding token + pos = total | branch ratio, mean over layers "
        "| first layer | last layer | stream first -> last | stream gradient factor |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in _reason_rows(s):
        names = SUBLAYERS[r["stack"]]

        def fmt(a, names=names):
            return ", ".join(f"{n} {_f(float(x))}" for n, x in zip(names, a, strict=True))

        x0 = r["x0"]
        lines.append(f"| {r['setting']} | {r['variant']} | {r['depth']} | {STACK_TITLES[r['stack']]} | "
                     f"{_f(r['loss'])} | {_f(x0[0])} + {_f(x0[1])} = {_f(x0[2])} | "
                     f"{fmt(r['ratio_mean'])} | {fmt(r['ratio_first'])} | "
                     f"{fmt(r['ratio_last'])} | {_f(r['stream'][0])} -> {_f(r['stream'][1])} | "
                     f"{_ci(r['gstream'], sci=False)} |")
    return lines + ["", "![branch ratios and stream gradients](ratios.png)", "", *_sublayer_section(s)]


def _log_gm_ci(x: np.ndarray) -> tuple[float, float, float]:
    """x (n, ...) per-draw positive factors -> geometric mean over everything but draws, then
    over draws, with a bootstrap interval over draws."""
    m, lo, hi = mean_ci(np.log(x).reshape(x.shape[0], -1).mean(axis=1))
    return float(np.exp(m)), float(np.exp(lo)), float(np.exp(hi))


def sublayer_factors(s: Study, setting: str, variant: str, depth: int, stack: str) -> list[dict]:
    """Per sublayer kind: the backward factors of its norm (||dL/dz|| / ||dL/dx_out||), of its
    residual branch (||dL/dx_in|| / ||dL/dz||) and of both (||dL/dx_in|| / ||dL/dx_out||),
    geometric means over layers and draws with intervals. > 1: the gradient grows going toward
    the input through that piece; < 1: it shrinks."""
    g = s.draws(setting, variant, depth, f"{stack}_gsub")  # (n, L, S, 2): at z, at the output stream
    if g is None:
        return []
    gz, gout = g[..., 0], g[..., 1]
    gin = np.concatenate([s.draws(setting, variant, depth, f"{stack}_gstream")[:, :-1, None], gout[:, :, :-1]], axis=2)
    return [{"sublayer": name, "norm": _log_gm_ci(gz[:, :, k] / gout[:, :, k]),
             "branch": _log_gm_ci(gin[:, :, k] / gz[:, :, k]), "total": _log_gm_ci(gin[:, :, k] / gout[:, :, k])}
            for k, name in enumerate(SUBLAYERS[stack])]


def _sublayer_section(s: Study) -> list[str]:
    lines = [
        "Where the stream's gradient grows or shrinks, sublayer by sublayer (backward, from a sublayer's output "
        "to its input). With z = x + F(x): the norm's factor ||dL/dz|| / ||dL/dx_out|| (post-LN: the LayerNorm "
        "after the add; pre-LN has none there: 1), the residual branch's ||dL/dx_in|| / ||dL/dz|| (the identity "
        "plus F's Jacobian, (I + dF/dx)^T), and their product. Geometric means over layers and draws [95% "
        "interval over draws]; < 1 shrinks the gradient on its way to the input, i.e. makes the layers below "
        "receive less than the layers above.", "",
        "| setting | variant | depth | stack | sublayer | norm backward | branch backward | sublayer total |",
        "|---|---|---|---|---|---|---|---|"]
    for setting in s.settings:
        for v in ("post", "pre"):
            for L in sorted({s.rule_depth, s.depths[-1]}):
                for stack in STACKS[setting]:
                    for r in sublayer_factors(s, setting, v, L, stack):
                        lines.append(f"| {setting} | {v} | {L} | {STACK_TITLES[stack]} | {r['sublayer']} | "
                                     f"{_ci(r['norm'], 3, False)} | {_ci(r['branch'], 3, False)} | "
                                     f"{_ci(r['total'], 3, False)} |")
    return lines


def _findings(s: Study, fig3: dict, thm: dict) -> str:
    """The opening paragraph, from the verdicts and their numbers."""
    out = []
    for setting in s.settings:
        v3, rows3 = fig3[setting]
        bits = [f"{r['variant']}-LN {_where(setting, r['stack'])} W2 factor {_ci(r['w2'], sci=False)}" for r in rows3]
        vt, rowst = thm[setting]
        pbits = [f"{r['variant']}-LN p = {_ci(r['p'], sci=False)} (predicted {PREDICTED[r['variant']]:+.1f})"
                 for r in rowst if r["counted"]]
        out.append(f"In {s.titles[setting]}, Fig. 3 **{v3}** at depth {s.rule_depth} ({'; '.join(bits)}) and "
                   f"Theorem 1 **{vt}** ({'; '.join(pbits) or 'fewer than two depths'}).")
    if len(s.settings) == 2:
        a, b = s.settings
        same3 = fig3[a][0] == fig3[b][0]
        samet = thm[a][0] == thm[b][0]
        out.append("The two settings give " + ("the same verdict" if same3 else "different verdicts")
                   + " for Fig. 3 and " + ("the same" if samet else "different ones") + " for Theorem 1"
                   + ("." if same3 and samet else "; what differs between them, measured, is in "
                      "[the measured reason](#the-measured-reason) below."))
    return " ".join(out) + "\n\n" + _contrast(s)


def _contrast(s: Study) -> str:
    """One sentence per variant at the rule's depth: the stream gradient's end-to-end factor, the
    mean FFN branch ratio and the embedding's mean square, in every (setting, stack)."""
    rows = {(r["setting"], r["variant"], r["stack"]): r for r in _reason_rows(s) if r["depth"] == s.rule_depth}
    out = []
    for v in ("post", "pre"):
        here = [(setting, stack) for setting, stack in _panels(s) if (setting, v, stack) in rows]
        if not here:
            continue
        def where(st, sk):
            return f"{st} {STACK_TITLES[sk]}"
        out.append(
            f"At depth {s.rule_depth}, {v}-LN's stream gradient ||dLoss/dx_l|| changes from input to output by "
            + ", ".join(f"{_ci(rows[(st, v, sk)]['gstream'], sci=False)} ({where(st, sk)})" for st, sk in here)
            + "; its mean FFN branch ratio ||F(x)|| / ||x|| is "
            + ", ".join(f"{_f(float(rows[(st, v, sk)]['ratio_mean'][-1]))} ({where(st, sk)})" for st, sk in here)
            + ".")
    for v in ("post", "pre"):
        here = [(st, sk) for st, sk in _panels(s) if s.get(st, v, s.rule_depth) is not None]
        per_layer = {(st, sk): _log_gm_ci(s.draws(st, v, s.rule_depth, f"{sk}_gstream")[:, :-1]
                                          / s.draws(st, v, s.rule_depth, f"{sk}_gstream")[:, 1:]) for st, sk in here}
        subs = {k: sublayer_factors(s, *k[:1], v, s.rule_depth, k[1]) for k in here}
        text = (f"Going one layer toward the input, {v}-LN's stream gradient is multiplied by "
                + ", ".join(f"{_f(per_layer[k][0], 3)} ({k[0]} {STACK_TITLES[k[1]]}: "
                            + " x ".join(f"{r['sublayer']} {_f(r['total'][0], 3)}" for r in subs[k]) + ")"
                            for k in here))
        cross = [r for k in here for r in subs[k] if r["sublayer"] == "cross-attn"]
        if cross and v == "post":
            text += (f"; the decoder's cross-attention branch passes the gradient on at {_f(cross[0]['branch'][0], 3)} "
                     f"while the LayerNorm after it multiplies it by {_f(cross[0]['norm'][0], 3)}, where the other "
                     "sublayers' branches give " + ", ".join(
                         f"{r['sublayer']} {_f(r['branch'][0], 3)} against their norms' {_f(r['norm'][0], 3)}"
                         for k in here for r in subs[k] if k[1] == "dec" and r["sublayer"] != "cross-attn")
                     + " (intervals in the sublayer table)")
        out.append(text + ".")
    pre = {st: theorem_parts(s, st, "pre") for st in s.settings}
    pre = {st: p for st, p in pre.items() if p is not None}
    if pre:
        out.append("Theorem 1, pre-LN, in the stack next to the loss: the stream where the last layer's FFN joins it "
                   "grows as ||x_L|| ~ L^p with p = "
                   + ", ".join(f"{_ci(p['stream'], sci=False)} ({st})" for st, p in pre.items())
                   + "; the stream's gradient there goes as " + ", ".join(f"{_ci(p['gstream'], sci=False)} ({st})"
                                                                         for st, p in pre.items())
                   + "; their product, what reaches the final norm from the loss, as " + ", ".join(
                       f"{_ci(p['product'], sci=False)} ({st}; loss at init {_f(p['loss'][0][1])} "
                       f"at L={p['loss'][0][0]}, "
                       f"{_f(p['loss'][-1][1])} at L={p['loss'][-1][0]})" for st, p in pre.items()) + ".")
    x0 = {st: rows[(st, v, sk)]["x0"][2] for (st, v, sk) in rows}
    out.append("The embedded input's mean square per coordinate is "
               + ", ".join(f"{_f(x)} ({st})" for st, x in x0.items()) + ".")
    return " ".join(out)


def write_report(out: Path) -> Path:
    """Write OUT/report.md and its PNGs from OUT/init.json and OUT/cells; returns the report's path."""
    out = Path(out)
    meta, cells = load(out)
    if not cells:
        raise SystemExit(f"no finished cells of the initialisation study in {out}")
    s = Study(meta, cells)
    study = meta["study"]
    fig3 = {setting: s.fig3(setting) for setting in s.settings}
    thm = {setting: s.theorem1(setting) for setting in s.settings}
    depth = s.rule_depth
    plot_profiles(s, out / f"profiles_L{depth}.png", depth)
    plot_profiles_depths(s, out / "profiles_depths.png")
    plot_last_layer(s, out / "last_layer.png")
    plot_ratios(s, out / "ratios.png")
    x, lab = study["xiong"], study["lab"]
    lab_note = " (the `depth` preset's size)" if meta.get("lab_preset") else ""
    runs = meta.get("runs", [])
    compile_s = sum(r["timing"]["compile_s"] for r in cells.values())
    run_s = sum(r["timing"]["run_s"] for r in cells.values())
    wall = "; ".join(f"{r['wall_seconds']:.0f} s wall ({r['cpu_seconds']:.0f} s CPU) computing "
                     f"{r['cells_computed']} cells, load average {r['load_average_before']} before and "
                     f"{r['load_average_after']} after" for r in runs) or "not recorded"
    per_cell = ["| setting | variant | depth | draws | compile s | run s | s per draw |",
                "|---|---|---|---|---|---|---|"]
    for (setting, v, L), rec in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        n = rec["config"]["draws"]
        per_cell.append(f"| {setting} | {v} | {L} | {n} | {rec['timing']['compile_s']:.1f} | "
                        f"{rec['timing']['run_s']:.1f} | {rec['timing']['run_s'] / n:.3f} |")
    checks = max(float(np.nanmax(np.abs(rec["draws"]["check"]))) for rec in cells.values())
    recons = max(float(np.nanmax(np.abs(rec["draws"][k]))) for rec in cells.values()
                 for k in rec["draws"] if k.endswith("_recon"))
    env = next(iter(cells.values()))["environment"]
    verdict_rows = ["| claim | " + " | ".join(s.titles[st] for st in s.settings) + " |",
                    "|---|" + "---|" * len(s.settings),
                    "| Fig. 3: post-LN's W2 gradient grows toward the output, pre-LN's is level (depth "
                    f"{s.rule_depth}) | " + " | ".join(f"**{fig3[st][0]}** ("
                    + ", ".join(f"{r['variant']} {STACK_TITLES[r['stack']]}: {r['part']}" for r in fig3[st][1])
                    + ")" for st in s.settings) + " |",
                    "| Theorem 1: the last layer's W2 gradient ~ L^0 (post-LN), ~ L^-1/2 (pre-LN) | "
                    + " | ".join(f"**{thm[st][0]}** (" + ", ".join(f"{r['variant']}: {r['part']}"
                                 for r in thm[st][1] if r["counted"]) + ")" for st in s.settings) + " |"]
    lines = [
        "# Gradient norms at initialisation: Xiong et al. 2020 in its own setting and in the lab's",
        "",
        f"Generated by `{meta.get('command') or 'python -m experiments.init_study'}`; the text and plots are "
        "regenerated from the saved cells alone by `python -m experiments.init_study.report DIR`. Every verdict is "
        "computed by a rule written in `experiments/init_study/report.py` before the data; no threshold or seed "
        "was tuned. Xiong, Yang, He, Zheng, Zheng, Xing, Zhang, Lan, Wang, Liu 2020, \"On Layer Normalization in the "
        "Transformer Architecture\" (ICML): Fig. 3 and Theorem 1.",
        "",
        "## Findings",
        "",
        _findings(s, fig3, thm),
        "",
        *verdict_rows,
        "",
        "## Fig. 3: the per-layer profile",
        "",
        *_fig3_section(s),
        "",
        "## Theorem 1: the last layer against depth",
        "",
        *_theorem_section(s),
        "",
        "## The measured reason",
        "",
        *_reason_section(s),
        "",
        "## Setup",
        "",
        f"- Xiong's setting: `flax_blocks.blocks.Transformer`, L encoder + L decoder layers, d_model "
        f"{x['d_model']}, d_ff {x['d_ff']}, {x['num_heads']} heads, ReLU, LayerNorm eps 1e-5, no dropout; fairseq's "
        "init: one embedding matrix E ~ N(0, d^-1/2) shared by source, target and output projection, used as "
        f"{'sqrt(d) E[token]' if x['embed_scale'] else 'E[token] (NOT rescaled)'} plus fairseq's sinusoidal "
        "positions; xavier-uniform block matrices, zero biases (`BlockConfig(init='xavier')`), q/k/v times "
        f"{x['qkv_gain']:.4f} (fairseq draws them over the packed (3d, d) matrix); pre-LN stacks with a final "
        f"LayerNorm each, post-LN without. Task: source {x['seq_len']} tokens uniform over 1..{x['vocab'] - 1}, "
        "target a fixed permutation of the vocabulary applied to the reversed source, decoder input "
        f"[start, target[:-1]], batch {x['batch']}, mean cross-entropy over the target tokens.",
        "- The lab's setting: the library's `fb.LanguageModel` as `experiments.stability.model` builds it (causal, the "
        "lab's init: xavier blocks without q/k/v biases, embeddings and learned positions N(0, 1/2) each, "
        f"xavier head), d_model {lab['d_model']}, "
        f"d_ff {lab['d_ff']}, {lab['num_heads']} heads{lab_note}, the Markov task over "
        f"{lab['vocab']} symbols, {lab['seq_len']} positions, batch {lab['batch']}, mean cross-entropy.",
        f"- Depths {', '.join(map(str, s.depths))} layers per stack (Xiong's: encoder = decoder = L); "
        f"{study['draws']} draws per cell ({study['deep_draws']} in Xiong's setting "
        f"from {study['deep_from']} layers on, "
        "where a draw costs most), each a fresh init and a fresh batch (draw i: JAX key "
        f"({study['seed']}, impl {next(iter(cells.values()))['config'].get('prng', 'threefry2x32')}) folded with i, "
        "the same in every cell). One jitted function per (setting, variant, depth), looped over draws.",
        "- Measured per draw: the gradient of the mean loss at init; per layer, the Frobenius norm of FFN W2's "
        "gradient (`linear2.kernel`, (d_ff, d_model)) and of all the layer's parameters; the branch ratios, the "
        "stream norms and the embedding scale above.",
        f"- Self-checks: rebuilding each block's output from its measured branches differs from the block's own "
        f"output by at most {recons:.1e} (largest |difference| / RMS), and the layer-by-layer rebuild of the whole "
        f"model's final hidden states from the library's own forward by at most {checks:.1e}.",
        f"- Ran on {env['device_count']} x {env['device_kind']} ({env['platform']}), jax {env['jax']}, flax "
        f"{env['flax']}.",
        "",
        "## Wall time",
        "",
        f"{wall}. Summed over the cells: {compile_s:.0f} s compiling, {run_s:.0f} s running the draws.",
        "",
        *per_cell,
        "",
        "## Rules",
        "",
        f"- Fig. 3 (read at depth {FIG3_DEPTH}, both stacks in Xiong's setting): post-LN grows toward the output "
        f"if the 95% interval of its W2 end-to-end factor lies above {RISE:.3f} (yes), entirely at or below it (no), "
        f"else unclear; pre-LN is level if the interval lies inside [{LEVEL[0]:.3f}, {LEVEL[1]:.3f}] (yes), "
        "entirely outside (no), else unclear.",
        f"- Theorem 1 (the last layer of the stack next to the loss): a variant's exponent agrees if its 95% "
        f"interval comes within {EXPONENT_TOL} of the prediction (post 0, pre -0.5) and is at most "
        f"{EXPONENT_MAX_WIDTH} wide (yes); further than {EXPONENT_TOL}: no; within but wider: unclear.",
        "- A claim agrees if every part is yes, does not agree if every part is no, is inconclusive if no part is "
        "yes and some are unclear, and partly agrees otherwise.",
        f"- Intervals: percentile bootstrap over draws, {BOOTSTRAP} resamples, seed {BOOT_SEED}.",
        "- " + ("No rule has been changed after its data was seen." if not RULE_CHANGES else
                "Rules changed after seeing data: " + "; ".join(" / ".join(c) for c in RULE_CHANGES)),
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.init_study.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the study's folder, holding init.json and cells/")
    args = p.parse_args(argv)
    if not (args.out / "init.json").exists():
        print(f"error: {args.out / 'init.json'} not found: pass the folder the study wrote "
              "(python -m experiments.init_study --out DIR)", file=sys.stderr)
        return 1
    print(write_report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
