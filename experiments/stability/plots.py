"""PNG plots of a finished sweep (matplotlib, Agg backend). Each function takes the run
records (dicts read from OUT/cells/*.json) and writes one file, returning its path.

Conventions: colour, marker and line style = variant (so lines that overlap stay
distinguishable; per-layer plots also shift each variant's points a little sideways); one
panel per depth; thin lines = seeds, thick = seed mean.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator, NullLocator  # noqa: E402

from .model import VARIANTS  # noqa: E402

COLORS = {"post": "tab:red", "pre": "tab:blue", "noskip": "tab:gray", "deepnorm": "tab:orange",
          "rezero": "tab:green", "layerscale": "tab:purple", "peri": "tab:cyan", "pre-rms": "tab:brown",
          "pre-qknorm": "tab:pink", "mixln": "tab:olive",
          "pre-dyt": "olivedrab", "pre-lns": "navy", "post-moe": "darkred", "pre-moe": "teal"}
MARKERS = {"post": "o", "pre": "s", "noskip": "x", "deepnorm": "^", "rezero": "v", "layerscale": "D",
           "peri": "P", "pre-rms": "*", "pre-qknorm": "h", "mixln": "<", "pre-dyt": ">", "pre-lns": "d",
           "post-moe": "8", "pre-moe": "p"}
LINESTYLES = {"post": "-", "pre": "-", "noskip": ":", "deepnorm": "--", "rezero": "-.", "layerscale": "--",
              "peri": "-.", "pre-rms": ":", "pre-qknorm": "--", "mixln": ":", "pre-dyt": "-", "pre-lns": "-.",
              "post-moe": "--", "pre-moe": "--"}
ORDER = {v: i for i, v in enumerate(VARIANTS)}


def style(variant: str, n_points: int | None = None) -> dict:
    """Colour, marker and line style of a variant (markers thinned to ~12 on long curves)."""
    kw = dict(color=COLORS.get(variant, "k"), marker=MARKERS.get(variant, "."),
              ls=LINESTYLES.get(variant, "-"), label=variant, ms=5, mfc="none")
    if n_points is not None and n_points > 16:
        kw["markevery"] = max(1, n_points // 12)
    return kw


def offset(variant: str, variants: list[str], width: float = 0.3) -> float:
    """Sideways shift of a variant's points in per-layer plots, so equal values do not hide each other."""
    if len(variants) < 2:
        return 0.0
    return width * (variants.index(variant) / (len(variants) - 1) - 0.5)


def _arr(x) -> np.ndarray:
    """JSON lists (None for non-finite) -> float array with NaN."""
    return np.array([np.nan if v is None else v for v in np.ravel(np.array(x, dtype=object))],
                    dtype=float).reshape(np.shape(x))


def _axes(n: int, width: float = 4.0, height: float = 3.2, rows: int = 1):
    cols = max(1, int(np.ceil(n / rows)))
    fig, axes = plt.subplots(rows, cols, figsize=(max(width * cols, 6.0), height * rows), squeeze=False)
    return fig, axes.ravel()


