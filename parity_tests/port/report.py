"""PortReport: per-module errors of a port along execution order, and where it first goes wrong."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    """One paired submodule call. Errors are relative (max|flax - torch| / max|torch|):
    accumulated: the full runs' outputs; input: what each was given; local: the Flax
    submodule run alone on torch's recorded input, against torch's output; grad: the worst of
    its own parameters' gradients, each relative to the larger of its size and a thousandth of
    the model's largest gradient (None without gradients or parameters). status: ok /
    inside (wrong on a right input) / between (given a wrong input by its parent's code while
    the modules before it are right) / inherited (a wrong input from an earlier divergence)."""

    torch_path: str
    flax_path: str
    call: int
    accumulated: float
    input: float
    local: float | None
    grad: float | None
    tol: float
    status: str = "ok"
    note: str = ""
    grad_tol: float | None = None  # float32: from torch's own float32 error on that gradient
    input_tol: float | None = None  # None: tol (a float32 island upstream loosens what a module is given)
    local_tol: float | None = None  # None: tol (float64's for a module with no float32 island inside)

    @property
    def tol_in(self) -> float:
        return self.tol if self.input_tol is None else self.input_tol

    @property
    def tol_local(self) -> float:
        return self.tol if self.local_tol is None else self.local_tol


@dataclass
class Divergence:
    """Where a port first goes wrong. kind: "inside" (the module computes something else on
    the same input), "between" (its input differs while the modules before it are right: the
    fault is in `parent`'s code between `previous` and it), or "inherited" (only gradients
    differ, first seen here going backward)."""

    torch_path: str
    flax_path: str
    kind: str
    local_error: float
    explanation: str
    parent: str | None = None
    previous: str | None = None

    def __str__(self) -> str:
        where = {"inside": f"inside {self.torch_path or '(root)'}",
                 "between": f"in {self.parent or '(root)'}'s code between "
                            f"{self.previous or 'its input'} and {self.torch_path}",
                 "inherited": f"in the backward pass of {self.torch_path or '(root)'}"}[self.kind]
        return f"first divergence {where} (local error {self.local_error:.1e}): {self.explanation}"


@dataclass
class PortReport:
    """compare()'s figures: rows in execution order, the first divergence (None when every
    pair is within tolerance), the tolerance, and the unpaired submodules."""

    dtype: str
    tol: float
    rows: list[Row]
    first_divergence: Divergence | None
    output_error: float
    unpaired: list[str] = field(default_factory=list)
    grads: dict[str, float] = field(default_factory=dict)
    islands: list[str] = field(default_factory=list)  # "LlamaRMSNorm computes in float32 in torch: ..."
    notes: list[str] = field(default_factory=list)  # arguments not reconciled, rows not compared, ...

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def __str__(self) -> str:
        def f(x):
            return "-" if x is None else f"{x:.1e}"

        head = (f"port check ({self.dtype}, tolerance {self.tol:.0e}"
                f"{' per module from the float32 noise floor' if self.dtype == 'float32' else ''}): "
                f"{'OK' if self.ok else 'DIVERGES'}; output error {self.output_error:.1e}")
        names = [(r.torch_path or "(root)") + (f" #{r.call}" if r.call else "") for r in self.rows]
        fnames = [r.flax_path or "(root)" for r in self.rows]
        w1, w2 = max([12, *map(len, names)]), max([11, *map(len, fnames)])
        lines = [head, "", f"{'torch module':{w1}} {'flax module':{w2}} {'accum':>8} {'input':>8} {'local':>8} "
                           f"{'grad':>8}  status"]
        for r, name, fname in zip(self.rows, names, fnames, strict=True):
            lines.append(f"{name:{w1}} {fname:{w2}} {f(r.accumulated):>8} {f(r.input):>8} {f(r.local):>8} "
                         f"{f(r.grad):>8}  {r.status}{' ' + r.note if r.note else ''}")
        if self.islands:
            lines += [""] + self.islands
        if self.notes:
            lines += [""] + self.notes
        if self.unpaired:
            lines += ["", "unpaired: " + ", ".join(self.unpaired)]
        lines += ["", str(self.first_divergence) if self.first_divergence else "every module within tolerance"]
        return "\n".join(lines)

    def to_json(self) -> str:
        def clean(x):
            if isinstance(x, float) and not math.isfinite(x):
                return str(x)
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        return json.dumps(clean({**asdict(self), "ok": self.ok}), indent=1)

    def plot(self, path) -> None:
        """Error per module along execution order (log scale), with the tolerance line and the
        first divergence marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        floor = 1e-18
        x = range(len(self.rows))
        fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(self.rows)), 4.0))
        for key, style in (("accumulated", "o-"), ("local", "s--"), ("grad", "^:")):
            ys = [getattr(r, key) for r in self.rows]
            if any(y is not None for y in ys):
                ax.semilogy(x, [max(y, floor) if y is not None else math.nan for y in ys], style, ms=3, label=key)
        tols = [r.tol for r in self.rows]
        ax.step(x, tols, "k-", where="mid", lw=1, label="tolerance")
        if self.first_divergence:
            i = next((i for i, r in enumerate(self.rows) if r.torch_path == self.first_divergence.torch_path), 0)
            ax.axvline(i, color="red", lw=1, alpha=0.6, label=f"first divergence: {self.first_divergence.torch_path}")
        ax.set_xticks(list(x), [(r.torch_path or "(root)") for r in self.rows], rotation=90, fontsize=6)
        ax.set_ylabel("relative error")
        ax.set_title(f"port check, {self.dtype}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
