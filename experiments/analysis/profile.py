"""A profile of the device at hand: what pdlab's engine steps, exports, imports and transfers cost here.

    python -m experiments.profile [model=tiny] [threads=N] [repeats=5] [calibrate=true] [out=FILE]

1. Steps. The engine's ModelRunner executes hand-built steps over a grid of decode batch B x context C
   x prompt chunk P (from token 0, and a few chunks that start later), in `repeats` interleaved rounds
   after a warm-up round (each round visits every cell, the order rotated, so drift hits all alike).
   The median per cell is fitted by experiments/sim/stepmodel.fit_linear; the profile keeps every
   sample, the fit error per cell (relative to the median) and the repeat noise (each sample's
   distance from its cell's median), so the fit can be judged against the noise.
2. Host time between steps: a real Engine steps B decodes; the gap from one step's end to the next's
   start (post-processing and scheduling) is fitted as g0 + g1 * B.
3. Handoff: KVCache.export of a prompt's KV and Engine.import_request of it, fitted as fixed + per byte.
4. Transfers: `benchmarks.transfer` at a few payload sizes, `transfer_repeats` times; per backend
   the median seconds per transfer at each size are fitted as latency + bytes / bandwidth.
5. Serving calibration (calibrate=true): a short real run of the three default layouts on this
   machine (its own seed, not a run anything is validated against; `calibration.repeats` times
   round-robin, so it reads the machine at several moments) gives the router's message latencies,
   the busy host gap, the KV handoff as served, and the serving factors: how much slower decode and
   prefill steps run while serving than in isolation, how much slower again while another worker
   of the host is busy, and how much they vary (experiments/analysis/calibrate.py; docs/simulator.md).

The machine's load over each part is recorded (experiments/serving/machine.py). Written as JSON to
profiles/<hardware>/<model>-<dtype>-<threads>t.json, <hardware> naming this machine (`machine_name`):
a few KB, the step grid kept as one row per cell (batch, context, chunk, start, median seconds), what
a refit reads.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments.serving.machine import snapshot, usage
from experiments.serving.profiles import machine_name, profile_path
from experiments.sim.stepmodel import LinearStepModel, chunk_features, describe_factors, fit_linear, relative_errors
from experiments.sim.transfer import fit_transfer

ROOT = Path(__file__).resolve().parents[2]


# -- 1. steps ---------------------------------------------------------------------------------------
class StepBench:
    """Hand-built steps executed by a real ModelRunner: B decodes at context C beside one P-token chunk
    from token s. Each decode request owns its blocks, as in serving. Timed by `clock` (wall time; a
    test may read thread CPU time, which other processes' load leaves alone)."""

    def __init__(self, model, max_batch: int, max_context: int, max_chunk_end: int, block_size: int = 16,
                 clock=time.perf_counter):
        self.clock = clock
        from workers.config import EngineConfig, blocks_for
        from workers.engine import Engine
        from workers.request import Request, SamplingParams

        per = blocks_for(max_context + 1, block_size)
        blocks = max_batch * per + blocks_for(max_chunk_end, block_size) + 8
        budget = max_batch + max_chunk_end
        self.engine = Engine(model, EngineConfig(policy="chunked", token_budget=budget, max_batch=max_batch + 1,
                                                 block_size=block_size, num_kv_blocks=blocks,
                                                 max_model_len=max(max_context + 2, max_chunk_end + 1)))
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        rng = np.random.default_rng(0)
        vocab = model.cfg.vocab_size
        self.decodes, self.base = [], []
        for i in range(max_batch):
            r = Request(id=f"d{i}", prompt_ids=rng.integers(0, vocab, max_context + 1).tolist(), params=params)
            self.engine.blocks.allocate(r.block_ids, max_context + 1)
            self.decodes.append(r)
        self.chunk = Request(id="p", prompt_ids=rng.integers(0, vocab, max_chunk_end).tolist(), params=params)
        self.engine.blocks.allocate(self.chunk.block_ids, max_chunk_end)

    def step_s(self, b: int, context: int, chunk: int, start: int) -> float:
        from workers.scheduler import ScheduledChunk, SchedulerOutput

        out = SchedulerOutput()
        for r in self.decodes[:b]:
            r.token_ids, r.num_computed_tokens = r.prompt_ids[:context + 1], context
            out.decodes.append(ScheduledChunk(r, 1))
        if chunk:
            r = self.chunk
            r.token_ids, r.num_computed_tokens = r.prompt_ids[:start + chunk], start
            out.prefills.append(ScheduledChunk(r, chunk))
        t = self.clock()
        self.engine.runner.execute(out)
        return self.clock() - t


def grid_cells(batches, contexts, chunks, starts) -> list[tuple[int, int, int, int]]:
    """(B, C, P, s) cells: every B x C x P from token 0 (B = 0 at one context), and chunks of P in
    `chunks` starting at each s in `starts` beside B in {0, the middle batch}."""
    cells = []
    for b, c, p in itertools.product(batches, contexts, chunks):
        if (b == 0 and (p == 0 or c != contexts[0])):
            continue
        cells.append((b, c, p, 0))
    mid = sorted(batches)[len(batches) // 2]
    for s, p, b in itertools.product(starts, [x for x in chunks if x], sorted({0, mid})):
        if s:
            cells.append((b, contexts[0], p, s))
    return cells


def measure_steps(bench: StepBench, cells, repeats: int) -> dict:
    """{cell: [seconds per round]}: one warm-up round, then `repeats` rounds in rotated order."""
    samples = {cell: [] for cell in cells}
    for k in range(repeats + 1):
        shift = (k * 7) % len(cells)
        for cell in cells[shift:] + cells[:shift]:
            t = bench.step_s(*cell)
            if k:
                samples[cell].append(t)
    return samples


CELL_COLUMNS = ("batch", "context", "chunk", "start", "median_s")


def fit_steps(samples: dict) -> dict:
    """The step model fitted to the median of each cell's samples ({(B, C, P, s): [seconds]}); the
    fit error per cell is relative to that median, the repeat noise each sample's distance from it."""
    cells = list(samples)
    feats = [chunk_features(b, b * c, [(p, s, True)] if p else []) for b, c, p, s in cells]
    med = [statistics.median(samples[c]) for c in cells]
    coef, err = fit_linear(feats, med)
    noise = [abs(x - m) / m for c, m in zip(cells, med) for x in samples[c]]
    return {"coef": coef, "fit_error": err,
            "repeat_noise": {"median_abs": float(np.median(noise)), "p90_abs": float(np.percentile(noise, 90)),
                             "samples_per_cell": max(len(v) for v in samples.values())},
            "cells": {"columns": list(CELL_COLUMNS),
                      "rows": [[b, c, p, s, float(f"{m:.4g}")] for (b, c, p, s), m in zip(cells, med)]}}


def cell_medians(cells: dict) -> dict:
    """{(B, C, P, s): [median seconds]} from a profile's cells (what fit_steps reads back)."""
    if isinstance(cells, list):            # an older profile: one dict per cell, every sample kept
        return {(c["batch"], c["context"], c["chunk"], c["start"]): [statistics.median(c["samples_s"])]
                for c in cells}
    return {tuple(r[:4]): [r[4]] for r in cells["rows"]}


# -- 2. host gap ------------------------------------------------------------------------------------
def measure_gap(model, batches, steps: int = 40, clock=None) -> dict:
    from workers.config import EngineConfig
    from workers.engine import Engine
    from workers.request import SamplingParams

    xs, ys = [], []
    for b in batches:
        engine = Engine(model, EngineConfig(policy="chunked", token_budget=17 * b, max_batch=b,
                                            num_kv_blocks=b * 8 + 8, max_model_len=128),
                        **({"clock": clock} if clock else {}))
        for i in range(b):
            engine.add_request(f"g{i}", [1] * 16, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        for _ in range(steps):
            engine.step()
        tr = engine.trace[2:]
        gaps = [nxt.start - cur.end for cur, nxt in zip(tr, tr[1:]) if cur.num_decode_seqs == b]
        xs.append(b)
        ys.append(statistics.median(gaps))
    g1, g0 = np.polyfit(xs, ys, 1)
    g0, g1 = max(float(g0), 0.0), max(float(g1), 0.0)
    return {"gap_coef": [g0, g1], "batches": xs, "median_gap_s": ys,
            "fit_error": relative_errors([g0 + g1 * x for x in xs], ys)}


# -- 3. handoff -------------------------------------------------------------------------------------
def measure_handoff(model, sizes, repeats: int = 7) -> dict:
    from workers.config import EngineConfig
    from workers.engine import Engine
    from workers.request import SamplingParams

    n_max = max(sizes)
    cfg = EngineConfig(policy="chunked", token_budget=n_max + 8, max_batch=4, num_kv_blocks=4 * (n_max // 16 + 2),
                       max_model_len=n_max + 8)
    src, dst = Engine(model, cfg.replace(role="prefill")), Engine(model, cfg.replace(role="decode"))
    per_token = model.cfg.kv_bytes_per_token(model.embed_tokens.element_size())
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    export, imp = [], []
    for n in sizes:
        ids = [1] * n
        src.add_request("h", ids, params)
        while src.requests["h"].status.value != "handoff":
            src.step()
        e, i = [], []
        for k in range(repeats):
            t = time.perf_counter()
            kv = src.export_kv("h")
            e.append(time.perf_counter() - t)
            t = time.perf_counter()
            dst.import_request(f"i{k}", ids, 1, params, kv)
            i.append(time.perf_counter() - t)
            dst.abort(f"i{k}")
        src.release("h")
        export.append(statistics.median(e))
        imp.append(statistics.median(i))
    nbytes = [n * per_token for n in sizes]
    out = {"sizes_tokens": list(sizes), "bytes": nbytes, "export_s": export, "import_s": imp}
    for key, ys in (("export", export), ("import", imp)):
        slope, fixed = np.polyfit(nbytes, ys, 1)
        out[key] = [max(float(fixed), 0.0), max(float(slope), 0.0)]
    return out


# -- 4. transfers -----------------------------------------------------------------------------------
def measure_transfers(sizes_mib, repeats: int, bench_repeats: int = 8) -> dict:
    """benchmarks.transfer `repeats` times; per backend the median per-transfer time at each size, fitted."""
    runs = []
    for _ in range(repeats):
        cmd = [sys.executable, "-m", "benchmarks.transfer", "--sizes-mib", ",".join(map(str, sizes_mib)),
               "--repeats", str(bench_repeats), "--device", "cpu"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmarks.transfer failed: {proc.stderr.strip().splitlines()[-1:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = {"source": f"python -m benchmarks.transfer --sizes-mib {','.join(map(str, sizes_mib))} --repeats "
                     f"{bench_repeats}, {repeats} times; median per size"}
    for backend in runs[0]["backends"]:
        sizes, secs = [], []
        for i, row in enumerate(runs[0]["results"]):
            per = [r["results"][i]["nbytes"] / (r["results"][i][f"{backend}_gbps"] * 1e9) for r in runs]
            sizes.append(row["nbytes"])
            secs.append(statistics.median(per))
        model, err = fit_transfer(sizes, secs, backend)
        out[backend] = model.to_dict() | {"bytes": sizes, "seconds": secs, "fit_error": err}
    return out


def describe(factors: dict) -> str:
    return describe_factors(factors) or "none (too few steps)"


def write(path: Path, prof: dict) -> None:
    """The profile as compact JSON (one line per top-level key), a few KB."""
    path.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                        for k, v in prof.items()) + "\n}\n")


def timed(fn, *args, **kwargs):
    before = snapshot()
    value = fn(*args, **kwargs)
    return value, usage(before, snapshot())


# -- 5. serving calibration and the command ----------------------------------------------------------
def calibration_run(out: Path, cfg, gemm_rows) -> Path:
    """The three default layouts served on this machine with the calibration's own seed, `repeats`
    times round-robin (A B C A B C ...), so the calibration reads the machine at several moments; its
    CPU linears on the route the steps were timed on (`gemm_rows`)."""
    c = cfg.calibration
    cmd = [sys.executable, "-m", "experiments.run", f"model={cfg.model.name}", f"repeats={c.get('repeats', 1)}",
           "report=false",
           f"seed={c.seed}", f"workload.num_requests={c.num_requests}", f"workload.rate={c.rate}",
           f"engine.cpu_gemm_rows={'null' if gemm_rows is None else gemm_rows}", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"calibration run failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return out


def run(cfg, out_dir: Path) -> dict:
    import torch

    from experiments.analysis.calibrate import calibrate
    from workers.weights import build_model, parse_device, resolve_dtype

    started = time.time()
    device = parse_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    threads = cfg.threads or max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                     else os.cpu_count() or 1) // 2)
    torch.set_num_threads(threads)
    model = build_model(model=cfg.model.name, dtype=dtype, device=device, seed=0)
    dname = str(dtype).removeprefix("torch.")
    g = cfg.grid
    print(f"profiling {cfg.model.name} ({dname}) on {machine_name()} with {threads} torch thread(s)")
    bench = StepBench(model, max(g.batches), max(g.contexts), max(g.starts) + max(g.chunks))
    cells = grid_cells(list(g.batches), list(g.contexts), list(g.chunks), list(g.starts))
    samples, m_steps = timed(measure_steps, bench, cells, cfg.repeats)
    gemm_rows = bench.engine.memory()["cpu_gemm_rows"]     # the linears' route the steps were timed on
    del bench
    steps = fit_steps(samples)
    e = steps["fit_error"]
    print(f"1/5 steps: {len(cells)} cells x {cfg.repeats} rounds; fit error median {e['median_abs']:.1%}, p90 "
          f"{e['p90_abs']:.1%}; repeat noise median {steps['repeat_noise']['median_abs']:.1%}")
    gap, m_gap = timed(measure_gap, model, list(cfg.gap_batches))
    print(f"2/5 host gap between steps: {gap['gap_coef'][0] * 1e6:.0f} us + {gap['gap_coef'][1] * 1e6:.1f} us/seq")
    handoff, m_handoff = timed(measure_handoff, model, list(cfg.handoff_tokens))
    print(f"3/5 handoff: export {handoff['export_s'][-1] * 1e3:.2f} ms, import {handoff['import_s'][-1] * 1e3:.2f} ms "
          f"at {handoff['sizes_tokens'][-1]} tokens")
    transfer, m_transfer = timed(measure_transfers, list(cfg.transfer_sizes_mib), cfg.transfer_repeats)
    for b in ("zmq", "nccl"):
        if b in transfer:
            print(f"4/5 transfer {b}: {transfer[b]['latency_s'] * 1e3:.2f} ms + bytes / "
                  f"{transfer[b]['bandwidth'] / 1e9:.2f} GB/s")
    model_d = LinearStepModel(steps["coef"], gap["gap_coef"], name=f"{cfg.model.name} on {machine_name()}").to_dict()
    prof = {"kind": "pdlab-profile", "hardware": machine_name(), "device": str(device), "model": cfg.model.name,
            "dtype": dname, "threads": threads, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "cpu_gemm_rows": gemm_rows, "step_model": model_d, "fit_error": steps["fit_error"],
            "repeat_noise": steps["repeat_noise"],
            "grid": {"batches": list(g.batches), "contexts": list(g.contexts), "chunks": list(g.chunks),
                     "starts": list(g.starts), "repeats": cfg.repeats, "cells": steps["cells"]},
            "gap": gap, "handoff": {"export": handoff["export"], "import": handoff["import"], "measured": handoff},
            "transfer": transfer,
            "machine": {"steps": m_steps, "gap": m_gap, "handoff": m_handoff, "transfer": m_transfer}}
    if cfg.calibrate:
        run_dir, m_cal = timed(calibration_run, out_dir / "calibration", cfg, gemm_rows)
        cal = calibrate([run_dir], LinearStepModel(steps["coef"], gap["gap_coef"]))
        c = cfg.calibration
        prof["serving"] = cal | {"source": f"python -m experiments.run seed={c.seed} (three layouts, "
                                           f"{c.get('repeats', 1)} x {c.num_requests} requests at {c.rate}/s)"}
        prof["machine"]["calibration"] = m_cal
        print(f"5/5 serving: dispatch {cal['dispatch_s'] * 1e3:.2f} ms, return {cal['return_s'] * 1e3:.2f} ms, gap "
              f"{cal['gap_s'] * 1e3:.3f} ms; factors {describe(cal['factors'])}")
    else:
        print("5/5 serving calibration skipped (calibrate=false)")
    path = Path(cfg.out) if cfg.out else profile_path(cfg.model.name, dname, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, prof)
    prof["path"] = str(path)
    prof["elapsed_s"] = time.time() - started
    return prof


def refit(cfg) -> dict:
    """refit=true: the profile at `out` (default: this machine's for the model, dtype and threads) with its
    step model fitted again to the samples it holds (nothing is measured again: a new model form reads
    the old measurements), and its serving calibration redone from `calibration.run_dir` (a calibration
    run made with experiments.run, the profile's calibration settings) when one is given."""
    from experiments.analysis.calibrate import calibrate
    from workers.weights import parse_device, resolve_dtype

    started = time.time()
    if cfg.out:
        path = Path(cfg.out)
    else:
        dname = str(resolve_dtype(cfg.dtype, parse_device(cfg.device))).removeprefix("torch.")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        path = profile_path(cfg.model.name, dname, cfg.threads or max(1, cores // 2))
    prof = json.loads(path.read_text())
    samples = cell_medians(prof["grid"]["cells"])
    steps = fit_steps(samples)
    gap_coef = prof["gap"]["gap_coef"]
    prof["step_model"] = LinearStepModel(steps["coef"], gap_coef, name=prof["step_model"]["name"]).to_dict()
    prof["fit_error"], prof["grid"]["cells"] = steps["fit_error"], steps["cells"]
    prof.get("transfer", {}).pop("runs", None)
    prof["refitted"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    e = steps["fit_error"]
    print(f"steps refitted to the profile's {len(samples)} cells: fit error median {e['median_abs']:.1%}, p90 "
          f"{e['p90_abs']:.1%}")
    run_dir = cfg.calibration.get("run_dir")
    if run_dir:
        cal = calibrate([Path(run_dir)], LinearStepModel(steps["coef"], gap_coef))
        c = cfg.calibration
        prof["serving"] = cal | {"source": f"calibration run {run_dir} (python -m experiments.run seed={c.seed}, "
                                           f"three layouts, {c.get('repeats', 1)} x {c.num_requests} requests at "
                                           f"{c.rate}/s)"}
        print(f"serving calibrated from {run_dir} (other processes used {cal['other_cores'] or 0:.2f} cores)")
    elif prof.get("serving"):
        print("warning: the serving calibration was made against the old step model; give calibration.run_dir")
    write(path, prof)
    return prof | {"path": str(path), "elapsed_s": time.time() - started}


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from experiments.compose import exit_on_bad_overrides

    exit_on_bad_overrides("profile")

    @hydra.main(version_base=None, config_path=str(ROOT / "conf"), config_name="profile")
    def app(cfg) -> None:
        try:
            prof = refit(cfg) if cfg.refit else run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ValueError, RuntimeError) as e:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
            sys.exit(2)
        print(f"profile: {prof['path']} ({prof['elapsed_s']:.0f} s)")
        print(json.dumps({"profile": prof["path"], "hardware": prof["hardware"], "threads": prof["threads"],
                          "fit_error": prof["fit_error"], "serving": prof.get("serving"),
                          "elapsed_s": round(prof["elapsed_s"], 1)}))

    app()
