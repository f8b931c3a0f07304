"""What serving adds to a profile measured in isolation, read from the files of a real run (docs/run-directory.md).

A profile times the engine's steps alone in one process. Serving adds the router's messages (Ray calls
both ways), the worker loop between steps, and sharing: the router, the other workers and whatever
else runs share the machine. `calibrate` reads a run's points (requests.jsonl, steps.jsonl) and
returns a handful of numbers, each a median of many measured events (docs/simulator.md):

- return_s: over completed requests, client_ttft - ttft: from the end of the step that made the
  first token (ttft times it: router/records.py) to the router receiving it;
- gap_s: the host time between two steps of a busy worker (its previous step left work), kept as the
  gap's constant (the profile's per-sequence slope stays);
- dispatch_s: over requests whose worker was idle when they arrived, the time from their arrival to
  their first step's start (ttft - prefill), less gap_s: the router's submit reaching the worker;
- factors: how much longer a step took than the profile predicts for it (measured / predicted, over
  the steps whose features the records determine: decode-only steps, whose batch is num_decode_seqs
  and whose cached tokens are their blocks x block_size less half a block per decode; prefill-only
  steps of whole prompts; a chunked run's single-chunk steps, placed in their prompts):
  `decode` and `prefill`, over the steps of that kind that ran with no other worker of their host
  busy for more than ALONE of their time; `shared_host`, over those that had another busy for at
  least SHARED of it, their ratio over their kind's factor. A factor needs MIN_STEPS steps; with
  fewer it is left out (1.0 in the simulator, which says so);
- spread: how much those steps vary around what their factors predict, as the sigma of a lognormal
  read off the 90th percentile of their log ratios (over the median): what gives the simulated
  tails (ITL and TPOT p90 and p99, queueing behind slow steps) the machine's own jitter;
- handoff: per transport, the KV handoff as serving runs it: from the end of the prefill step that
  made a request's first token to its last KV byte on the decode worker (exposed_transfer_s of
  disaggregated points with transfer.stream off), fitted as latency + bytes / bandwidth
  (experiments/sim/transfer.py's fit_transfer); it holds the export, the sender's pickup and the wire;
- other_cores: the CPU other processes used meanwhile (the median over its repeats), the condition
  the calibration holds for.

A worker is busy from the start of a step to the start of its next one when the step left it work
(running or waiting requests), else to the step's end. Workers whose host the run did not record
(metrics.json's isolation) share one host: a local run's. No run that a profile is calibrated on
should be validated against it: the profile command makes its own calibration run with its own seed.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from pathlib import Path

import numpy as np

from experiments.report.points import find_points
from experiments.serving.aggregate import read_jsonl
from experiments.sim.stepmodel import chunk_features

ALONE, SHARED = 0.1, 0.9      # share of a step with another worker of its host busy: alone below, shared above
MIN_STEPS = 20                # steps a factor is read from, at least
Z90 = 1.2815515655446004      # the standard normal's 90th percentile


def _repeats(run_dir: Path):
    """(point identity, requests, steps) of every repeat under run_dir."""
    for point in find_points(run_dir):
        if point.metrics is None:
            continue
        for d in point.repeats:
            metrics = _read(d / "metrics.json") if (d / "metrics.json").is_file() else {}
            per_worker = (metrics.get("isolation") or {}).get("per_worker") or []
            hosts = {w["worker"]: w.get("host") for w in per_worker}
            yield (point.info | {"machine": metrics.get("machine") or {}, "stream": _read_stream(d / "config.yaml"),
                                 "hosts": hosts},
                   read_jsonl(d / "requests.jsonl"), read_jsonl(d / "steps.jsonl"))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _read_stream(path: Path) -> str:
    try:
        from omegaconf import OmegaConf
        return str(OmegaConf.load(path).transfer.stream)
    except Exception:       # no config, or one without transfer.stream: the default
        return "off"


def by_worker(steps: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in steps:
        out.setdefault(s["worker"], []).append(s)
    for ss in out.values():
        ss.sort(key=lambda s: s["start_s"])
    return out


def busy_intervals(ss: list[dict]) -> list[tuple[float, float]]:
    """A worker's busy time, merged: each step, and the gap after it when it left work."""
    out: list[list[float]] = []
    for cur, nxt in zip(ss, ss[1:] + [None]):
        end = nxt["start_s"] if nxt is not None and (cur["num_running"] or cur["num_waiting"]) else cur["end_s"]
        if out and cur["start_s"] <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([cur["start_s"], end])
    return [(a, b) for a, b in out]


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of [a, b] inside merged, sorted `intervals`."""
    i = max(0, bisect.bisect_right([x for x, _ in intervals], a) - 1)
    t = 0.0
    while i < len(intervals) and intervals[i][0] < b:
        t += max(0.0, min(b, intervals[i][1]) - max(a, intervals[i][0]))
        i += 1
    return t


def shared_shares(workers: dict[str, list[dict]], hosts: dict[str, str]) -> dict[int, float]:
    """{id(step): share of its time another worker of its host was busy}."""
    busy = {w: busy_intervals(ss) for w, ss in workers.items()}
    out = {}
    for w, ss in workers.items():
        others = merge([iv for o, ivs in busy.items() if o != w and hosts.get(o) == hosts.get(w) for iv in ivs])
        for s in ss:
            d = s["end_s"] - s["start_s"]
            out[id(s)] = covered(others, s["start_s"], s["end_s"]) / d if d > 0 and others else 0.0
    return out


def calibrate(run_dirs: list[Path], model, block_size: int = 16) -> dict:
    """The serving calibration of `model` (a profile's LinearStepModel, uncalibrated) from real runs."""
    returns, queues, gaps, others = [], [], [], []
    handoffs: dict[str, list[tuple]] = {}          # transport -> (bytes, exposed seconds)
    seen = {"decode": [], "prefill": []}           # (measured / predicted, share shared)
    for run_dir in run_dirs:
        for ident, rows, steps in _repeats(Path(run_dir)):
            workers = by_worker(steps)
            shares = shared_shares(workers, ident["hosts"])
            if ident["machine"].get("other_cores") is not None:
                others.append(ident["machine"]["other_cores"])
            whole = ident.get("mode") == "disaggregated" or ident.get("policy") == "prefill_first"
            for worker, ss in workers.items():
                if not worker.startswith("prefill"):
                    gaps += [n["start_s"] - c["end_s"] for c, n in zip(ss, ss[1:]) if c["num_running"] or c["num_waiting"]]
                for s in ss:
                    b, p = s["num_decode_seqs"], s["num_prefill_tokens"]
                    measured = s["end_s"] - s["start_s"]
                    if b and not p:
                        context = max(0, s["num_blocks_used"] * block_size - b * block_size // 2)
                        seen["decode"].append((measured / model.time(chunk_features(b, context, [])), shares[id(s)]))
                    elif p and not b and s["num_prefill_seqs"] == 1 and whole:
                        seen["prefill"].append((measured / model.time(chunk_features(0, 0, [(p, 0, True)])),
                                                shares[id(s)]))
                if not whole:
                    seen["prefill"] += [(m / pred, shares[id(s)]) for pred, m, s in
                                        chunk_steps(rows, {worker: ss}, model, block_size)]
            for r in rows:
                if r.get("status") != "ok" or r.get("queue_s") is None:
                    continue
                if r.get("client_ttft_s") is not None:
                    returns.append(r["client_ttft_s"] - r["ttft_s"])
                if _idle_at(workers.get(r["prefill_worker"], []), r["arrival_s"]):
                    queues.append(r["ttft_s"] - r["prefill_s"])
                if (ident.get("mode") == "disaggregated" and ident.get("stream") == "off" and r.get("transfer_bytes")
                        and (r.get("exposed_transfer_s") or 0) > 0):
                    handoffs.setdefault(ident.get("transfer") or "zmq", []).append(
                        (r["transfer_bytes"], r["exposed_transfer_s"]))
    if not returns or not seen["decode"]:
        raise ValueError(f"no completed requests with client times, or no decode-only steps, to calibrate on in "
                         f"{list(map(str, run_dirs))}")
    factors, num = step_factors(seen)
    g0 = statistics.median(gaps) if gaps else model.gap(0)
    dispatch = [max(0.0, q - g0) for q in queues]
    return {"factors": factors, "gap_s": g0, "return_s": statistics.median(returns),
            "dispatch_s": statistics.median(dispatch) if dispatch else 0.0,
            "handoff": handoff_fits(handoffs),
            "other_cores": statistics.median(others) if others else None,
            "num": {"returns": len(returns), "idle_arrivals": len(queues), "gaps": len(gaps), **num}}


def step_factors(seen: dict[str, list[tuple[float, float]]]) -> tuple[dict, dict]:
    """(factors, steps each was read from) from {kind: [(measured / predicted, share shared)]}."""
    factors, num, shared = {}, {}, []
    for kind, pairs in seen.items():
        alone = [r for r, f in pairs if f <= ALONE]
        num[f"{kind}_alone"] = len(alone)
        if len(alone) >= MIN_STEPS:
            factors[kind] = statistics.median(alone)
            shared += [r / factors[kind] for r, f in pairs if f >= SHARED]
    num["shared"] = len(shared)
    if len(shared) >= MIN_STEPS:
        factors["shared_host"] = statistics.median(shared)
    logs = []                                  # each step's log ratio over its factors' prediction
    for kind, pairs in seen.items():
        if kind in factors:
            logs += [math.log(r / factors[kind]) for r, f in pairs if f <= ALONE]
            if "shared_host" in factors:
                logs += [math.log(r / (factors[kind] * factors["shared_host"])) for r, f in pairs if f >= SHARED]
    if len(logs) >= MIN_STEPS:
        q50, q90 = np.percentile(logs, [50, 90])
        if q90 - q50 > 1e-6:                   # (steps that all ran at their prediction: none)
            factors["spread"] = float((q90 - q50) / Z90)
    return factors, num


def handoff_fits(handoffs: dict[str, list[tuple]], min_handoffs: int = MIN_STEPS) -> dict:
    """Per transport, exposed seconds = latency + bytes / bandwidth over its measured handoffs (at least
    `min_handoffs`, at two sizes or more), with its fit error."""
    from experiments.sim.transfer import fit_transfer

    out = {}
    for transport, pairs in handoffs.items():
        if len(pairs) < min_handoffs or len({b for b, _ in pairs}) < 2:
            continue
        model, err = fit_transfer([b for b, _ in pairs], [s for _, s in pairs], f"{transport} (serving)")
        out[transport] = model.to_dict() | {"fit_error": err, "num": len(pairs)}
    return out


def repeat_dirs(run_dir: Path) -> list[Path]:
    """Every repeat of every point under run_dir."""
    return [d for point in find_points(run_dir) for d in point.repeats]


def chunk_steps(rows: list[dict], workers: dict, model, block_size: int) -> list[tuple[float, float, dict]]:
    """(predicted, measured, step) of a chunked run's steps that carried one prompt chunk: a request's chunks
    are its worker's steps up to the one that made its first token (ending at its arrival + ttft_s,
    both on the router's clock); where each carried one chunk and their tokens add up
    to the prompt, they are all its own, in order, so each one's start in the prompt is known."""
    out = []
    for r in rows:
        if r.get("status") != "ok" or r.get("queue_s") is None or r.get("prefill_s") is None:
            continue
        ss = workers.get(r["prefill_worker"], [])
        if not ss:
            continue
        first_token = r["arrival_s"] + r["ttft_s"]
        last = min(range(len(ss)), key=lambda i: abs(ss[i]["end_s"] - first_token))
        mine, total, i = [], 0, last
        while i >= 0 and total < r["prompt_len"] and ss[i]["num_prefill_seqs"] == 1:
            mine.insert(0, ss[i])
            total += ss[i]["num_prefill_tokens"]
            i -= 1
        if total != r["prompt_len"] or abs(ss[last]["end_s"] - first_token) > 1e-4:
            continue
        start = 0
        for s in mine:
            n, b = s["num_prefill_tokens"], s["num_decode_seqs"]
            context = max(0, s["num_blocks_used"] * block_size - (start + n) - b * block_size // 2) if b else 0
            f = chunk_features(b, context, [(n, start, start + n == r["prompt_len"])])
            out.append((model.time(f), s["end_s"] - s["start_s"], s))
            start += n
    return out


def _idle_at(steps: list[dict], t: float) -> bool:
    """No step of the worker in flight at t, and the one before left it without work."""
    before = [s for s in steps if s["start_s"] <= t]
    if not before:
        return True
    last = before[-1]
    return last["end_s"] < t and not (last["num_running"] or last["num_waiting"])
