"""How many emulated GPUs this machine holds: the emulator's own error as the cluster grows.

    pdlab bench emulation [--gpus 2,4,8,16] [--layout colocated-chunked] [--rate-per-gpu 6]
                          [--requests-per-gpu 40] [--hardware h200] [--model llama-3-8b] [--out DIR]

Serves one emulated point (engine.timing=emulated, docs/emulation.md) per cluster size, its load
growing with it (rate and requests per GPU), each in its own `python -m experiments.run`, and reads
back what the emulation recorded: how many steps a second the cluster ran, how late the host woke
to a step's end (its wait as measured against its price, steps.jsonl's forward_s - price_s) at the
median, p90 and p99, that lateness over the median step's price, the time between two steps of a
busy worker (what the simulator charges as the host gap), and the CPU the run took. A cluster is held
while the p99 lateness stays a small share of a step; where the router's, Ray's or the workers' CPU
runs out, it grows with every GPU added. One JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def served(out: Path, gpus: int, args) -> dict:
    cmd = [sys.executable, "-m", "experiments.run", f"model={args.model}", f"hardware={args.hardware}",
           "engine.timing=emulated", f"cluster.gpus={gpus}", f"layout={args.layout}",
           f"workload.rate={args.rate_per_gpu * gpus}", f"workload.num_requests={args.requests_per_gpu * gpus}",
           "repeats=1", "report=false", f"hydra.run.dir={out}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{gpus} GPUs: the run failed:\n{done.stderr[-2000:]}")
    wall = time.perf_counter() - started
    m = json.loads((out / "rep0" / "metrics.json").read_text())
    steps = [json.loads(line) for line in (out / "rep0" / "steps.jsonl").read_text().splitlines()]
    prices = [s["price_s"] for s in steps if s.get("price_s")]
    by_worker: dict[str, list] = {}
    for s in steps:
        by_worker.setdefault(s["worker"], []).append(s)
    gaps = []
    for ss in by_worker.values():
        ss.sort(key=lambda s: s["start_s"])
        gaps += [n["start_s"] - c["end_s"] for c, n in zip(ss, ss[1:]) if c["num_running"] or c["num_waiting"]]
    lag = m["emulated"]["steps"]
    span = max(s["end_s"] for s in steps) - min(s["start_s"] for s in steps)
    price = statistics.median(prices)
    return {"gpus": gpus, "steps_per_s": len(steps) / span, "price_p50_ms": 1e3 * price,
            "late_p50_ms": lag["ms_p50"], "late_p90_ms": lag["ms_p90"], "late_p99_ms": lag["ms_p99"],
            "late_p99_over_price": lag["ms_p99"] / (1e3 * price),
            "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "ours_cores": (m.get("machine") or {}).get("ours_cores"),
            "steal_cores": (m.get("machine") or {}).get("steal_cores"),
            "completed": m["num_completed"], "submitted": m["num_submitted"], "wall_s": wall}


def _or_nan(x) -> float:
    return float("nan") if x is None else x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdlab bench emulation", description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="2,4,8,16", help="cluster sizes, comma-separated")
    ap.add_argument("--layout", default="colocated-chunked")
    ap.add_argument("--rate-per-gpu", type=float, default=6.0, help="requests/s per GPU")
    ap.add_argument("--requests-per-gpu", type=int, default=40)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        print(f"error: --gpus={args.gpus!r}: give cluster sizes such as 2,4,8,16", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or args.rate_per_gpu <= 0 or args.requests_per_gpu < 1:
        print("error: --gpus, --rate-per-gpu and --requests-per-gpu must be positive", file=sys.stderr)
        return 2
    root = args.out or Path(tempfile.mkdtemp(prefix="pdlab-bench-emulation-"))
    rows = []
    print(f"{'GPUs':>4} {'steps/s':>8} {'price p50':>9} {'late p50':>8} {'p90':>6} {'p99':>6} {'p99/price':>9} "
          f"{'gap p50':>7} {'cores':>5} {'steal':>5}  (ms unless said)")
    for g in sizes:
        r = served(root / f"gpus{g}", g, args)
        rows.append(r)
        print(f"{g:>4} {r['steps_per_s']:>8.0f} {r['price_p50_ms']:>9.2f} {r['late_p50_ms']:>8.3f} "
              f"{r['late_p90_ms']:>6.3f} {r['late_p99_ms']:>6.3f} {r['late_p99_over_price']:>9.1%} "
              f"{r['gap_p50_ms']:>7.3f} {_or_nan(r['ours_cores']):>5.2f} {_or_nan(r['steal_cores']):>5.2f}",
              flush=True)
    print(json.dumps({"layout": args.layout, "hardware": args.hardware, "model": args.model,
                      "rate_per_gpu": args.rate_per_gpu, "runs": rows, "out": str(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
