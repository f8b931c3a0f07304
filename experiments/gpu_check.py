"""One command that checks pdlab on a GPU, in minutes: every stage in its own subprocess with its own
timeout, each stage's JSON written as it finishes (a stage that fails or times out does not stop the
others), ending with one JSON line {"device": ..., "stages": {name: {"ok": bool, ...}}, "ok": bool}.

    python -m experiments.gpu_check                 # the first visible GPU, Llama-3-8B shapes in bf16
    python -m experiments.gpu_check --device cpu    # every stage on the CPU at the tiny model's shapes
    python -m experiments.gpu_check --only attention,engine --out DIR

Stages (random weights): environment; flex against reference attention per layer on a mixed and a
decode-only step, and the compiles over 20 step shapes; the engine's logits and tokens, reference
against flex, a CUDA graph's replay against the eager step; decode steps against the HBM floor and
prefill against a looped GEMM's peak; the interference curve (prefill chunks beside 32 decodes);
disaggregation on one GPU (a prefill and a decode worker sharing it) over ZeroMQ, whole and streamed,
tokens equal to colocated, and over NCCL where there are two GPUs; the main job, reduced. What can
only happen on CUDA is skipped on a CPU and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments import gpu_stages, gpu_timing

STAGES = {           # name: (the stage, its timeout in s); the whole check stays within 8 minutes on a GPU
    "environment": (gpu_stages.environment, 60), "attention": (gpu_stages.attention, 120),
    "engine": (gpu_stages.engine, 120), "roofline": (gpu_timing.roofline, 120),
    "interference": (gpu_timing.interference, 90), "disaggregation": (gpu_stages.disaggregation, 150),
    "main_job": (gpu_stages.main_job, 240),
}


# -- the driver -------------------------------------------------------------------------------------
def run_stage(name: str, device: str) -> dict:
    fn = STAGES[name][0]
    t = time.monotonic()
    try:
        out = fn(device, gpu_stages.shapes(device))
    except Exception as e:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    out["seconds"] = round(time.monotonic() - t, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--only", default=None, help=f"comma-separated stages of {', '.join(STAGES)}")
    ap.add_argument("--out", default=None, help="where each stage's JSON goes (default outputs/gpu_check/<time>)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every stage's timeout")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)     # run one stage in this process
    args = ap.parse_args(argv)
    if not args.timeout_scale > 0:
        ap.error(f"--timeout-scale {args.timeout_scale:g}: must be positive")
    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.stage:
        print(json.dumps(run_stage(args.stage, device)))
        return 0
    names = list(STAGES) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        ap.error(f"--only: unknown stage(s) {unknown}; choose from {list(STAGES)}")
    out_dir = Path(args.out or f"outputs/gpu_check/{time.strftime('%Y-%m-%d/%H-%M-%S')}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {out_dir}: {e.strerror or e}")
    env = {**os.environ, "PDLAB_GPU_CHECK_OUT": str(out_dir.resolve())}
    results = {}
    for name in names:
        limit = STAGES[name][1] * args.timeout_scale
        cmd = [sys.executable, "-m", "experiments.gpu_check", "--stage", name, "--device", device]
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            line = next((l for l in reversed(p.stdout.splitlines()) if l.startswith("{")), None)
            res = json.loads(line) if line else {"ok": False, "error": f"exit {p.returncode}",
                                                 "stderr": p.stderr.strip().splitlines()[-12:]}
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": f"timed out after {limit:g} s"}
        res.setdefault("seconds", round(time.monotonic() - t, 2))
        results[name] = res
        (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        print(f"{name:15s} {'ok' if res['ok'] else 'FAILED':7s} {res['seconds']:7.1f} s  "
              f"{res.get('error', '')}", flush=True)
    summary = {"device": results.get("environment", {}).get("gpu") or device, "stages": results,
               "ok": all(r["ok"] for r in results.values())}
    (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
