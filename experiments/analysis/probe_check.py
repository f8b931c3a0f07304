"""How well the speed probe tells how fast a run's steps ran: `python -m experiments.analysis.probe_check
RUN_DIR... [--profile FILE]`.

For each repeat of each run: the probe's decode reading (workers/probe.py: its decode step / the
profile's time for it, the median over the repeat's workers) beside the median serving decode step
in no serving state the calibration prices (decode-only, 8 or more steps after the worker's last
prompt tokens, not from idle) / the profile's time for it. Printed per run (the medians over its
probes and its repeats, and those of the probes after the requests where the run has them; then per
point) and over every repeat: how steady serving / probe is. The run-level reading of the probes
before is what experiments/analysis/calibrate.py and experiments.validate use (run_speed).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from experiments.analysis.calibrate import by_worker, repeat_dirs, run_speed
from experiments.analysis.step_states import after_idle, since_prefill
from experiments.analysis.validate import raw_model
from experiments.serving.aggregate import read_jsonl
from experiments.sim.stepmodel import chunk_features

QUIET_AFTER = 8          # decode-only steps since the last prompt tokens before a step counts as quiet


def serving_decode(steps: list[dict], model, block_size: int = 16) -> float | None:
    """The median decode-only step in no serving state / the profile's time for it, over a repeat."""
    ratios = []
    for ss in by_worker(steps).values():
        since, idle = since_prefill(ss), after_idle(ss)
        for s in ss:
            b = s["num_decode_seqs"]
            if not b or s["num_prefill_tokens"] or idle.get(id(s)) is not None:
                continue
            if since.get(id(s), (QUIET_AFTER, 0))[0] < QUIET_AFTER:
                continue
            context = max(0, s["num_blocks_used"] * block_size - b * block_size // 2)
            ratios.append((s["end_s"] - s["start_s"]) / model.time(chunk_features(b, context, [])))
    return statistics.median(ratios) if ratios else None


def check(runs: list[Path], model) -> list[dict]:
    out = []
    for run in runs:
        reps = []
        for d in repeat_dirs(run):
            probe = run_speed([d], model)
            serve = serving_decode(read_jsonl(d / "steps.jsonl"), model)
            if probe and serve:
                reps.append({"repeat": str(d.relative_to(run)), "probe": probe["decode"], "serving": serve})
        out.append({"run": str(run), "repeats": reps})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.probe_check", description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--profile", type=Path, required=True, help="the profile whose step model both are read against")
    args = ap.parse_args(argv)
    model = raw_model(args.profile)
    rows = check(args.runs, model)
    every = []
    for r in rows:
        reps = r["repeats"]
        if not reps:
            print(f"{r['run']}: no repeat with both a probe and quiet decode steps")
            continue
        run_probe = run_speed(repeat_dirs(Path(r["run"])), model)["decode"]
        after = run_speed(repeat_dirs(Path(r["run"])), model, "speed_probe_end")
        serve = statistics.median(x["serving"] for x in reps)
        every += [x["serving"] / x["probe"] for x in reps]
        print(f"{r['run']}: probe {run_probe:.3f}x the profile (repeats {min(x['probe'] for x in reps):.3f}-"
              f"{max(x['probe'] for x in reps):.3f}), serving decode {serve:.3f}x (repeats "
              f"{min(x['serving'] for x in reps):.3f}-{max(x['serving'] for x in reps):.3f}): serving / probe {serve / run_probe:.3f}"
              + (f"; the probes after the requests {after['decode']:.3f}x (serving / probe {serve / after['decode']:.3f})"
                 if after else ""))
        points: dict[str, list] = {}
        for x in reps:
            points.setdefault(str(Path(x["repeat"]).parent), []).append(x)
        print("  by point, serving decode (probe): " + ", ".join(
            f"{name} {statistics.median(x['serving'] for x in xs):.3f}x ({statistics.median(x['probe'] for x in xs):.3f}x)"
            for name, xs in sorted(points.items())))
    if every:
        p10, p90 = np.percentile(every, [10, 90])
        print(f"per repeat, serving / probe: median {statistics.median(every):.3f}, p10-p90 {p10:.3f}-{p90:.3f}, "
              f"min-max {min(every):.3f}-{max(every):.3f}, over {len(every)} repeats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
