"""The report's figures: one function per figure, each takes plain data, writes one PNG, returns its path.

Also the per-point numbers two figures share with the report's tables (the time to the first decode step,
step durations by kind). Nothing here reads run files; experiments/report.py does and hands over records.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

KINDS = ("decode", "mixed", "prefill")
KIND_STYLE = {  # mixed steps are the interference: red, large, drawn on top
    "decode": dict(color="tab:blue", s=8, alpha=0.5, marker="o", zorder=2, label="decode-only"),
    "prefill": dict(color="tab:green", s=14, alpha=0.6, marker="s", zorder=3, label="prefill-only"),
    "mixed": dict(color="red", s=36, alpha=0.9, marker="D", zorder=4, label="mixed (prefill + decode)"),
}
BREAKDOWN = (  # (key, legend label, colour): the parts of the time to the first decode step, in order
    ("queue_ms", "queue", "tab:gray"),
    ("prefill_ms", "prefill", "tab:orange"),
    ("transfer_ms", "KV transfer", "tab:purple"),
    ("first_decode_ms", "first decode", "tab:blue"),
)


def num(x) -> float | None:
    """x as a float; None for null, NaN, booleans, strings and the like."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def step_kind(step: dict) -> str:
    """decode (no prefill tokens), mixed (prefill tokens and decode sequences) or prefill (no decode)."""
    if not step.get("num_decode_seqs"):
        return "prefill"
    return "mixed" if step.get("num_prefill_tokens") else "decode"


def step_ms(step: dict) -> float | None:
    start, end = num(step.get("start_s")), num(step.get("end_s"))
    return None if start is None or end is None else (end - start) * 1000.0


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def first_decode_breakdown(requests: list[dict]) -> dict | None:
    """Mean ms of each BREAKDOWN part over completed requests with 2+ tokens (None when there are none).

    first decode = itl_s[0] minus transfer_s when the KV moved (floored at 0), else itl_s[0].
    """
    reqs = [r for r in requests if r.get("status") == "ok" and num((r.get("itl_s") or [None])[0]) is not None]
    if not reqs:
        return None

    def first_decode(r):
        gap = r["itl_s"][0]
        return max(0.0, gap - (num(r.get("transfer_s")) or 0.0)) if (r.get("transfer_bytes") or 0) > 0 else gap

    parts = {"queue_ms": [num(r.get("queue_s")) or 0.0 for r in reqs],
             "prefill_ms": [num(r.get("prefill_s")) or 0.0 for r in reqs],
             "transfer_ms": [num(r.get("transfer_s")) or 0.0 for r in reqs],
             "first_decode_ms": [first_decode(r) for r in reqs]}
    row = {"num_requests": len(reqs)} | {k: 1000 * float(np.mean(v)) for k, v in parts.items()}
    return row | {"total_ms": sum(row[k] for k in parts)}


