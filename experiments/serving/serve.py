"""Serve points on the cluster, each `repeats` times, round-robin: A B C A B C ..., so drift hits all alike.

`prepare` validates every point and builds its workload before any worker starts. `serve_all` runs the
rounds: each repeat of a point is a full run into `<point>/rep<i>/` (config.yaml, requests.jsonl,
steps.jsonl, metrics.json with within-run intervals and the machine's load: docs/run-directory.md).
A repeat whose files are on disk with the same config is skipped; a repeat that crashes leaves
error.json, its workers and placement group are released, and that point serves no more repeats in
this run. After the last round each point's metrics.json aggregates its repeats (experiments/serving/aggregate.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.serving import aggregate
from experiments.serving.capacity import check_memory
from experiments.serving.confidence import METHOD_WITHIN, replicates, within_run_ci
from experiments.config import ConfigError, RunSpec, points
from experiments.progress import Progress, echo
from experiments.serving.machine import shared_cores, snapshot, usage
from experiments.serving.metrics import request_fields, summarize
from experiments.serving.steps import price_error, step_ratio
from experiments.workload import WorkloadError, WorkloadRequest, build_workload
from workers.config import gemm_route

log = logging.getLogger("pdlab")


def label(spec: RunSpec) -> str:
    c, s = spec.cluster, spec.scheduler
    if c.mode == "colocated":
        budget = spec.engines()["colocated"].token_budget
        return f"colocated {s.policy} x{c.workers}" + (f" (chunk {budget})" if s.policy == "chunked" else "")
    cond = f", local prefill < {spec.router.conditional_threshold}" if spec.router.conditional_threshold else ""
    return f"disaggregated {c.prefill_workers}P+{c.decode_workers}D ({spec.transfer.backend}{cond})"


def identity(spec: RunSpec, cfg: DictConfig, overrides: str) -> dict:
    c = spec.cluster
    return {"label": label(spec), "layout": cfg.get("layout"), "mode": c.mode, "policy": spec.scheduler.policy,
            "token_budget": spec.engines()["colocated"].token_budget,
            "prefill_workers": c.prefill_workers if c.mode == "disaggregated" else None,
            "decode_workers": c.decode_workers if c.mode == "disaggregated" else None,
            "workers": c.workers if c.mode == "colocated" else None, "num_gpus": c.num_workers,
            "transfer": spec.transfer.backend if c.mode == "disaggregated" else None,
            "rate": spec.workload.rate, "workload": spec.workload.name,
            "model": spec.model.checkpoint or spec.model.model, "device": spec.model.device, "overrides": overrides}


@dataclass
class Prepared:
    out: Path                        # the point's directory
    cfg: DictConfig
    spec: RunSpec
    requests: list[WorkloadRequest]
    ident: dict
    shared: str | None               # machine.SHARED with its arithmetic, when workers share cores
    failed: bool = False
    warnings: list[str] = field(default_factory=list)   # requests failed for reasons of their own
    emulated: dict | None = None     # engine.timing=emulated: its engines, workers' prices and link, and what
                                     # metrics.json records of them (experiments/sim/emulated.py)

    @property
    def repeat_config(self) -> str:
        """A repeat's config.yaml: the point's resolved config less `repeats` (more repeats reuse these)."""
        cfg = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True))
        cfg.pop("repeats", None)
        return OmegaConf.to_yaml(cfg)


def prepare(cfg: DictConfig, run_dir: Path, overrides: str) -> list[Prepared]:
    """Every point of `cfg`, validated, with its workload built and its memory need checked (a simulated
    point, backend=sim, needs no memory here and no token ids)."""
    out = []
    for sub, pcfg, spec in points(cfg):
        real = spec.backend == "real"
        emulated = real and spec.engine.timing == "emulated"
        if real and not emulated:
            check_memory(spec)
        try:
            requests = build_workload(spec.workload, spec.vocab_size, spec.max_model_len, spec.seed, token_ids=real)
        except (WorkloadError, ValueError) as e:
            raise ConfigError(f"workload: {str(e).splitlines()[0]}") from None
        c = spec.cluster
        shared = (shared_cores(c.num_workers, c.torch_threads, c.address is None, c.num_cpus)
                  if real and not emulated else None)
        out.append(Prepared(run_dir / sub if sub else run_dir, pcfg, spec, requests,
                            identity(spec, pcfg, ",".join(filter(None, [overrides, sub]))), shared))
    return out


def round_robin(prepared: list[Prepared]) -> list[Prepared]:
    """Record in each point's identity how many points its repeats were interleaved with (itself included)."""
    for p in prepared:
        p.ident["round_robin"] = len(prepared)
    return prepared


# -- Ray and the cluster --------------------------------------------------------------------------
def ensure_ray(spec: RunSpec) -> None:
    """An embedded Ray declaring enough GPUs for this point (restarted if an earlier point's is too small)."""
    import ray
    import torch
    from cluster.ray_cluster import start_ray, stop_ray

    cluster = spec.cluster
    if cluster.address is None:
        fake = max(spec.gpus, math.ceil(cluster.num_gpus_needed))      # on CPU: enough for the layout's share
        gpus = cluster.num_gpus if cluster.num_gpus is not None else (torch.cuda.device_count() or fake)
        cluster = dataclasses.replace(cluster, num_gpus=gpus)
        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < gpus:
            stop_ray()
    start_ray(cluster)


