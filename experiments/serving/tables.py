"""Columnar records of a large simulated run: requests.npz and steps.npz, and its metrics in one pass.

A simulation of 100,000 requests makes some 25 million tokens; as requests.jsonl (every token's time,
twice) that is over a gigabyte written, read back and parsed. Above TOKEN_TIMES_MAX requests a
simulated repeat keeps no per-token times (experiments/sim/records.py: first and last times per
request, inter-token gaps pooled by Gaps) and writes one numpy array per field instead:
requests.npz with every requests.jsonl field but the per-token lists (itl_s, client_itl_s,
output_ids, itl_ms, retried_for), steps.npz with every steps.jsonl field (docs/run-directory.md).
Missing values are NaN (numbers) or "" (text). `summarize_sim` gives metrics.summarize's dict from
the records themselves, the pooled gaps standing in for each request's itl_s; `read_table` reads a
table back as rows (experiments/serving/aggregate.py's read_requests and read_steps). The simulator
writes these tables and the run directory's readers (aggregate, the report) read them, so they live
here, below both.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from experiments.serving.metrics import percentiles, weighted_percentiles

TOKEN_TIMES_MAX = 20_000     # requests up to which a simulated repeat keeps every token's time (JSONL)

_FLOATS = ("arrival_s", "end_s", "ttft_s", "e2e_s", "tpot_s", "client_ttft_s", "client_e2e_s", "transfer_s",
           "exposed_transfer_s", "queue_s", "prefill_s", "handoff_s", "decode_s")
_INTS = ("prompt_len", "output_len", "max_tokens", "transfer_bytes", "attempts")
_TEXT = ("id", "status", "reason", "finish_reason", "prefill_worker", "decode_worker", "note")
STEP_COLUMNS = ("worker", "step", "num_prefill_tokens", "num_prefill_seqs", "num_decode_seqs", "num_tokens",
                "num_blocks_used", "num_running", "num_waiting", "num_preempted", "prepare_s", "forward_s",
                "sample_s", "start_s", "end_s")


def _f(x) -> float:
    return math.nan if x is None else float(x)


def request_columns(records: list) -> dict[str, np.ndarray]:
    """One array per requests.jsonl field of simulated Records (no per-token lists)."""
    cols: dict[str, list] = {k: [] for k in _TEXT + _INTS + _FLOATS}
    for r in records:
        ok = r.status == "ok"
        first, last = r.first_time, r.last_time
        ttft = None if first is None else first - r.arrival_s
        e2e = None if last is None else last - r.arrival_s
        n = r.num_out
        for k, v in (("id", r.id), ("status", "ok" if ok else "failed"), ("reason", r.reason),
                     ("finish_reason", r.finish_reason), ("prefill_worker", r.prefill_worker),
                     ("decode_worker", r.decode_worker), ("note", r.note)):
            cols[k].append(v or "")
        for k, v in (("prompt_len", r.prompt_len), ("output_len", n), ("max_tokens", r.max_tokens),
                     ("transfer_bytes", r.transfer_bytes), ("attempts", r.attempts)):
            cols[k].append(v)
        exposed = r.kv_arrived - r.prefill_end if r.kv_arrived is not None and r.prefill_end is not None else None
        for k, v in (("arrival_s", r.arrival_s), ("end_s", r.end_time), ("ttft_s", ttft), ("e2e_s", e2e),
                     ("tpot_s", (e2e - ttft) / (n - 1) if n >= 2 else None),
                     ("client_ttft_s", None if r.client_first is None else r.client_first - r.arrival_s),
                     ("client_e2e_s", None if r.client_last is None else r.client_last - r.arrival_s),
                     ("transfer_s", r.transfer_s), ("exposed_transfer_s", exposed), ("queue_s", r.queue_s),
                     ("prefill_s", r.prefill_s), ("handoff_s", r.handoff_s), ("decode_s", r.decode_s)):
            cols[k].append(_f(v))
    out = {k: np.asarray(v, dtype=str) for k, v in cols.items() if k in _TEXT}
    out |= {k: np.asarray(cols[k], dtype=np.int64) for k in _INTS}
    out |= {k: np.asarray(cols[k], dtype=np.float64) for k in _FLOATS}
    return out


_LOGGED = ("start_s", "end_s", "num_prefill_tokens", "num_prefill_seqs", "num_decode_seqs", "num_blocks_used",
           "num_running", "num_waiting", "num_preempted")        # a scheduled step's log tuple, in order


def step_columns(workers: list) -> dict[str, np.ndarray]:
    """One array per steps.jsonl field of every worker's step log (experiments/sim/records.py's step_rows).
    Scheduled steps (tuples) and runs (arrays) are gathered apart, each kind in one set of arrays,
    then put back in log order by their segment number (a run, or a stretch of tuples between two)."""
    tuples, t_seg, t_worker = [], [], []                 # scheduled steps: rows, segment, worker
    r_start, r_end, r_used, r_k, r_b, r_prompt, r_wait, r_last, r_seg, r_worker = ([] for _ in range(10))
    chunks = {}                                          # a chunk run's place among the runs: its prompt's tokens a step
    seg = 0
    for wi, w in enumerate(workers):
        open_stretch = False
        for entry in w.log:
            if isinstance(entry, tuple):
                if not open_stretch:
                    seg, open_stretch = seg + 1, True
                tuples.append(entry)
                t_seg.append(seg)
                t_worker.append(wi)
                continue
            seg, open_stretch = seg + 1, False
            r_start.append(entry["start"])
            r_end.append(entry["end"])
            r_used.append(entry["used"])
            r_k.append(len(entry["start"]))
            r_b.append(entry["b"])
            r_prompt.append(entry["prefill"] is not None)
            if entry["prefill"] is not None:
                chunks[len(r_b) - 1] = entry["prefill"]
            r_wait.append(entry["waiting"])
            r_last.append(entry["running_last"])
            r_seg.append(seg)
            r_worker.append(wi)
    t = np.array(tuples, dtype=np.float64).reshape(-1, len(_LOGGED))
    k = np.asarray(r_k, dtype=np.int64)
    b = np.repeat(np.asarray(r_b, dtype=np.float64), k)
    p_seqs = np.repeat(np.asarray(r_prompt, dtype=np.float64), k)
    running = b + p_seqs
    if len(k):
        running[np.cumsum(k) - 1] = r_last
    p_tokens = np.zeros(int(k.sum()))
    first = np.cumsum(k) - k                                 # each run's first row
    for i, tokens in chunks.items():
        p_tokens[first[i]:first[i] + k[i]] = tokens
    cat = (lambda xs: np.concatenate(xs).astype(np.float64) if xs else np.zeros(0))
    zeros = np.zeros(int(k.sum()))
    runs = {"start_s": cat(r_start), "end_s": cat(r_end), "num_prefill_tokens": p_tokens, "num_prefill_seqs": p_seqs,
            "num_decode_seqs": b, "num_blocks_used": cat(r_used), "num_running": running,
            "num_waiting": np.repeat(np.asarray(r_wait, dtype=np.float64), k), "num_preempted": zeros}
    order = np.argsort(np.concatenate([np.asarray(t_seg, dtype=np.int64), np.repeat(np.asarray(r_seg, dtype=np.int64), k)]),
                       kind="stable")
    out = {key: np.concatenate([t[:, i], runs[key]])[order] for i, key in enumerate(_LOGGED)}
    worker = np.concatenate([np.asarray(t_worker, dtype=np.int64), np.repeat(np.asarray(r_worker, dtype=np.int64), k)])[order]
    first = np.searchsorted(worker, worker, side="left")          # each row's worker's first row (rows by worker)
    out["step"] = np.arange(len(worker)) - first
    for key in out:
        if key.startswith("num_"):
            out[key] = out[key].astype(np.int64)
    names = np.array([w.name for w in workers] or [""], dtype=str)
    out["worker"] = names[worker] if len(worker) else np.zeros(0, dtype=str)
    out["num_tokens"] = out["num_prefill_tokens"] + out["num_decode_seqs"]
    out["forward_s"] = out["end_s"] - out["start_s"]
    out["prepare_s"] = out["sample_s"] = np.zeros(len(out["start_s"]))
    return {key: out[key] for key in STEP_COLUMNS}


def write_table(path: Path, cols: dict[str, np.ndarray]) -> None:
    np.savez(path, **cols)


def table_rows(path: Path) -> int:
    with np.load(path) as z:
        return len(z[z.files[0]]) if z.files else 0


def read_table(path: Path, max_rows: int | None = None) -> list[dict]:
    """A table's rows as dicts, NaN and "" read back as None (and requests' per-token lists empty);
    with `max_rows`, a steps table longer than that gives only its first max_rows steps in time
    (the run's first seconds, every worker's steps in them)."""
    with np.load(path) as z:
        cols = {k: z[k] for k in z.files}
    n = len(next(iter(cols.values()))) if cols else 0
    if max_rows is not None and n > max_rows and "start_s" in cols:
        keep = np.sort(np.argsort(cols["start_s"], kind="stable")[:max_rows])
        cols, n = {k: v[keep] for k, v in cols.items()}, max_rows
    conv = {}
    for k, a in cols.items():
        if a.dtype.kind == "f":
            conv[k] = [None if x != x else x for x in a.tolist()] if np.isnan(a).any() else a.tolist()
        elif a.dtype.kind == "U":
            conv[k] = [x or None for x in a.tolist()] if k != "worker" and (a == "").any() else a.tolist()
        else:
            conv[k] = a.tolist()
    keys = list(conv)
    rows = [dict(zip(keys, vals)) for vals in zip(*(conv[k] for k in keys))] if n else []
    if "ttft_s" in cols:
        for r in rows:
            r["itl_s"], r["client_itl_s"], r["output_ids"], r["retried_for"], r["itl_ms"] = [], [], [], [], None
            r["status"] = r["status"] or "failed"
    return rows


def step_ratio_columns(steps: dict[str, np.ndarray]) -> dict:
    """experiments/serving/steps.step_ratio from step columns."""
    ms = (steps["end_s"] - steps["start_s"]) * 1e3
    decode = (steps["num_decode_seqs"] > 0) & (steps["num_prefill_tokens"] == 0)
    mixed = (steps["num_decode_seqs"] > 0) & (steps["num_prefill_tokens"] > 0)
    dec, mix = [], []
    for w in np.unique(steps["worker"]):
        mine = steps["worker"] == w
        if (mine & decode).any() and (mine & mixed).any():
            dec.append(ms[mine & decode])
            mix.append(ms[mine & mixed])
    d = np.concatenate(dec) if dec else np.zeros(0)
    m = np.concatenate(mix) if mix else np.zeros(0)
    dp = float(np.percentile(d, 50)) if d.size else None
    mp = float(np.percentile(m, 50)) if m.size else None
    return {"decode_p50_ms": dp, "mixed_p50_ms": mp, "ratio": mp / dp if mp is not None and dp else None,
            "num_decode_steps": int(d.size), "num_mixed_steps": int(m.size)}


def summarize_sim(sim, cols: dict[str, np.ndarray], slo_ttft_ms: float, slo_tpot_ms: float, num_gpus: int,
                  attainment_target: float = 0.9) -> dict:
    """metrics.summarize of a simulation's requests from their columns and its pooled gaps (sim.gaps)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} must be positive")
    ok = cols["status"] == "ok"
    end, arrival = cols["end_s"], cols["arrival_s"]
    ended = ~np.isnan(end)
    duration = float(end[ended].max() - arrival[ended].min()) if ended.any() else 0.0
    ttft, tpot = cols["ttft_s"], cols["tpot_s"]
    good = ok & (ttft * 1e3 <= slo_ttft_ms) & (np.isnan(tpot) | (tpot * 1e3 <= slo_tpot_ms))
    num_good = int(good.sum())
    input_tokens, output_tokens = int(cols["prompt_len"][ok].sum()), int(cols["output_len"][ok].sum())
    n = len(ok)

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    by_index = np.zeros(n, dtype=bool)
    by_index[[r.index for r in sim.records.values() if r.status == "ok"]] = True
    if sim.gaps is not None:
        made, got, weights = sim.gaps.pooled(by_index)
        itl, client_itl = weighted_percentiles(made, weights), weighted_percentiles(got, weights)
    else:
        itl = client_itl = percentiles([])
    itl = {k: None if v is None else 1e3 * v for k, v in itl.items()}
    client_itl = {k: None if v is None else 1e3 * v for k, v in client_itl.items()}
    client = cols["client_ttft_s"][ok]
    return {
        "num_submitted": n, "num_completed": int(ok.sum()), "num_failed": int(n - ok.sum()), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": per_s(int(ok.sum())), "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens), "goodput": per_s(num_good),
        "goodput_per_gpu": per_s(num_good) / num_gpus, "slo_attainment": num_good / n if n else 0.0,
        "num_gpus": num_gpus,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "attainment_target": attainment_target},
        "ttft_ms": percentiles(ttft[ok] * 1e3), "tpot_ms": percentiles(tpot[ok & ~np.isnan(tpot)] * 1e3),
        "itl_ms": itl, "e2el_ms": percentiles(cols["e2e_s"][ok] * 1e3),
        "client_ttft_ms": percentiles(client[~np.isnan(client)] * 1e3), "client_itl_ms": client_itl,
    }
