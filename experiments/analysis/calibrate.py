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
- the step's time, from the steps whose features the records determine (decode-only steps: batch
  from num_decode_seqs, their cached tokens from num_blocks_used, the blocks every running decode
  holds, as blocks x block_size less half a block per decode; prefill-only steps of whole prompts,
  prefill_first or prefill workers: one chunk from token 0; a chunked run's single-chunk steps), as
  measured / predicted by the profile, explained by the worker's State at the step's start
  (experiments/analysis/step_states.py): a step costs predicted x slowdown(predicted) x each factor
  whose state holds (contention for the share of its time it holds).
  Figures below: the profile in profiles/ (calibration run of 18:48, 160 requests a layout):
  - slowdown: the median per bin of predicted time, made non-decreasing, over steps in none of the
    states below (1.01x at 3 ms, 1.06x from 6 ms);
  - contention: another worker of the host has work (a step in flight, or due after one that left
    it work), by what it does, prefill (in or after a step with prompt tokens) or decode: work goes
    1.09x slower in decode steps, 1.22x in prefills while it does (one factor for both, at 18:48;
    apart, at 23:53: a decode step 1.16x beside decodes, 1.09x beside a prefill), though each worker
    has a core of its own (they share caches, memory bandwidth and the router, which has twice the
    tokens to post while both decode: a guess, not measured); a step that shares a share f of its time runs
    1 / (1 - f + f / c) longer (contended, with f and c per kind of neighbour). Read at the start
    only it missed most of it on long prefills: of the 1P+1D prompts that started with the decode
    worker idle, the fifth it then worked beside for over 30% of the step ran 1.77x the profile, the
    rest 1.47x (three runs of 18:55-19:00);
  - after_prefill: the decode-only steps 0, 1, 2, ... after the worker's last step with prompt
    tokens: 1.39x, 1.25x, 1.14x, 1.07x, then within 4% (the prefill's activations pushed the weights
    and the KV out of the core's caches), and by that step's size (after_prefill_by_size): 1.32x
    after a chunk of up to 64 tokens, 1.41x up to 256, 1.46x beyond;
  - after_idle: a step that starts a worker from idle (its first, or one after a step that left it
    nothing to do), as a curve by how long it idled: decode steps 1.09x after 7 ms to 1.56x after
    170 ms, prefills 1.08x after 3 ms to 1.38x after 600 ms (the rest of the machine had its caches
    meanwhile); per role where a role has enough such steps (after_idle_by_role: a prefill worker
    wakes to a whole prompt, 1.34-1.38x, a colocated one often to a 64-token chunk, which suffers less);
  - kv_transfer: a KV transfer from or to the worker is in flight (from the first token to the KV
    landing): its threads serialise, send or receive it beside the step: 1.47x for a decode worker's
    step; 0.99x for a prefill worker's prompt once contention is priced by its share of the step
    (read at the start, contention had left 1.14x here);
- after_prompt: a step with prompt tokens right after the worker's last one, not from idle (mostly
    a prompt's next chunk, its caches warm: 0.72x in the AMD EPYC's calibration of 14:31), left out
    of the slowdown curve, which decode steps make; the other factors are read without it;
- prefill_size: what the factors above leave of the steps with prompt tokens, per bin of their
    predicted time, never rising with it (0.95x at 51 ms at the calibration of 01:45: one linear fit
    over every prompt size priced the longest too high);
