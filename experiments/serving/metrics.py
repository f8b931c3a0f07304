"""Serving metrics from `requests.jsonl` rows, defined as `vllm bench serve` defines them.

Per request (status "ok" only): TTFT = first token - arrival; E2EL = last token - arrival;
TPOT = (E2EL - TTFT) / (output tokens - 1), only for requests with at least 2 output tokens;
ITL = gaps between successive tokens, pooled over requests. Token times are when each token was made
(its worker's step end on the router's clock); `client_ttft_ms` and `client_itl_ms` time tokens when
they reached the router instead, so tokens that came back in one poll count a 0 ms gap there.

Per point: duration = max(end_s) - min(arrival_s) over rows that ended; throughputs divide
completed requests and tokens by it (0.0 when it is 0). A request is *good* when it completed with
TTFT <= slo_ttft_ms and TPOT <= slo_tpot_ms (no TPOT, fewer than 2 tokens: meets the TPOT SLO).
goodput = good requests / duration (DistServe); slo_attainment = good / submitted, so failed
requests count as misses; latency statistics use completed requests only.
"""
from __future__ import annotations

import numpy as np

PERCENTILES = {"p50": 50, "p90": 90, "p99": 99}


def percentiles(values) -> dict:
    """{mean, p50, p90, p99} of `values` (linear interpolation, np.percentile's default), same unit.

    All None for an empty input.
    """
    a = np.asarray(list(values), dtype=float)
    if a.size == 0:
        return {"mean": None, **{k: None for k in PERCENTILES}}
    return {"mean": float(a.mean()), **{k: float(np.percentile(a, q)) for k, q in PERCENTILES.items()}}


def weighted_percentiles(values: np.ndarray, weights: np.ndarray) -> dict:
    """metrics.percentiles of the sample in which each value appears `weights` times (whole numbers):
    the same mean and linearly interpolated p50, p90, p99, without expanding it."""
    n = float(weights.sum())
    if n == 0:
        return {"mean": None, **{k: None for k in PERCENTILES}}
    order = np.argsort(values, kind="stable")
    v, c = values[order], np.cumsum(weights[order])
    out = {"mean": float((values * weights).sum() / n)}
    for key, q in PERCENTILES.items():
        pos = q / 100 * (n - 1)
        lo = int(np.floor(pos))
        a = v[np.searchsorted(c, lo + 1)]                 # the value at rank lo (0-based)
        b = v[min(np.searchsorted(c, lo + 2), len(v) - 1)]
        out[key] = float(a + (b - a) * (pos - lo))
    return out


def _tpot_s(row: dict) -> float | None:
    if row["output_len"] < 2:
        return None
    return (row["e2e_s"] - row["ttft_s"]) / (row["output_len"] - 1)


