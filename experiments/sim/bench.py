"""How fast the simulator runs: `python -m experiments.sim.bench [--requests N] [--gpus G] [overrides...]`.

Simulates N requests of a workload on G GPUs (default: 100,000 code-completion requests on 64 H200s
serving Llama-3-8B, at --rate-per-gpu requests/s each) for each --layouts entry, and prints per layout
the wall time, the events handled, the engine steps simulated and how many of them decode runs
advanced without scheduling; `--write DIR` also writes the run's files (requests.jsonl, steps.jsonl,
metrics.json) and times that apart. Ends with one JSON line. Timings are of this machine at this
moment: compare them within one run.

`--targets` instead runs the scale targets (TARGETS), each command in a child process timed end to end
with its peak memory, and prints each against its limit and the CPU share the child got (on a loaded
machine wall time overstates it); the JSON line carries {"targets": [{name, wall_s, max_rss_gb, cpu_s,
met}]}. `--targets NAME,...` runs only those.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from experiments.compose import compose_config
from experiments.config import ConfigError, apply_layout, parse
from experiments.serving.tables import TOKEN_TIMES_MAX
from experiments.sim.backend import costs_for, simulate, write_repeat
from experiments.workload import build_workload


# (name, command, wall-time limit s, memory limit GB): the scale targets, each as a user runs it
TARGETS = [
    ("run-100k-64", ["-m", "experiments.run", "backend=sim", "compare=null", "layout=32p32d", "cluster.gpus=64",
                     "model=llama-3-8b", "hardware=h200", "workload=chat", "workload.num_requests=100000",
                     "workload.rate=400", "repeats=1"], 60.0, 4.0),
    ("bench-1m-1000", ["-m", "experiments.sim.bench", "--requests", "1000000", "--gpus", "1000",
                       "--layouts", "colocated-chunked"], 120.0, None),
    ("plan-1000", ["-m", "experiments.plan", "model=llama-3-8b", "hardware=h200", "workload=chat",
                   "slo=interactive", "cluster.gpus=1000"], 30.0, None),
]


_MEASURE = """import json, resource, subprocess, sys, time
t0 = time.perf_counter()
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
u = resource.getrusage(resource.RUSAGE_CHILDREN)
out = (proc.stdout.strip().splitlines() or [""])[-1] if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [""])[-1]
print(json.dumps({"rc": proc.returncode, "wall_s": time.perf_counter() - t0, "cpu_s": u.ru_utime + u.ru_stime,
                  "max_rss_gb": u.ru_maxrss / 1e6, "last_line": out[:200]}))
