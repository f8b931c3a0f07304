"""What serving adds to a profile measured in isolation, read from the files of a real run (FORMATS.md).

A profile times the engine's steps alone in one process. Serving adds the router's messages (Ray calls
both ways), the worker loop between steps, and contention: the router, the other workers and whatever
else runs share the cores. `calibrate` reads a run's points (requests.jsonl, steps.jsonl) and returns:

- return_s: the median, over completed requests, of client_ttft - ttft: from the end of the step that
  made the first token (ttft times it: router/records.py) to the router receiving it;
- dispatch_s: over requests whose worker was idle when they arrived (no step of it in flight, none
  due), the median time from their arrival to their first step's start (ttft - prefill), less the
  host gap: the router's submit reaching the worker's loop;
- gap_coef: the host time between two steps of a busy worker (its previous step left work) after a
  step that made tokens: the median gap, as g0, with the profile's per-sequence slope g1 kept;
  gap_quiet_s: the median after a step that made none (a chunk that leaves its prompt unfinished:
  half of g0 here, as the worker loop then has no token to post);
- slowdown: how much longer a step takes while serving than the profile predicts, as a function of
  the predicted time: over the steps whose features the records determine (decode-only steps: batch
  from num_decode_seqs, their cached tokens from num_blocks_used, the blocks every running decode
  holds, as blocks x block_size less half a block per decode; prefill-only steps of whole prompts,
  prefill_first or prefill workers: one chunk from token 0), the median measured / predicted per bin
  of predicted time, made non-decreasing, over steps of a busy worker. On a shared CPU a long step
  is interrupted more often than a short one, so it is slowed more;
- after_idle: how much longer again a step takes that starts a worker from idle (its first, or one
  after a step that left it nothing to do): the median measured / (predicted x slowdown) over those,
  decode-only and prefill steps apart (1.0 with fewer than `per_bin`). Such a step is slow here (a
  64-token first chunk ran 22-31% over the profile where the chunks after it ran 1-9% under, a decode
  worker's first step after idle 45-49% over): a curve by predicted time alone spread that over
  every step of its length;
- noise: the quantiles of each of these (experiments/sim/noise.py), for the simulator to draw from;
  steps as measured / (predicted x slowdown x after_idle where it applies), decode-only and prefill
  apart;
- handoff: the KV handoff as serving runs it, per transport: from the end of the prefill step that
  made a request's first token to its last KV byte landing on the decode worker (exposed_transfer_s,
  disaggregated points with transfer.stream off) fitted as latency + bytes / bandwidth (sim/transfer.py's
  fit_transfer), with the quantiles of measured / fitted as its noise. It is the export, the sender
  thread's pickup and the wire while both workers step: the sender's part alone took 3.3-4.0x what
  cluster.transfer_bench measures here (0.4-0.9 ms + bytes / 0.61-0.67 GB/s against 0.27 ms + bytes /
  3.26 GB/s, four runs);
- other_cores: the CPU other processes used meanwhile (the median over its repeats): the condition
  the calibration holds for (on a shared machine a run made while others used more CPU is slower).

No run that a profile is calibrated on should be validated against it: the profile command makes
its own calibration run with its own seed.
"""
from __future__ import annotations

import bisect
import json
import statistics
from pathlib import Path

from experiments.report.points import find_points
from experiments.serving.aggregate import read_jsonl
from experiments.sim.noise import quantiles
from experiments.sim.stepmodel import chunk_features


def _repeats(run_dir: Path):
    """(point identity, requests, steps) of every repeat under run_dir."""
    for point in find_points(run_dir):
        if point.metrics is None:
            continue
        for d in point.repeats:
            machine = (_read(d / "metrics.json").get("machine") or {}) if (d / "metrics.json").is_file() else {}
            stream = _read_stream(d / "config.yaml")
            yield point.info | {"machine": machine, "stream": stream}, read_jsonl(d / "requests.jsonl"), read_jsonl(d / "steps.jsonl")


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