def _by(records: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        out[tuple(r["config"][k] for k in keys)].append(r)
    return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _mean_curves(ax, recs: list[dict], get: Callable[[dict], np.ndarray], x: np.ndarray | None = None, **kw):
    """Thin line per seed, thick line for the mean over seeds (NaN-aware)."""
    ys = [get(r) for r in recs]
    for y in ys:
        ax.plot(x if x is not None else np.arange(len(y)), y, lw=0.6, alpha=0.35, color=kw.get("color"),
                ls=kw.get("ls", "-"))
    if ys:
        with warnings.catch_warnings():  # all-NaN columns (diverged seeds) give NaN, quietly
            warnings.simplefilter("ignore", RuntimeWarning)
            m = np.nanmean(np.stack(ys), axis=0) if all(len(y) == len(ys[0]) for y in ys) else ys[0]
        ax.plot(x if x is not None else np.arange(len(m)), m, lw=1.8, **kw)


def default_lr_warmup(records: list[dict]) -> tuple[float, int]:
    """The (lr, warmup) shown in per-depth plots and used by the per-depth claims: the most
    common lr (the lower median of those on ties, i.e. of a full grid), warmup 0 if run."""
    lrs = sorted({r["config"]["lr"] for r in records})
    counts = {lr: sum(r["config"]["lr"] == lr for r in records) for lr in lrs}
    top = [lr for lr in lrs if counts[lr] == max(counts.values())]
    lr = top[(len(top) - 1) // 2]  # a grid run as a whole: its (lower) median
    warmups = sorted({r["config"]["warmup"] for r in records})
    return lr, (0 if 0 in warmups else warmups[0])


def loss_curves(records: list[dict], path: Path) -> Path:
    """Held-out loss vs step, one panel per (lr, warmup) x depth, colour = variant."""
    h = records[0]["task"]["optimal_loss"]
    uni = records[0]["task"]["unigram_loss"]
    settings = sorted({(r["config"]["lr"], r["config"]["warmup"]) for r in records})
    depths = sorted({r["config"]["depth"] for r in records})
    fig, axes = _axes(len(settings) * len(depths), rows=len(settings))
    by = _by(records, "lr", "warmup", "depth", "variant")
    for i, (lr, warmup) in enumerate(settings):
        for j, depth in enumerate(depths):
            ax = axes[i * len(depths) + j]
            for v in sorted({k[3] for k in by if k[:3] == (lr, warmup, depth)}, key=ORDER.get):
                recs = by[(lr, warmup, depth, v)]
                _mean_curves(ax, recs, lambda r: _arr(r["metrics"]["heldout_loss"]),
                             **style(v, len(recs[0]["metrics"]["heldout_loss"])))
            ax.axhline(h, color="k", ls=":", lw=1, label=f"H = {h:.2f}")
            ax.axhline(uni, color="k", ls="--", lw=0.8, label=f"unigram {uni:.2f}")
            ax.set_ylim(max(0.0, h - 0.3), uni + 1.2)
            ax.set_title(f"{depth} layers, lr {lr:g}, warmup {warmup}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("held-out loss (nats)")
            ax.legend(fontsize=7)
    fig.suptitle("Held-out loss (thin: seeds, thick: mean)", fontsize=10)
    return _save(fig, path)


def failure_heatmap(records: list[dict], path: Path) -> Path:
    """Failure rate over seeds on a variant x learning-rate grid, one panel per depth x warmup."""
    variants = sorted({r["config"]["variant"] for r in records}, key=ORDER.get)
    warmups = sorted({r["config"]["warmup"] for r in records})
    depths = sorted({r["config"]["depth"] for r in records})
    lrs = sorted({r["config"]["lr"] for r in records})
    fig, axes = _axes(len(depths) * len(warmups), width=max(3.0, 0.7 * len(lrs) + 2.0),
                      height=max(2.4, 0.38 * len(variants) + 1.4), rows=len(warmups))
    by = _by(records, "variant", "warmup", "depth", "lr")
    for i, w in enumerate(warmups):
        for j, depth in enumerate(depths):
            ax = axes[i * len(depths) + j]
            here = [v for v in variants if any(k[:3] == (v, w, depth) for k in by)]  # rows: variants run here
            if not here:
                ax.axis("off")
                continue
            rate = np.full((len(here), len(lrs)), np.nan)
            for a, v in enumerate(here):
                for b, lr in enumerate(lrs):
                    recs = by.get((v, w, depth, lr), [])
                    if recs:
                        rate[a, b] = np.mean([r["summary"]["status"] != "trained" for r in recs])
                        ax.text(b, a,
                                f"{rate[a, b]:.2f}".rstrip("0").rstrip(".") if rate[a, b] % 1 else f"{rate[a, b]:.0f}",
                                ha="center", va="center", fontsize=8,
                                color="white" if rate[a, b] > 0.5 else "black")
            ax.imshow(np.ma.masked_invalid(rate), cmap="Reds", vmin=0, vmax=1, origin="upper", aspect="auto")
            ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs], fontsize=7)
            ax.set_yticks(range(len(here)), here, fontsize=7)
            ax.set_xlabel("learning rate", fontsize=8)
            ax.set_title(f"{depth} layers, warmup {w}", fontsize=9)
    fig.suptitle("Failure rate over seeds (NaN or plateau); blank = not run", fontsize=10)
    return _save(fig, path)


def _init_panels(records: list[dict], path: Path, get: Callable[[dict], np.ndarray], title: str,
                 ylabel: str, log: bool, x_from: int = 1) -> Path:
    """One panel per depth of a per-layer quantity (x: layer), at the default lr and warmup."""
    lr, warmup = default_lr_warmup(records)
    recs = [r for r in records if r["config"]["lr"] == lr and r["config"]["warmup"] == warmup]
    depths = sorted({r["config"]["depth"] for r in recs})
    fig, axes = _axes(len(depths))
    by = _by(recs, "depth", "variant")
    # strict=False: _axes makes at least one axis, so with no depths one is spare
    for ax, depth in zip(axes, depths, strict=False):
        here = sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get)
        for v in here:
            ys = [get(r) for r in by[(depth, v)]]
            x = np.arange(x_from, x_from + len(ys[0])) + offset(v, here)
            _mean_curves(ax, by[(depth, v)], get, x=x, **style(v))
        if log:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{depth} layers", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def init_grad_norms(records: list[dict], path: Path) -> Path:
    """Per-layer gradient norm of the FFN output matrix W2 at initialisation (Xiong Fig. 3)."""
    return _init_panels(records, path, lambda r: _arr(r["metrics"]["w2_grad_norm"])[0],
                        "Gradient norm of each layer's FFN W2 at initialisation", "||grad W2||", log=True)


