"""`python -m experiments.roofline model=... hardware=...`: the roofline of one model on one GPU.

Prints FLOPs, bytes, arithmetic intensity, the bound and the predicted time of prefills, decode
steps and one mixed step; plots the roofline with these operating points; ends with a JSON line.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.hardware import DTYPE_BYTES, Hardware, HardwareSpec, OperatingPoint, operating_points
from workers.config import ModelConfig, from_hf_config, preset

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


def run(cfg: DictConfig, out_dir: Path) -> dict:
    from experiments.lesson.plots import roofline_plot

    mcfg = model_config(cfg.model)
    hw = HardwareSpec(**OmegaConf.to_container(cfg.hardware, resolve=True)).resolve()
    dtype_bytes = DTYPE_BYTES[cfg.dtype]
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

    @hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parents[2] / "conf"),
                config_name="roofline")
    def app(cfg: DictConfig) -> None:
        try:
            result = run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ValueError, KeyError, TypeError) as e:
            print(f"config error: {str(e).splitlines()[0]}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps(result))

    app()
