"""How long a run's KV handoffs took beside their sender's next steps: `python -m
experiments.analysis.handoff_check RUN_DIR... [--profile FILE]`.

For each disaggregated repeat's handoffs (transfer.stream=off), measured from the prefill step's end
to the last byte in (requests.jsonl exposed_transfer_s), against the fitted time W of the profile's
serving handoff (latency + bytes / bandwidth, experiments/analysis/calibrate.py handoff_fits). Those
the sender stepped beside (its next step started before the KV landed) are printed apart: measured / W,
and the factor a send would go slower for the time it overlaps a sender step if it ran at full speed
otherwise (overlap / (W - the time without overlap)). The calibration prices such handoffs by the
median of its own run's (of those that overlapped a quarter of W or more); this says how that reading
moves from run to run.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from experiments.analysis.calibrate import by_worker, overlap, overlap_factor, repeat_dirs, sender_steps
from experiments.serving.aggregate import read_jsonl


def handoffs(run: Path, latency_s: float, bandwidth: float) -> list[dict]:
    """{bytes, measured / W, overlap share, time-based factor or None} per stream=off handoff of run."""
    out = []
    for d in repeat_dirs(run):
        rows = read_jsonl(d / "requests.jsonl")
        if not any(r.get("transfer_bytes") for r in rows):
            continue
        workers = by_worker(read_jsonl(d / "steps.jsonl"))
        for r in rows:
            s, b = r.get("exposed_transfer_s"), r.get("transfer_bytes")
            if not (s and b and r.get("status") == "ok"):
                continue
            w = latency_s + b / bandwidth
            o = overlap(sender_steps(workers.get(r["prefill_worker"], []), r["arrival_s"] + r["ttft_s"]), s)
            out.append({"bytes": b, "ratio": s / w, "overlap": o / s, "factor": overlap_factor(w, s, o)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.handoff_check", description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--profile", type=Path, required=True, help="the profile whose serving handoff fit gives W")
    ap.add_argument("--transport", default="zmq")
    args = ap.parse_args(argv)
    fit = json.loads(args.profile.read_text())["serving"]["handoff"][args.transport]
    print(f"W = {fit['latency_s'] * 1e3:.2f} ms + bytes / {fit['bandwidth'] / 1e6:.0f} MB/s; the profile's busy "
          f"factor {fit.get('busy', 1.0):.2f} (a send goes that much slower while its sender steps)")
    for run in args.runs:
        hs = handoffs(run, fit["latency_s"], fit["bandwidth"])
        alone = [h["ratio"] for h in hs if not h["overlap"]]
        beside = [h for h in hs if h["overlap"]]
        if not hs:
            print(f"{run}: no handoff")
            continue
        line = f"{run}: {len(alone)} alone, measured / W median {statistics.median(alone):.2f}" if alone else f"{run}: none alone"
        if beside:
            f = [h["factor"] for h in beside if h["factor"]]
            q = np.percentile(f, [25, 75]) if f else (float("nan"),) * 2
            line += (f"; {len(beside)} beside a sender step, measured / W median "
                     f"{statistics.median(h['ratio'] for h in beside):.2f}, for the overlap "
                     f"{statistics.median(f) if f else float('nan'):.2f}x slower (p25-p75 {q[0]:.2f}-{q[1]:.2f})")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
