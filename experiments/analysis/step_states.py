"""A step's serving state, and what each state costs, from a real run's steps.jsonl and requests.jsonl.

experiments/analysis/calibrate.py reads a run and hands each step it can predict (its features known
from the records) here with its State at its start: how long its worker had been idle, how many
decode-only steps since its last step with prompt tokens (and that step's size), the share of its
time another worker of its host had work, whether a KV transfer from or to its worker was in
flight, and its worker's role. `state_factors` prices each state as a factor on the profile's
prediction and leaves the rest as residual noise; `drift_fit` measures how that residual carries
from step to step. The simulator applies the same factors in the same states (experiments/sim/).
"""
from __future__ import annotations

import bisect
import itertools
import math
import statistics
from typing import NamedTuple

import numpy as np

from experiments.sim.stepmodel import curve_at, echo_factors


ECHO_STEPS = 8      # decode-only steps after a prefill step that may have an after_prefill factor of their own


ALONE = 0.1         # a step that shares at most this share of its time with another busy worker counts as alone


PROMPT_SIZES = (64, 256, None)   # after_prefill_by_size's bins of the prefill step's prompt tokens (None: no top)


class State(NamedTuple):
    """A step's serving state at its start (state_factors)."""

    idle: float | None          # seconds its worker had been idle before it; None: it was busy
    k: int                      # decode-only steps between the worker's last step with prompt tokens and it
    busy: float                 # the share of its time another worker of its host had work
    beside_prefill: float       # of its time, the share that worker was prefilling (in or after a step with prompt tokens)
    transfer: bool              # a KV transfer from or to its worker was in flight
    role: str                   # its worker's role
    prompt: int                 # prompt tokens of the worker's last step with some (0: none yet)
    after_prompt: bool = False  # a step with prompt tokens right after its worker's last one, not from idle


