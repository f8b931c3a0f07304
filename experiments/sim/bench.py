"""How fast the simulator runs: `python -m experiments.sim.bench [--requests N] [--gpus G] [overrides...]`.

Simulates N requests of a workload on G GPUs (default: 100,000 code-completion requests on 64 H200s
serving Llama-3-8B, at --rate-per-gpu requests/s each) for each --layouts entry, and prints per layout
the wall time, the events handled, the engine steps simulated and how many of them decode runs
advanced without scheduling; `--write DIR` also writes the run's files (requests.jsonl, steps.jsonl,
metrics.json) and times that apart. Ends with one JSON line. Timings are of this machine at this
moment: compare them within one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.config import apply_layout, parse
from experiments.run import CONF_DIR
from experiments.serving.workload import build_workload
from experiments.sim.backend import costs_for, simulate, write_repeat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.sim.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--rate-per-gpu", type=float, default=12.0)
    ap.add_argument("--layouts", default="colocated-chunked,16p48d")
    ap.add_argument("--write", type=Path, help="also write each layout's files under this directory")
    ap.add_argument("overrides", nargs="*", default=["model=llama-3-8b", "hardware=h200", "workload=code",
                                                     "scheduler.token_budget=512", "scheduler.max_batch=256"])
    args = ap.parse_args(argv)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["compare=null", f"cluster.gpus={args.gpus}", *args.overrides])
    results = []
    for layout in args.layouts.split(","):
        spec = parse(apply_layout(cfg, layout))
        w = dataclasses.replace(spec.workload, num_requests=args.requests, rate=args.rate_per_gpu * args.gpus)
        t0 = time.perf_counter()
        arrivals = build_workload(w, spec.vocab_size, spec.max_model_len, spec.seed, token_ids=False)
        costs = costs_for(spec)
        t1 = time.perf_counter()
        sim = simulate(spec, arrivals, costs, record_steps=args.write is not None, keep_tokens=args.write is not None)
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
