"""The one place where pdlab words a comparison: sentences chosen from medians and 95% intervals.

A difference is stated only when two intervals do not overlap and the medians differ by at least
MIN_DIFFERENCE (2%) of the larger; otherwise the sentence says "no significant difference" (and,
when the intervals did separate, that the medians lie within 2%: a gap that small between tight
intervals, e.g. goodput that only tracks the arrival rate, flips from run to run and means nothing). Points without an interval are named and left out of the comparison. The
console, report.md and lesson.md call these functions and never phrase a comparison themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

from experiments.serving.stats import separated


MIN_DIFFERENCE = 0.02


@dataclass(frozen=True)
class Estimate:
    label: str
    value: float | None
    ci: tuple[float, float] | None = None

    @property
    def ok(self) -> bool:
        return self.value is not None and self.ci is not None and None not in self.ci


def number(x: float | None, digits: int | None = None) -> str:
    if x is None:
        return "n/a"
    if digits is None:
        digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    return f"{x:,.{digits}f}"


def with_ci(e: Estimate, unit: str = "", digits: int | None = None) -> str:
    """"24.7 ms [22.0, 27.1]"; no brackets without an interval, "n/a" without a value."""
    if e.value is None:
        return "n/a"
    text = number(e.value, digits) + unit
    if e.ci is not None and None not in e.ci:
        text += f" [{number(e.ci[0], digits)}, {number(e.ci[1], digits)}]"
    return text


def differs(a: Estimate, b: Estimate) -> int:
    """-1 when a is below b, +1 above, 0 when no difference may be stated (module docstring)."""
    s = separated(a.ci, b.ci) if a.ok and b.ok else 0
    if s and abs(a.value - b.value) < MIN_DIFFERENCE * max(abs(a.value), abs(b.value)):
        return 0
    return s


def _close(a: Estimate, b: Estimate) -> bool:
    """Intervals that separate around medians too close for a difference to be stated."""
    return separated(a.ci, b.ci) != 0 and differs(a, b) == 0


CLOSE = f"medians within {MIN_DIFFERENCE:.0%}"


def listed(labels: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def verdict(estimates: list[Estimate]) -> str:
    """What the intervals allow one to say about the order of two or more points."""
    known = sorted((e for e in estimates if e.ok), key=lambda e: e.value)
    missing = [e.label for e in estimates if not e.ok]
    tail = f"; {listed(missing)}: not compared (no value or no interval)" if missing else ""
    if len(known) < 2:
        return "nothing to compare" + tail
    below = {e.label: [f.label for f in known if differs(e, f) == -1] for e in known}
    pairs = [(a, b) for i, a in enumerate(known) for b in known[i + 1:] if differs(a, b) == 0]
    ties = [(a.label, b.label) for a, b in pairs]
    close = any(_close(a, b) for a, b in pairs)
    if not any(below.values()):
        why = f"95% intervals overlap, or {CLOSE}" if close else "95% intervals overlap"
        return f"no significant difference between {listed([e.label for e in known])} ({why})" + tail
    if not ties:
        order = [e.label for e in known]
        if len(order) == 2:
            return f"{order[0]} is lower than {order[1]} (95% intervals separate)" + tail
        return f"{order[0]} is lowest, then " + ", then ".join(order[1:]) + " (every pair's intervals separate)" + tail
    clauses = [f"{a} is lower than {listed(bs)}" for a, bs in below.items() if bs]
    clauses.append("no significant difference between " + ", or between ".join(f"{a} and {b}" for a, b in ties)
                   + (f" (intervals overlap or {CLOSE})" if close else ""))
    return "; ".join(clauses) + tail


def sentence(metric: str, estimates: list[Estimate], unit: str = "", digits: int | None = None) -> str:
    """"ITL p99 (median [95% CI]): A 24.7 ms [22.0, 27.1], B 39.5 ms [35.0, 44.2]: A is lower than B."""
    values = ", ".join(f"{e.label} {with_ci(e, unit, digits)}" for e in estimates)
    return f"{metric} (median [95% CI]): {values}: {verdict(estimates)}."