def state_factors(steps_seen: dict, model, per_bin: int) -> dict:
    """The serving factors of a step by its State, from (predicted, measured, State) per step kind: the
    slowdown curve from steps in none of the states below; then `contention` (work goes that much
    slower while another worker of the host has work: from steps that shared at least 1 - ALONE of
    their time with one, the rest priced by their share: contended), per kind and per what that
    worker did (decode or prefill: {kind: {beside: factor}}, the pooled factor where fewer than
    `per_bin` steps shared their time with one kind alone); `after_prefill`, the decode-only steps 0, 1, ... after the
    worker's last step with prompt tokens (as long as `per_bin` of them were seen, up to ECHO_STEPS),
    and `after_prefill_by_size` the same per size of that step (PROMPT_SIZES: a 64-token chunk pushes
    less out of the caches than a whole prompt); `after_idle`, per kind, a curve by the time the
    worker had been idle (the longer, the more of its caches the rest of the machine has taken: never
    less), from steps in no transfer, and `after_idle_by_role` the same per role where one has
    `per_bin` such steps of a kind (a prefill worker wakes to a whole prompt, a colocated one often to
    a chunk of one); `kv_transfer` (a KV transfer from or to the worker in flight: its threads send or
    receive it), per kind. Each is the median of measured / (curve x the factors already found) over
    its steps (1.0 with fewer than `per_bin`). Last, `prefill_size`: what is left of the steps with
    prompt tokens per bin of their predicted time, never rising with it (rising_curve of its negative),
    over its median (None with fewer
    than 2 x `per_bin`). `residual` is measured / everything modelled, what the noise tables are made of."""
    plain = sorted((p, m) for kind, v in steps_seen.items() for p, m, st in v
                   if not (st.idle is not None or st.busy > ALONE or st.transfer or st.k < ECHO_STEPS
                           or (st.after_prompt and kind == "prefill")))
    if len(plain) < per_bin:      # too few steps in no state at all: the curve over every step from busy
        plain = sorted((p, m) for kind, v in steps_seen.items() for p, m, st in v if st.idle is None)
    slowdown = slowdown_curve(plain, per_bin)
    curve = type(model)(list(model.coef), list(model.gap_coef), slowdown={"pred_s": slowdown[0], "ratio": slowdown[1]},
                        terms=model.terms)
    ratios = {kind: [(m / curve._slowed(p), st) for p, m, st in v] for kind, v in steps_seen.items()}
    # a prompt step straight after the worker's last one (the next chunk of a prompt, mostly) finds
    # its caches warm: on an AMD EPYC here such lone chunks ran 1.06x the profile, 0.79x the curve
    warm = [x for x, st in ratios["prefill"] if st.after_prompt and st.busy <= ALONE and not st.transfer]
    after_prompt = statistics.median(warm) if len(warm) >= per_bin else 1.0
    ratios["prefill"] = [(x / after_prompt if st.after_prompt else x, st) for x, st in ratios["prefill"]]

    def med(xs):
        return statistics.median(xs) if len(xs) >= per_bin else 1.0

    def beside(kind, v):
        """{what the other worker did: factor} from this kind's steps in no other state that shared at
        least 1 - ALONE of their time with it doing that; the pooled factor where too few did."""
        xs = [(x, st.beside_prefill / st.busy) for x, st in v if st.busy >= 1 - ALONE and not st.transfer
              and st.idle is None and st.k >= ECHO_STEPS]
        pooled = med([x for x, _ in xs])
        out = {}
        for other, keep in (("decode", lambda f: f <= ALONE), ("prefill", lambda f: f >= 1 - ALONE)):
            mine = [x for x, f in xs if keep(f)]
            out[other] = statistics.median(mine) if len(mine) >= per_bin else pooled
        return out

    contention = {kind: beside(kind, v) for kind, v in ratios.items()}

    def echo_of(steps):
        out = []
        for j in range(ECHO_STEPS):
            xs = [x / contended(st, contention["decode"]) for x, st in steps
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
        return x / contended(st, contention[kind]) / (e[st.k] if kind == "decode" and st.k < len(e) else 1.0)

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
    # What is left of a prompt's step by its predicted time: one linear fit over every prompt size,
    # and state factors read over all of them, leave the longest prompts slower in the model than
    # served (their residual 0.87-0.95x the median above 45 ms predicted, in ten runs of 01:45-06:14).
    prefill = [(p, r) for (p, _, _), r in zip(steps_seen["prefill"], residual["prefill"])]
    size = None
    if len(prefill) >= 2 * per_bin:
        level = statistics.median(r for _, r in prefill)
        xs, ys = rising_curve(sorted((p, -r) for p, r in prefill), per_bin)     # never rising
        size = {"pred_s": xs, "ratio": [-y / level for y in ys]}
        residual["prefill"] = [r / curve_at(size, p) for p, r in prefill]
    count = {kind: {"after_idle": sum(st.idle is not None for _, st in v), "contended": sum(st.busy >= 0.5 for _, st in v),
                    "transfer": sum(st.transfer for _, st in v)} for kind, v in ratios.items()}
    return {"slowdown": slowdown, "contention": contention, "after_prefill": echo, "after_prefill_by_size": by_size,
            "after_prompt": after_prompt,
            "after_idle": after, "after_idle_by_role": by_role, "kv_transfer": transfer, "prefill_size": size,
            "residual": residual,
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


def overlaps(workers: dict[str, list[dict]], hosts: dict[str, str]) -> dict[int, tuple[float, float]]:
    """id of each step -> (the share of its time another worker of its host had work: was in a step, or
    between two steps after one that left it work (running or waiting requests); the share it was
    prefilling: in, or after, a step with prompt tokens). Workers without a host in `hosts` (a run
    whose metrics do not say) share one."""
    busy: dict[str, list[tuple[float, float, bool]]] = {}
    for w, ss in workers.items():
        busy[w] = [(cur["start_s"], nxt["start_s"] if (cur["num_running"] or cur["num_waiting"]) else cur["end_s"],
                    bool(cur["num_prefill_tokens"])) for cur, nxt in zip(ss, ss[1:])]
        busy[w] += [(ss[-1]["start_s"], ss[-1]["end_s"], bool(ss[-1]["num_prefill_tokens"]))] if ss else []
    out = {}
    for w, ss in workers.items():
        others = [iv for o in workers if o != w and hosts.get(o) == hosts.get(w) for iv in busy[o]]
        share = _covered(ss, [(a, b) for a, b, _ in others])
        prefilling = _covered(ss, [(a, b) for a, b, p in others if p])
        for s in ss:
            out[id(s)] = (share[id(s)], min(prefilling[id(s)], share[id(s)]))
    return out


def _covered(ss: list[dict], intervals: list[tuple[float, float]]) -> dict[int, float]:
    """id of each step -> the share of its time within the union of `intervals`."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]
    out = {}
    for s in ss:
        t0, t1 = s["start_s"], s["end_s"]
        covered, i = 0.0, max(0, bisect.bisect_right(starts, t0) - 1)
        while i < len(merged) and merged[i][0] < t1:
            covered += max(0.0, min(t1, merged[i][1]) - max(t0, merged[i][0]))
            i += 1
        out[id(s)] = covered / (t1 - t0) if t1 > t0 else float(any(a <= t0 < b for a, b in merged[i - 1:i]))
    return out


def contended(st: State, c: dict) -> float:
    """How much longer a step runs that shares a share f_d of its time with another busy worker that
    decodes and f_p with one that prefills, when sharing makes work go c["decode"] or c["prefill"] times
    slower: its work W took (1 - f_d - f_p) T + f_d T / c_d + f_p T / c_p = W."""
    f_p = st.beside_prefill
    f_d = st.busy - f_p
    return 1.0 / (1.0 - f_d - f_p + f_d / c["decode"] + f_p / c["prefill"])


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


def after_idle(ss: list[dict]) -> dict[int, float]:
    """id -> seconds idle before, of a worker's steps that start it from idle: its first (idle since
    the run began), and each after a step that left it no work (nothing running, nothing waiting)."""
    out = {id(ss[0]): max(0.0, ss[0]["start_s"])} if ss else {}
    for cur, nxt in zip(ss, ss[1:]):
        if not (cur["num_running"] or cur["num_waiting"]):
            out[id(nxt)] = max(0.0, nxt["start_s"] - cur["end_s"])
    return out


def slowdown_curve(pairs: list[tuple[float, float]], per_bin: int) -> tuple[list[float], list[float]]:
    """(predicted seconds, median measured / predicted) per bin of predicted time (rising_curve): a
    longer step is never less slowed, as contention for the cores interrupts a long step more often."""
    return rising_curve(sorted((p, m / p) for p, m in pairs), per_bin)


def rising_curve(pairs: list[tuple[float, float]], per_bin: int) -> tuple[list[float], list[float]]:
    """(median x, median y) per bin of x over (x, y) pairs sorted by x (bins a factor of 1.25 wide,
    merged with the next until they hold `per_bin` pairs, the last with the one before), the medians
    made non-decreasing, pooling adjacent bins that break it (isotonic regression on medians)."""
    out: list[list[float]] = []
    for blk in _bins(pairs, per_bin):
        out.append(blk)
        while len(out) > 1 and out[-2][1] > out[-1][1]:
            b2, b1 = out.pop(), out.pop()
            w = b1[2] + b2[2]
            out.append([(b1[0] * b1[2] + b2[0] * b2[2]) / w, (b1[1] * b1[2] + b2[1] * b2[2]) / w, w])
    return [float(b[0]) for b in out], [float(b[1]) for b in out]


def _bins(pairs: list[tuple[float, float]], per_bin: int) -> list[list[float]]:
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
    return [[statistics.median(x for x, _ in b), statistics.median(y for _, y in b), len(b)] for b in bins if b]
