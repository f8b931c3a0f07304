"""Goodput against request rate per mode, and where a disaggregated request's time goes.

`simulated_curves`: SLO attainment of each layout on the same GPUs at each rate of a grid, one
simulation per (layout, rate) sized as the planner sizes a probe (experiments/analysis/plan.py: long
enough for a queue to show) up to MAX_REQUESTS, with the costs of the hardware group (experiments/sim/
backend.costs_for, as the planner takes them). A rate counts as met when attainment reaches the
target and the cluster kept up (plan.kept_up); `last_met` is the highest grid rate met before the first
one missed, `falls_below` that first missed rate (None: met everywhere).

`measured_curves`: the same from served runs (median attainment with its interval per rate; the knee
in rates per worker, as the simulated one is per GPU).

`breakdown`: per request, the time from arrival to the last token split into waiting for prefill,
prefill, the exposed KV transfer, the rest of the handoff and the decode steps (docs/run-directory.md: queue_s,
prefill_s, exposed_transfer_s, handoff_s, decode_s); means over the completed requests, the dominant
component (overall, and before the decode steps) and, against a colocated run, the component that
grew most: the answer to "why was disaggregation slower here?". For served runs (`measured_against`)
each part's difference carries a 95% interval, and a part is named as the one that grew most only
where the 95% interval of its extra over each other part's lies above zero.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from experiments.analysis.decision_sim import cell_config
from experiments.analysis.plan import HORIZON, Search, _spec, attainment, kept_up
from experiments.serving.stats import LEVEL, NUM_BOOT, interval

MAX_REQUESTS = 3000       # a curve's simulation at most: past the knee a queue shows long before this

PARTS = ("queue", "prefill", "exposed_transfer", "handoff", "decode")
PART_NAMES = {"queue": "waiting for prefill", "prefill": "prefill", "exposed_transfer": "exposed KV transfer",
              "handoff": "handoff (besides the transfer)", "decode": "decode steps"}


def knee(rates: list[float], met: list[bool]) -> dict:
    """{"last_met": highest rate met before the first miss (None: the first misses), "falls_below": first
    missed rate (None: none)}; `rates` ascending."""
    first_miss = next((i for i, ok in enumerate(met) if not ok), None)
    if first_miss is None:
        return {"last_met": rates[-1] if rates else None, "falls_below": None}
    return {"last_met": rates[first_miss - 1] if first_miss else None, "falls_below": rates[first_miss]}


def parts(row: dict) -> dict:
    """A request's time split into PARTS, in seconds (a missing field counts as zero)."""
    def g(k):
        v = row.get(k)
        return float(v) if v is not None else 0.0
    exposed = max(0.0, g("exposed_transfer_s"))
    handoff = g("handoff_s")
    return {"queue": g("queue_s"), "prefill": g("prefill_s"), "exposed_transfer": min(exposed, handoff),
            "handoff": max(0.0, handoff - exposed), "decode": g("decode_s")}


def breakdown(rows: list[dict]) -> dict:
    """Mean of each part over completed rows, in ms; `dominant`: the largest part."""
    done = [r for r in rows if r.get("status", "ok") == "ok"]
    if not done:
        return {"num_requests": 0, "mean_ms": {p: None for p in PARTS}, "dominant": None,
                "dominant_before_decode": None, "total_ms": None}
    per = [parts(r) for r in done]
    mean = {p: 1e3 * sum(x[p] for x in per) / len(per) for p in PARTS}
    before = {p: v for p, v in mean.items() if p != "decode"}
    return {"num_requests": len(done), "mean_ms": mean, "total_ms": sum(mean.values()),
            "dominant": max(mean, key=mean.get), "dominant_before_decode": max(before, key=before.get)}


def against(disagg: dict, colocated: dict) -> dict:
    """The disaggregated breakdown beside a colocated one: each part's difference and the part that grew most."""
    if not disagg["num_requests"] or not colocated["num_requests"]:
        return {"disaggregated": disagg, "colocated": colocated, "extra_ms": None, "grew_most": None}
    extra = {p: disagg["mean_ms"][p] - colocated["mean_ms"][p] for p in PARTS}
    return {"disaggregated": disagg, "colocated": colocated, "extra_ms": extra,
            "total_extra_ms": disagg["total_ms"] - colocated["total_ms"], "grew_most": max(extra, key=extra.get)}


