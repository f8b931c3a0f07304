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
  (state_factors): a step costs predicted x slowdown(predicted) x each factor whose state holds
  (contention for the share of its time it holds).
  Figures below: the profile in profiles/ (calibration run of 18:48, 160 requests a layout):
  - slowdown: the median per bin of predicted time, made non-decreasing, over steps in none of the
    states below (1.01x at 3 ms, 1.06x from 6 ms);
  - contention: another worker of the host has work (a step in flight, or due after one that left
    it work): work goes 1.09x slower in decode steps, 1.22x in prefills while it does, though each
    worker has a core of its own (they share caches, memory bandwidth and the router's core); a step
    that shares a share f of its time runs 1 / (1 - f + f / c) longer (contended). Read at the start
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
- noise: the quantiles of what is left (measured / everything modelled, decode-only and prefill apart)
  and of the gaps and latencies (experiments/sim/noise.py), for the simulator to draw from; and
  drift (drift_fit): how that residual carries from one step of a worker to its next ones (rank
  correlation 0.23 one step apart, 0.09 eight steps apart: weight 0.32, time constant 24 ms), what
  spreads a request's TPOT;
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
import itertools
import math
import json
import statistics
from pathlib import Path
from typing import NamedTuple

import numpy as np

from experiments.report.points import find_points
from experiments.serving.aggregate import read_jsonl
from experiments.sim.engine import NEVER
from experiments.sim.noise import quantiles
from experiments.sim.stepmodel import chunk_features, curve_at, echo_factors


def _repeats(run_dir: Path):
    """(point identity, requests, steps) of every repeat under run_dir."""
    for point in find_points(run_dir):
        if point.metrics is None:
            continue
        for d in point.repeats:
            metrics = _read(d / "metrics.json") if (d / "metrics.json").is_file() else {}
            hosts = {w["worker"]: w.get("host") for w in (metrics.get("isolation") or {}).get("per_worker") or []}
            yield (point.info | {"machine": metrics.get("machine") or {}, "stream": _read_stream(d / "config.yaml"),
                                 "hosts": hosts}, read_jsonl(d / "requests.jsonl"), read_jsonl(d / "steps.jsonl"))


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


ECHO_STEPS = 8      # decode-only steps after a prefill step that may have an after_prefill factor of their own
ALONE = 0.1         # a step that shares at most this share of its time with another busy worker counts as alone
PROMPT_SIZES = (64, 256, None)   # after_prefill_by_size's bins of the prefill step's prompt tokens (None: no top)


def by_worker(steps: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in steps:
        out.setdefault(s["worker"], []).append(s)
    for ss in out.values():
        ss.sort(key=lambda s: s["start_s"])
    return out


def calibrate(run_dirs: list[Path], model, block_size: int = 16, per_bin: int = 20) -> dict:
    returns, queues, gaps, quiet_gaps, others = [], [], [], [], []
    handoffs: dict[str, list[tuple]] = {}          # transport -> (bytes, exposed seconds, sender busy)
    # (predicted, measured seconds, State)
    steps_seen = {"decode": [], "prefill": []}
    decode_at = []                      # (repeat, worker, start) of each decode step, for the drift
    for rep, (ident, rows, steps) in enumerate(x for d in run_dirs for x in _repeats(Path(d))):
        workers = by_worker(steps)
        overlap, in_transfer = overlaps(workers, ident["hosts"]), transfer_steps(workers, rows)
        if ident["machine"].get("other_cores") is not None:
            others.append(ident["machine"]["other_cores"])
        whole = ident.get("mode") == "disaggregated" or ident.get("policy") == "prefill_first"
        for worker, ss in workers.items():
            idle, since = after_idle(ss), since_prefill(ss)      # idle: {id: seconds idle before}
            role = worker.partition(":")[0]
            made = token_steps(rows, worker, ss)
            for cur, nxt in zip(ss, ss[1:]):
                if (cur["num_running"] or cur["num_waiting"]) and not worker.startswith("prefill"):
                    (gaps if id(cur) in made else quiet_gaps).append(nxt["start_s"] - cur["end_s"])
            for s in ss:
                measured = s["end_s"] - s["start_s"]
                b, p = s["num_decode_seqs"], s["num_prefill_tokens"]
                k, prompt = since.get(id(s), (NEVER, 0))
                state = State(idle.get(id(s)), k, overlap.get(id(s), 0.0), id(s) in in_transfer, role, prompt)
                if b and not p:
                    context = max(0, s["num_blocks_used"] * block_size - b * block_size // 2)
                    steps_seen["decode"].append((model.time(chunk_features(b, context, [])), measured, state))
                    decode_at.append((rep, worker, s["start_s"]))
                elif p and not b and s["num_prefill_seqs"] == 1 and (whole or worker.startswith("prefill")):
                    f = chunk_features(0, 0, [(p, 0, True)])
                    steps_seen["prefill"].append((model.time(f), measured, state))
            if not whole:
                steps_seen["prefill"] += [(p, m, State(idle.get(id(s)), NEVER, overlap.get(id(s), 0.0), False, role, 0))
                                          for p, m, s in chunk_steps(rows, {worker: ss}, model, block_size)]
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
                    (r["transfer_bytes"], r["exposed_transfer_s"], sender_busy(workers.get(r["prefill_worker"], []),
                                                                               r["arrival_s"] + r["ttft_s"])))
    if not returns or not steps_seen["decode"]:
        raise ValueError(f"no completed requests with client times, or no decode-only steps, to calibrate on in {list(map(str, run_dirs))}")
    factors = state_factors(steps_seen, model, per_bin)
    slowdown, after, residual = factors["slowdown"], factors["after_idle"], factors["residual"]
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
            "noise": noise, "drift": drift_fit(residual["decode"], decode_at),
            "other_cores": statistics.median(others) if others else None,
            "handoff": handoff_fits(handoffs, per_bin),
            "num": {"returns": len(returns), "idle_arrivals": len(queues), "gaps": len(gaps),
                    "quiet_gaps": len(quiet_gaps), "decode_steps": len(steps_seen["decode"]),
                    "prefill_steps": len(steps_seen["prefill"]),
                    **factors["num"]}}


class State(NamedTuple):
    """A step's serving state at its start (state_factors)."""

    idle: float | None          # seconds its worker had been idle before it; None: it was busy
    k: int                      # decode-only steps between the worker's last step with prompt tokens and it
    busy: float                 # the share of its time another worker of its host had work
    transfer: bool              # a KV transfer from or to its worker was in flight
    role: str                   # its worker's role
    prompt: int                 # prompt tokens of the worker's last step with some (0: none yet)


def state_factors(steps_seen: dict, model, per_bin: int) -> dict:
    """The serving factors of a step by its State, from (predicted, measured, State) per step kind: the
    slowdown curve from steps in none of the states below; then `contention` (work goes that much
    slower while another worker of the host has work: from steps that shared at least 1 - ALONE of
    their time with one, the rest priced by their share: contended), per kind; `after_prefill`, the decode-only steps 0, 1, ... after the
    worker's last step with prompt tokens (as long as `per_bin` of them were seen, up to ECHO_STEPS),
    and `after_prefill_by_size` the same per size of that step (PROMPT_SIZES: a 64-token chunk pushes
    less out of the caches than a whole prompt); `after_idle`, per kind, a curve by the time the
    worker had been idle (the longer, the more of its caches the rest of the machine has taken: never
    less), from steps in no transfer, and `after_idle_by_role` the same per role where one has
    `per_bin` such steps of a kind (a prefill worker wakes to a whole prompt, a colocated one often to
    a chunk of one); `kv_transfer` (a KV transfer from or to the worker in flight: its threads send or
    receive it), per kind. Each is the median of measured / (curve x the factors already found) over
    its steps (1.0 with fewer than `per_bin`), and `residual` is measured / everything modelled, what
    the noise tables are made of."""
    plain = sorted((p, m) for v in steps_seen.values() for p, m, st in v
                   if not (st.idle is not None or st.busy > ALONE or st.transfer or st.k < ECHO_STEPS))
    if len(plain) < per_bin:      # too few steps in no state at all: the curve over every step from busy
        plain = sorted((p, m) for v in steps_seen.values() for p, m, st in v if st.idle is None)
    slowdown = slowdown_curve(plain, per_bin)
    curve = type(model)(list(model.coef), list(model.gap_coef), slowdown={"pred_s": slowdown[0], "ratio": slowdown[1]},
                        terms=model.terms)
    ratios = {kind: [(m / curve._slowed(p), st) for p, m, st in v] for kind, v in steps_seen.items()}

    def med(xs):
        return statistics.median(xs) if len(xs) >= per_bin else 1.0

    contention = {kind: med([x for x, st in v if st.busy >= 1 - ALONE and not st.transfer and st.idle is None
                             and st.k >= ECHO_STEPS]) for kind, v in ratios.items()}

    def echo_of(steps):
        out = []
        for j in range(ECHO_STEPS):
            xs = [x / contended(st.busy, contention["decode"]) for x, st in steps
                  if st.k == j and st.idle is None and not st.transfer]
            if len(xs) < per_bin:
                break
            out.append(statistics.median(xs))
        return out

    echo = echo_of(ratios["decode"])
    by_size = []
    for i, top in enumerate(PROMPT_SIZES):
        low = PROMPT_SIZES[i - 1] if i else 0
        mine = echo_of([(x, st) for x, st in ratios["decode"] if low < st.prompt <= (top or math.inf)])
        if mine:
            by_size.append({"max_tokens": top, "factors": mine})

    def known(kind, x, st):
        e = echo_factors(echo, by_size, st.prompt)
        return x / contended(st.busy, contention[kind]) / (e[st.k] if kind == "decode" and st.k < len(e) else 1.0)

    def idle_curve(pairs):
        xs, ys = rising_curve(sorted(pairs), per_bin) if len(pairs) >= per_bin else ([1.0], [1.0])
        return {"idle_s": xs, "ratio": ys}

    cold = {kind: [(st.role, max(st.idle, 1e-6), known(kind, x, st)) for x, st in v
                   if st.idle is not None and not st.transfer] for kind, v in ratios.items()}
    after = {kind: idle_curve([(i, y) for _, i, y in v]) for kind, v in cold.items()}
    by_role: dict[str, dict] = {}
    for kind, v in cold.items():
        for role in sorted({r for r, _, _ in v}):
            mine = [(i, y) for r, i, y in v if r == role]
            if len(mine) >= per_bin:
                by_role.setdefault(role, {})[kind] = idle_curve(mine)

    def idled(kind, st):
        return 1.0 if st.idle is None else curve_at(by_role.get(st.role, {}).get(kind, after[kind]), st.idle)

    transfer = {kind: med([known(kind, x, st) / idled(kind, st) for x, st in v if st.transfer])
                for kind, v in ratios.items()}
    residual = {kind: [known(kind, x, st) / idled(kind, st) / (transfer[kind] if st.transfer else 1.0)
                       for x, st in v] for kind, v in ratios.items()}
    count = {kind: {"after_idle": sum(st.idle is not None for _, st in v), "contended": sum(st.busy >= 0.5 for _, st in v),
                    "transfer": sum(st.transfer for _, st in v)} for kind, v in ratios.items()}
    return {"slowdown": slowdown, "contention": contention, "after_prefill": echo, "after_prefill_by_size": by_size,
            "after_idle": after, "after_idle_by_role": by_role, "kv_transfer": transfer, "residual": residual,
            "num": {f"{name}_steps": {kind: c[name] for kind, c in count.items()} for name in ("after_idle", "contended", "transfer")}
                   | {"after_prefill_steps": sum(st.k < ECHO_STEPS for _, st in ratios["decode"])}}


def drift_fit(residual: list[float], at: list[tuple], max_lag: int = 8) -> dict | None:
    """How a worker's unexplained slowness carries from step to step: the rank correlation of its
    decode steps' residuals k steps apart (k = 1..max_lag, pooled over workers), fitted as weight x
    rho^k (a part `weight` of the noise drifts, rho per step, the rest is fresh each step); tau_s =
    the time rho takes per step (the median interval between a busy worker's decode starts) as a
    time constant: noise drawn tau_s apart is correlated weight / e. None with too few steps."""
    series: dict[tuple, list[tuple[float, float]]] = {}
    for r, (rep, worker, start) in zip(residual, at):
        series.setdefault((rep, worker), []).append((start, math.log(r)))
    lags, pairs, intervals = [], {k: ([], []) for k in range(1, max_lag + 1)}, []
    for xs in series.values():
        xs.sort()
        intervals += [b[0] - a[0] for a, b in zip(xs, xs[1:])]
        ranks = np.argsort(np.argsort([x for _, x in xs])) / max(len(xs) - 1, 1)
        for k, (a, b) in pairs.items():
            a.extend(ranks[:-k])
            b.extend(ranks[k:])
    if len(pairs[max_lag][0]) < 100:
        return None
    for k, (a, b) in pairs.items():
        lags.append(float(np.corrcoef(a, b)[0, 1]))
    ks = [k for k, c in zip(pairs, lags) if c > 0.02]
    if len(ks) < 2 or ks[0] != 1:
        return {"weight": 0.0, "rho": 0.0, "tau_s": 0.0, "lags": lags}
    slope, icpt = np.polyfit(ks, [math.log(lags[k - 1]) for k in ks], 1)
    rho, weight = min(math.exp(slope), 0.999), min(math.exp(icpt), 1.0)
    dt = statistics.median(intervals)
    return {"weight": weight, "rho": rho, "tau_s": -dt / math.log(rho) if rho > 0 else 0.0, "lags": lags,
            "step_interval_s": dt}


def since_prefill(ss: list[dict]) -> dict[int, tuple[int, int]]:
    """id of each decode-only step of a worker -> (how many decode-only steps came between the worker's
    last step with prompt tokens and it, that step's prompt tokens); none before it: not listed."""
    out, k, prompt = {}, None, 0
    for s in ss:
        if s["num_prefill_tokens"]:
            k, prompt = 0, s["num_prefill_tokens"]
        elif k is not None:
            out[id(s)] = (k, prompt)
            k += 1
    return out


def overlaps(workers: dict[str, list[dict]], hosts: dict[str, str]) -> dict[int, float]:
    """id of each step -> the share of its time another worker of its host had work: was in a step, or
    between two steps after one that left it work (running or waiting requests). Workers without a
    host in `hosts` (a run whose metrics do not say) share one."""
    busy = {}
    for w, ss in workers.items():
        busy[w] = [(cur["start_s"], nxt["start_s"] if (cur["num_running"] or cur["num_waiting"]) else cur["end_s"])
                   for cur, nxt in zip(ss, ss[1:])] + ([(ss[-1]["start_s"], ss[-1]["end_s"])] if ss else [])
    out = {}
    for w, ss in workers.items():
        merged: list[list[float]] = []
        for a, b in sorted(iv for o in workers if o != w and hosts.get(o) == hosts.get(w) for iv in busy[o]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        starts = [a for a, _ in merged]
        for s in ss:
            t0, t1 = s["start_s"], s["end_s"]
            covered, i = 0.0, max(0, bisect.bisect_right(starts, t0) - 1)
            while i < len(merged) and merged[i][0] < t1:
                covered += max(0.0, min(t1, merged[i][1]) - max(t0, merged[i][0]))
                i += 1
            out[id(s)] = covered / (t1 - t0) if t1 > t0 else float(any(a <= t0 < b for a, b in merged[i - 1:i]))
    return out


def contended(overlap: float, c: float) -> float:
    """How much longer a step runs that shares `overlap` of its time with another busy worker, when
    sharing makes work go c times slower: its work W took (1 - f) T + f T / c = W, so T = W / (1 - f + f / c)."""
    return 1.0 / (1.0 - overlap + overlap / c)


def transfer_steps(workers: dict[str, list[dict]], rows: list[dict]) -> set[int]:
    """ids of the steps of a worker that started while a KV transfer from or to it was in flight: from
    the request's first token to its KV landing (exposed_transfer_s), on its prefill and decode worker."""
    windows: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("exposed_transfer_s") and r.get("ttft_s") is not None and r.get("prefill_worker"):
            t = r["arrival_s"] + r["ttft_s"]
            for w in (r["prefill_worker"], r.get("decode_worker")):
                if w:
                    windows.setdefault(w, []).append((t, t + r["exposed_transfer_s"]))
    out = set()
    for w, ws in windows.items():
        ws.sort()
        starts = [a for a, _ in ws]
        latest = list(itertools.accumulate((b for _, b in ws), max))      # the latest end among windows begun
        for s in workers.get(w, []):
            i = bisect.bisect_right(starts, s["start_s"]) - 1
            if i >= 0 and s["start_s"] < latest[i]:
                out.add(id(s))
    return out


def handoff_fits(handoffs: dict[str, list[tuple]], per_bin: int) -> dict:
    """Per transport, exposed handoff seconds = latency + bytes / bandwidth over the measured handoffs
    (at least `per_bin` of them, at two sizes or more) whose sender went idle after the prefill, its fit
    error; `busy`: how much longer one takes whose sender stepped again at once (sender_busy: its
    sender thread then shares the core with the next prompt; 1.27x in the calibration run of 18:48,
    1.59x on three runs after it), the median of measured / fitted over those (1.0 with fewer than
    `per_bin`); and the quantiles of measured / (fitted x busy where it applies), median 1, for the
    simulator's draws."""
    from experiments.sim.transfer import fit_transfer

    out = {}
    for transport, pairs in handoffs.items():
        quiet = [(b, s) for b, s, busy in pairs if not busy]
        if len(quiet) < per_bin or len({b for b, _ in quiet}) < 2:
            quiet = [(b, s) for b, s, _ in pairs]
        if len(quiet) < per_bin or len({b for b, _ in quiet}) < 2:
            continue
        model, err = fit_transfer([b for b, _ in quiet], [s for _, s in quiet], f"{transport} (serving)")
        busy = [s / model.seconds(b) for b, s, x in pairs if x]
        factor = statistics.median(busy) if len(busy) >= per_bin else 1.0
        ratios = [s / model.seconds(b) / (factor if x else 1.0) for b, s, x in pairs]
        out[transport] = model.to_dict() | {"fit_error": err, "num": len(pairs), "busy": factor,
                                            "num_busy": len(busy), "noise": quantiles(ratios, normalise=True)}
    return out


def sender_busy(steps: list[dict], first_token: float, within_s: float = 1e-3) -> bool:
    """The prefill worker started its next step within `within_s` of the step that made a request's first
    token (it had the next prompt already)."""
    i = bisect.bisect_left([s["start_s"] for s in steps], first_token)
    return i < len(steps) and steps[i]["start_s"] - first_token <= within_s


def after_idle(ss: list[dict]) -> dict[int, float]:
    """id -> seconds idle before, of a worker's steps that start it from idle: its first (idle since
    the run began), and each after a step that left it no work (nothing running, nothing waiting)."""
    out = {id(ss[0]): max(0.0, ss[0]["start_s"])} if ss else {}
    for cur, nxt in zip(ss, ss[1:]):
        if not (cur["num_running"] or cur["num_waiting"]):
            out[id(nxt)] = max(0.0, nxt["start_s"] - cur["end_s"])
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
    """(predicted seconds, median measured / predicted) per bin of predicted time (rising_curve): a
    longer step is never less slowed, as contention for the cores interrupts a long step more often."""
    return rising_curve(sorted((p, m / p) for p, m in pairs), per_bin)


def rising_curve(pairs: list[tuple[float, float]], per_bin: int) -> tuple[list[float], list[float]]:
    """(median x, median y) per bin of x over (x, y) pairs sorted by x: bins a factor of 1.25 wide,
    merged with the next until they hold `per_bin` pairs (the last with the one before); the medians
    then made non-decreasing, pooling adjacent bins that break it (isotonic regression on medians)."""
    bins, cur, edge = [], [], None
    for x, y in pairs:
        if edge is None:
            edge = x * 1.25
        if x > edge and len(cur) >= per_bin:
            bins.append(cur)
            cur, edge = [], x * 1.25
        cur.append((x, y))
    if cur:
        if bins and len(cur) < per_bin:
            bins[-1] += cur
        else:
            bins.append(cur)
    blocks = [[statistics.median(x for x, _ in b), statistics.median(y for _, y in b), len(b)] for b in bins if b]
    out: list[list[float]] = []
    for blk in blocks:
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
