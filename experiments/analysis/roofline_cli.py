"""`python -m experiments.roofline model=... hardware=...`: the roofline of one model on one GPU.

Prints FLOPs, bytes, arithmetic intensity, the bound and the predicted time of prefills, decode
steps and one mixed step; plots the roofline with these operating points; ends with a JSON line.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.analysis.roofline import HARDWARE, Cost, Hardware, decode_cost, measured_hardware, mixed_cost, prefill_cost
from workers.config import ModelConfig, from_hf_config, preset

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class HardwareSpec:
    """The `hardware` group: a datasheet GPU (a100, h100, h200) or the device at hand (measured), with
    overrides; the simulator also reads the step-time model's settings (experiments/sim/costs.py)."""

    name: str = "h200"
    device: str = "auto"
    peak_flops: float | None = None
    mem_bw: float | None = None
    link_bw: float | None = None
    profile: str | None = None           # simulator: a profile JSON (null: this machine's, for `measured`)
    compute_eff: float | None = None     # simulator, datasheet GPUs: shares of the peaks a step reaches
    mem_eff: float | None = None         # (null: experiments/sim/stepmodel.py's documented defaults)
    step_overhead_ms: float | None = None
    hbm_gb: float | None = None          # simulator: GPU memory for weights and KV (null: the datasheet's)
    gpus_per_node: int = 8               # simulator: GPUs sharing a node's NVLink; the network between nodes
    costs: str = "auto"                  # simulator, datasheet GPUs: step times from aiconfigurator's measured
                                         # database where it has them (auto), always (aiconfigurator) or the
                                         # roofline (experiments/sim/gpu_costs.py)
    framework: str = "vllm"              # ... the serving framework whose measurements price a step

    def resolve(self) -> Hardware:
        if self.name == "measured":
            hw = measured_hardware(self.device)
        elif self.name in HARDWARE:
            hw = HARDWARE[self.name]
        else:
            raise ValueError(f"hardware.name={self.name!r}: choose one of {sorted(HARDWARE) + ['measured']}")
        changes = {k: v for k, v in (("peak_flops", self.peak_flops), ("mem_bw", self.mem_bw),
                                     ("net_bw", self.link_bw)) if v is not None}
        return replace(hw, **changes)


def model_config(model: DictConfig | dict) -> ModelConfig:
    checkpoint = model.get("checkpoint")
    return from_hf_config(Path(checkpoint) / "config.json") if checkpoint else preset(model.get("name", "tiny"))


@dataclass
class OperatingPoint:
    step: str
    flops: float
    bytes: float
    intensity: float
    bound: str
    time_ms: float
    achieved_flops: float      # flops / predicted time: where the point sits on the roofline


def operating_point(name: str, cost: Cost, hw: Hardware) -> OperatingPoint:
    t = cost.time(hw)
    return OperatingPoint(name, cost.flops, cost.bytes, cost.intensity, cost.bound(hw), 1e3 * t, cost.flops / t)


def operating_points(cfg: ModelConfig, hw: Hardware, dtype_bytes: int, prefill_tokens, decode_batches, context: int,
                     mixed_batch: int, mixed_chunk: int) -> list[OperatingPoint]:
    pts = [operating_point(f"prefill P={p}", prefill_cost(cfg, p, dtype_bytes), hw) for p in prefill_tokens]
    pts += [operating_point(f"decode B={b} C={context}", decode_cost(cfg, b, context, dtype_bytes), hw)
            for b in decode_batches]
    pts.append(operating_point(f"mixed B={mixed_batch} C={context} + P={mixed_chunk}",
                               mixed_cost(cfg, mixed_batch, context, mixed_chunk, dtype_bytes), hw))
    return pts


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