def stream_norm(records: list[dict], path: Path) -> Path:
    """||x_l||^2 / d after each layer at initialisation (layer 0 = embedded input)."""
    return _init_panels(records, path, lambda r: _arr(r["metrics"]["stream_norm"])[0],
                        "Residual stream ||x_l||^2 / d at initialisation (0 = input)", "||x_l||^2 / d",
                        log=False, x_from=0)


def last_layer_grad(records: list[dict], path: Path) -> Path:
    """Last layer's W2 gradient norm at init against depth, log-log."""
    lr, warmup = default_lr_warmup(records)
    recs = [r for r in records if r["config"]["lr"] == lr and r["config"]["warmup"] == warmup]
    fig, axes = _axes(1, width=4.5)
    ax = axes[0]
    by = _by(recs, "variant", "depth")
    for v in sorted({k[0] for k in by}, key=ORDER.get):
        depths = sorted(d for (vv, d) in by if vv == v)
        means = [np.mean([_arr(r["metrics"]["w2_grad_norm"])[0][-1] for r in by[(v, d)]]) for d in depths]
        ax.plot(depths, means, **style(v))
    ax.set_xscale("log")
    ax.set_yscale("log")
    all_depths = sorted({d for (_, d) in by})
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(all_depths, [str(d) for d in all_depths])
    ax.set_xlabel("depth L")
    ax.set_ylabel("||grad W2|| of the last layer")
    ax.set_title("Last-layer gradient at init vs depth\n(Xiong: post flat, pre ~ 1/sqrt(L))", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def update_size(records: list[dict], path: Path, max_steps: int | None = None) -> Path:
    """||F(x; theta_t) - F(x; theta_0)|| vs step (Wang et al. 2022, Fig. 5), one panel per depth."""
    lr, warmup = default_lr_warmup(records)
    recs = [r for r in records if r["config"]["lr"] == lr and r["config"]["warmup"] == warmup]
    depths = sorted({r["config"]["depth"] for r in recs})
    fig, axes = _axes(len(depths))
    by = _by(recs, "depth", "variant")
    # strict=False: _axes makes at least one axis, so with no depths one is spare
    for ax, depth in zip(axes, depths, strict=False):
        for v in sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get):
            def get(r):
                return _arr(r["metrics"]["update"])[:max_steps]
            n = len(get(by[(depth, v)][0]))
            _mean_curves(ax, by[(depth, v)], get, x=np.arange(1, n + 1), **style(v, n))
        ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_title(f"{depth} layers, lr {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("||F(x;θ_t) − F(x;θ_0)||")
        ax.legend(fontsize=7)
    fig.suptitle("Model update size on held-out inputs (per-token L2, encoder output)", fontsize=10)
    return _save(fig, path)


def grad_norm(records: list[dict], path: Path) -> Path:
    """Gradient global norm over training, one panel per depth."""
    lr, warmup = default_lr_warmup(records)
    recs = [r for r in records if r["config"]["lr"] == lr and r["config"]["warmup"] == warmup]
    depths = sorted({r["config"]["depth"] for r in recs})
    fig, axes = _axes(len(depths))
    by = _by(recs, "depth", "variant")
    # strict=False: _axes makes at least one axis, so with no depths one is spare
    for ax, depth in zip(axes, depths, strict=False):
        for v in sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get):
            _mean_curves(ax, by[(depth, v)], lambda r: _arr(r["metrics"]["grad_norm"]),
                         **style(v, len(by[(depth, v)][0]["metrics"]["grad_norm"])))
        ax.set_yscale("log")
        ax.set_title(f"{depth} layers, lr {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("gradient global norm")
        ax.legend(fontsize=7)
    fig.suptitle("Gradient global norm over training", fontsize=10)
    return _save(fig, path)


def stream_norm_trained(records: list[dict], path: Path) -> Path:
    """||x_l||^2 / d after each layer after training (layer 0 = embedded input)."""
    return _init_panels(records, path, lambda r: _arr(r["metrics"]["stream_norm_probe"])[-1],
                        "Hidden-state ||x_l||^2 / d after training (0 = input)", "||x_l||^2 / d",
                        log=True, x_from=0)


def train_grad_norms(records: list[dict], path: Path) -> Path:
    """Per-layer gradient norm averaged over training (NormFormer Fig. 2)."""
    return _init_panels(records, path, lambda r: np.nanmean(_arr(r["metrics"]["layer_grad_norm_mean"]), axis=0),
                        "Gradient norm of each layer, mean over training steps", "||grad layer||", log=True)


def lr_sweep(records: list[dict], path: Path) -> Path:
    """Final held-out loss (clipped at the loss at init; diverged = loss at init) vs learning
    rate, one panel per depth; colour/marker = variant, seed mean with seeds as dots; runs with
    warmup as thin dotted lines of the variant's colour."""
    from .analysis import clipped_loss

    h = records[0]["task"]["optimal_loss"]
    depths = sorted({r["config"]["depth"] for r in records})
    if len({r["config"]["lr"] for r in records}) == 1:  # no learning-rate axis to draw: a point per variant
        return _one_lr(records, path, depths, h)
    fig, axes = _axes(len(depths), width=4.6, height=3.6)
    by = _by(records, "depth", "variant", "warmup", "lr")
    # strict=False: _axes makes at least one axis, so with no depths one is spare
    for ax, depth in zip(axes, depths, strict=False):
        here = sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get)
        for v in here:
            shift = 2 ** offset(v, here, width=0.25)  # multiplicative: the x axis is logarithmic
            for w in sorted({k[2] for k in by if k[:2] == (depth, v)}):
                lrs = sorted(k[3] for k in by if k[:3] == (depth, v, w))
                ys = [[clipped_loss(r["summary"]["final_loss"], float(r["metrics"]["heldout_loss0"]))
                       for r in by[(depth, v, w, lr)]] for lr in lrs]
                kw = style(v) if w == 0 else dict(style(v), ls=":", lw=1.0, ms=3, label=f"{v}, warmup {w}")
                for lr, y in zip(lrs, ys, strict=True):
                    ax.plot([lr * shift] * len(y), y, ".", color=COLORS.get(v, "k"), alpha=0.35, ms=3)
                ax.plot([lr * shift for lr in lrs], [np.mean(y) for y in ys], **kw)
        ax.axhline(h, color="k", ls=":", lw=1, label=f"H = {h:.2f}")
        ax.set_xscale("log")
        ax.set_title(f"{depth} layers", fontsize=9)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("min(final, initial) held-out loss")
        ax.legend(fontsize=6)
    fig.suptitle("Final loss vs learning rate (line: seed mean, dots: seeds; dotted: with warmup)", fontsize=10)
    return _save(fig, path)