def measured_against(disagg: list[list[dict]], colocated: list[list[dict]], seed: int = 0,
                     num: int = NUM_BOOT) -> dict:
    """`against` for served runs, from each side's request rows one list per repeat: each part's extra
    time with its interval (`extra_ci`; the whole request's: `total_extra_ci`), from resamples that
    draw repeats with replacement and then requests within each drawn repeat. `grew_most` is the part
    whose extra exceeds every other part's in the interval of their difference; where none does, it is
    None and `grew_most_among` names the part with the largest extra and those it cannot be told from."""
    out = against(breakdown([r for rep in disagg for r in rep]), breakdown([r for rep in colocated for r in rep]))
    if out["extra_ms"] is None:
        return out | {"extra_ci": None, "total_extra_ci": None, "grew_most_among": None}
    rng = np.random.default_rng(seed)
    extra = _boot_means(disagg, rng, num) - _boot_means(colocated, rng, num)          # [num, parts]
    top = PARTS.index(out["grew_most"])
    among = [PARTS[top]] + [p for j, p in enumerate(PARTS) if j != top
                            and not (interval(extra[:, top] - extra[:, j]) or (0.0, 0.0))[0] > 0]
    return out | {"extra_ci": {p: interval(extra[:, j]) for j, p in enumerate(PARTS)},
                  "total_extra_ci": interval(extra.sum(axis=1)), "repeats": min(len(disagg), len(colocated)),
                  "grew_most": PARTS[top] if len(among) == 1 else None, "grew_most_among": among, "level": LEVEL}


def _boot_means(reps: list[list[dict]], rng: np.random.Generator, num: int) -> np.ndarray:
    """[num, len(PARTS)] mean part times in ms of the completed requests of resampled repeats."""
    x = [np.array([[parts(r)[p] for p in PARTS] for r in rep if r.get("status", "ok") == "ok"]) for rep in reps]
    x = [a for a in x if len(a)]
    out = np.empty((num, len(PARTS)))
    for b in range(num):
        drawn = [x[i][rng.integers(0, len(x[i]), len(x[i]))] for i in rng.integers(0, len(x), len(x))]
        out[b] = 1e3 * np.concatenate(drawn).mean(axis=0)
    return out


def _record_row(rec) -> dict:
    exposed = rec.kv_arrived - rec.prefill_end if rec.kv_arrived is not None and rec.prefill_end is not None else None
    return {"status": rec.status, "queue_s": rec.queue_s, "prefill_s": rec.prefill_s, "exposed_transfer_s": exposed,
            "handoff_s": rec.handoff_s, "decode_s": rec.decode_s}


def simulated_curves(base, gpus: int, prompt_len: int, output_len: int, slo: dict, link_bw: float, stream: str,
                     layouts: list[dict], rates_per_gpu: list[float], requests_per_worker: int,
                     breakdown_rate_per_gpu: float | None = None, seed: int = 0) -> dict:
    """The simulated curves of the module docstring for one request shape; `layouts`: [{"layout", "chunk"}].
    With `breakdown_rate_per_gpu`, each layout's request-time breakdown at that rate (its own simulation)."""
    cfg = cell_config(base, prompt_len, output_len, slo, link_bw, stream)
    search = Search(cfg, requests_per_worker, 0, seed)
    slo_s = (search.slo.ttft_ms / 1e3, search.slo.tpot_ms / 1e3)
    rates = sorted(float(r) for r in rates_per_gpu)
    curves = []
    for lay in layouts:
        spec = _spec(cfg, lay["layout"], gpus, lay.get("chunk"))
        att, met = [], []
        for r in rates:
            sim = search.run(spec, r * gpus, _count(r * gpus, gpus, requests_per_worker, slo_s[0]), horizon=False)
            a = attainment(sim, *slo_s)
            att.append(a)
            met.append(bool(a >= search.target and kept_up(sim)))
        row = {"name": _name(lay), **lay, "rates_per_gpu": rates, "attainment": att, "met": met, **knee(rates, met)}
        if breakdown_rate_per_gpu:
            rate = breakdown_rate_per_gpu * gpus
            sim = search.run(spec, rate, _count(rate, gpus, requests_per_worker, slo_s[0]), horizon=False)
            row["breakdown"] = breakdown([_record_row(r) for r in sim.records.values()])
        curves.append(row)
    return {"prompt_len": prompt_len, "output_len": output_len, "slo": dict(slo), "link_bw": link_bw, "stream": stream,
            "gpus": gpus, "target": search.target, "costs": search.costs.source, "num_sims": search.num_sims,
            "breakdown_rate_per_gpu": breakdown_rate_per_gpu, "curves": curves}