def change(metric: str, start: Estimate, end: Estimate, unit: str = "", digits: int | None = None) -> str:
    """How a metric moved from one point to another: "rose"/"fell" only when the intervals separate."""
    s = differs(start, end)
    moved = {-1: "rose", 1: "fell"}.get(s)
    values = f"from {with_ci(start, unit, digits)} ({start.label}) to {with_ci(end, unit, digits)} ({end.label})"
    if moved:
        return f"{metric} {moved} {values}"
    why = "no significant change" if start.ok and end.ok else "not compared (no interval)"
    return f"{metric} showed {why}, {values}"


IMPLAUSIBLE = "the measurement is implausible (mixed step faster than decode-only): noise dominates"


def ratio(subject: str, value: float | None, ci: tuple[float, float] | None, remeasured: int | None = None) -> str:
    """A mixed step against a decode-only step (value = mixed / decode): more, no significant difference,
    or implausible (below one), saying how often it was re-measured when that was tried."""
    if value is None:
        return f"{subject}: not measured"
    e = Estimate(subject, value, ci)
    if value < 1.0:
        again = f"; re-measured {remeasured} times" if remeasured is not None else ""
        return f"{subject} measured {with_ci(e, 'x')}: {IMPLAUSIBLE}{again}"
    if e.ok and ci[0] > 1.0:
        return f"{subject} took {with_ci(e, 'x')} a decode-only step"
    if not e.ok:
        return f"{subject} took {with_ci(e, 'x')} a decode-only step (no interval: not tested against one)"
    return f"{subject} took {with_ci(e, 'x')} a decode-only step: no significant difference from one"


# -- from metrics.json ----------------------------------------------------------------------------
# What the console and report compare: (dotted key, name, unit, scale).
HEADLINES = (("itl_ms.p99", "ITL p99", " ms", 1), ("ttft_ms.p50", "TTFT p50", " ms", 1),
             ("tpot_ms.p50", "TPOT p50", " ms", 1), ("goodput_per_gpu", "goodput per GPU", " req/s", 1),
             ("slo_attainment", "SLO attainment", " %", 100), ("step_ratio.ratio", "mixed/decode step ratio", "x", 1))


def _get(d: dict, key: str):
    for k in key.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d if isinstance(d, (int, float)) and not isinstance(d, bool) and d == d else None


def estimate(label: str, metrics: dict, key: str, scale: float = 1) -> Estimate:
    """A metric of one point's metrics.json with its interval (`ci`), scaled (e.g. 100 for percent)."""
    value, ci = _get(metrics, key), (metrics.get("ci") or {}).get(key)
    ci = tuple(scale * x for x in ci) if ci and None not in ci else None
    return Estimate(label, None if value is None else scale * value, ci)


ONE_REPEAT = "with one repeat an interval covers request-to-request variation, not run-to-run drift"


def headline_sentences(named: list[tuple[str, dict]]) -> list[str]:
    """One sentence per HEADLINES metric over the named points' metrics (skipping metrics none of them has),
    and a last line saying so when a point was served once."""
    out = []
    for key, name, unit, scale in HEADLINES:
        ests = [estimate(label, m, key, scale) for label, m in named]
        if any(e.value is not None for e in ests):
            out.append(sentence(name, ests, unit))
    once = [label for label, m in named if ((m.get("repeats") or {}).get("num_ok") or 1) < 2]
    if out and once:
        out.append(f"{listed(once)}: served once; {ONE_REPEAT}.")
    return out


def best(estimates: list[Estimate], higher: bool = True) -> str | None:
    """The label whose interval lies wholly above (higher=True) or below every other's; None when none does."""
    known = [e for e in estimates if e.ok]
    if len(known) < 2 or len(known) < len(estimates):
        return None
    top = max(known, key=lambda e: e.value) if higher else min(known, key=lambda e: e.value)
    want = 1 if higher else -1
    return top.label if all(differs(top, e) == want for e in known if e is not top) else None
