"""Serve a workload on a cluster and write what happened: `python -m experiments.run [overrides]`.

With no arguments it compares colocated prefill_first, colocated chunked and disaggregated 1P+1D
on two (fake) GPUs with the tiny model, and writes a report. Each point writes config.yaml,
requests.jsonl, steps.jsonl and metrics.json (experiments/FORMATS.md) into its directory.
Sweeps: `python -m experiments.run -m +sweep=pool_ratio`. A point whose results are on disk
with the same config is skipped; a point that crashes leaves error.json and the rest go on.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from experiments.config import ConfigError, RunSpec, points
from experiments.metrics import format_summary, percentiles, summarize
from experiments.workload import WorkloadError, WorkloadRequest, build_workload

log = logging.getLogger("pdlab")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


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


# -- Ray and the cluster --------------------------------------------------------------------------
def ensure_ray(spec: RunSpec) -> None:
    """An embedded Ray declaring enough GPUs for this point (restarted if an earlier point's is too small)."""
    import ray
    import torch
    from cluster.ray_cluster import start_ray, stop_ray

    cluster = spec.cluster
    if cluster.address is None:
        gpus = cluster.num_gpus if cluster.num_gpus is not None else (torch.cuda.device_count() or spec.gpus)
        cluster = dataclasses.replace(cluster, num_gpus=gpus)
        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < gpus:
            stop_ray()
    start_ray(cluster)


def drive(router, requests: list[WorkloadRequest], desc: str) -> float:
    """Submit each request at its arrival time (open loop); wait for all. Returns the start time."""
    from tqdm import tqdm
    from workers.request import SamplingParams

    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=None, mininterval=0.5, leave=False)
    start = time.time()

    def tick():
        p = router.progress()
        elapsed = max(time.time() - start, 1e-9)
        bar.n = p["ok"] + p["failed"]
        bar.set_postfix(ok=p["ok"], failed=p["failed"], req_s=f"{bar.n / elapsed:.1f}",
                        tok_s=f"{p['tokens'] / elapsed:.0f}", refresh=False)
        bar.refresh()

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


def request_row(rec, t0: float) -> dict:
    n, itl = len(rec.output_ids), rec.itl_s
    ttft, e2e = rec.ttft_s, rec.e2e_s
    itl_ms = None
    if itl:
        q = percentiles([1e3 * x for x in itl])
        itl_ms = {"mean": q["mean"], "p50": q["p50"], "p99": q["p99"], "max": 1e3 * max(itl)}
    return {
        "id": rec.id, "prompt_len": rec.prompt_len, "output_len": n, "output_ids": rec.output_ids,
        "max_tokens": rec.max_tokens, "arrival_s": rec.arrival_s - t0,
        "end_s": None if rec.end_time is None else rec.end_time - t0,
        "status": rec.status if rec.status == "ok" else "failed", "reason": rec.reason,
        "finish_reason": rec.finish_reason, "ttft_s": ttft, "e2e_s": e2e,
        "tpot_s": (e2e - ttft) / (n - 1) if n >= 2 else None, "itl_s": itl, "itl_ms": itl_ms,
        "client_ttft_s": rec.client_ttft_s, "client_e2e_s": rec.client_e2e_s, "client_itl_s": rec.client_itl_s,
        "prefill_worker": rec.prefill_worker, "decode_worker": rec.decode_worker,
        "transfer_bytes": rec.transfer_bytes, "transfer_s": rec.transfer_s, "queue_s": rec.queue_s,
        "prefill_s": rec.prefill_s, "handoff_s": rec.handoff_s, "decode_s": rec.decode_s, "attempts": rec.attempts,
        "note": rec.note,
    }


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


