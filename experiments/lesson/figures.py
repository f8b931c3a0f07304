"""Figures of the lesson's controlled experiments: the stall timeline, the chunking trade-off, goodput
against rate per mode, and a request's time broken down. Each reads the lesson.json section it draws."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

SETUP_COLORS = {"prefill_first": "tab:red", "disaggregated": "tab:blue"}
CURVE_COLORS = ["tab:red", "tab:green", "tab:blue", "tab:purple", "tab:orange", "tab:brown"]


def timeline_plot(timeline: dict, path, title: str) -> None:
    """One row of panels per setup on one time axis (0 = the prompt's arrival): each decode's tokens as
    ticks, the prompt's arrival and first token as lines (disaggregated: also its joining the decode worker)."""
    names = list(timeline)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.3 + 1.25 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        ep = timeline[name]
        decodes = ep["decodes"]
        for i, times in enumerate(decodes.values()):
            ax.plot(times, [i] * len(times), "|", ms=9, color=SETUP_COLORS.get(name, "tab:green"))
        ax.axvline(0, color="black", lw=1.2)
        ax.axvline(ep["first_token_ms"], color="tab:orange", lw=1.5, ls="--")
        if ep.get("joined_ms") is not None:
            ax.axvline(ep["joined_ms"], color="tab:gray", lw=1, ls=":")
        ax.set_yticks(range(len(decodes)), list(decodes), fontsize=6)
        ax.set_ylim(-0.8, len(decodes) - 0.2)
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0, 0].plot([], [], color="black", label="prompt arrives")
    axes[0, 0].plot([], [], color="tab:orange", ls="--", label="prompt's first token")
    axes[0, 0].plot([], [], color="tab:gray", ls=":", label="prompt joins the decode worker")
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlabel("time since the prompt arrived (ms, each setup's own clock); a tick is a decode token")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _err(v):
    med, lo, hi = v
    lo, hi = (med, med) if lo is None else (lo, hi)
    return med, [[med - lo], [hi - med]]


