"""Confidence intervals of a point's headline metrics: within one run across requests, and across repeats.

Within a run the unit is the request: each bootstrap resample draws the run's submitted requests with
replacement and recomputes every headline metric from the drawn ones exactly as metrics.summarize does
(TTFT, TPOT and E2EL over completed requests; ITL over the gaps of the drawn requests, so the gaps of
one request stay together; goodput and throughputs over the run's duration; attainment over the drawn
requests). The mixed/decode step ratio resamples decode-only and mixed steps. Across repeats the point's
value is the median of its repeats' values and its interval comes from stats.two_level. Every resample
is seeded from fixed keys, so a report rebuilt from the files prints the same intervals as the run did.
"""
from __future__ import annotations

import numpy as np

from experiments.serving.metrics import _meets_slo, _tpot_s
from experiments.serving.stats import NUM_BOOT, interval, resample_counts, rng_for, two_level
from experiments.serving.steps import num, pooled_steps

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STATS = ("mean", "p50", "p90", "p99")
RATES = ("goodput", "goodput_per_gpu", "slo_attainment", "request_throughput", "output_throughput")
HEADLINE = tuple(f"{m}.{s}" for m in LATENCIES for s in STATS) + RATES + ("step_ratio.ratio",)
LOWER_IS_BETTER = {k: k.split(".")[0] in LATENCIES + ("step_ratio",) for k in HEADLINE}
METHOD_WITHIN = f"percentile bootstrap over requests ({NUM_BOOT} resamples; steps for step_ratio)"
METHOD_ACROSS = (f"two-level percentile bootstrap ({NUM_BOOT} resamples): repeats drawn with replacement, "
                 "then one within-run resample of each; the median across repeats")


def get(d: dict, key: str):
    """A number by dotted key ("ttft_ms.p50"); None when absent, null or NaN."""
    for k in key.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return num(d)


def _stats_into(reps: dict, name: str, b: int, x: np.ndarray) -> None:
    if x.size:
        reps[f"{name}.mean"][b] = x.mean()
        for s, v in zip(STATS[1:], np.percentile(x, [50, 90, 99])):
            reps[f"{name}.{s}"][b] = v


def request_replicates(rows: list[dict], slo_ttft_ms: float, slo_tpot_ms: float, num_gpus: int,
                       duration_s: float, rng: np.random.Generator, num: int = NUM_BOOT) -> dict[str, np.ndarray]:
    """Bootstrap replicates (length `num`, NaN where undefined) of every request-level headline metric."""
    n = len(rows)
    ok = np.array([r["status"] == "ok" for r in rows], dtype=bool)
    good = np.array([r["status"] == "ok" and _meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in rows], dtype=float)
    out_len = np.array([r["output_len"] if r["status"] == "ok" else 0 for r in rows], dtype=float)
    per_request = {}
    for name, value in (("ttft_ms", lambda r: r["ttft_s"]), ("tpot_ms", _tpot_s), ("e2el_ms", lambda r: r["e2e_s"])):
        idx = [i for i, r in enumerate(rows) if r["status"] == "ok" and value(r) is not None]
        per_request[name] = (np.array([1e3 * value(rows[i]) for i in idx]), np.array(idx, dtype=int))
    gaps = [(i, 1e3 * g) for i, r in enumerate(rows) if r["status"] == "ok" for g in r.get("itl_s") or ()]
    gap_owner = np.array([i for i, _ in gaps], dtype=int)
    gap_ms = np.array([g for _, g in gaps])
    reps = {k: np.full(num, np.nan) for k in HEADLINE if not k.startswith("step_ratio")}
    counts = resample_counts(n, num, rng)
    for b in range(num):
        c = counts[b]
        for name, (values, idx) in per_request.items():
            _stats_into(reps, name, b, np.repeat(values, c[idx]))
        _stats_into(reps, "itl_ms", b, np.repeat(gap_ms, c[gap_owner]))
    if n:
        num_good, num_ok = counts @ good, counts @ ok.astype(float)
        reps["slo_attainment"] = num_good / n
        if duration_s > 0:
            reps["goodput"] = num_good / duration_s
            reps["goodput_per_gpu"] = reps["goodput"] / num_gpus
            reps["request_throughput"] = num_ok / duration_s
            reps["output_throughput"] = (counts @ out_len) / duration_s
    return reps


def step_replicates(steps: list[dict], rng: np.random.Generator, num: int = NUM_BOOT) -> np.ndarray:
    """Replicates of the pooled mixed/decode step ratio: decode-only and mixed steps resampled apart."""
    decode, mixed = (np.asarray(x, dtype=float) for x in pooled_steps(steps))
    if not decode.size or not mixed.size:
        return np.full(num, np.nan)
    d = np.median(decode[rng.integers(0, decode.size, (num, decode.size))], axis=1)
    m = np.median(mixed[rng.integers(0, mixed.size, (num, mixed.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, m / d, np.nan)


def replicates(rows: list[dict], steps: list[dict], metrics: dict, repeat: int) -> dict[str, np.ndarray]:
    """Within-run replicates of every headline metric of one repeat, from its files (seeded by `repeat`)."""
    slo = metrics["slo"]
    reps = request_replicates(rows, slo["ttft_ms"], slo["tpot_ms"], metrics["num_gpus"], metrics["duration_s"],
                              rng_for("within-run", repeat))
    reps["step_ratio.ratio"] = step_replicates(steps, rng_for("steps", repeat))
    return reps


def within_run_ci(reps: dict[str, np.ndarray], metrics: dict) -> dict:
    """{key: [lo, hi] | None} for each headline metric; None where the run has no value for it."""
    out = {}
    for key in HEADLINE:
        ci = interval(reps[key]) if get(metrics, key) is not None else None
        out[key] = None if ci is None else list(ci)
    return out


def _median_leaves(values: list):
    """Median of numbers; for dicts, the same structure with medians of their numeric leaves."""
    first = values[0]
    if isinstance(first, dict):
        return {k: _median_leaves([v.get(k) if isinstance(v, dict) else None for v in values]) for k in first}
    nums = [num(v) for v in values]
    defined = [v for v in nums if v is not None]
    if num(first) is None or isinstance(first, bool):
        return first
    if not defined:
        return None
    med = float(np.median(defined))
    counts = all(isinstance(v, int) and not isinstance(v, bool) for v in values if v is not None)
    return int(med) if counts and med.is_integer() else med      # counts stay integers where they can


def across_repeats(metrics: list[dict], reps: list[dict[str, np.ndarray]]) -> dict:
    """The point's metrics from its successful repeats: medians of every number, and for each headline
    metric its repeats' values and the two-level interval."""
    out = _median_leaves(metrics)
    for k in ("slo", "num_gpus"):
        out[k] = metrics[0][k]
    out["ci"], out["repeat_values"] = {}, {}
    for key in HEADLINE:
        values = [get(m, key) for m in metrics]
        out["repeat_values"][key] = values
        ci = None
        if any(v is not None for v in values):
            ci = two_level([r[key] for r in reps], rng_for("across-repeats", key))
        out["ci"][key] = None if ci is None else list(ci)
    out["ci_level"], out["ci_method"] = 0.95, METHOD_ACROSS
    return out