"""


def run_target(name: str, args: list[str], out: Path) -> dict:
    """One target's command, timed by a child of its own (so getrusage's peak memory is that command's
    alone): wall time, CPU time and peak resident memory. Its run directory is emptied first: a run
    finds the repeats an earlier one left there and skips them (a resumed run)."""
    import shutil
    import subprocess
    import sys

    shutil.rmtree(out / name, ignore_errors=True)
    extra = [f"hydra.run.dir={out / name}"] if args[1] in ("experiments.run", "experiments.plan") else []
    proc = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, *args, *extra], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"timing {name} failed: {proc.stderr.strip()[-300:]}")
    return {"name": name} | json.loads(proc.stdout.strip().splitlines()[-1])


def targets(names: str, out: Path) -> int:
    chosen = [t for t in TARGETS if names == "all" or t[0] in names.split(",")]
    if not chosen:
        raise SystemExit(f"--targets {names}: choose from {[t[0] for t in TARGETS]} or all")
    rows = []
    for name, args, wall_max, mem_max in chosen:
        r = run_target(name, args, out)
        r["met"] = r["rc"] == 0 and r["wall_s"] <= wall_max and (mem_max is None or r["max_rss_gb"] <= mem_max)
        r["limits"] = {"wall_s": wall_max, "max_rss_gb": mem_max}
        rows.append(r)
        mem = f", {r['max_rss_gb']:.2f} GB (limit {mem_max:g})" if mem_max else f", {r['max_rss_gb']:.2f} GB"
        print(f"{name}: {r['wall_s']:.1f} s wall (limit {wall_max:g}), {r['cpu_s']:.1f} s CPU "
              f"({r['cpu_s'] / max(r['wall_s'], 1e-9):.0%} of one core){mem}: "
              f"{'met' if r['met'] else 'MISSED'}" + ("" if r["rc"] == 0 else f" (exit {r['rc']}: {r['last_line']})"))
    print(json.dumps({"targets": rows}))
    return 0 if all(r["met"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.sim.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--targets", metavar="NAMES", help="run the scale targets (all, or names from TARGETS)")
    ap.add_argument("--out", type=Path, default=Path("outputs/sim-bench"), help="where --targets' runs write")
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--rate-per-gpu", type=float, default=12.0)
    ap.add_argument("--layouts", help="comma-separated layouts (default: colocated-chunked and a 1:3 P:D split "
                                      "of --gpus, 16p48d on 64)")
    ap.add_argument("--write", type=Path, help="also write each layout's files under this directory")
    ap.add_argument("overrides", nargs="*", default=["model=llama-3-8b", "hardware=h200", "workload=code",
                                                     "scheduler.token_budget=512", "scheduler.max_batch=256"])
    args = ap.parse_args(argv)
    if args.targets:
        return targets(args.targets, args.out)
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: need at least one request")
    if not args.rate_per_gpu > 0:
        ap.error(f"--rate-per-gpu {args.rate_per_gpu:g}: must be positive")
    if args.write is not None:
        try:
            args.write.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--write {args.write}: {e.strerror or e}")
    p = max(1, args.gpus // 4)
    layouts = args.layouts or ("colocated-chunked" + (f",{p}p{args.gpus - p}d" if args.gpus > 1 else ""))
    try:
        cfg = compose_config("config", ["compare=null", f"cluster.gpus={args.gpus}", *args.overrides])
        specs = [(layout, parse(apply_layout(cfg, layout))) for layout in layouts.split(",")]
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    results = []
    for layout, spec in specs:
        w = dataclasses.replace(spec.workload, num_requests=args.requests, rate=args.rate_per_gpu * args.gpus)
        t0 = time.perf_counter()
        arrivals = build_workload(w, spec.vocab_size, spec.max_model_len, spec.seed, token_ids=False)
        costs = costs_for(spec)
        t1 = time.perf_counter()
        write = args.write is not None
        sim = simulate(spec, arrivals, costs, record_steps=write, keep_tokens=write and args.requests <= TOKEN_TIMES_MAX,
                       pool_gaps=write)
        t2 = time.perf_counter()
        steps = sum(w.engine.num_steps for w in sim.workers)
        done = sum(r.status == "ok" for r in sim.records.values())
        row = {"layout": layout, "requests": args.requests, "gpus": args.gpus, "completed": done,
               "simulated_s": max((r.end_time or 0.0) for r in sim.records.values()), "workload_s": t1 - t0,
               "simulate_s": t2 - t1, "events": sim.num_events, "steps": steps,
               "steps_per_event": steps / max(sim.num_events, 1), "costs": costs.source}
        if args.write is not None:
            out = args.write / layout / "rep0"
            out.mkdir(parents=True, exist_ok=True)
            write_repeat(out, spec, {"label": layout, "layout": layout}, sim, 0, t2 - t1)
            row["write_s"] = time.perf_counter() - t2
        results.append(row)
        print(f"{layout}: {args.requests} requests on {args.gpus} GPUs ({done} completed, {row['simulated_s']:.0f} s "
              f"simulated) in {row['simulate_s']:.1f} s: {sim.num_events} events, {steps} engine steps "
              f"({row['steps_per_event']:.1f} per event)" + (f"; files in {row['write_s']:.1f} s" if "write_s" in row else ""))
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
