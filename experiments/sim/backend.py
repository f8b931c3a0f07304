"""backend=sim: any experiments.run point simulated instead of served, into the same files.

`sim_config` turns a RunSpec into the simulated cluster: the layout's roles, each role's EngineConfig
exactly as a real run builds it, and each worker's KV pool sized as the real engine sizes it (on a
CPU from scheduler.kv_cache_mb or num_kv_blocks; on a GPU from its memory less weights and
activations, workers/kv_cache.py's rule). `costs_for` reads the `hardware` group: `measured` (or
hardware.profile) simulates with a profile of a device (experiments/analysis/profile.py), a datasheet
GPU with aiconfigurator's measured step times or the roofline model (hardware.costs,
experiments/sim/gpu_costs.py). `simulate_repeat` writes a repeat's requests.jsonl, steps.jsonl and
metrics.json as experiments/serving/serve.py's serve_repeat does, plus `simulated` in metrics.json
(what the costs came from, events, wall time). A simulation is deterministic: a point is simulated
once (rep0) whatever `repeats` says, so its intervals are within-run ones, over requests.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from experiments.config import ConfigError, RunSpec
from experiments.hardware import HARDWARE
from experiments.serving.confidence import METHOD_WITHIN, replicates, within_run_ci
from experiments.serving.metrics import summarize
from experiments.serving.profiles import model_config, profile_for
from experiments.serving.steps import step_ratio
from experiments.serving.tables import (TOKEN_TIMES_MAX, request_columns, step_columns, step_ratio_columns,
                                        summarize_sim, write_table)
from experiments.sim.costs import Costs, from_gpu, from_profile
from experiments.sim.records import request_row, step_rows
from experiments.sim.simulator import SimConfig, Simulator

# Datasheet memory per GPU (NVIDIA A100 SXM 80GB, H100 SXM 80GB, H200 SXM 141GB).
HBM_BYTES = {"a100": 80e9, "h100": 80e9, "h200": 141e9}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_CI_GAPS = 200_000       # within-run bootstrap only up to this many ITL gaps (1,000 resamples of each)


def on_gpu(spec: RunSpec) -> bool:
    """A datasheet GPU is simulated as a GPU; a profile as the device it was measured on."""
    return spec.hardware.name in HARDWARE


def dtype_bytes(spec: RunSpec, costs: Costs | None = None) -> int:
    dtype = spec.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu(spec) else ((costs.detail if costs else {}).get("dtype") or "float32")
    return DTYPE_BYTES[dtype]


def num_blocks(spec: RunSpec, role: str, nbytes: int) -> int:
    """The KV pool of one worker, in blocks, sized as workers/kv_cache.num_blocks_for sizes it."""
    e = spec.engines()[role]
    if e.num_kv_blocks is not None:
        return e.num_kv_blocks
    mcfg = model_config(spec)
    block = mcfg.kv_bytes_per_token(nbytes) * e.block_size
    if on_gpu(spec):
        from workers.kv_cache import activation_bytes

        hbm = spec.hardware.hbm_gb * 1e9 if spec.hardware.hbm_gb else HBM_BYTES[spec.hardware.name]
        free = hbm - mcfg.num_params() * nbytes
        budget = int(free - (1 - e.gpu_memory_utilization) * hbm - activation_bytes(mcfg, e.token_budget, nbytes))
    else:
        budget = e.kv_cache_bytes
    n = budget // block - 1
    if n < 1:
        raise ConfigError(f"model={mcfg.name} leaves no room for a KV cache on {spec.hardware.name} "
                          f"({budget} bytes for KV, one block needs {block})")
    return int(n)


def sim_config(spec: RunSpec, nbytes: int, record_steps: bool = True, keep_tokens: bool = True,
               fast_forward: bool = True, pool_gaps: bool = False) -> SimConfig:
    mcfg = model_config(spec)
    roles = spec.cluster.roles
    engines = spec.engines()
    blocks = {role: num_blocks(spec, role, nbytes) for role in set(roles)}
    return SimConfig(roles, {r: engines[r] for r in set(roles)}, blocks, mcfg.kv_bytes_per_token(nbytes),
                     mcfg.num_layers, spec.max_model_len, spec.router, spec.transfer, spec.fault,
                     spec.cluster.placement, spec.hardware.gpus_per_node if on_gpu(spec) else 0,
                     getattr(spec.transfer, "stream", "off"), fast_forward, record_steps, keep_tokens, pool_gaps)


def costs_for(spec: RunSpec, serving: dict | None = None) -> Costs:
    """The costs of the `hardware` group; `serving`: a profile's calibration from another run."""
    hw = spec.hardware
    if hw.name in HARDWARE:
        base = HARDWARE[hw.name]
        base = replace(base, **{k: v for k, v in (("peak_flops", hw.peak_flops), ("mem_bw", hw.mem_bw)) if v})
        over = {"compute_eff": hw.compute_eff, "mem_eff": hw.mem_eff,
                "overhead_s": hw.step_overhead_ms / 1e3 if hw.step_overhead_ms is not None else None}
        try:
            return from_gpu(model_config(spec), base, dtype_bytes(spec), hw.link_bw, hw.costs, hw.framework, **over)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if hw.name != "measured":
        raise ConfigError(f"hardware.name={hw.name!r}: choose measured or one of {sorted(HARDWARE)}")
    return from_profile(profile_for(spec), spec.transfer.backend, serving=serving)


