"""The figures a parity check returns (`parity_tests.check.check`, and
`parity_tests.check.hf.check_hf` for Hugging Face folders), and their printed table."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckReport:
    """Per-layer figures: rows of (where, forward max abs, forward rel, grad rel)."""

    kind: str
    dtype: str
    reference: str = "the torch_blocks twin"
    rows: list[tuple[str, float, float, float]] = field(default_factory=list)
    stock_rows: list[tuple[str, float, float, float]] = field(default_factory=list)  # vs stock torch
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what this check could not verify

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        lines = [f"{self.kind}, {self.dtype}: Flax vs {self.reference} (rel = max|diff| / max|reference|)",
                 f"{'where':<14}{'fwd max abs':>13}{'fwd rel':>11}{'grad rel':>11}"]
        lines += [f"{w:<14}{a:>13.2e}{r:>11.2e}{g:>11.2e}" for w, a, r, g in self.rows + self.stock_rows]
        lines += [f"note: {n}" for n in self.notes]
        lines.append("PASS" if self.ok else "FAIL\n  " + "\n  ".join(self.failures))
        return "\n".join(lines)