def _one_lr(records: list[dict], path: Path, depths: list[int], h: float) -> Path:
    """lr_sweep's chart for a sweep of one learning rate: per depth, each variant (and warmup)
    on its own tick, its seeds as dots and their mean as a bar; no learning-rate axis."""
    from .analysis import clipped_loss

    fig, axes = _axes(len(depths), width=4.6, height=3.6)
    by = _by(records, "depth", "variant", "warmup")
    for ax, depth in zip(axes, depths, strict=False):
        keys = sorted((k[1], k[2]) for k in by if k[0] == depth)
        keys.sort(key=lambda k: (ORDER.get(k[0], 99), k[1]))
        for i, (v, w) in enumerate(keys):
            y = [clipped_loss(r["summary"]["final_loss"], float(r["metrics"]["heldout_loss0"]))
                 for r in by[(depth, v, w)]]
            ax.bar(i, np.mean(y), width=0.6, color=COLORS.get(v, "k"), alpha=0.45 if w else 0.8)
            ax.plot([i] * len(y), y, ".", color="k", ms=4)
        ax.set_xticks(range(len(keys)), [v if not w else f"{v}\nwarmup {w}" for v, w in keys], fontsize=7)
        ax.axhline(h, color="k", ls=":", lw=1, label=f"H = {h:.2f}")
        ax.set_title(f"{depth} layers", fontsize=9)
        ax.set_ylabel("min(final, initial) held-out loss")
        ax.legend(fontsize=6)
    lr = records[0]["config"]["lr"]
    fig.suptitle(f"Final loss at the sweep's one learning rate, {lr:g} (bar: seed mean, dots: seeds)", fontsize=10)
    return _save(fig, path)


