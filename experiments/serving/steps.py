"""Engine steps from steps.jsonl rows: their kind, their duration, and per-worker and per-point statistics.

A step is *decode* (decode sequences, no prefill tokens), *mixed* (both: the interference) or *prefill*
(no decode sequence). The point's mixed/decode step ratio pools the steps of every worker that ran
both kinds: median mixed step / median decode-only step.
"""
from __future__ import annotations

import numpy as np

KINDS = ("decode", "mixed", "prefill")


def num(x) -> float | None:
    """x as a float; None for null, NaN, booleans, strings and the like."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def step_kind(step: dict) -> str:
    """decode (no prefill tokens), mixed (prefill tokens and decode sequences) or prefill (no decode)."""
    if not step.get("num_decode_seqs"):
        return "prefill"
    return "mixed" if step.get("num_prefill_tokens") else "decode"


def step_ms(step: dict) -> float | None:
    start, end = num(step.get("start_s")), num(step.get("end_s"))
    return None if start is None or end is None else (end - start) * 1000.0


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def durations_by_kind(steps: list[dict]) -> dict[str, dict[str, list[float]]]:
    """{worker: {kind: [ms, ...]}} in step order."""
    out: dict[str, dict[str, list[float]]] = {}
    for s in steps:
        ms = step_ms(s)
        if ms is not None:
            out.setdefault(str(s.get("worker")), {k: [] for k in KINDS})[step_kind(s)].append(ms)
    return out


def step_stats(steps: list[dict]) -> list[dict]:
    """Per worker: step-duration percentiles by kind and how much slower a mixed step is than a decode-only one."""
    rows = []
    by_worker = durations_by_kind(steps)
    tokens: dict[str, list] = {}             # each worker's mixed steps' prefill tokens, in one pass
    for s in steps:
        if step_ms(s) is not None and step_kind(s) == "mixed":
            tokens.setdefault(str(s.get("worker")), []).append(s.get("num_prefill_tokens") or 0)
    for worker in sorted(by_worker):
        ms = by_worker[worker]
        prefill_tokens = tokens.get(worker, [])
        dec, mix = pct(ms["decode"], 50), pct(ms["mixed"], 50)
        rows.append({"worker": worker, "decode_p50_ms": dec, "mixed_p50_ms": mix, "mixed_p99_ms": pct(ms["mixed"], 99),
                     "ratio": mix / dec if mix is not None and dec else None,
                     "mixed_prefill_tokens_p50": pct(prefill_tokens, 50)}
                    | {f"num_{k}_steps": len(ms[k]) for k in KINDS})
    return rows


def pooled_steps(steps: list[dict]) -> tuple[list[float], list[float]]:
    """(decode-only ms, mixed ms) pooled over the workers that ran both kinds."""
    decode, mixed = [], []
    for ms in durations_by_kind(steps).values():
        if ms["decode"] and ms["mixed"]:
            decode += ms["decode"]
            mixed += ms["mixed"]
    return decode, mixed


def step_ratio(steps: list[dict]) -> dict:
    """{decode_p50_ms, mixed_p50_ms, ratio, num_decode_steps, num_mixed_steps}; None values without mixed steps."""
    decode, mixed = pooled_steps(steps)
    dec, mix = pct(decode, 50), pct(mixed, 50)
    return {"decode_p50_ms": dec, "mixed_p50_ms": mix, "ratio": mix / dec if mix is not None and dec else None,
            "num_decode_steps": len(decode), "num_mixed_steps": len(mixed)}


def price_error(steps: list[dict]) -> dict:
    """How long an emulated engine's waits took against their price (steps.jsonl's forward_s, measured,
    and price_s): the emulator's own error, the host waking late, over the steps that carry a price.
    Relative errors (measured - price) / price as median, p90, p99 and max; the same in milliseconds;
    how many steps."""
    rel, ms = [], []
    for s in steps:
        price, waited = num(s.get("price_s")), num(s.get("forward_s"))
        if price is None or waited is None or price <= 0:
            continue
        rel.append((waited - price) / price)
        ms.append((waited - price) * 1e3)
    if not rel:
        return {"num": 0}
    return {"num": len(rel), **{f"rel_{k}": pct(rel, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
            "rel_max": max(rel), **{f"ms_{k}": pct(ms, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
            "ms_max": max(ms)}
