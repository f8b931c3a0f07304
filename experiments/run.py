"""Serve a workload on a cluster and write what happened: `python -m experiments.run [overrides]`.

With no arguments it compares colocated prefill_first, colocated chunked and disaggregated 1P+1D
on two (fake) GPUs with the tiny model, each served `repeats` times round-robin, and writes a report.
Each repeat writes config.yaml, requests.jsonl, steps.jsonl and metrics.json into `<point>/rep<i>/`;
the point's metrics.json holds medians and 95% intervals over its repeats (docs/run-directory.md).
The console prints each point's summary with intervals, the comparisons the intervals support, and
warnings about the machine's load. Sweeps: `python -m experiments.run -m +sweep=pool_ratio`. A repeat
whose results are on disk with the same config is skipped; one that crashes leaves error.json.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments.serving.compare import MIN_DIFFERENCE, headline_sentences
from experiments.compose import exit_on_bad_overrides
from experiments.config import CONF_DIR, ConfigError, repeats, yield_to_overrides
from experiments.serving.machine import point_warnings
from experiments.serving.metrics import format_summary
from experiments.serving.serve import prepare, serve_all

log = logging.getLogger("pdlab")


def run_points(cfg: DictConfig, run_dir: Path, overrides: str) -> list[dict]:
    """Validate every point (and build its workload) before any worker starts, then serve them all;
    with backend=sim, simulate them (experiments/sim/backend.py; once each: a simulation is deterministic);
    with engine.timing=emulated, serve them on engines that wait for each step's price (experiments/sim/emulated.py)."""
    prepared = prepare(cfg, run_dir, overrides)
    if cfg.get("backend", "real") == "sim":
        from experiments.sim.backend import simulate_repeat
        return serve_all(prepared, 1, simulate_repeat)
    if any(p.spec.engine.timing == "emulated" for p in prepared):
        from experiments.sim.emulated import prepare_emulation      # its workers priced as the simulator prices
        prepared = prepare_emulation(prepared)
    return serve_all(prepared, repeats(cfg))


def warnings(results: list[dict]) -> list[str]:
    """The machine's load and the layouts' core sharing, once per distinct line."""
    lines = []
    for r in results:
        label = r["point"].get("label", "?")
        lines += [f"{label}: {w}" for w in point_warnings(r) + r.get("failure_warnings", [])]
    return list(dict.fromkeys(lines))


def console(results: list[dict]) -> None:
    ok = [r for r in results if "error" not in r]
    for r in ok:
        print(format_summary(r, title=r["point"]["label"]))
    for r in results:
        if "error" in r:
            print(f"{r['point'].get('label', '?')}: failed: {r['error']}")
    if len(ok) >= 2:
        print(f"{f' Comparison (differences stated only where 95% intervals separate, medians {MIN_DIFFERENCE:.0%}+ apart) ':=^50}")
        for line in headline_sentences([(r["point"]["label"], r) for r in ok]):
            print(f"- {line}")
    for line in warnings(results):
        print(f"warning: {line}")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    logging.getLogger("pdlab").setLevel(logging.INFO)
    try:
        cfg = yield_to_overrides(cfg, list(hc.overrides.task))
        results = run_points(cfg, run_dir, hc.job.override_dirname)
    except ConfigError as e:
        if not multirun:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        (run_dir / "error.json").write_text(json.dumps({"error": f"config error: {e}", "traceback": "",
                                                        "point": {"label": hc.job.override_dirname}}, indent=2))
        print(f"config error: {e}", file=sys.stderr)
        return
    console(results)
    if cfg.get("report") and not multirun:
        from experiments.report.report import build_report
        build_report(run_dir)
        print(f"report: {run_dir / 'report.md'}")
    failed = [r for r in results if "error" in r]
    summary = {"run_dir": str(run_dir), "points": [json_point(r) for r in results]}
    print(json.dumps(summary))
    if failed and not multirun:
        sys.exit(1)


def json_point(r: dict) -> dict:
    """A point in the final JSON line: its median headline numbers with their intervals."""
    ci = r.get("ci") or {}
    out = {"label": r["point"].get("label"), "error": r.get("error"),
           "repeats": (r.get("repeats") or {}).get("num_ok"),
           **{k: r.get(k) for k in ("num_completed", "num_failed", "goodput", "goodput_per_gpu", "slo_attainment")}}
    for key in ("itl_ms.p99", "ttft_ms.p50", "ttft_ms.p99"):
        section, stat = key.split(".")
        out[f"{section}_{stat}"] = (r.get(section) or {}).get(stat)
        out[f"{section}_{stat}_ci"] = ci.get(key)
    out["step_ratio"] = (r.get("step_ratio") or {}).get("ratio")
    return out


if __name__ == "__main__":
    exit_on_bad_overrides("config")
    main()