def step_stats(steps: list[dict]) -> list[dict]:
    """Per worker: step-duration percentiles by kind and how much slower a mixed step is than a decode-only one."""
    rows = []
    for worker in sorted({str(s.get("worker")) for s in steps}):
        ms, prefill_tokens = {k: [] for k in KINDS}, []
        for s in steps:
            if str(s.get("worker")) == worker and step_ms(s) is not None:
                ms[step_kind(s)].append(step_ms(s))
                if step_kind(s) == "mixed":
                    prefill_tokens.append(s.get("num_prefill_tokens") or 0)
        dec, mix = pct(ms["decode"], 50), pct(ms["mixed"], 50)
        rows.append({"worker": worker, "decode_p50_ms": dec, "mixed_p50_ms": mix, "mixed_p99_ms": pct(ms["mixed"], 99),
                     "ratio": mix / dec if mix is not None and dec else None,
                     "mixed_prefill_tokens_p50": pct(prefill_tokens, 50)}
                    | {f"num_{k}_steps": len(ms[k]) for k in KINDS})
    return rows


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def _legend_outside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cdf(path: Path, what: str, series: dict[str, list[float]], slo_ms: list[float]) -> Path:
    """Empirical CDF of one latency (`what`, in ms) per point, a dashed vertical line per distinct SLO."""
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.cm.tab20(np.linspace(0, 1, 20)) if len(series) > 10 else plt.cm.tab10(np.arange(10))
    lo, hi = np.inf, 0.0
    for i, (label, values) in enumerate(series.items()):
        x = np.sort(np.asarray(values, dtype=float))
        x, y = np.r_[x[0], x], np.arange(len(x) + 1) / len(x)  # rise from 0 at the smallest value
        ax.step(x, y, where="post", color=colors[i % len(colors)], label=f"{label} (n={len(values)})")
        if (x > 0).any():
            lo, hi = min(lo, x[x > 0].min()), max(hi, x.max())
    for v in sorted(set(slo_ms)):
        ax.axvline(v, color="black", ls="--", lw=1.2, label=f"{what} SLO = {v:g} ms")
    if hi / lo > 50:  # overloaded points sit decades to the right of healthy ones
        ax.set_xscale("log")
    ax.set(title=f"{what} distribution per point (empirical CDF, completed requests)",
           xlabel=f"{what} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def vs_rate(path: Path, title: str, ylabel: str, lines: dict[str, tuple[list[float], list[float]]],
            targets: list[float] = ()) -> Path:
    """One line per configuration: y (goodput or attainment) against the offered rate."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config, (rates, ys) in lines.items():
        ax.plot(rates, [_nan(y) for y in ys], marker="o", label=config)
    for t in sorted(set(targets)):
        ax.axhline(t, color="black", ls="--", lw=1.2, label=f"target = {t:g} %")
    ax.set(title=title, xlabel="offered rate (req/s)", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def pool_ratio(path: Path, rows: list[dict]) -> Path:
    """Bars per point: goodput per GPU (top); TTFT p90 and TPOT p90 (bottom). Colour = comparison group.

    rows: {label, group, goodput_per_gpu, ttft_p90_ms, tpot_p90_ms}, in drawing order.
    """
    x = np.arange(len(rows))
    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.5, 1.6 * len(rows) + 3), 7.5), sharex=True)
    for i, g in enumerate(groups):
        idx = [j for j, r in enumerate(rows) if r["group"] == g]
        top.bar(x[idx], [_nan(rows[j]["goodput_per_gpu"]) for j in idx], color=f"C{i}", label=g)
    top.set(title="Pool-ratio comparison at equal GPU count: goodput per GPU",
            ylabel="goodput per GPU (req/s/GPU)")
    _legend_outside(top)
    w = 0.38
    bottom.bar(x - w / 2, [_nan(r["ttft_p90_ms"]) for r in rows], w, color="tab:orange", label="TTFT p90")
    bottom.bar(x + w / 2, [_nan(r["tpot_p90_ms"]) for r in rows], w, color="tab:blue", label="TPOT p90")
    bottom.set(title="Latency tails (p90)", ylabel="latency (ms)", xlabel="point")
    bottom.set_xticks(x, [r["label"] for r in rows], rotation=20, ha="right", fontsize=8)
    _legend_outside(bottom)
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
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
    ax.set(title="Mean time to the first decode step, by part", ylabel="mean time per request (ms)",
           xlabel="point")
    ax.grid(axis="y", alpha=0.3)
    _legend_outside(ax)
    return _save(fig, path)


def timeline(path: Path, label: str, steps: list[dict]) -> Path:
    """One row per worker: each engine step's duration at its start time, coloured by step kind."""
    workers = sorted({str(s.get("worker")) for s in steps})
    fig, axes = plt.subplots(len(workers), 1, figsize=(10, 1.2 + 2.0 * len(workers)), sharex=True,
                             squeeze=False)
    for ax, worker in zip(axes[:, 0], workers):
        mine = [s for s in steps if str(s.get("worker")) == worker and step_ms(s) is not None]
        for kind in KINDS:
            sel = [s for s in mine if step_kind(s) == kind]
            ax.scatter([s["start_s"] for s in sel], [step_ms(s) for s in sel], **KIND_STYLE[kind])
        ax.set_ylim(0, 1.15 * max([step_ms(s) for s in mine] + [1e-3]))
        ax.set_ylabel("step duration (ms)")
        ax.set_title(f"worker {worker}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step start (s since the point's start)")
    handles = [Line2D([], [], ls="", marker=KIND_STYLE[k]["marker"], color=KIND_STYLE[k]["color"],
                      label=KIND_STYLE[k]["label"]) for k in KINDS]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=3)
    fig.suptitle(f"Engine steps: {label}", x=0.02, ha="left")
    return _save(fig, path)