def _count(rate: float, gpus: int, per_worker: int, ttft_s: float) -> int:
    """Requests of one curve simulation: the planner's horizon (HORIZON TTFT targets of arrivals, at least
    `per_worker` a GPU), capped at MAX_REQUESTS so a rate far past the knee stays cheap."""
    return min(MAX_REQUESTS, max(per_worker * gpus, math.ceil(rate * HORIZON * ttft_s)))


def _name(lay: dict) -> str:
    return f"{lay['layout']} (chunk {lay['chunk']})" if lay.get("chunk") else lay["layout"]


def measured_curves(served: dict[str, dict], modes: list[str], rates: list[float], target: float, gpus: int) -> dict:
    """From served summaries keyed "<mode>@<rate>": per mode the median attainment and its interval per rate;
    a rate is met when the median attainment reaches the target."""
    curves = []
    for mode in modes:
        att, ci = [], []
        for r in rates:
            m = served[f"{mode}@{r:g}"]
            att.append(m["slo_attainment"])
            ci.append((m.get("ci") or {}).get("slo_attainment"))
        met = [a is not None and a >= target for a in att]
        per = [r / gpus for r in rates]
        curves.append({"name": mode, "rates": list(rates), "rates_per_gpu": per,
                       "attainment": att, "attainment_ci": ci, "met": met, **knee(per, met)})
    return {"gpus": gpus, "target": target, "curves": curves}


def run_rows(run_dir: Path) -> list[list[dict]]:
    """The request rows of a served point, one list per repeat (rep*/requests.jsonl)."""
    return [[json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in sorted(Path(run_dir).glob("rep*/requests.jsonl"))]


def emulated_rows(runs: dict[str, Path], served: dict[str, dict]) -> list[dict]:
    """Each emulated point (name -> its run directory, and its served summary) beside the simulator on the
    same requests (its rep0's arrivals and lengths) at the same costs, the hardware group's as the curves
    take them: SLO attainment, TTFT p50 and TPOT p50 of both."""
    from experiments.analysis.validate import _spec
    from experiments.serving.aggregate import read_jsonl
    from experiments.serving.metrics import summarize
    from experiments.sim.backend import costs_for, outputs, simulate
    from experiments.sim.simulator import Arrival

    rows = []
    for name, run_dir in runs.items():
        rep = Path(run_dir) / "rep0"
        spec = _spec(rep)
        reqs = read_jsonl(rep / "requests.jsonl")
        arrivals = sorted((Arrival(r["id"], r["arrival_s"], r["prompt_len"], r["max_tokens"]) for r in reqs),
                          key=lambda a: a.arrival_s)
        sim_rows, _ = outputs(simulate(spec, arrivals, costs_for(spec), record_steps=False))
        s = spec.slo
        sim = summarize(sim_rows, s.ttft_ms, s.tpot_ms, spec.cluster.num_workers, s.attainment_target)
        em = served[name]
        rows.append({"layout": name, "rate_per_gpu": spec.workload.rate / spec.cluster.num_workers,
                     "num_requests": len(reqs), "gpus": spec.cluster.num_workers,
                     "emulated": {"slo_attainment": em["slo_attainment"], "ttft_p50_ms": em["ttft_ms"]["p50"],
                                  "tpot_p50_ms": em["tpot_ms"]["p50"]},
                     "simulated": {"slo_attainment": sim["slo_attainment"], "ttft_p50_ms": sim["ttft_ms"]["p50"],
                                   "tpot_p50_ms": sim["tpot_ms"]["p50"]}})
    return rows
