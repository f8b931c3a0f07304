"""The report's figures: one function per figure, each takes plain data, writes one PNG, returns its path.

Intervals travel with the numbers: a value is (median, (lo, hi) | None) and is drawn with a whisker.
Also the time to the first decode step, which a figure and a table share. Nothing here reads run files;
experiments/report/sections.py does and hands over records.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from experiments.report.points import natural  # noqa: E402
from experiments.serving.steps import num, step_kind, step_ms  # noqa: E402

MARKERS = {"decode": "o", "mixed": "D", "prefill": "s"}
KIND_NAMES = {"decode": "decode-only", "mixed": "mixed (prefill + decode)", "prefill": "prefill-only"}
BREAKDOWN = (  # (key, legend label, colour): the parts of the time to the first decode step, in order
    ("queue_ms", "queue", "tab:gray"),
    ("prefill_ms", "prefill", "tab:orange"),
    ("exposed_ms", "KV transfer (exposed)", "tab:purple"),
    ("first_decode_ms", "first decode", "tab:blue"),
)


def first_decode_breakdown(requests: list[dict]) -> dict | None:
    """Mean ms of each BREAKDOWN part over completed requests with 2+ tokens (None when there are none),
    and beside them (not part of the total) the bulk transfer time, `transfer_ms`.

    exposed = the part of the KV transfer on the request's critical path: `exposed_transfer_s` (last KV
    byte landed - prefill finished, floored at 0; with streaming most of the transfer hides behind the
    prefill), or `transfer_s` for records that lack it; 0 when no KV moved.
    first decode = itl_s[0] minus exposed (floored at 0).
    """
    reqs = [r for r in requests if r.get("status") == "ok" and num((r.get("itl_s") or [None])[0]) is not None]
    if not reqs:
        return None

    def exposed(r):
        if not (r.get("transfer_bytes") or 0) > 0:
            return 0.0
        seen = num(r.get("exposed_transfer_s"))
        return max(0.0, seen) if seen is not None else num(r.get("transfer_s")) or 0.0

    parts = {"queue_ms": [num(r.get("queue_s")) or 0.0 for r in reqs],
             "prefill_ms": [num(r.get("prefill_s")) or 0.0 for r in reqs],
             "exposed_ms": [exposed(r) for r in reqs],
             "first_decode_ms": [max(0.0, r["itl_s"][0] - exposed(r)) for r in reqs]}
    row = {"num_requests": len(reqs)} | {k: 1000 * float(np.mean(v)) for k, v in parts.items()}
    bulk = 1000 * float(np.mean([num(r.get("transfer_s")) or 0.0 for r in reqs]))
    return row | {"total_ms": sum(row[k] for k in parts), "transfer_ms": bulk}


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def _whiskers(values: list, cis: list) -> np.ndarray:
    """[2, n] distances below and above each value for errorbar(); 0 where there is no interval."""
    lo = [v - c[0] if v is not None and c else 0.0 for v, c in zip(values, cis)]
    hi = [c[1] - v if v is not None and c else 0.0 for v, c in zip(values, cis)]
    return np.array([lo, hi])


def _legend_outside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _colors(n: int):
    return plt.cm.tab20(np.linspace(0, 1, 20)) if n > 10 else plt.cm.tab10(np.arange(10))


def _ecdf(ax, series: dict[str, list[float]], colors) -> tuple[float, float]:
    lo, hi = np.inf, 0.0
    for i, (label, values) in enumerate(series.items()):
        x = np.sort(np.asarray(values, dtype=float))
        x, y = np.r_[x[0], x], np.arange(len(x) + 1) / len(x)  # rise from 0 at the smallest value
        ax.step(x, y, where="post", color=colors[i % len(colors)], label=f"{label} (n={len(values)})")
        if (x > 0).any():
            lo, hi = min(lo, x[x > 0].min()), max(hi, x.max())
    return lo, hi


def cdf(path: Path, what: str, series: dict[str, list[float]], slo_ms: list[float]) -> Path:
    """Empirical CDF of one latency (`what`, in ms) per point, a dashed vertical line per distinct SLO."""
    fig, ax = plt.subplots(figsize=(8, 5))
    lo, hi = _ecdf(ax, series, _colors(len(series)))
    for v in sorted(set(slo_ms)):
        ax.axvline(v, color="black", ls="--", lw=1.2, label=f"{what} SLO = {v:g} ms")
    if hi / lo > 50:  # overloaded points sit decades to the right of healthy ones
        ax.set_xscale("log")
    ax.set(title=f"{what} per point (empirical CDF, completed requests, repeats pooled)",
           xlabel=f"{what} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def itl_cdf(path: Path, series: dict[str, list[float]], p99: dict[str, tuple[float | None, tuple | None]]) -> Path:
    """Inter-token gaps per point: the whole CDF (left) and its tail above 0.9 (right), where each point's
    ITL p99 (the median of its repeats' p99s) is marked with its 95% interval."""
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = _colors(len(series))
    lo, hi = _ecdf(whole, series, colors)
    _ecdf(tail, series, colors)
    if hi / lo > 50:
        whole.set_xscale("log")
    p90 = min(float(np.percentile(v, 90)) for v in series.values())
    marks = [(i, label, *p99.get(label, (None, None))) for i, label in enumerate(series)]
    right = max([hi] + [ci[1] for *_, ci in marks if ci])
    tail.set_xlim(0.9 * p90, 1.05 * right)
    for k, (i, label, value, ci) in enumerate(m for m in marks if m[2] is not None):
        y = 0.99 - 0.0025 * k                # stacked just below 0.99, so that equal p99s stay visible
        tail.errorbar([value], [y], xerr=_whiskers([value], [ci]), fmt="o", color=colors[i % len(colors)],
                      capsize=4, ms=5)
    for ax in (whole, tail):
        ax.grid(alpha=0.3)
        ax.set_xlabel("gap between successive tokens (ms)")
    whole.set(title="ITL per point (empirical CDF, repeats pooled)", ylabel="fraction of gaps", ylim=(0, 1.02))
    tail.set(title="Tail; dots: ITL p99 (median of repeats) with 95% interval", ylim=(0.9, 1.001))
    tail.axhline(0.99, color="gray", lw=0.8, ls=":")
    whole.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def vs_rate(path: Path, title: str, ylabel: str, lines: dict[str, tuple[list, list, list]],
            targets: list[float] = ()) -> Path:
    """One line per configuration: y (goodput or attainment) against the offered rate, 95% whiskers."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for config, (rates, ys, cis) in lines.items():
        ax.errorbar(rates, [_nan(y) for y in ys], yerr=_whiskers(ys, cis), marker="o", capsize=3, label=config)
    for t in sorted(set(targets)):
        ax.axhline(t, color="black", ls="--", lw=1.2, label=f"target = {t:g} %")
    ax.set(title=title, xlabel="offered rate (req/s)", ylabel=ylabel)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    return _save(fig, path)


COMPARED = (("goodput_per_gpu", "goodput per GPU (req/s/GPU)"), ("itl_p99_ms", "ITL p99 (ms)"),
            ("ttft_p99_ms", "TTFT p99 (ms)"))


def comparison(path: Path, title: str, rows: list[dict]) -> Path:
    """One panel per COMPARED metric, a bar per point with its 95% interval; colour = comparison group.

    rows: {label, group, <key>: value, <key>_ci: (lo, hi) | None} for each COMPARED key, in drawing order.
    """
    x = np.arange(len(rows))
    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, axes = plt.subplots(len(COMPARED), 1, figsize=(max(8.5, 1.4 * len(rows) + 4), 3.0 * len(COMPARED) + 1.2),
                             sharex=True)
    for ax, (key, ylabel) in zip(axes, COMPARED):
        for i, g in enumerate(groups):
            idx = [j for j, r in enumerate(rows) if r["group"] == g]
            vals = [rows[j][key] for j in idx]
            ax.bar(x[idx], [_nan(v) for v in vals], color=f"C{i}", alpha=0.8, label=g,
                   yerr=_whiskers(vals, [rows[j].get(f"{key}_ci") for j in idx]), capsize=5)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    if len(groups) > 1:
        _legend_outside(axes[0])
    axes[0].set_title(title, fontsize=11)
    axes[-1].set_xticks(x, [r["label"] for r in rows], rotation=20, ha="right", fontsize=8)
    axes[-1].set_xlabel("point (bars: median over repeats; whiskers: 95% interval)")
    return _save(fig, path)


def ttft_breakdown(path: Path, rows: list[dict]) -> Path:
    """Stacked bar per point of the mean time to the first decode step: rows hold BREAKDOWN's keys."""
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8.5, 1.5 * len(rows) + 3), 5))
    base = np.zeros(len(rows))
    for key, name, color in BREAKDOWN:
        h = np.array([_nan(r[key]) for r in rows])
        ax.bar(x, np.nan_to_num(h), bottom=base, color=color, label=name)
        base += np.nan_to_num(h)
    ax.set_xticks(x, [r["label"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set(title="Mean time to the first decode step, by part (repeats pooled)", ylabel="mean time per request (ms)",
           xlabel="point")
    ax.grid(axis="y", alpha=0.3)
    _legend_outside(ax)
    return _save(fig, path)


MAX_TIMELINE_ROWS = 8


def timeline_rows(workers: list[str], limit: int = MAX_TIMELINE_ROWS) -> list[str]:
    """The workers a timeline draws: all of them up to `limit`, else `limit` evenly spaced through the
    names in order (so every role of a large cluster keeps rows; 64 rows of steps are not readable)."""
    if len(workers) <= limit:
        return list(workers)
    return [workers[round(i * (len(workers) - 1) / (limit - 1))] for i in range(limit)]


def timeline(path: Path, label: str, steps: list[dict], ymax_ms: float, max_prefill: int) -> Path:
    """One row per worker (at most MAX_TIMELINE_ROWS, timeline_rows): each engine step's duration at its
    start time. Marker = step kind; colour and size = the step's prefill tokens, on the same scale (and
    y-scale) for every point of the report."""
    by_worker: dict[str, list] = {}
    for s in steps:
        by_worker.setdefault(str(s.get("worker")), []).append(s)
    every = sorted(by_worker, key=natural)
    workers = timeline_rows(every)
    fig, axes = plt.subplots(len(workers), 1, figsize=(11, 1.6 + 2.1 * len(workers)), sharex=True, squeeze=False)
    norm = Normalize(0, max(max_prefill, 1))
    cmap = plt.cm.viridis
    for ax, worker in zip(axes[:, 0], workers):
        mine = [s for s in by_worker[worker] if step_ms(s) is not None]
        for kind, marker in MARKERS.items():
            sel = [s for s in mine if step_kind(s) == kind]
            tokens = np.array([s.get("num_prefill_tokens") or 0 for s in sel], dtype=float)
            ax.scatter([s["start_s"] for s in sel], [step_ms(s) for s in sel], c=tokens, cmap=cmap, norm=norm,
                       s=6 + 60 * tokens / max(max_prefill, 1), marker=marker, alpha=0.7, linewidths=0,
                       zorder=2 + (kind == "mixed"))
        ax.set_ylim(0, ymax_ms)
        ax.set_ylabel("step (ms)")
        ax.set_title(f"worker {worker}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step start (s since the point's start)")
    handles = [Line2D([], [], ls="", marker=m, color="gray", label=KIND_NAMES[k]) for k, m in MARKERS.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=3, bbox_to_anchor=(0.99, 0.995))
    shown = "" if len(workers) == len(every) else f" ({len(workers)} of {len(every)} workers, evenly spaced)"
    fig.suptitle(f"Engine steps: {label}{shown}", x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 0.96))
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[:, 0].tolist(), fraction=0.03, pad=0.01)
    bar.set_label("prefill tokens in the step")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
