"""Figures of the lesson: the roofline with operating points, and the interference measurement."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {"prefill": "tab:red", "decode": "tab:blue", "mixed": "tab:purple"}


def roofline_plot(hw, points, path, title: str, extra=None) -> None:
    """Attainable FLOP/s against arithmetic intensity, each operating point marked.
    `extra`: more (hardware, points, marker) to draw on the same axes (e.g. a measured device)."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for hw_i, pts_i, marker in [(hw, points, "o")] + list(extra or []):
        x = np.logspace(-1, 5, 200)
        ax.plot(x, np.minimum(hw_i.peak_flops, x * hw_i.mem_bw), color="black" if marker == "o" else "gray",
                label=f"{hw_i.name} roofline (ridge {hw_i.ridge:.0f} FLOP/B)")
        for i, p in enumerate(pts_i):
            kind = p.step.split()[0]
            ax.scatter(p.intensity, p.achieved_flops, color=COLORS.get(kind, "k"), marker=marker, s=40, zorder=3)
            on_plateau = p.achieved_flops >= 0.999 * hw_i.peak_flops
            ax.annotate(p.step, (p.intensity, p.achieved_flops), fontsize=7, textcoords="offset points",
                        xytext=(0, 8) if on_plateau else (5, -10), rotation=40 if on_plateau else 0)
    for kind, color in COLORS.items():
        ax.scatter([], [], color=color, label=f"{kind} step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 30)          # room for the labels above the plateau
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable FLOP/s (roofline bound)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def interference_plot(points, path, device: str) -> None:
    """Left: mixed step time against chunk size, measured and predicted. Right: prefill throughput."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for batch in sorted({p.batch for p in points}):
        row = [p for p in points if p.batch == batch]
        x = [max(p.chunk, 1) for p in row]
        line, = a.plot(x, [p.step_ms for p in row], marker="o", label=f"measured, B={batch} C={row[0].context}")
        a.plot(x, [p.predicted_ms for p in row], ls="--", color=line.get_color(), label=f"roofline, B={batch}")
        b.plot(x[1:], [p.prefill_tok_s for p in row][1:], marker="o", color=line.get_color(), label=f"B={batch}")
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