def _meets_slo(row: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    tpot = _tpot_s(row)
    return row["ttft_s"] * 1e3 <= slo_ttft_ms and (tpot is None or tpot * 1e3 <= slo_tpot_ms)


def summarize(rows: list[dict], slo_ttft_ms: float, slo_tpot_ms: float, num_gpus: int,
              attainment_target: float = 0.9) -> dict:
    """metrics.json of one point, less `point` (the caller adds it). Latencies in ms.

    Besides the keys docs/run-directory.md lists: `total_input_tokens`, `total_output_tokens` (completed requests).
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} must be positive")
    ok = [r for r in rows if r["status"] == "ok"]
    ended = [r for r in rows if r.get("end_s") is not None]
    duration = max(r["end_s"] for r in ended) - min(r["arrival_s"] for r in ended) if ended else 0.0
    input_tokens = sum(r["prompt_len"] for r in ok)
    output_tokens = sum(r["output_len"] for r in ok)
    num_good = sum(_meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    goodput = per_s(num_good)
    return {
        "num_submitted": len(rows),
        "num_completed": len(ok),
        "num_failed": len(rows) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "goodput": goodput,
        "goodput_per_gpu": goodput / num_gpus,
        "slo_attainment": num_good / len(rows) if rows else 0.0,
        "num_gpus": num_gpus,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "attainment_target": attainment_target},
        "ttft_ms": percentiles(r["ttft_s"] * 1e3 for r in ok),
        "tpot_ms": percentiles(t * 1e3 for t in map(_tpot_s, ok) if t is not None),
        "itl_ms": percentiles(gap * 1e3 for r in ok for gap in r.get("itl_s") or ()),
        "e2el_ms": percentiles(r["e2e_s"] * 1e3 for r in ok),
        # as a client of the router sees them: tokens timed when they reached it (docs/run-directory.md)
        "client_ttft_ms": percentiles(r["client_ttft_s"] * 1e3 for r in ok if r.get("client_ttft_s") is not None),
        "client_itl_ms": percentiles(gap * 1e3 for r in ok for gap in r.get("client_itl_s") or ()),
    }


def _line(label: str, value, fmt: str = ".2f", ci=None) -> str:
    if fmt == "d" and isinstance(value, float):   # a median of counts over repeats
        value, fmt = (int(value), "d") if value.is_integer() else (value, ".1f")
    text = "n/a" if value is None else format(value, fmt)
    if ci and value is not None and None not in ci:
        text = f"{text:<10} [{format(ci[0], fmt)}, {format(ci[1], fmt)}]"
    return f"{label:<40} {text:<10}".rstrip()


_SECTIONS = [("ttft_ms", "TTFT", "Time to First Token"),
             ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl_ms", "ITL", "Inter-token Latency"),
             ("e2el_ms", "E2EL", "End-to-end Latency")]


def format_summary(metrics: dict, title: str = "Serving Benchmark Result") -> str:
    """A text block shaped like `vllm bench serve`'s printout; "n/a" where a value is None. When metrics
    carry intervals (`ci`), each headline value is followed by its 95% interval in brackets."""
    m, slo = metrics, metrics["slo"]
    ci = m.get("ci") or {}
    attainment = m["slo_attainment"]
    attain_text = "n/a" if attainment is None else (
        f"{attainment:.2%} (target {slo['attainment_target'] * 100:g}%; "
        f"TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms)")
    if attainment is not None and ci.get("slo_attainment"):
        lo, hi = ci["slo_attainment"]
        attain_text = f"{attainment:.2%} [{lo:.2%}, {hi:.2%}]" + attain_text[len(f"{attainment:.2%}"):]
    lines = [f"{' ' + title + ' ':=^50}"]
    reps = m.get("repeats")
    if isinstance(reps, dict):
        lines.append(f"{'Repeats (median; [95% CI]):':<40} {reps['num_ok']}"
                     + (f" ({reps['num_failed']} failed)" if reps.get("num_failed") else ""))
    elif ci:
        lines.append(f"{'One run ([95% CI] over requests):':<40} 1")
    lines += [_line("Successful requests:", m["num_completed"], "d"),
              _line("Failed requests:", m["num_failed"], "d"),
              _line("Benchmark duration (s):", m["duration_s"]),
              _line("Total input tokens:", m["total_input_tokens"], "d"),
              _line("Total generated tokens:", m["total_output_tokens"], "d"),
              _line("Request throughput (req/s):", m["request_throughput"], ci=ci.get("request_throughput")),
              _line("Output token throughput (tok/s):", m["output_throughput"], ci=ci.get("output_throughput")),
              _line("Total Token throughput (tok/s):", m["total_token_throughput"]),
              _line("Request goodput (req/s):", m["goodput"], ci=ci.get("goodput")),
              _line("Goodput per GPU (req/s):", m["goodput_per_gpu"], ci=ci.get("goodput_per_gpu")),
              f"{'SLO attainment:':<40} {attain_text}"]
    for key, short, name in _SECTIONS:
        stats = m[key]
        lines.append(f"{name:-^50}")
        lines.append(_line(f"Mean {short} (ms):", stats["mean"], ci=ci.get(f"{key}.mean")))
        lines.append(_line(f"Median {short} (ms):", stats["p50"], ci=ci.get(f"{key}.p50")))
        lines.append(_line(f"P90 {short} (ms):", stats["p90"], ci=ci.get(f"{key}.p90")))
        lines.append(_line(f"P99 {short} (ms):", stats["p99"], ci=ci.get(f"{key}.p99")))
    if isinstance(m.get("step_ratio"), dict):
        sr = m["step_ratio"]
        lines.append(f"{'Engine steps':-^50}")
        lines.append(_line("Decode-only step p50 (ms):", sr.get("decode_p50_ms")))
        lines.append(_line("Mixed step p50 (ms):", sr.get("mixed_p50_ms")))
        lines.append(_line("Mixed / decode-only step:", sr.get("ratio"), ci=ci.get("step_ratio.ratio")))
    lines.append("=" * 50)
    return "\n".join(lines)


def request_fields(rec, t0: float, output_ids: list, ttft: float | None, e2e: float | None, itl: list,
                   client_ttft: float | None, client_e2e: float | None, client_itl: list) -> dict:
    """One requests.jsonl row (docs/run-directory.md) of a record with the router's fields (a real
    RequestRecord or the simulator's Record), given its token timings; times relative to t0."""
    n = len(output_ids)
    itl_ms = None
    if itl:
        q = percentiles([1e3 * x for x in itl])
        itl_ms = {"mean": q["mean"], "p50": q["p50"], "p99": q["p99"], "max": 1e3 * max(itl)}
    return {
        "id": rec.id, "prompt_len": rec.prompt_len, "output_len": n, "output_ids": output_ids,
        "max_tokens": rec.max_tokens, "arrival_s": rec.arrival_s - t0,
        "end_s": None if rec.end_time is None else rec.end_time - t0,
        "status": rec.status if rec.status == "ok" else "failed", "reason": rec.reason,
        "finish_reason": rec.finish_reason, "ttft_s": ttft, "e2e_s": e2e,
        "tpot_s": (e2e - ttft) / (n - 1) if n >= 2 else None, "itl_s": itl, "itl_ms": itl_ms,
        "client_ttft_s": client_ttft, "client_e2e_s": client_e2e, "client_itl_s": client_itl,
        "prefill_worker": rec.prefill_worker, "decode_worker": rec.decode_worker,
        "transfer_bytes": rec.transfer_bytes, "transfer_s": rec.transfer_s,
        "exposed_transfer_s": (rec.kv_arrived - rec.prefill_end
                               if rec.kv_arrived is not None and rec.prefill_end is not None else None),
        "queue_s": rec.queue_s,
        "prefill_s": rec.prefill_s, "handoff_s": rec.handoff_s, "decode_s": rec.decode_s, "attempts": rec.attempts,
        "retried_for": rec.retried_for, "note": rec.note,
    }
