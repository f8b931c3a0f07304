"""Figures of the lesson: the interference measurement and the decision map (the roofline figure is
experiments/analysis/roofline_cli.py's, shared with `pdlab roofline`)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def interference_plot(points, path, device: str) -> None:
    """Left: mixed step time against chunk size, measured and predicted. Right: prefill throughput."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for batch in sorted({p.batch for p in points}):
        row = [p for p in points if p.batch == batch]
        x = [max(p.chunk, 1) for p in row]
        y = [p.step_ms for p in row]
        spread = [[v - p.step_ms_min for v, p in zip(y, row)], [p.step_ms_max - v for v, p in zip(y, row)]]
        line = a.errorbar(x, y, yerr=spread, marker="o", capsize=3,
                          label=f"measured (median, range), B={batch} C={row[0].context}")[0]
        a.plot(x, [p.predicted_ms for p in row], ls="--", color=line.get_color(), label=f"roofline, B={batch}")
        tok = row[1:]
        err = [[p.prefill_tok_s - (p.prefill_tok_s_ci or [p.prefill_tok_s] * 2)[0] for p in tok],
               [(p.prefill_tok_s_ci or [p.prefill_tok_s] * 2)[1] - p.prefill_tok_s for p in tok]]
        b.errorbar(x[1:], [p.prefill_tok_s for p in tok], yerr=err, marker="o", capsize=3, color=line.get_color(),
                   label=f"B={batch} (median, 95% interval)")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("prefill tokens in the step (P; 0 plotted at 1)")
    a.set_ylabel("step time (ms)")
    a.set_title(f"Decode step with a co-scheduled prefill chunk ({device})")
    a.legend(fontsize=8)
    a.grid(True, which="both", alpha=0.3)
    b.set_xscale("log")
    b.set_xlabel("chunk size P (tokens)")
    b.set_ylabel("prefill throughput in that step (tokens/s)")
    b.set_title("Prefill efficiency against chunk size")
    b.legend(fontsize=8)
    b.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _value_ci(m: dict, key: str) -> tuple[float, list[float]]:
    section, stat = key.split(".")
    v = m[section][stat]
    ci = (m.get("ci") or {}).get(key)
    if not ci or None in ci:
        ci = [v, v]
    return v, [v - ci[0], ci[1] - v]


def chunking_plot(chunked: list[dict], refs: dict, path) -> None:
    """TTFT (p50 filled, p99 open) against decode ITL p99 for each chunk size, with the references;
    whiskers are 95% intervals on both axes."""
    fig, ax = plt.subplots(figsize=(8.5, 5.5))

    def draw(rows, key, **style):
        xs, xerr = zip(*(_value_ci(r, "itl_ms.p99") for r in rows))
        ys, yerr = zip(*(_value_ci(r, key) for r in rows))
        return ax.errorbar(xs, ys, xerr=np.array(xerr).T, yerr=np.array(yerr).T, capsize=3, **style)
    draw(chunked, "ttft_ms.p50", marker="o", color="tab:green", label="chunked: TTFT p50")
    draw(chunked, "ttft_ms.p99", marker="o", mfc="none", ls=":", color="tab:green", label="chunked: TTFT p99")
    for c in chunked:
        ax.annotate(f"chunk {c['chunk']}", (c["itl_ms"]["p99"], c["ttft_ms"]["p50"]), fontsize=8,
                    xytext=(6, 6), textcoords="offset points")
    for (name, ref), (marker, color) in zip(refs.items(), [("*", "tab:red"), ("^", "tab:blue")]):
        draw([ref], "ttft_ms.p50", marker=marker, ms=12, ls="", color=color, label=f"{ref['label']}: TTFT p50")
        draw([ref], "ttft_ms.p99", marker=marker, ms=12, ls="", mfc="none", color=color,
             label=f"{ref['label']}: TTFT p99")
    ax.set_xlabel("decode inter-token latency p99 (ms)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("First-token latency against the decode ITL tail, by chunk size (95% intervals)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MODE_COLORS = {"colocated_prefill_first": "#d62728", "colocated_chunked": "#2ca02c", "disaggregated": "#1f77b4",
               "colocated-prefill_first": "#d62728", "colocated-chunked": "#2ca02c", "tie": "#bbbbbb"}


CELL_NAMES = {"colocated_prefill_first": "prefill first", "colocated-prefill_first": "prefill first",
              "colocated_chunked": "chunked", "colocated-chunked": "chunked", "disaggregated": "disagg.",
              "tie": "no sig. diff.", "none": "none meets\nthe SLOs"}


def _cells(ax, rows: list[dict], tag: str, title: str) -> None:
    xs = sorted({r["prompt_len"] for r in rows})
    ys = sorted({r["output_len"] for r in rows})
    for r in rows:
        i, j = xs.index(r["prompt_len"]), ys.index(r["output_len"])
        winner = r["winner"]
        color = MODE_COLORS.get(winner, MODE_COLORS["disaggregated"] if "p" in winner and "d" in winner else "#999")
        ax.add_patch(plt.Rectangle((i - 0.5, j - 0.5), 1, 1, color=color, alpha=0.75))
        best = r["modes"].get(winner, {}).get("goodput_per_gpu")
        short = CELL_NAMES.get(winner, f"disagg. {winner}")
        text = f"{short}\n{best:.3g}/s/GPU" if best is not None else short
        ax.text(i, j, f"{text}\n({tag})", ha="center", va="center", fontsize=6.5)
    won = {(xs.index(r["prompt_len"]), ys.index(r["output_len"])): r["winner"] for r in rows}
    for (i, j), w in won.items():          # the crossovers: a thick edge wherever neighbours' winners differ
        if (i + 1, j) in won and won[(i + 1, j)] != w:
            ax.plot([i + 0.5, i + 0.5], [j - 0.5, j + 0.5], color="black", lw=3)
        if (i, j + 1) in won and won[(i, j + 1)] != w:
            ax.plot([i - 0.5, i + 0.5], [j + 0.5, j + 0.5], color="black", lw=3)
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlim(-0.5, len(xs) - 0.5)
    ax.set_ylim(-0.5, len(ys) - 0.5)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("output length (tokens)")
    ax.set_title(title, fontsize=10)


def decision_plot(simulated: dict, measured: list[dict], path, title: str) -> None:
    """Which mode gives the most goodput per GPU: one simulated map per SLO, then the cells measured here."""
    n = len(simulated)
    fig, axes = plt.subplots(1, n + 1, figsize=(6 * n + 4, 5), gridspec_kw={"width_ratios": [3] * n + [1.6]})
    for ax, (name, est) in zip(axes, simulated.items()):
        slo = est["slo"]
        _cells(ax, est["grid"], "sim.", f"simulated, {name} SLO (TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms)")
    if measured:
        _cells(axes[-1], measured, "meas.", "measured here")
    else:
        axes[-1].text(0.5, 0.5, "not measured\nin this run", ha="center", va="center", fontsize=10)
        axes[-1].set_axis_off()
    handles = [plt.Rectangle((0, 0), 1, 1, color=MODE_COLORS[k], alpha=0.75)
               for k in ("colocated_prefill_first", "colocated_chunked", "disaggregated", "tie")]
    fig.legend(handles, ["colocated prefill_first", "colocated chunked", "disaggregated",
                         "no significant difference (measured)"],
               loc="lower center", ncol=4, fontsize=9)
    fig.suptitle(f"Most goodput per GPU: {title}", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
