"""PNG plots of a finished sweep (matplotlib, Agg backend). Each function takes the run
records (dicts read from OUT/cells/*.json) and writes one file, returning its path.

Conventions: colour = variant; one panel per depth; thin lines = seeds, thick = seed mean.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator, NullLocator  # noqa: E402

from .model import VARIANTS  # noqa: E402

COLORS = {"post": "tab:red", "pre": "tab:blue", "noskip": "tab:gray", "deepnorm": "tab:orange",
          "rezero": "tab:green", "layerscale": "tab:purple"}
ORDER = {v: i for i, v in enumerate(VARIANTS)}


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
        ax.plot(x if x is not None else np.arange(len(y)), y, lw=0.6, alpha=0.35, color=kw.get("color"))
    if ys:
        with warnings.catch_warnings():  # all-NaN columns (diverged seeds) give NaN, quietly
            warnings.simplefilter("ignore", RuntimeWarning)
            m = np.nanmean(np.stack(ys), axis=0) if all(len(y) == len(ys[0]) for y in ys) else ys[0]
        ax.plot(x if x is not None else np.arange(len(m)), m, lw=1.8, **kw)


def default_lr_warmup(records: list[dict]) -> tuple[float, int]:
    """The (lr, warmup) shown in per-depth plots: the most common lr (smallest on ties), warmup 0 if run."""
    lrs = sorted({r["config"]["lr"] for r in records})
    counts = {lr: sum(r["config"]["lr"] == lr for r in records) for lr in lrs}
    lr = max(lrs, key=lambda v: (counts[v], -v))
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
                _mean_curves(ax, recs, lambda r: _arr(r["metrics"]["heldout_loss"]), color=COLORS[v], label=v)
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
    """Failure rate over seeds on depth x lr, one panel per variant x warmup."""
    variants = sorted({r["config"]["variant"] for r in records}, key=ORDER.get)
    warmups = sorted({r["config"]["warmup"] for r in records})
    depths = sorted({r["config"]["depth"] for r in records})
    lrs = sorted({r["config"]["lr"] for r in records})
    fig, axes = _axes(len(variants) * len(warmups), width=max(2.6, 0.9 * len(lrs) + 1.6),
                      height=max(2.4, 0.45 * len(depths) + 1.4), rows=len(variants))
    by = _by(records, "variant", "warmup", "depth", "lr")
    for i, v in enumerate(variants):
        for j, w in enumerate(warmups):
            ax = axes[i * len(warmups) + j]
            rate = np.full((len(depths), len(lrs)), np.nan)
            for a, d in enumerate(depths):
                for b, lr in enumerate(lrs):
                    recs = by.get((v, w, d, lr), [])
                    if recs:
                        rate[a, b] = np.mean([r["summary"]["status"] != "trained" for r in recs])
                        ax.text(b, a, f"{rate[a, b]:.2f}".rstrip("0").rstrip(".") if rate[a, b] % 1 else f"{rate[a, b]:.0f}",
                                ha="center", va="center", fontsize=8,
                                color="white" if rate[a, b] > 0.5 else "black")
            ax.imshow(np.ma.masked_invalid(rate), cmap="Reds", vmin=0, vmax=1, origin="lower", aspect="auto")
            ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs], fontsize=7)
            ax.set_yticks(range(len(depths)), [str(d) for d in depths], fontsize=7)
            ax.set_xlabel("learning rate", fontsize=8)
            ax.set_ylabel("depth", fontsize=8)
            ax.set_title(f"{v}, warmup {w}", fontsize=9)
    fig.suptitle("Failure rate over seeds (NaN or plateau); blank = not run", fontsize=10)
    return _save(fig, path)


def _init_panels(records: list[dict], path: Path, get: Callable[[dict], np.ndarray], title: str,
                 ylabel: str, log: bool, x_from: int = 1) -> Path:
    lr, warmup = default_lr_warmup(records)
    recs = [r for r in records if r["config"]["lr"] == lr and r["config"]["warmup"] == warmup]
    depths = sorted({r["config"]["depth"] for r in recs})
    fig, axes = _axes(len(depths))
    by = _by(recs, "depth", "variant")
    for ax, depth in zip(axes, depths):
        for v in sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get):
            ys = [get(r) for r in by[(depth, v)]]
            x = np.arange(x_from, x_from + len(ys[0]))
            _mean_curves(ax, by[(depth, v)], get, x=x, color=COLORS[v], label=v)
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
        ax.plot(depths, means, "o-", color=COLORS[v], label=v)
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
    for ax, depth in zip(axes, depths):
        for v in sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get):
            get = lambda r: _arr(r["metrics"]["update"])[:max_steps]
            n = len(get(by[(depth, v)][0]))
            _mean_curves(ax, by[(depth, v)], get, x=np.arange(1, n + 1), color=COLORS[v], label=v)
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
    for ax, depth in zip(axes, depths):
        for v in sorted({k[1] for k in by if k[0] == depth}, key=ORDER.get):
            _mean_curves(ax, by[(depth, v)], lambda r: _arr(r["metrics"]["grad_norm"]), color=COLORS[v], label=v)
        ax.set_yscale("log")
        ax.set_title(f"{depth} layers, lr {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("gradient global norm")
        ax.legend(fontsize=7)
    fig.suptitle("Gradient global norm over training", fontsize=10)
    return _save(fig, path)


ALL = {
    "loss_curves.png": loss_curves,
    "failure_heatmap.png": failure_heatmap,
    "init_grad_norms.png": init_grad_norms,
    "last_layer_grad.png": last_layer_grad,
    "stream_norm.png": stream_norm,
    "update_size.png": update_size,
    "grad_norm.png": grad_norm,
}


def write_all(records: list[dict], out: Path) -> dict[str, Path]:
    """Every plot into `out`; returns {file name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    return {name: fn(records, out / name) for name, fn in ALL.items()}