# -- one point ------------------------------------------------------------------------------------
def serve_point(spec: RunSpec, requests: list[WorkloadRequest], out: Path, ident: dict) -> dict:
    from cluster.pool import WorkerPool
    from router.router import Router

    ensure_ray(spec)
    pool = WorkerPool(spec.cluster, spec.model, spec.engines(), spec.transfer).start()
    info = pool.workers[0].info
    ident["device"], ident["dtype"] = info["gpu"] or info["device"], info["dtype"]
    try:
        router = Router(pool, spec.router, spec.transfer, spec.fault).start()
        t0 = drive(router, requests, ident["label"])
        router.close()
        traces = router.traces()          # steps on the router's clock, like the requests
    finally:
        pool.shutdown()
    rows = [request_row(rec, t0) for rec in router.records.values()]
    write_jsonl(out / "requests.jsonl", rows)
    write_jsonl(out / "steps.jsonl", ({"worker": worker, **{k: v for k, v in s.items() if k not in ("start", "end")},
                                       "start_s": s["start"] - t0, "end_s": s["end"] - t0}
                                      for worker, steps in traces.items() for s in steps))
    metrics = summarize(rows, spec.slo.ttft_ms, spec.slo.tpot_ms, spec.cluster.num_workers, spec.slo.attainment_target)
    metrics["point"] = ident
    metrics["isolation"] = pool.isolation
    metrics["clocks"] = router.clock_report()
    if router.transport_errors:
        metrics["transport_errors"] = router.transport_errors[:20]
    if unexpected := unexpected_failures(router.records.values()):
        metrics["unexpected_failures"] = unexpected
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def run_points(cfg: DictConfig, run_dir: Path, overrides: str) -> list[dict]:
    """Validate every point (and build its workload) before any worker starts, then serve each."""
    prepared = []
    for sub, pcfg, spec in points(cfg):
        try:
            requests = build_workload(spec.workload, spec.vocab_size, spec.max_model_len, spec.seed)
        except (WorkloadError, ValueError) as e:
            raise ConfigError(f"workload: {str(e).splitlines()[0]}") from None
        out = run_dir / sub if sub else run_dir
        prepared.append((out, pcfg, spec, requests, identity(spec, pcfg, ",".join(filter(None, [overrides, sub])))))
    results = []
    for out, pcfg, spec, requests, ident in prepared:
        out.mkdir(parents=True, exist_ok=True)
        config_text = OmegaConf.to_yaml(pcfg, resolve=True)
        if (out / "metrics.json").exists() and (out / "config.yaml").exists() \
                and (out / "config.yaml").read_text() == config_text:
            print(f"{ident['label']}: results already in {out}, skipped")
            results.append(json.loads((out / "metrics.json").read_text()))
            continue
        (out / "config.yaml").write_text(config_text)
        (out / "error.json").unlink(missing_ok=True)
        try:
            metrics = serve_point(spec, requests, out, ident)
        except Exception as e:   # a crashed point is recorded and the others go on
            log.error("%s failed: %s", ident["label"], e)
            (out / "error.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}",
                                                        "traceback": traceback.format_exc(), "point": ident}, indent=2))
            results.append({"point": ident, "error": f"{type(e).__name__}: {e}"})
            continue
        print(format_summary(metrics, title=ident["label"]))
        if warning := failure_warning(metrics):
            print(warning)
        results.append(metrics)
    return results


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    logging.getLogger("pdlab").setLevel(logging.INFO)
    try:
        results = run_points(cfg, run_dir, hc.job.override_dirname)
    except ConfigError as e:
        if not multirun:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        (run_dir / "error.json").write_text(json.dumps({"error": f"config error: {e}", "traceback": "",
                                                        "point": {"label": hc.job.override_dirname}}, indent=2))
        print(f"config error: {e}", file=sys.stderr)
        return
    if cfg.get("report") and not multirun:
        from experiments.report import build_report
        build_report(run_dir)
        print(f"report: {run_dir / 'report.md'}")
    failed = [r for r in results if "error" in r]
    summary = {"run_dir": str(run_dir), "points": [{"label": r["point"]["label"], "error": r.get("error"),
                                                     **{k: r.get(k) for k in ("num_completed", "num_failed", "goodput",
                                                                              "slo_attainment")},
                                                     "itl_ms_p99": (r.get("itl_ms") or {}).get("p99"),
                                                     "ttft_ms_p99": (r.get("ttft_ms") or {}).get("p99")}
                                                    for r in results]}
    print(json.dumps(summary))
    if failed and not multirun:
        sys.exit(1)


def precheck(argv: list[str]) -> str | None:
    """Compose the command line's config once (first value of each sweep) so that a Hydra error is
    reported as one line naming the override, before Hydra starts."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if not a.startswith("-") and "=" in a and not a.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
        firsts = []
        for o in parsed:
            if o.is_delete():
                firsts.append(o.get_key_element())
                continue
            value = next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else o.get_value_element_as_str()
            firsts.append(f"{o.get_key_element()}={value}")
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            compose("config", overrides=firsts)
    except Exception as e:
        return str(e).strip().splitlines()[0]
    return None


if __name__ == "__main__":
    problem = precheck(sys.argv[1:])
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