def drive(router, requests: list[WorkloadRequest], desc: str) -> float:
    """Submit each request at its arrival time (open loop); wait for all. Returns the start time."""
    from workers.request import SamplingParams

    bar = Progress(desc, total=len(requests), unit="requests")
    start = time.time()

    def tick():
        p = router.progress()
        elapsed = max(time.time() - start, 1e-9)
        bar.update(p["ok"] + p["failed"] - bar.done, failed=p["failed"], tok_s=f"{p['tokens'] / elapsed:.0f}")

    for req in requests:
        while (delay := start + req.arrival_s - time.time()) > 0:
            time.sleep(min(delay, 0.25))
            tick()
        router.submit(req.id, req.prompt_ids, SamplingParams(max_tokens=req.max_tokens, ignore_eos=True))
    while not router.wait(timeout_s=0.25):
        tick()
    tick()
    bar.close()
    return start


def step_row(worker: str, step: dict, t0: float) -> dict:
    """One steps.jsonl row: a worker's step record (router's clock) with its times relative to t0."""
    return {"worker": worker, **{k: v for k, v in step.items() if k not in ("start", "end")},
            "start_s": step["start"] - t0, "end_s": step["end"] - t0}


def request_row(rec, t0: float) -> dict:
    return request_fields(rec, t0, rec.output_ids, rec.ttft_s, rec.e2e_s, rec.itl_s,
                          rec.client_ttft_s, rec.client_e2e_s, rec.client_itl_s)


def unexpected_failures(records) -> dict | None:
    """Requests that failed for a reason other than an injected fault: how many, how many distinct
    reasons, and the three commonest."""
    bad = Counter(r.reason for r in records if r.status == "failed" and not r.injected_fault)
    if not bad:
        return None
    return {"count": sum(bad.values()), "num_reasons": len(bad), "reasons": dict(bad.most_common(3))}


def failure_warning(metrics: dict) -> str | None:
    """The line a run prints under its summary when requests failed for reasons of their own."""
    u = metrics.get("unexpected_failures")
    if not u:
        return None
    reason, n = next(iter(u["reasons"].items()))
    others = f" (+{u['num_reasons'] - 1} other reasons)" if u["num_reasons"] > 1 else ""
    return (f"WARNING: {u['count']} of {metrics['num_submitted']} requests failed for reasons other than "
            f"injected faults; commonest ({n}): {reason}{others}. See requests.jsonl.")


def write_jsonl(path: Path, rows) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def engines_for(spec: RunSpec) -> dict:
    """The engines a real run starts: spec.engines(), with `engine.cpu_gemm_rows=auto` on a CPU taken
    from this machine's profile where it records one. Measured per process, the route flips between
    workers and runs where MKL and the panel kernel are close (tests/test_gemm_route.py), and a run on
    another route than its profile's is an engine the simulator does not price; one machine, one route."""
    engines = spec.engines()
    rows = profiled_gemm_rows(spec)
    if rows == "auto":
        return engines
    log.info("CPU linears: %s, as this machine's profile measured them (engine.cpu_gemm_rows=auto)",
             gemm_route(rows))
    return {role: e.replace(cpu_gemm_rows=rows) for role, e in engines.items()}


def profiled_gemm_rows(spec: RunSpec):
    """The profile's cpu_gemm_rows for a CPU run on this machine left on auto, else "auto" (measured per
    process: on a GPU, on an existing cluster whose workers run elsewhere, or without a profile)."""
    from experiments.serving.profiles import profile_for
    from workers.config import check_gemm_rows
    from workers.weights import parse_device

    if (spec.engine.cpu_gemm_rows != "auto" or spec.cluster.address is not None
            or spec.model.device not in ("auto", "cpu") or parse_device(spec.model.device).type != "cpu"):
        return "auto"
    try:
        path = profile_for(spec)
        prof = json.loads(path.read_text())
    except (ConfigError, OSError, ValueError):
        return "auto"
    rows = prof.get("cpu_gemm_rows", "auto")
    if rows != "auto":
        try:
            check_gemm_rows(rows)
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
    return rows


