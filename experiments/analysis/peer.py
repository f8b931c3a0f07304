"""The planner against a peer: experiments.plan's choice beside aiconfigurator's own recommendation.

    python -m experiments.analysis.peer [--gpus 8] [--workloads chat,summarization] [--slos interactive,tight]
                                        [--out DIR] [overrides...]

For each workload and SLO preset, on the same model, GPU and GPU count:
- pdlab: experiments/analysis/plan.py's search in the simulator (goodput per GPU at the SLO attainment
  target, Poisson arrivals, the workload's length distributions; every worker one GPU), with steps
  priced by aiconfigurator's measured database (hardware.costs=auto picks it where installed);
- aiconfigurator (`pip install -e ".[gpu-peer]"`): `aiconfigurator.cli.api.cli_default`, its
  aggregated-vs-disaggregated comparison, given the workload's mean prompt and output lengths (what it
  takes: one isl, one osl), the SLO's TTFT and TPOT, the same GPU count, system and framework. It
  searches tensor parallelism and batch sizes, and ranks by tokens/s per GPU within the SLO on its
  estimated (mean) latencies.
Prints a table of both choices (colocated or disaggregated, the P:D split) and ends with one JSON line;
`--out` also writes it (peer.json, peer.md). Where aiconfigurator is not installed its column says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

from omegaconf import OmegaConf

from experiments.compose import compose_config
from experiments.config import ConfigError, apply_layout, parse

SYSTEM_FOR = {"a100": "a100_sxm", "h100": "h100_sxm", "h200": "h200_sxm"}


def mean_lengths(spec, num: int = 4000) -> tuple[int, int]:
    """The mean prompt and output lengths of the workload the planner simulates (its sampler, its seed)."""
    from experiments.workload import build_workload

    w = dataclasses.replace(spec.workload, num_requests=num)
    reqs = build_workload(w, spec.vocab_size, spec.max_model_len, spec.seed, token_ids=False)
    return (round(sum(r.num_prompt_tokens for r in reqs) / len(reqs)), round(sum(r.max_tokens for r in reqs) / len(reqs)))


def planner_choice(cfg, gpus: int, plan_opts: dict) -> dict:
    from experiments.analysis.plan import chunk_sizes, plan

    base = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    base.pop("plan", None)
    base.compare, base.layout = None, None
    r = plan(base, gpus, chunk_sizes(cfg), plan_opts["probe"], plan_opts["requests_per_worker"], plan_opts["steps"],
             plan_opts["verify_requests_per_gpu"], int(cfg.seed))
    best = r["best"]
    top = {}
    for c in r["candidates"]:
        kind = "disaggregated" if c.disaggregated else "colocated"
        if kind not in top or c.goodput_per_gpu > top[kind].goodput_per_gpu:
            top[kind] = c
    checked = {c.name: c for c in (r["best"], r["runner_up"]) if c is not None}
    return {"choice": "disaggregated" if best.disaggregated else "colocated", "layout": best.name,
            "goodput_per_gpu": best.goodput_per_gpu, "how": best.how, "costs": r["costs"],
            "best_by_mode": {k: {"layout": c.name, "goodput_per_gpu": checked.get(c.name, c).goodput_per_gpu}
                             for k, c in top.items()},
            "num_sims": r["num_sims"], "elapsed_s": r["elapsed_s"]}


def _row(df, keys: dict) -> dict | None:
    if df is None or len(df) == 0:
        return None
    row = df.iloc[0]
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in ((k, row.get(col)) for k, col in keys.items())}


AGG_KEYS = {"seq_s_gpu": "seq/s/gpu", "tokens_s_gpu": "tokens/s/gpu", "tp": "tp", "bs": "bs", "gpus": "num_total_gpus",
            "ttft_ms": "ttft", "tpot_ms": "tpot"}
DISAGG_KEYS = {"seq_s_gpu": "seq/s/gpu", "tokens_s_gpu": "tokens/s/gpu", "prefill_workers": "(p)workers",
               "prefill_tp": "(p)tp", "decode_workers": "(d)workers", "decode_tp": "(d)tp", "gpus": "num_total_gpus",
               "decode_bs": "(d)bs", "ttft_ms": "ttft", "tpot_ms": "tpot"}


def peer_choice(model_dir: str, gpus: int, system: str, framework: str, isl: int, osl: int, ttft_ms: float,
                tpot_ms: float) -> dict:
    """aiconfigurator's agg-vs-disagg recommendation; {"error": why} where it cannot give one."""
    try:
        from aiconfigurator.cli.api import cli_default
    except ImportError:
        return {"error": "aiconfigurator is not installed (pip install -e \".[gpu-peer]\")"}
    for name in ("aiconfigurator", "aiconfigurator_core"):
        logging.getLogger(name).setLevel(logging.ERROR)
    started = time.perf_counter()
    try:
        res = cli_default(model_dir, gpus, system, backend=framework, isl=isl, osl=osl, ttft=ttft_ms, tpot=tpot_ms,
                          top_n=20)
    except Exception as e:              # noqa: BLE001 - report any refusal of the peer as its answer
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"chosen": res.chosen_exp, "tokens_s_gpu_cluster": {k: float(v) for k, v in res.best_throughputs.items()},
           "elapsed_s": time.perf_counter() - started}
    agg, dis = res.best_configs.get("agg"), res.best_configs.get("disagg")
    out["agg"] = _row(agg, AGG_KEYS)
    out["agg_tp1"] = _row(agg[agg["tp"] == 1] if agg is not None and len(agg) else None, AGG_KEYS)
    out["disagg"] = _row(dis, DISAGG_KEYS)
    out["disagg_tp1"] = _row(dis[(dis["(p)tp"] == 1) & (dis["(d)tp"] == 1)] if dis is not None and len(dis) else None,
                             DISAGG_KEYS)
    return out


