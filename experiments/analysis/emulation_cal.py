"""What an emulated cluster's system adds to its priced steps, read from emulated runs (docs/emulation.md).

An emulated run's steps take their price (plus the emulator's own small overshoot, which steps.jsonl
records beside it). Everything else that takes time is the system, on the machine that ran it: the
router's message to a worker, the worker loop between two steps, the KV handoff's handling beside
its time on the link, the router reading a worker's tokens. `calibrate_system` reads emulated runs
(never the run it will validate) and returns each as a number the simulator charges:

- `dispatch_s`: over requests that found their worker idle, their first step's start less their
  arrival, less the gap before a first step (gap_coef[0]): the router's submit reaching the worker;
- `gap_coef` [g0, g1]: the time between two steps of a busy worker (its step left it work), fitted as
  g0 + g1 * the sequences of the step before (least squares on each sequence count's median);
- `wire_s`: the handoff's own time beside the link's: the prefill step's end to the last KV byte in
  (exposed_transfer_s) less the link's time for those bytes (metrics.json's emulated.link), over
  handoffs with transfer.stream off; the simulator adds it to the link's latency;
- `return_s`: client TTFT - TTFT over completed requests: a worker's step end to the router reading it.

Each is a median over many events (the gap a fit), and `num` says how many. `python -m
experiments.analysis.emulation_cal RUN_DIR... [--write FILE]` prints it, or writes it where `validate`
looks for this machine's (`default_path`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from experiments.analysis.calibrate import _idle_at, by_worker
from experiments.report.points import find_points
from experiments.serving.aggregate import read_jsonl
from experiments.serving.profiles import PROFILES, machine_name

MIN_EVENTS = 20


def default_path(machine: str | None = None) -> Path:
    """Where this machine's emulation calibration lives (profiles/<machine>/emulation/system.json; a
    folder of its own, beside the machine's step profiles)."""
    return PROFILES / (machine or machine_name()) / "emulation" / "system.json"


def _link(rep_metrics: dict):
    link = (rep_metrics.get("emulated") or {}).get("link")
    return None if link is None else (float(link["latency_s"]), float(link["bandwidth"]))


def calibrate_system(run_dirs: list[Path]) -> dict:
    """The system's latencies of an emulated cluster from emulated runs (see the module docstring)."""
    returns, idle_waits, gaps, seqs, wires = [], [], [], [], []
    emulated = 0
    for run_dir in run_dirs:
        for ident, rows, steps, metrics in _emulated_repeats(Path(run_dir)):
            emulated += 1
            workers = by_worker(steps)
            for ss in workers.values():
                for cur, nxt in zip(ss, ss[1:]):
                    if cur["num_running"] or cur["num_waiting"]:
                        gaps.append(nxt["start_s"] - cur["end_s"])
                        seqs.append(cur["num_decode_seqs"] + cur["num_prefill_seqs"])
            link = _link(metrics)
            for r in rows:
                if r.get("status") != "ok" or r.get("queue_s") is None:
                    continue
                if r.get("client_ttft_s") is not None:
                    returns.append(r["client_ttft_s"] - r["ttft_s"])
                if r.get("attempts") == 1 and _idle_at(workers.get(r["prefill_worker"], []), r["arrival_s"]):
                    idle_waits.append(r["ttft_s"] - r["prefill_s"])
                exposed = r.get("exposed_transfer_s")
                if link is not None and ident.get("stream") == "off" and r.get("transfer_bytes") and exposed:
                    wires.append(exposed - (link[0] + r["transfer_bytes"] / link[1]))
    if not emulated:
        raise ValueError(f"no emulated run (engine.timing=emulated) under {list(map(str, run_dirs))}")
    if len(gaps) < MIN_EVENTS or len(returns) < MIN_EVENTS:
        raise ValueError(f"{len(gaps)} busy gaps and {len(returns)} completed requests under "
                         f"{list(map(str, run_dirs))}: too few to calibrate on (at least {MIN_EVENTS} each)")
    g = fit_gap(seqs, gaps)
    dispatch = [max(0.0, w - g[0]) for w in idle_waits]
    return {"kind": "pdlab-emulation-calibration", "dispatch_s": _median(dispatch), "gap_coef": g,
            "wire_s": _median(wires), "return_s": _median(returns), "export": [0.0, 0.0], "import": [0.0, 0.0],
            "num": {"gaps": len(gaps), "idle_arrivals": len(dispatch), "handoffs": len(wires),
                    "returns": len(returns), "repeats": emulated},
            "runs": [str(d) for d in run_dirs], "machine": machine_name()}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if len(xs) >= MIN_EVENTS else 0.0


def fit_gap(seqs: list[int], gaps: list[float]) -> list[float]:
    """[g0, g1] of gap = g0 + g1 * sequences, by least squares on the medians of each sequence count
    (a few slow gaps, the machine busy elsewhere, do not pull the line); g1 >= 0."""
    by: dict[int, list[float]] = {}
    for n, g in zip(seqs, gaps):
        by.setdefault(n, []).append(g)
    xs = np.array(sorted(by), dtype=float)
    ys = np.array([statistics.median(by[int(n)]) for n in xs])
    w = np.sqrt([len(by[int(n)]) for n in xs])
    if len(xs) < 2:
        return [float(ys[0]), 0.0]
    slope, icpt = np.polyfit(xs, ys, 1, w=w)
    if slope < 0:
        return [float(np.average(ys, weights=w * w)), 0.0]
    return [float(icpt), float(slope)]


def _emulated_repeats(run_dir: Path):
    """(point identity with its transfer.stream, requests, steps, metrics.json) of each emulated repeat."""
    for point in find_points(run_dir):
        if point.metrics is None:
            continue
        for d in point.repeats:
            try:
                metrics = json.loads((d / "metrics.json").read_text())
            except (OSError, ValueError):
                continue
            if "emulated" not in metrics:
                continue
            yield (point.info | {"stream": _stream(d)}, read_jsonl(d / "requests.jsonl"),
                   read_jsonl(d / "steps.jsonl"), metrics)


def _stream(rep_dir: Path) -> str:
    try:
        from omegaconf import OmegaConf
        return str(OmegaConf.load(rep_dir / "config.yaml").transfer.stream)
    except Exception:        # no config, or one without transfer.stream: the default
        return "off"


def load(path: Path) -> dict:
    d = json.loads(Path(path).read_text())
    if d.get("kind") != "pdlab-emulation-calibration":
        raise ValueError(f"{path}: not an emulation calibration (no kind: pdlab-emulation-calibration)")
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.emulation_cal",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", type=Path, nargs="+", help="emulated runs (not the ones you will validate)")
    ap.add_argument("--write", type=Path, nargs="?", const=default_path(), metavar="FILE",
                    help=f"write it (default: this machine's, {default_path()})")
    args = ap.parse_args(argv)
    try:
        cal = calibrate_system(args.run_dirs)
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    text = json.dumps(cal, indent=2)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text + "\n")
        print(f"wrote {args.write}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