def simulate(spec: RunSpec, arrivals, costs: Costs | None = None, record_steps: bool = True,
             keep_tokens: bool = True, fast_forward: bool = True, pool_gaps: bool = False) -> Simulator:
    """Run the simulator over `arrivals` (WorkloadRequests, or objects with id, arrival_s, prompt_len,
    max_tokens); returns it, its records and workers' step logs filled (deterministic: no draws).
    `keep_tokens=False` keeps no per-token times, and `pool_gaps` then pools the inter-token gaps."""
    costs = costs or costs_for(spec)
    cfg = sim_config(spec, dtype_bytes(spec, costs), record_steps, keep_tokens, fast_forward, pool_gaps)
    sim = Simulator(cfg, costs)
    sim.run(arrivals)
    return sim


def outputs(sim: Simulator) -> tuple[list[dict], list[dict]]:
    rows = [request_row(rec) for rec in sim.records.values()]
    steps = [row for w in sim.workers for row in step_rows(w.name, w.log)]
    return rows, steps


def write_repeat(out: Path, spec: RunSpec, ident: dict, sim: Simulator, repeat: int, wall_s: float) -> dict:
    """requests.jsonl, steps.jsonl and metrics.json of one simulated repeat (docs/run-directory.md); a simulation
    that kept no per-token times writes requests.npz and steps.npz instead (experiments/serving/tables.py)."""
    from experiments.serving.serve import write_jsonl

    s = spec.slo
    if sim.cfg.keep_tokens:
        rows, steps = outputs(sim)
        write_jsonl(out / "requests.jsonl", rows)
        write_jsonl(out / "steps.jsonl", steps)
        metrics = summarize(rows, s.ttft_ms, s.tpot_ms, spec.cluster.num_workers, s.attainment_target)
        metrics["step_ratio"] = step_ratio(steps)
        num_gaps = sum(len(r["itl_s"]) for r in rows)
    else:
        cols, steps = request_columns(list(sim.records.values())), step_columns(sim.workers)
        write_table(out / "requests.npz", cols)
        write_table(out / "steps.npz", steps)
        metrics = summarize_sim(sim, cols, s.ttft_ms, s.tpot_ms, spec.cluster.num_workers, s.attainment_target)
        metrics["step_ratio"] = step_ratio_columns(steps)
        num_gaps = None
    if num_gaps is not None and num_gaps <= MAX_CI_GAPS:
        metrics["ci"] = within_run_ci(replicates(rows, steps, metrics, repeat), metrics)
        metrics["ci_method"] = METHOD_WITHIN
    else:
        why = (f"{num_gaps} ITL gaps, more than the {MAX_CI_GAPS} resampled within a run" if num_gaps is not None
               else f"no per-token times kept (over {TOKEN_TIMES_MAX} requests)")
        metrics["ci"] = {}
        metrics["ci_method"] = f"none: {why}"
    metrics["ci_level"] = 0.95
    metrics["machine"] = {}
    metrics["repeat"], metrics["point"] = repeat, ident | {"backend": "sim", "costs": sim.costs.source}
    detail = sim.costs.detail
    if getattr(sim.costs.step, "kind", None) == "aiconfigurator":   # its roofline fallbacks, counted to now
        detail = detail | {"step_model": sim.costs.step.to_dict()}
    metrics["simulated"] = {"costs": sim.costs.source, "detail": detail, "num_events": sim.num_events,
                            "wall_s": wall_s, "notes": sim.notes, "token_times": sim.cfg.keep_tokens}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=float))
    return metrics


def simulate_repeat(p, repeat: int, out: Path) -> dict:
    """experiments.serving.serve.serve_repeat's counterpart: one repeat of a prepared point, simulated
    (every token's time kept up to TOKEN_TIMES_MAX requests, above them columnar records)."""
    spec = p.spec
    costs = costs_for(spec)
    started = time.perf_counter()
    keep = len(p.requests) <= TOKEN_TIMES_MAX
    sim = simulate(spec, p.requests, costs, keep_tokens=keep, pool_gaps=not keep)
    ident = dict(p.ident)
    ident["device"] = spec.hardware.name if on_gpu(spec) else (costs.detail.get("hardware") or "profile")
    ident["label"] = f"{ident['label']} [sim]"
    return write_repeat(out, spec, ident, sim, repeat, time.perf_counter() - started)