def _split(d: dict | None, gpus: int) -> str:
    """aiconfigurator's disaggregated replica as GPUs for prefill and decode, and how many fill `gpus`."""
    if not d:
        return "-"
    p, q = d["prefill_workers"] * d["prefill_tp"], d["decode_workers"] * d["decode_tp"]
    tp = "" if d["prefill_tp"] == d["decode_tp"] == 1 else f", TP{d['prefill_tp']}/TP{d['decode_tp']}"
    n = max(1, gpus // max(1, p + q))
    return f"{n * p}p{n * q}d ({n} x {p}p{q}d{tp})" if n > 1 else f"{p}p{q}d{tp}"


def _agg(d: dict | None, gpus: int) -> str:
    if not d:
        return "-"
    return f"{gpus // d['tp']} x TP{d['tp']}"


def table(rows: list[dict]) -> str:
    lines = ["| workload (mean in/out) | SLO (TTFT, TPOT) | pdlab plan: choice, layout, req/s/GPU | pdlab best colocated "
             "/ disaggregated req/s/GPU | aiconfigurator: choice | its agg (req/s/GPU) | its disagg P:D (req/s/GPU) "
             "| its TP1-only agg / disagg req/s/GPU |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, a = r["pdlab"], r["aiconfigurator"]
        bm = p["best_by_mode"]
        mine = f"{p['choice']}, {p['layout']}, {p['goodput_per_gpu']:.3g}"
        modes = " / ".join(f"{bm[k]['goodput_per_gpu']:.3g} ({bm[k]['layout']})" if k in bm else "-"
                           for k in ("colocated", "disaggregated"))
        if "error" in a:
            theirs = [f"not run: {a['error']}", "-", "-", "-"]
        else:
            chosen = {"agg": "colocated (agg)", "disagg": "disaggregated"}.get(a["chosen"], a["chosen"])
            g = r["gpus"]
            theirs = [chosen,
                      f"{_agg(a['agg'], g)}, {a['agg']['seq_s_gpu']:.3g}" if a["agg"] else "none within the SLO",
                      f"{_split(a['disagg'], g)}, {a['disagg']['seq_s_gpu']:.3g}" if a["disagg"] else "none within the SLO",
                      " / ".join(f"{d['seq_s_gpu']:.3g}" if d else "-" for d in (a["agg_tp1"], a["disagg_tp1"]))]
        lines.append(f"| {r['workload']} ({r['isl']}/{r['osl']}) | {r['slo']} ({r['ttft_ms']:g} ms, {r['tpot_ms']:g} ms) "
                     f"| {mine} | {modes} | " + " | ".join(theirs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from experiments.serving.profiles import model_config
    from experiments.sim.gpu_costs import _model_dir

    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.peer", description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--workloads", default="chat,summarization")
    ap.add_argument("--slos", default="interactive,tight")
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*", default=["model=llama-3-8b", "hardware=h200"])
    args = ap.parse_args(argv)
    rows = []
    for wl in args.workloads.split(","):
        for slo in args.slos.split(","):
            try:
                cfg = compose_config("plan", ["backend=sim", f"workload={wl}", f"slo={slo}",
                                              f"cluster.gpus={args.gpus}", *args.overrides])
                spec = parse(apply_layout(OmegaConf.create({k: v for k, v in OmegaConf.to_container(cfg).items()
                                                            if k not in ("plan", "hydra")}), "colocated-chunked"))
            except ConfigError as e:
                raise SystemExit(f"error: {e}") from None
            if spec.hardware.name not in SYSTEM_FOR:
                raise SystemExit(f"error: hardware={spec.hardware.name}: the peer needs a datasheet GPU "
                                 f"({', '.join(SYSTEM_FOR)})")
            isl, osl = mean_lengths(spec)
            print(f"{wl} x {slo}: planning ({isl}/{osl} mean tokens in/out) ...", flush=True)
            try:
                mine = planner_choice(cfg, args.gpus, OmegaConf.to_container(cfg.plan))
            except ConfigError as e:
                raise SystemExit(f"error: {e}") from None
            theirs = peer_choice(str(_model_dir(model_config(spec))), args.gpus, SYSTEM_FOR[spec.hardware.name],
                                 spec.hardware.framework, isl, osl, spec.slo.ttft_ms, spec.slo.tpot_ms)
            rows.append({"workload": wl, "slo": slo, "isl": isl, "osl": osl, "ttft_ms": spec.slo.ttft_ms,
                         "tpot_ms": spec.slo.tpot_ms, "gpus": args.gpus, "model": model_config(spec).name,
                         "hardware": spec.hardware.name, "pdlab": mine, "aiconfigurator": theirs})
            print(f"  pdlab: {mine['choice']} {mine['layout']} ({mine['goodput_per_gpu']:.3g} req/s/GPU, "
                  f"{mine['num_sims']} simulations in {mine['elapsed_s']:.0f} s); aiconfigurator: "
                  f"{theirs.get('chosen', theirs.get('error'))}", flush=True)
    text = table(rows)
    print(text)
    result = {"rows": rows, "gpus": args.gpus}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peer.json").write_text(json.dumps(result, indent=2, default=str))
        (args.out / "peer.md").write_text(text + "\n")
    print(json.dumps(result, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