- by_place: what is left, per step kind, by the worker's place on its host (place_factors);
- speed: where the run's workers timed the speed probe before each repeat (workers/probe.py), how many
  times the profile's time its steps took, the median over every probe of the run (run_speed; over
  runs, the median of theirs). Every step above is read at that speed (its time times speed / its
  run's), so the factors hold for the calibration's speed, and the simulator takes a run's speed /
  this one as a factor on every step (experiments.validate);
- noise: the quantiles of what is left (measured / everything modelled, decode-only and prefill apart)
  and of the gaps and latencies (experiments/sim/noise.py), for the simulator to draw from; and
  drift (step_states.drift_fit): how that residual carries from one step of a worker to its next ones (rank
  correlation 0.23 one step apart, 0.09 eight steps apart: weight 0.32, time constant 24 ms), what
  spreads a request's TPOT;
- handoff: the KV handoff as serving runs it, per transport: from the end of the prefill step that
  made a request's first token to its last KV byte landing on the decode worker (exposed_transfer_s,
  disaggregated points with transfer.stream off) fitted as latency + bytes / bandwidth (sim/transfer.py's
  fit_transfer), with the quantiles of measured / fitted as its noise, and how much slower it goes
  while its sender steps (handoff_fits' busy). It is the export, the sender
  thread's pickup and the wire while both workers step: the sender's part alone took 3.3-4.0x what
  benchmarks.transfer measures here (0.4-0.9 ms + bytes / 0.61-0.67 GB/s against 0.27 ms + bytes /
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

from experiments.analysis.step_states import (State, after_idle, drift_fit, overlaps, since_prefill,
                                              state_factors, transfer_steps)
from experiments.report.points import find_points
from experiments.serving.aggregate import read_jsonl
from experiments.sim.engine import NEVER
from experiments.sim.noise import quantiles
from experiments.sim.stepmodel import chunk_features
from workers.probe import usable


def _repeats(run_dir: Path):
    """(point identity, requests, steps) of every repeat under run_dir."""
    for point in find_points(run_dir):
        if point.metrics is None:
            continue
        for d in point.repeats:
            metrics = _read(d / "metrics.json") if (d / "metrics.json").is_file() else {}
            per_worker = (metrics.get("isolation") or {}).get("per_worker") or []
            hosts = {w["worker"]: w.get("host") for w in per_worker}
            places = {w["worker"]: sum(1 for o in per_worker[:i] if o.get("host") == w.get("host"))
                      for i, w in enumerate(per_worker)}          # its order among its host's workers
            yield (point.info | {"machine": metrics.get("machine") or {}, "stream": _read_stream(d / "config.yaml"),
                                 "hosts": hosts, "places": places, "speed_probe": metrics.get("speed_probe")},
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


def calibrate(run_dirs: list[Path], model, block_size: int = 16, per_bin: int = 20) -> dict:
    returns, queues, gaps, quiet_gaps, others = [], [], [], [], []
    handoffs: dict[str, list[tuple]] = {}          # transport -> (bytes, exposed seconds, until the sender steps)
    # (predicted, measured seconds, State)
    steps_seen = {"decode": [], "prefill": []}
    places = {"decode": [], "prefill": []}          # the place on its host of each step's worker
    decode_at = []                      # (repeat, worker, start) of each decode step, for the drift
    repeats = [(d, x) for d in run_dirs for x in _repeats(Path(d))]
    speeds = {d: run_speed(repeat_dirs(Path(d)), model) for d in run_dirs}
    known = [x for x in speeds.values() if x is not None]
    speed = {k: statistics.median(x[k] for x in known) for k in ("decode", "prefill")} if known else None
    for rep, (run_dir, (ident, rows, steps)) in enumerate(repeats):
        workers = by_worker(steps)
        mine = speeds[run_dir]
        # each run's steps read at the calibration's median speed (its own where it has no probe)
        at = {k: mine[k] / speed[k] for k in speed} if mine and speed else {"decode": 1.0, "prefill": 1.0}
        overlap, in_transfer = overlaps(workers, ident["hosts"]), transfer_steps(workers, rows)
        if ident["machine"].get("other_cores") is not None:
            others.append(ident["machine"]["other_cores"])
        whole = ident.get("mode") == "disaggregated" or ident.get("policy") == "prefill_first"
        for worker, ss in workers.items():
            place = ident["places"].get(worker)
            seen = {kind: len(v) for kind, v in steps_seen.items()}
            idle, since = after_idle(ss), since_prefill(ss)      # idle: {id: seconds idle before}
            warm = {id(b) for a, b in zip(ss, ss[1:])           # a prompt step right after one, not from idle
                    if a["num_prefill_tokens"] and b["num_prefill_tokens"] and idle.get(id(b)) is None}
            role = worker.partition(":")[0]
            made = token_steps(rows, worker, ss)
            for cur, nxt in zip(ss, ss[1:]):
                if (cur["num_running"] or cur["num_waiting"]) and not worker.startswith("prefill"):
                    (gaps if id(cur) in made else quiet_gaps).append(nxt["start_s"] - cur["end_s"])
            for s in ss:
                b, p = s["num_decode_seqs"], s["num_prefill_tokens"]
                measured = (s["end_s"] - s["start_s"]) / at["prefill" if p else "decode"]
                k, prompt = since.get(id(s), (NEVER, 0))
                busy, prefilling = overlap.get(id(s), (0.0, 0.0))
                state = State(idle.get(id(s)), k, busy, prefilling, id(s) in in_transfer, role, prompt, id(s) in warm)
                if b and not p:
                    context = max(0, s["num_blocks_used"] * block_size - b * block_size // 2)
                    steps_seen["decode"].append((model.time(chunk_features(b, context, [])), measured, state))
                    decode_at.append((rep, worker, s["start_s"]))
                elif p and not b and s["num_prefill_seqs"] == 1 and (whole or worker.startswith("prefill")):
                    f = chunk_features(0, 0, [(p, 0, True)])
                    steps_seen["prefill"].append((model.time(f), measured, state))
            if not whole:
                steps_seen["prefill"] += [
                    (p, m / at["prefill"], State(idle.get(id(s)), NEVER, *overlap.get(id(s), (0.0, 0.0)), False, role, 0,
                                                 id(s) in warm))
                    for p, m, s in chunk_steps(rows, {worker: ss}, model, block_size)]
            for kind, v in steps_seen.items():
                places[kind] += [place] * (len(v) - seen[kind])
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
                    (r["transfer_bytes"], r["exposed_transfer_s"], sender_steps(workers.get(r["prefill_worker"], []),
                                                                                r["arrival_s"] + r["ttft_s"])))
    if not returns or not steps_seen["decode"]:
        raise ValueError(f"no completed requests with client times, or no decode-only steps, to calibrate on in {list(map(str, run_dirs))}")
    factors = state_factors(steps_seen, model, per_bin)
    slowdown, after = factors["slowdown"], factors["after_idle"]
    by_place, residual = place_factors(factors["residual"], places, per_bin)
    g0 = statistics.median(gaps) if gaps else model.gap(0)
    dispatch = [max(0.0, q - g0) for q in queues]
    noise = {"decode": quantiles(residual["decode"], normalise=True),
             "prefill": quantiles(residual["prefill"], normalise=True) if residual["prefill"] else None,
             "gap": quantiles(gaps) if gaps else None, "gap_quiet": quantiles(quiet_gaps) if quiet_gaps else None,
             "return": quantiles(returns), "dispatch": quantiles(dispatch) if dispatch else None}
    return {"return_s": statistics.median(returns),
            "dispatch_s": statistics.median(dispatch) if dispatch else 0.0, "gap_s": g0,
            "gap_quiet_s": statistics.median(quiet_gaps) if quiet_gaps else None,
            "slowdown": {"pred_s": slowdown[0], "ratio": slowdown[1]}, "after_idle": after,
            "after_prefill": factors["after_prefill"], "after_prefill_by_size": factors["after_prefill_by_size"],
            "contention": factors["contention"],
            "after_idle_by_role": factors["after_idle_by_role"], "kv_transfer": factors["kv_transfer"],
            "prefill_size": factors["prefill_size"], "after_prompt": factors["after_prompt"],
            "by_place": by_place,
            "noise": noise, "drift": drift_fit(residual["decode"], decode_at),
            "other_cores": statistics.median(others) if others else None,
            "speed": speed,
            "handoff": handoff_fits(handoffs, per_bin),
            "num": {"returns": len(returns), "idle_arrivals": len(queues), "gaps": len(gaps),
                    "quiet_gaps": len(quiet_gaps), "probed_runs": len(known),
                    "decode_steps": len(steps_seen["decode"]),
                    "prefill_steps": len(steps_seen["prefill"]),
                    **factors["num"]}}


def probe_speed(probes: list[dict], model) -> dict | None:
    """{"decode": x, "prefill": y}: how many times the profile's time the speed probe's steps took
    (workers/probe.py), the median over the given probe results; None where there are none."""
    ok = [r for r in probes if r.get("decode_s") and r.get("prefill_s")]
    if not ok:
        return None
    return {"decode": statistics.median(r["decode_s"] / model.time(chunk_features(1, r["context"], [])) for r in ok),
            "prefill": statistics.median(r["prefill_s"] / model.time(chunk_features(0, 0, [(r["prompt_tokens"], 0, True)]))
                                         for r in ok)}


def run_speed(repeat_dirs: list[Path], model, which: str = "speed_probe") -> dict | None:
    """A run's speed: probe_speed over every probe of the given repeats (a run's, of one model), those
    taken before each repeat's requests (`which`: "speed_probe_end" for those after them, which runs
    since 2026-12-02 06:55 also have; pricing reads the ones before, as every calibration has them).
    One repeat's probes are too few to tell a repeat's speed from the next one's, while the run's
    median tracks how fast its steps ran from one run to the next (experiments/results/README.md)."""
    probes = []
    for d in repeat_dirs:
        probes += usable(_read(Path(d) / "metrics.json").get(which))
    return probe_speed(probes, model)


def repeat_dirs(run_dir: Path) -> list[Path]:
    """Every repeat of every point under run_dir."""
    return [d for point in find_points(run_dir) for d in point.repeats]


def place_factors(residual: dict, places: dict, per_bin: int) -> tuple[dict | None, dict]:
    """({kind: {place: factor}}, the residuals less it): per step kind, how much longer the steps of the
    worker at each place on its host ran than all of them, once every state is priced (the median of
    its residuals over the median of all, for places with `per_bin` steps or more, where two places at
    least have that many). None where no run says where its workers ran (metrics.json's isolation).
    Here the second worker of the host (the second core) ran slower in every state: colocated decode
    steps beside the other's decodes 0.97-1.34x against 0.94-1.10x for the first worker's, alone
    0.89-1.17x against 0.82-0.96x (the calibration run of 23:53 and two runs after it); fitted at
    23:53, decode steps 0.95x at place 0 and 1.06x at place 1 (where 1P+1D's decode worker runs),
    prompts 0.99x and 1.04x. The router, not pinned when each worker holds a core, may run there more
    often (not measured)."""
    out = {}
    for kind, res in residual.items():
        groups: dict = {}
        for r, place in zip(res, places[kind]):
            if place is not None:
                groups.setdefault(place, []).append(r)
        groups = {k: v for k, v in groups.items() if len(v) >= per_bin}
        if len(groups) >= 2:
            m = statistics.median(res)
            out[kind] = {str(k): statistics.median(v) / m for k, v in sorted(groups.items())}
    adjusted = {kind: [r / (out.get(kind) or {}).get(str(place), 1.0) for r, place in zip(res, places[kind])]
                for kind, res in residual.items()}
    return out or None, adjusted


def handoff_fits(handoffs: dict[str, list[tuple]], per_bin: int) -> dict:
    """Per transport, from (bytes, exposed seconds, the sender's steps after it: sender_steps) per
    measured handoff: exposed = latency + bytes / bandwidth fitted over those whose sender did not step
    while it ran (at least `per_bin`, at two sizes or more), its fit error; `busy`: how much slower a
    handoff goes while its sender steps (its sender thread then shares the worker's core with the next
    prompt), at full speed between steps (busy_finish). A handoff of fitted time W that overlapped its
    sender's steps for o of its measured s did W - (s - o) of its work in o, so each one that overlapped
    them for a quarter of W or more gives busy = o / (W - s + o), and `busy` is their median (1.0 with
    fewer than `per_bin`). Read from the first sender step on, for the whole rest (the rule before),
    it was 1.47x in the calibration run of 01:45 and 1.31-1.86x in the nine runs after it; read for
    the overlap alone, 1.62x and 1.50-2.17x (experiments.analysis.handoff_check). `noise`: the
    quantiles of measured / modelled, median 1, for the simulator's draws."""
    from experiments.sim.transfer import fit_transfer

    out = {}
    for transport, pairs in handoffs.items():
        quiet = [(b, s) for b, s, steps in pairs if overlap(steps, s) == 0.0]
        if len(quiet) < per_bin or len({b for b, _ in quiet}) < 2:
            quiet = [(b, s) for b, s, _ in pairs]
        if len(quiet) < per_bin or len({b for b, _ in quiet}) < 2:
            continue
        model, err = fit_transfer([b for b, _ in quiet], [s for _, s in quiet], f"{transport} (serving)")
        busy = []
        for b, s, steps in pairs:
            w, o = model.seconds(b), overlap(steps, s)
            x = overlap_factor(w, s, o)
            if x is not None and o >= 0.25 * w:
                busy.append(x)
        factor = statistics.median(busy) if len(busy) >= per_bin else 1.0
        ratios = [s / busy_finish(model.seconds(b), steps, factor) for b, s, steps in pairs]
        out[transport] = model.to_dict() | {"fit_error": err, "num": len(pairs), "busy": factor,
                                            "num_busy": len(busy), "noise": quantiles(ratios, normalise=True)}
    return out


def sender_steps(steps: list[dict], first_token: float, horizon_s: float = 1.0) -> list[tuple[float, float]]:
    """(start, end) of a prefill worker's steps from the end of the step that made a request's first
    token on, in seconds after it, for `horizon_s`."""
    i = bisect.bisect_left([s["start_s"] for s in steps], first_token)
    out = []
    for s in steps[i:]:
        if s["start_s"] - first_token > horizon_s:
            break
        out.append((s["start_s"] - first_token, s["end_s"] - first_token))
    return out


def overlap(steps: list[tuple[float, float]], t: float) -> float:
    """Seconds of [0, t] inside the steps."""
    return sum(max(0.0, min(b, t) - max(a, 0.0)) for a, b in steps)


def overlap_factor(work_s: float, measured_s: float, overlap_s: float) -> float | None:
    """How much slower a handoff of `work_s` at full speed went inside its sender's steps, if it took
    `measured_s` and overlapped them for `overlap_s` (at full speed outside them); None where it
    did not overlap or the reading is undefined."""
    rest = work_s - (measured_s - overlap_s)
    return overlap_s / rest if overlap_s > 0 and rest > 0 else None


def busy_finish(work_s: float, steps: list[tuple[float, float]], busy: float) -> float:
    """When a handoff of `work_s` at full speed ends, going `busy` times slower inside the steps."""
    t, left = 0.0, work_s
    for a, b in steps:
        if a > t:
            if left <= a - t:
                return t + left
            left, t = left - (a - t), a
        if b > t:
            if left <= (b - t) / busy:
                return t + left * busy
            left, t = left - (b - t) / busy, b
    return t + left


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


def _idle_at(steps: list[dict], t: float) -> bool:
    """No step of the worker in flight at t, and the one before left it without work."""
    before = [s for s in steps if s["start_s"] <= t]
    if not before:
        return True
    last = before[-1]
    return last["end_s"] < t and not (last["num_running"] or last["num_waiting"])
