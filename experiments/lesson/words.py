"""How the lesson writes a number, a mode and a table cell: shared by its sections (text.py, when.py)."""
from __future__ import annotations

from experiments.serving import compare
from experiments.serving.compare import Estimate
from experiments.serving.stats import LEVEL

SHORT = {"colocated_prefill_first": "colocated prefill_first", "colocated_chunked": "colocated chunked",
         "disaggregated": "disaggregated", "colocated-prefill_first": "colocated prefill_first",
         "colocated-chunked": "colocated chunked", None: "no mode (SLO infeasible)",
         "tie": "no significant difference"}
CI = f"{LEVEL:.0%}"


def est(label: str, triple) -> Estimate:
    """An Estimate from a lesson.json [median, low, high] (low None: no interval)."""
    med, lo, hi = triple
    return Estimate(label, med, None if lo is None else (lo, hi))


def num(x, unit: str = "") -> str:
    """A number as a reader wants it: few significant digits, thousands kept whole."""
    if x is None:
        return "n/a"
    x = float(x)
    text = f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"
    return f"{text}{unit}"


def name(mode) -> str:
    return SHORT.get(mode, f"disaggregated {mode}" if mode else SHORT[None])


def cell(m: dict, key: str, scale: float = 1) -> str:
    e = compare.estimate("", m, key, scale)
    return compare.with_ci(e, digits=None)


def find(points: list[dict], step: str) -> dict:
    return next(p for p in points if p["step"] == step)