def depth_loss(records: list[dict], path: Path) -> Path:
    """Final held-out loss (clipped at the loss at init) against depth, one line per variant,
    each point at the variant's best learning rate at that depth (no warmup; seed mean, seeds
    as dots): the first plot of the report."""
    from .analysis import clipped_loss

    h = records[0]["task"]["optimal_loss"]
    recs = [r for r in records if r["config"]["warmup"] == 0] or records
    by = _by(recs, "variant", "depth", "lr")
    fig, axes = _axes(1, width=6.0, height=4.2)
    ax = axes[0]
    variants = sorted({k[0] for k in by}, key=ORDER.get)
    for v in variants:
        depths = sorted({k[1] for k in by if k[0] == v})
        best = []
        for depth in depths:
            per_lr = {k[2]: [clipped_loss(r["summary"]["final_loss"], float(r["metrics"]["heldout_loss0"]))
                             for r in by[k]] for k in by if k[:2] == (v, depth)}
            lr = min(per_lr, key=lambda x: np.mean(per_lr[x]))
            best.append(per_lr[lr])
        shift = 2 ** offset(v, variants, width=0.15)
        for depth, y in zip(depths, best, strict=True):
            ax.plot([depth * shift] * len(y), y, ".", color=COLORS.get(v, "k"), alpha=0.35, ms=3)
        ax.plot([d * shift for d in depths], [np.mean(y) for y in best], **style(v))
    ax.axhline(h, color="k", ls=":", lw=1, label=f"H = {h:.2f}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({k[1] for k in by}), [str(x) for x in sorted({k[1] for k in by})])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("layers")
    ax.set_ylabel("min(final, initial) held-out loss")
    ax.legend(fontsize=7)
    fig.suptitle("Final loss against depth, each variant at its best learning rate (no warmup)", fontsize=10)
    return _save(fig, path)


def attn_logit_max(records: list[dict], path: Path) -> Path:
    """Largest attention logit (max over layers) at init and after every chunk, at the highest
    learning rate without warmup, one panel per depth."""
    lr = max(r["config"]["lr"] for r in records)
    warmup = 0 if any(r["config"]["warmup"] == 0 for r in records) else min(r["config"]["warmup"] for r in records)
    recs = [r for r in records if r["config"]["lr"] == lr and r["config"]["warmup"] == warmup]
    depths = sorted({r["config"]["depth"] for r in recs})
    fig, axes = _axes(len(depths))
    by = _by(recs, "depth", "variant")
    # strict=False: _axes makes at least one axis, so with no depths one is spare
    for ax, depth in zip(axes, depths, strict=False):
        for v in sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get):
            def get(r: dict) -> np.ndarray:  # max over layers; all NaN if the cells hold no logits
                a = _arr(r["metrics"]["attn_logit_max"])
                return np.nanmax(a, axis=1) if np.any(np.isfinite(a)) else a[:, 0]

            x = _arr(by[(depth, v)][0]["metrics"]["probe_steps"])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                _mean_curves(ax, by[(depth, v)], get, x=x, **style(v))
        ax.set_yscale("log")
        ax.set_title(f"{depth} layers, lr {lr:g}, warmup {warmup}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("largest attention logit")
        ax.legend(fontsize=7)
    fig.suptitle("Largest attention logit over training at the highest learning rate", fontsize=10)
    return _save(fig, path)


def router(records: list[dict], path: Path) -> Path:
    """The experts variants' router over training, one column per depth: the largest |router
    logit| and the load balance (X * the busiest expert's share of the top-k picks; 1 = balanced),
    each the max over layers, seed mean; colour = variant, line style = learning rate."""
    recs = [r for r in records if "router_logit_max" in r["metrics"]]
    depths = sorted({r["config"]["depth"] for r in recs})
    lrs = sorted({r["config"]["lr"] for r in recs})
    dashes = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, max(1, len(depths)), figsize=(max(4.2 * len(depths), 6.0), 6.4), squeeze=False)
    by = _by(recs, "depth", "variant", "lr")
    for col, depth in enumerate(depths):
        for v in sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get):
            for i, lr in enumerate(lrs):
                group = by.get((depth, v, lr), [])
                if not group:
                    continue
                x = _arr(group[0]["metrics"]["probe_steps"])
                kw = dict(color=COLORS.get(v, "k"), ls=dashes[i % len(dashes)], label=f"{v}, lr {lr:g}")
                for row, key in enumerate(("router_logit_max", "expert_balance")):
                    with warnings.catch_warnings():  # a diverged run's NaNs, quietly
                        warnings.simplefilter("ignore", RuntimeWarning)
                        _mean_curves(axes[row][col], group, lambda r, k=key: np.nanmax(_arr(r["metrics"][k]), axis=1),
                                     x=x, **kw)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{depth} layers", fontsize=9)
        axes[0][col].set_ylabel("largest |router logit|")
        axes[1][col].set_ylabel("load balance, busiest layer")
        axes[1][col].set_xlabel("step")
        axes[0][col].legend(fontsize=6)
    fig.suptitle("The router over training (max over layers; 1 = balanced, X/k = every token on k experts)",
                 fontsize=10)
    return _save(fig, path)


ALL = {
    "depth_loss.png": depth_loss,
    "loss_curves.png": loss_curves,
    "failure_heatmap.png": failure_heatmap,
    "init_grad_norms.png": init_grad_norms,
    "last_layer_grad.png": last_layer_grad,
    "stream_norm.png": stream_norm,
    "update_size.png": update_size,
    "grad_norm.png": grad_norm,
    "stream_norm_trained.png": stream_norm_trained,
    "train_grad_norms.png": train_grad_norms,
    "lr_sweep.png": lr_sweep,
    "attn_logit_max.png": attn_logit_max,
}


def write_all(records: list[dict], out: Path) -> dict[str, Path]:
    """Every plot into `out` (router.png only where the cells hold the experts variants' router
    measures); returns {file name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    written = {name: fn(records, out / name) for name, fn in ALL.items()}
    if any("router_logit_max" in r["metrics"] for r in records):  # a sweep with the experts variants
        written["router.png"] = router(records, out / "router.png")
    return written