# -- one repeat of one point ----------------------------------------------------------------------
def serve_repeat(p: Prepared, repeat: int, out: Path) -> dict:
    from cluster.pool import WorkerPool
    from router.router import Router

    spec, ident, emu = p.spec, dict(p.ident), p.emulated
    ensure_ray(spec)
    engines = emu["engines"] if emu else engines_for(spec)
    pool = WorkerPool(spec.cluster, spec.model, engines, spec.transfer, emu["emulation"] if emu else None)
    try:                                    # whatever fails, this point's actors and placement group go
        pool.start()
        info = pool.workers[0].info
        ident["device"], ident["dtype"] = emu["device"] if emu else (info["gpu"] or info["device"]), info["dtype"]
        router = Router(pool, spec.router, spec.transfer, spec.fault).start()
        before = snapshot()
        t0 = drive(router, p.requests, f"{ident['label']} rep{repeat}")
        router.close()
        after = snapshot()
        traces = router.traces()          # steps on the router's clock, like the requests
        end_probe = pool.probe() if spec.cluster.speed_probe else None   # the same, once it has served
        served_on = pool.record()     # the layout served, each worker's place, workers lost (docs/faults.md)
        if emu:                       # an emulated worker is meant to stay small: what each one held at its peak
            used = pool.gather({w: w.actor.memory_used.remote() for w in pool.workers if w.alive}, "memory", 30,
                               errors={})
            emu = emu | {"record": emu["record"] | {"worker_peak_rss_bytes": {
                w.name: m.get("peak_rss_bytes") for w, m in used.items()}}}
    finally:
        pool.shutdown()
    rows = [request_row(rec, t0) for rec in router.records.values()]
    steps = [step_row(worker, s, t0) for worker, trace in traces.items() for s in trace]
    write_jsonl(out / "requests.jsonl", rows)
    write_jsonl(out / "steps.jsonl", steps)
    metrics = summarize(rows, spec.slo.ttft_ms, spec.slo.tpot_ms, spec.cluster.num_workers, spec.slo.attainment_target)
    metrics["step_ratio"] = step_ratio(steps)
    metrics["ci"] = within_run_ci(replicates(rows, steps, metrics, repeat), metrics)
    metrics["ci_level"], metrics["ci_method"] = 0.95, METHOD_WITHIN
    metrics["machine"] = usage(before, after) | {"workers_share_cores": p.shared is not None, "shared_cores": p.shared}
    metrics["repeat"], metrics["point"] = repeat, ident
    if emu:
        metrics["emulated"] = emu["record"] | {"steps": price_error(steps)}
    metrics["isolation"] = pool.isolation
    metrics["pool"] = served_on
    if pool.speed is not None:
        metrics["speed_probe"] = pool.speed
    if end_probe is not None:
        metrics["speed_probe_end"] = end_probe
    metrics["clocks"] = router.clock_report()
    if router.killed_at is not None:      # when fault.kill_worker was killed, on the run's time (a replay kills then)
        metrics["fault_times"] = {"kill_s": router.killed_at - t0}
    if router.transport_errors:
        metrics["transport_errors"] = router.transport_errors[:20]
    if unexpected := unexpected_failures(router.records.values()):
        metrics["unexpected_failures"] = unexpected
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _one_line(m: dict) -> str:
    def v(key, digits=1):
        section, _, stat = key.partition(".")
        x = (m.get(section) or {}).get(stat) if stat else m.get(section)
        return "n/a" if x is None else f"{x:.{digits}f}"
    load = (m.get("machine") or {}).get("load_1m_end")
    return (f"{m['num_completed']}/{m['num_submitted']} ok, ITL p99 {v('itl_ms.p99')} ms, TTFT p50 {v('ttft_ms.p50')} "
            f"ms, goodput/GPU {v('goodput_per_gpu', 2)}" + (f", load {load:.1f}" if load is not None else ""))


def serve_all(prepared: list[Prepared], repeats: int, serve=None) -> list[dict]:
    """Serve every point `repeats` times, round-robin; returns each point's aggregated metrics (or error).
    `serve(p, repeat, out)` serves one repeat (default serve_repeat; experiments/sim/backend.py's
    simulate_repeat for backend=sim)."""
    serve = serve or serve_repeat
    round_robin(prepared)
    for p in prepared:
        if p.shared:
            print(f"warning: {p.ident['label']}: {p.shared}")
    bar = Progress("served", total=repeats * len(prepared), unit="repeats")
    for r in range(repeats):
        for p in bar.each(prepared):
            out = p.out / f"rep{r}"
            name = f"{p.ident['label']} rep {r + 1}/{repeats}"
            if p.failed:
                continue
            out.mkdir(parents=True, exist_ok=True)
            text = p.repeat_config
            if (out / "metrics.json").exists() and (out / "config.yaml").exists() \
                    and (out / "config.yaml").read_text() == text:
                echo(f"{name}: results already in {out}, skipped")
                continue
            (out / "config.yaml").write_text(text)
            (out / "metrics.json").unlink(missing_ok=True)
            (out / "error.json").unlink(missing_ok=True)
            try:
                metrics = serve(p, r, out)
            except Exception as e:   # a crashed repeat is recorded, its point stops, the others go on
                log.error("%s failed: %s", name, e)
                (out / "error.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}",
                                                            "traceback": traceback.format_exc(),
                                                            "point": p.ident}, indent=2))
                p.failed = True
                continue
            echo(f"{name}: {_one_line(metrics)}")
            if warning := failure_warning(metrics):
                echo(warning)
                p.warnings.append(f"rep {r + 1}: {warning}")
    bar.close()
    results = []
    for p in prepared:
        (p.out / "config.yaml").write_text(OmegaConf.to_yaml(p.cfg, resolve=True))
        result = aggregate.write(p.out, repeats) or {"error": "no repeat was served", "point": p.ident}
        if p.warnings:
            result["failure_warnings"] = p.warnings
        results.append(result)
    return results
