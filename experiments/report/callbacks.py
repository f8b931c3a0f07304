"""Hydra callbacks: a sweep ends by writing its report (sweep presets register this)."""
from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback


class ReportWhenSweepEnds(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        from experiments.report.report import build_report

        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            build_report(sweep_dir)
            print(f"report: {sweep_dir / 'report.md'}")
