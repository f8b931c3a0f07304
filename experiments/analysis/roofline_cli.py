"""`python -m experiments.roofline model=... hardware=...`: the roofline of one model on one GPU.

Prints FLOPs, bytes, arithmetic intensity, the bound and the predicted time of prefills, decode
steps and one mixed step; plots the roofline with these operating points (`roofline_plot`, which the
lesson draws too); ends with a JSON line.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import matplotlib
import numpy as np
from omegaconf import DictConfig, OmegaConf

from experiments.compose import exit_on_bad_overrides
from experiments.config import CONF_DIR
from experiments.hardware import Hardware, HardwareSpec, OperatingPoint, dtype_bytes_of, operating_points
from workers.config import ModelConfig, from_hf_config, preset

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def model_config(model: DictConfig | dict) -> ModelConfig:
    checkpoint = model.get("checkpoint")
    return from_hf_config(Path(checkpoint) / "config.json") if checkpoint else preset(model.get("name", "tiny"))


def table(hw: Hardware, pts: list[OperatingPoint]) -> str:
    lines = [f"{hw.name}: peak {hw.peak_flops / 1e12:.1f} TFLOP/s, memory {hw.mem_bw / 1e9:.0f} GB/s, "
             f"ridge {hw.ridge:.0f} FLOP/byte",
             f"{'step':34s} {'GFLOP':>12s} {'GB moved':>10s} {'FLOP/B':>9s} {'bound':>8s} {'time ms':>10s}"]
    lines += [f"{p.step:34s} {p.flops / 1e9:12.1f} {p.bytes / 1e9:10.3f} {p.intensity:9.1f} {p.bound:>8s} "
              f"{p.time_ms:10.3f}" for p in pts]
    return "\n".join(lines)


COLORS = {"prefill": "tab:red", "decode": "tab:blue", "mixed": "tab:purple"}


def roofline_plot(hw, points, path, title: str, extra=None, measured=None) -> None:
    """Attainable FLOP/s against arithmetic intensity, each operating point marked by a number that the
    key beside the axes names (long step names next to close points would overlap).
    `extra`: more (hardware, points, marker) to draw on the same axes (e.g. a measured device);
    `measured`: `points` again at the FLOP/s their measured times imply (crosses, under `hw`'s roof)."""
    fig, (ax, key) = plt.subplots(1, 2, figsize=(10, 5), gridspec_kw={"width_ratios": [3.2, 1]})
    numbers: dict[str, int] = {}
    for hw_i, pts_i, marker in [(hw, points, "o")] + list(extra or []):
        x = np.logspace(-1, 5, 200)
        ax.plot(x, np.minimum(hw_i.peak_flops, x * hw_i.mem_bw), color="black" if marker == "o" else "gray",
                label=f"{hw_i.name} roofline (ridge {hw_i.ridge:.0f} FLOP/B)")
        placed: list[float] = []                        # log10 intensity of the numbers placed so far
        for p in sorted(pts_i, key=lambda q: q.intensity):
            kind = p.step.split()[0]
            ax.scatter(p.intensity, p.achieved_flops, color=COLORS.get(kind, "k"), marker=marker, s=40, zorder=3)
            n = numbers.setdefault(p.step, len(numbers) + 1)
            lx = np.log10(p.intensity)
            near = sum(1 for px in placed if abs(px - lx) < 0.25)       # stack the numbers of close points
            placed.append(lx)
            ax.annotate(str(n), (p.intensity, p.achieved_flops), fontsize=7, textcoords="offset points",
                        xytext=(4, -11 - 9 * near), color=COLORS.get(kind, "k"))
    for p in measured or []:
        ax.scatter(p.intensity, p.achieved_flops, color=COLORS.get(p.step.split()[0], "k"), marker="x", s=40, zorder=3)
    if measured:
        ax.scatter([], [], color="gray", marker="x", label=f"{hw.name} measured (aiconfigurator)")
    for kind, color in COLORS.items():
        ax.scatter([], [], color=color, label=f"{kind} step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable FLOP/s (roofline bound)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    key.set_axis_off()
    key.text(0, 1, "\n".join(f"{n:>2}  {step}" for step, n in numbers.items()), va="top", ha="left",
             fontsize=7.5, family="monospace", transform=key.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: DictConfig, out_dir: Path) -> dict:
    mcfg = model_config(cfg.model)
    hw = HardwareSpec(**OmegaConf.to_container(cfg.hardware, resolve=True)).resolve()
    dtype_bytes = dtype_bytes_of(cfg.dtype)
    pts = operating_points(mcfg, hw, dtype_bytes, list(cfg.prefill_tokens), list(cfg.decode_batches), cfg.context,
                           cfg.mixed.batch, cfg.mixed.chunk)
    print(f"{mcfg.name}, {cfg.dtype}")
    print(table(hw, pts))
    plot = out_dir / "roofline.png"
    roofline_plot(hw, pts, plot, title=f"{mcfg.name} on {hw.name}")
    print(f"plot: {plot}")
    return {"model": mcfg.name, "hardware": asdict(hw), "dtype": cfg.dtype, "points": [asdict(p) for p in pts],
            "plot": str(plot)}


def main() -> None:
    import sys

    import hydra
    from hydra.core.hydra_config import HydraConfig

    exit_on_bad_overrides("roofline")

    @hydra.main(version_base=None, config_path=CONF_DIR, config_name="roofline")
    def app(cfg: DictConfig) -> None:
        try:
            result = run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ValueError, KeyError, TypeError) as e:
            print(f"config error: {str(e).splitlines()[0]}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps(result))

    app()