def calibrate(run_dirs: list[Path], model, block_size: int = 16, per_bin: int = 20) -> dict:
    returns, queues, gaps, quiet_gaps, others = [], [], [], [], []
    handoffs: dict[str, list[tuple[int, float]]] = {}        # transport -> (bytes, exposed seconds)
    steps_seen = {"decode": [], "prefill": []}              # (predicted, measured seconds, after idle)
    for ident, rows, steps in (x for d in run_dirs for x in _repeats(Path(d))):
        workers = by_worker(steps)
        if ident["machine"].get("other_cores") is not None:
            others.append(ident["machine"]["other_cores"])
        whole = ident.get("mode") == "disaggregated" or ident.get("policy") == "prefill_first"
        for worker, ss in workers.items():
            idle = after_idle(ss)
            made = token_steps(rows, worker, ss)
            for cur, nxt in zip(ss, ss[1:]):
                if (cur["num_running"] or cur["num_waiting"]) and not worker.startswith("prefill"):
                    (gaps if id(cur) in made else quiet_gaps).append(nxt["start_s"] - cur["end_s"])
            for s in ss:
                measured = s["end_s"] - s["start_s"]
                b, p = s["num_decode_seqs"], s["num_prefill_tokens"]
                if b and not p:
                    context = max(0, s["num_blocks_used"] * block_size - b * block_size // 2)
                    steps_seen["decode"].append((model.time(chunk_features(b, context, [])), measured, id(s) in idle))
                elif p and not b and s["num_prefill_seqs"] == 1 and (whole or worker.startswith("prefill")):
                    f = chunk_features(0, 0, [(p, 0, True)])
                    steps_seen["prefill"].append((model.time(f), measured, id(s) in idle))
            if not whole:
                steps_seen["prefill"] += [(p, m, id(s) in idle) for p, m, s in chunk_steps(rows, {worker: ss}, model,
                                                                                            block_size)]
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
    if not returns or not steps_seen["decode"]:
        raise ValueError(f"no completed requests with client times, or no decode-only steps, to calibrate on in {list(map(str, run_dirs))}")
    busy = sorted((p, m) for v in steps_seen.values() for p, m, cold in v if not cold)
    slowdown = slowdown_curve(busy, per_bin)
    curve = type(model)(list(model.coef), list(model.gap_coef), slowdown={"pred_s": slowdown[0], "ratio": slowdown[1]},
                        terms=model.terms)
    cold = {k: [m / curve._slowed(p) for p, m, c in v if c] for k, v in steps_seen.items()}
    after = {k: statistics.median(v) if len(v) >= per_bin else 1.0 for k, v in cold.items()}
    residual = {k: [m / curve._slowed(p) / (after[k] if c else 1.0) for p, m, c in v] for k, v in steps_seen.items()}
    g0 = statistics.median(gaps) if gaps else model.gap(0)
    dispatch = [max(0.0, q - g0) for q in queues]
    noise = {"decode": quantiles(residual["decode"], normalise=True),
             "prefill": quantiles(residual["prefill"], normalise=True) if residual["prefill"] else None,
             "gap": quantiles(gaps) if gaps else None, "gap_quiet": quantiles(quiet_gaps) if quiet_gaps else None,
             "return": quantiles(returns), "dispatch": quantiles(dispatch) if dispatch else None}
    return {"return_s": statistics.median(returns),
            "dispatch_s": statistics.median(dispatch) if dispatch else 0.0, "gap_s": g0,
            "gap_quiet_s": statistics.median(quiet_gaps) if quiet_gaps else None,
            "slowdown": {"pred_s": slowdown[0], "ratio": slowdown[1]}, "after_idle": after, "noise": noise,
            "other_cores": statistics.median(others) if others else None,
            "handoff": handoff_fits(handoffs, per_bin),
            "num": {"returns": len(returns), "idle_arrivals": len(queues), "gaps": len(gaps),
                    "quiet_gaps": len(quiet_gaps), "decode_steps": len(steps_seen["decode"]),
                    "prefill_steps": len(steps_seen["prefill"]),
                    "after_idle_steps": {k: len(v) for k, v in cold.items()}}}


def handoff_fits(handoffs: dict[str, list[tuple[int, float]]], per_bin: int) -> dict:
    """Per transport, exposed handoff seconds = latency + bytes / bandwidth over the measured handoffs
    (at least `per_bin` of them, at two sizes or more), its fit error, and the quantiles of measured /
    fitted (median 1) for the simulator's draws."""
    from experiments.sim.transfer import fit_transfer

    out = {}
    for transport, pairs in handoffs.items():
        if len(pairs) < per_bin or len({b for b, _ in pairs}) < 2:
            continue
        model, err = fit_transfer([b for b, _ in pairs], [s for _, s in pairs], f"{transport} (serving)")
        ratios = [s / model.seconds(b) for b, s in pairs]
        out[transport] = model.to_dict() | {"fit_error": err, "num": len(pairs),
                                            "noise": quantiles(ratios, normalise=True)}
    return out


def after_idle(ss: list[dict]) -> set[int]:
    """ids of a worker's steps that start it from idle: its first, and each after a step that left it
    no work (nothing running, nothing waiting)."""
    out = {id(ss[0])} if ss else set()
    for cur, nxt in zip(ss, ss[1:]):
        if not (cur["num_running"] or cur["num_waiting"]):
            out.add(id(nxt))
    return out


def token_steps(rows: list[dict], worker: str, ss: list[dict]) -> set[int]:
    """ids of a worker's steps that made a token: any with decodes, and those whose end is a request's
    first token there (arrival + ttft_s, the router's clock, as steps.jsonl's). A chunk that leaves its
    prompt unfinished makes none, and the worker loop has less to do after it (no token to post)."""
    firsts = sorted(r["arrival_s"] + r["ttft_s"] for r in rows
                    if r.get("ttft_s") is not None and r.get("prefill_worker") == worker)
    out = set()
    for s in ss:
        i = bisect.bisect_left(firsts, s["end_s"] - 1e-4)
        if s["num_decode_seqs"] or (i < len(firsts) and abs(firsts[i] - s["end_s"]) <= 1e-4):
            out.add(id(s))
    return out


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


def slowdown_curve(pairs: list[tuple[float, float]], per_bin: int) -> tuple[list[float], list[float]]:
    """(predicted seconds, median measured / predicted) per bin of predicted time: bins a factor of 1.25
    wide, merged with the next until they hold `per_bin` steps (the last with the one before); the
    ratios then made non-decreasing (a longer step is never less slowed: contention for the cores
    interrupts a long step more often), pooling adjacent bins that break it."""
    bins, cur, edge = [], [], None
    for p, m in pairs:
        if edge is None:
            edge = p * 1.25
        if p > edge and len(cur) >= per_bin:
            bins.append(cur)
            cur, edge = [], p * 1.25
        cur.append((p, m))
    if cur:
        if bins and len(cur) < per_bin:
            bins[-1] += cur
        else:
            bins.append(cur)
    blocks = [[statistics.median(p for p, _ in b), statistics.median(m / p for p, m in b), len(b)] for b in bins if b]
    out: list[list[float]] = []
    for blk in blocks:                        # pool adjacent violators (isotonic regression on medians)
        out.append(blk)
        while len(out) > 1 and out[-2][1] > out[-1][1]:
            b2, b1 = out.pop(), out.pop()
            w = b1[2] + b2[2]
            out.append([(b1[0] * b1[2] + b2[0] * b2[2]) / w, (b1[1] * b1[2] + b2[1] * b2[2]) / w, w])
    return [float(b[0]) for b in out], [float(b[1]) for b in out]


def _idle_at(steps: list[dict], t: float) -> bool:
    """No step of the worker in flight at t, and the one before left it without work."""
    before = [s for s in steps if s["start_s"] <= t]
    if not before:
        return True
    last = before[-1]
    return last["end_s"] < t and not (last["num_running"] or last["num_waiting"])