def tradeoff_plot(rows: list[dict], path, title: str) -> None:
    """The stall running decodes see against the prompt's TTFT, one point per chunk size (joined in order),
    prefill_first and disaggregated beside them; whiskers are 95% intervals on both axes."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    chunked = [r for r in rows if r["policy"] == "chunked"]
    if chunked:
        ax.plot([r["ttft_ms"][0] for r in chunked], [r["stall_ms"][0] for r in chunked], "-", color="tab:green",
                alpha=0.5)
    for r in rows:
        (x, xe), (y, ye) = _err(r["ttft_ms"]), _err(r["stall_ms"])
        color = SETUP_COLORS.get(r["setup"], "tab:green")
        marker = {"prefill_first": "*", "disaggregated": "^"}.get(r["setup"], "o")
        ax.errorbar([x], [y], xerr=xe, yerr=ye, marker=marker, ms=10 if marker != "o" else 6, color=color, capsize=3,
                    ls="")
        ax.annotate(r["setup"], (x, y), fontsize=8, xytext=(6, 5), textcoords="offset points")
    steady = [r["steady_ms"][0] for r in rows if r["steady_ms"][0] is not None]
    if steady:
        ax.axhline(float(np.median(steady)), color="gray", ls=":", lw=1, label="a steady decode gap (median)")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("the prompt's time to first token (ms)")
    ax.set_ylabel("largest gap a running decode sees while the prompt is in (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def goodput_rate_plot(simulated: dict | None, measured: dict | None, path, titles: tuple[str, str]) -> None:
    """SLO attainment against request rate per GPU, one line per layout, the target dashed and the rate where
    each layout first falls below it marked with a cross: simulated at GPU scale (left), measured here (right)."""
    panels = [(s, t) for s, t in zip((simulated, measured), titles) if s]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6.5 * max(1, len(panels)), 4.8), squeeze=False)
    for ax, (sec, title) in zip(axes[0], panels):
        for color, c in zip(CURVE_COLORS, sec["curves"]):
            x, y = c["rates_per_gpu"], [100 * a if a is not None else np.nan for a in c["attainment"]]
            cis = c.get("attainment_ci")
            if cis and any(cis):
                lo = [100 * (a - ci[0]) if ci else 0 for a, ci in zip(c["attainment"], cis)]
                hi = [100 * (ci[1] - a) if ci else 0 for a, ci in zip(c["attainment"], cis)]
                ax.errorbar(x, y, yerr=[lo, hi], marker="o", color=color, capsize=3, label=c["name"])
            else:
                ax.plot(x, y, marker="o", color=color, label=c["name"])
            i = next((k for k, ok in enumerate(c["met"]) if not ok), None)
            if i is not None:
                ax.plot([x[i]], [y[i]], "x", ms=12, mew=2.5, color=color)
        ax.axhline(100 * sec["target"], color="black", ls="--", lw=1, label=f"target {sec['target']:.0%}")
        ax.set_xscale("log")
        ax.set_xlabel("request rate per GPU (requests/s)")
        ax.set_ylabel("requests within both SLOs (%)")
        ax.set_ylim(-3, 103)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PART_COLORS = {"queue": "tab:gray", "prefill": "tab:red", "exposed_transfer": "tab:orange", "handoff": "gold",
               "decode": "tab:blue"}


def breakdown_plot(bars: list[tuple[str, dict]], path, title: str) -> None:
    """Stacked horizontal bars: a request's mean time in each part, one bar per (label, breakdown); left the
    whole request, right the parts before the decode steps (drawn to their own scale, as decode dominates)."""
    from experiments.lesson.rates import PART_NAMES, PARTS

    fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.55 * len(bars)), sharey=True)
    for ax, parts, xlabel in ((axes[0], PARTS, "mean time per request (ms)"),
                              (axes[1], [p for p in PARTS if p != "decode"], "before the decode steps (ms)")):
        for i, (label, b) in enumerate(bars):
            left = 0.0
            for p in parts:
                v = (b.get("mean_ms") or {}).get(p) or 0.0
                ax.barh(i, v, left=left, color=PART_COLORS[p], label=PART_NAMES[p] if i == 0 else None)
                left += v
        ax.set_xlabel(xlabel)
    axes[0].set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def link_plot(by_slo: dict, path, title: str) -> None:
    """The winner over link bandwidth at the crossover shape, one strip per SLO, the crossover (the highest
    bandwidth at which disaggregation loses though it wins above) marked; the cell at the map's link is the
    map's own simulation (experiments/analysis/decision_sim.py), so strip and map agree there."""
    from experiments.lesson.plots import CELL_NAMES, MODE_COLORS

    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.8 * len(by_slo)))
    for j, (name, s) in enumerate(by_slo.items()):
        bl = s["by_link"]
        for i, (bw, w) in enumerate(zip(bl["link_bws"], bl["winners"])):
            ax.add_patch(plt.Rectangle((i - 0.5, j - 0.4), 1, 0.8, color=MODE_COLORS.get(w, "#999"), alpha=0.75))
            ax.text(i, j, CELL_NAMES.get(w, w), ha="center", va="center", fontsize=7)
        if bl["crossover_link_bw"] is not None:
            k = bl["link_bws"].index(bl["crossover_link_bw"])
            ax.plot([k + 0.5, k + 0.5], [j - 0.45, j + 0.45], color="black", lw=3)
    bws = next(iter(by_slo.values()))["by_link"]["link_bws"] if by_slo else []
    ax.set_xticks(range(len(bws)), [f"{bw / 1e9:g}" for bw in bws])
    ax.set_yticks(range(len(by_slo)), [f"{k} SLO" for k in by_slo])
    ax.set_xlim(-0.5, len(bws) - 0.5)
    ax.set_ylim(-0.5, len(by_slo) - 0.5)
    ax.set_xlabel("KV link bandwidth (GB/s); a thick edge marks the crossover")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
