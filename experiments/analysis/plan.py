"""Which layout gives the most goodput per GPU: `python -m experiments.plan [overrides] cluster.gpus=N`.

The criterion is DistServe's: a layout's goodput per GPU is the highest request rate per GPU at which
at least slo.attainment_target (90%) of requests meet both SLOs (TTFT and TPOT), found by bisection
over the rate with the simulator (experiments/sim/), the workload's shape at each rate. A rate is met
when the attainment target holds and the cluster keeps up (`kept_up`): a burst of a few requests
meets any SLO, so attainment alone would pass any rate; a queue that grows over the second half of
the arrivals shows a rate the cluster cannot sustain however loose the SLOs. A probe serves at least
`requests_per_worker` requests per worker and HORIZON x the TTFT target of arrivals (not the decode
probe: its prompts are free), extended to RUN_LATENCIES median latencies when that is longer, so the
second half starts after the run has warmed up.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
from omegaconf import DictConfig, OmegaConf

from experiments.analysis.forked import run_all
from experiments.config import ConfigError, apply_layout, parse
from experiments.sim.backend import costs_for, simulate
from experiments.sim.stepmodel import chunk_features
from experiments.workload import build_workload


HORIZON = 10              # a probe's arrivals span at least this many TTFT targets ...
RUN_LATENCIES = 12        # ... and this many of its requests' median latency
GROWTH = 0.02             # kept up: the queue grew by at most this share of the second half's arrivals
MAX_REQUESTS = 50_000     # ... up to this many requests (a simulation's records stay under ~100 MB)


class FreeStep:
    """A step model whose steps take 1 us: the prefill side of the decode probe."""

    name = "free"

    def __repr__(self) -> str:
        return "FreeStep()"

    def time(self, f) -> float:
        return 1e-6

    def gap(self, num_seqs: int, quiet: bool = False) -> float:
        return 0.0

    def decode_run(self, b: int, context: int, k: int) -> np.ndarray:
        return np.full(k, 1e-6)


@dataclass
class Candidate:
    layout: str                  # colocated-prefill_first | colocated-chunked | <P>p<D>d
    chunk: int | None            # chunked: the token budget
    goodput_per_gpu: float       # requests/s per GPU at >= target attainment
    how: str                     # "phases" (min(P g_p, D g_d)) | "probe" (a small colocated cluster) | "full"
    rate: float = 0.0            # whole-cluster request rate at that goodput
    attainment: float | None = None
    detail: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.layout} (chunk {self.chunk})" if self.chunk else self.layout

    @property
    def disaggregated(self) -> bool:
        return not self.layout.startswith("colocated")


def _spec(cfg: DictConfig, layout: str, gpus: int, chunk: int | None = None):
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    c.cluster.gpus = gpus
    if chunk:
        c.scheduler.token_budget = chunk
    return parse(apply_layout(c, layout))


def attainment(sim, ttft_s: float, tpot_s: float, phase: str = "both") -> float:
    """Share of submitted requests that completed within the SLOs of `phase` (prefill: TTFT; decode:
    TPOT; both), as experiments/serving/metrics.py counts them."""
    good = 0
    recs = sim.records.values()
    for r in recs:
        if r.status != "ok":
            continue
        t_ok = r.first_time - r.arrival_s <= ttft_s
        p_ok = r.num_out < 2 or (r.last_time - r.first_time) / (r.num_out - 1) <= tpot_s
        good += {"prefill": t_ok, "decode": p_ok, "both": t_ok and p_ok}[phase]
    return good / max(len(recs), 1)


def kept_up(sim, phase: str = "both") -> bool:
    """The requests in the system (arrived, not ended; for the prefill phase, not through their first
    token) grew over the second half of the arrivals by at most GROWTH of that half's arrivals, plus
    three standard deviations of a steady count (Poisson: the square root of the count at the half)."""
    recs = list(sim.records.values())
    arrivals = np.sort([r.arrival_s for r in recs])
    done = [r.first_time if phase == "prefill" else r.end_time for r in recs]
    ends = np.sort([math.inf if t is None else t for t in done])
    half, last = arrivals[-1] / 2, arrivals[-1]

    def in_system(t):
        return np.searchsorted(arrivals, t, side="right") - np.searchsorted(ends, t, side="right")

    second = len(arrivals) - np.searchsorted(arrivals, half, side="right")
    return in_system(last) - in_system(half) <= GROWTH * second + 3 * math.sqrt(in_system(half) + 1)


@dataclass(frozen=True)
class Finished:
    """What a search reads of a simulation: its request records."""
    records: dict


def _key(spec, costs, seed: int) -> tuple:
    """What a simulation's records depend on: the spec but its SLO (judged afterwards), the costs, the
    seed; a colocated layout moves no KV, so neither its link nor its transfer settings count."""
    colocated = spec.cluster.mode == "colocated"
    spec = dataclasses.replace(spec, slo=None)
    if colocated:
        spec = dataclasses.replace(spec, transfer=None, hardware=dataclasses.replace(spec.hardware, link_bw=None))
    steps = tuple(sorted((role, _model_key(m, costs)) for role, m in costs.role_step.items()))
    moves = None if colocated else (repr(costs.transfer), costs.export, costs.import_)
    return repr(spec), seed, _model_key(costs.step, costs), steps, moves, costs.dispatch_s, costs.return_s


def _model_key(model, costs) -> str:
    """A step model by its fields where it is a dataclass, else by its kind and the costs' source."""
    if dataclasses.is_dataclass(model) or isinstance(model, FreeStep):
        return repr(model)
    return f"{type(model).__name__}: {costs.source}"


class Search:
    """Bisection of the highest rate meeting the target, each probe one simulation."""

    def __init__(self, cfg: DictConfig, requests_per_worker: int, steps: int, seed: int, costs=None,
                 shared: dict | None = None):
        self.cfg, self.per_worker, self.steps, self.seed = cfg, requests_per_worker, steps, seed
        self.num_sims = 0
        self.shared = shared            # simulations by what they depend on, kept across searches (see _key)
        base = parse(apply_layout(cfg, "colocated-chunked"))
        self.slo, self.target = base.slo, base.slo.attainment_target
        self.costs = costs or costs_for(base)
        floor_ms = 1e3 * (self.costs.step.time(chunk_features(1, 1, [])) + self.costs.step.gap(1))
        if self.slo.tpot_ms < floor_ms:
            raise ConfigError(f"slo.tpot_ms={self.slo.tpot_ms:g} is below the fastest decode step here: "
                              f"{floor_ms:.2f} ms for one sequence with its host gap ({self.costs.source}); "
                              "no layout can meet it (python -m experiments.sim.costs shows the step times)")

    def run(self, spec, rate: float, n: int, costs=None, horizon: bool = True, phase: str = "both"):
        """A simulation at `rate`; with `horizon`, long enough to judge `phase` (the module docstring:
        the latency is to the first token for the prefill phase, to the last otherwise)."""
        if horizon and phase != "decode":           # a decode probe's prompts are free: no TTFT to queue in
            n = min(MAX_REQUESTS, max(n, math.ceil(rate * HORIZON * self.slo.ttft_ms / 1e3)))
        sim = self._simulate(spec, rate, n, costs)
        if horizon and n < MAX_REQUESTS:
            ends = [(r.first_time if phase == "prefill" else r.last_time) - r.arrival_s
                    for r in sim.records.values() if r.status == "ok"]
            want = math.ceil(rate * RUN_LATENCIES * float(np.median(ends))) if ends else n
            if want > n:
                sim = self._simulate(spec, rate, min(MAX_REQUESTS, want), costs)
        return sim

    def _simulate(self, spec, rate: float, n: int, costs):
        w = dataclasses.replace(spec.workload, rate=rate, num_requests=n)
        costs = costs or self.costs
        key = None if self.shared is None else _key(dataclasses.replace(spec, workload=w), costs, self.seed)
        if key in (self.shared or {}):
            return self.shared[key]
        arrivals = build_workload(w, spec.vocab_size, spec.max_model_len, self.seed, token_ids=False)
        self.num_sims += 1
        sim = simulate(spec, arrivals, costs, record_steps=False, keep_tokens=False)
        if key is not None:
            self.shared[key] = Finished(sim.records)
        return sim

    def meets(self, spec, rate: float, n: int, phase: str, costs=None, horizon: bool = True) -> tuple[bool, float]:
        sim = self.run(spec, rate, n, costs, horizon, phase)
        a = attainment(sim, self.slo.ttft_ms / 1e3, self.slo.tpot_ms / 1e3, phase)
        return a >= self.target and (not horizon or kept_up(sim, phase)), a

    def highest(self, spec, per: int, phase: str, guess: float, costs=None) -> tuple[float, float | None]:
        """Highest rate per `per` workers meeting the target (0.0 if even a trickle misses it) and the
        attainment there; `costs` in place of the search's (the decode probe's)."""
        n = self.per_worker * per

        def ok(r):
            return self.meets(spec, r * per, n, phase, costs)

        lo, hi, att = 0.0, guess, None
        good, a = ok(hi)
        if good:
            while good:                       # grow until it fails
                lo, att = hi, a
                hi *= 2
                good, a = ok(hi)
                if hi > 1e6:
                    break
        else:
            while not good and hi > guess / 1024:
                hi /= 2
                good, a = ok(hi)
            if not good:
                return 0.0, a
            lo, att, hi = hi, a, hi * 2
        for _ in range(self.steps):
            mid = (lo + hi) / 2
            good, a = ok(mid)
            if good:
                lo, att = mid, a
            else:
                hi = mid
        return lo, att


def plan(cfg: DictConfig, gpus: int, chunks: list[int], probe: int = 2, requests_per_worker: int = 200,
         steps: int = 7, verify_requests_per_gpu: int = 30, seed: int = 0, costs=None,
         shared: dict | None = None, jobs: int = 1) -> dict:
    """The search of the module docstring; `costs` (experiments/sim/costs.py) replace the hardware
    group's; `shared` keeps simulations for later plans to reuse (one per layout, rate and request
    count, whatever the SLO: plans of the same cells under other SLOs or links; `num_sims` counts
    only this plan's own). The colocated prefill_first search comes first and its rate is every other
    search's first guess; those searches, then the two full-scale checks, are independent of each
    other and run in up to `jobs` processes (serially with `shared`, whose simulations stay in this
    process): the same result for any `jobs`."""
    started = time.perf_counter()
    s = Search(cfg, requests_per_worker, steps, seed, costs, shared)
    jobs = 1 if shared is not None else max(1, jobs)
    out: list[Candidate] = []
    k = max(1, min(probe, gpus))
    colocated = [("colocated-prefill_first", None)] + [("colocated-chunked", c) for c in chunks]
    layout, chunk = colocated[0]
    rate, att = s.highest(_spec(cfg, layout, k, chunk), k, "both", 1.0)
    out.append(Candidate(layout, chunk, rate, "probe", rate * gpus, att, {"probe_gpus": k}))
    guess = rate or 1.0
    searches = [(_spec(cfg, layout, k, chunk), k, "both", None) for layout, chunk in colocated[1:]]
    if gpus >= 2:
        kp = max(1, min(probe, gpus // 2))
        pspec = _spec(cfg, f"{kp}p{kp}d", 2 * kp)
        free = dataclasses.replace(s.costs, role_step=s.costs.role_step | {"prefill": FreeStep()}, export=(0.0, 0.0))
        searches += [(pspec, kp, "prefill", None), (pspec, kp, "decode", free)]
    found = _in_processes(s, [lambda a=a: s.highest(a[0], a[1], a[2], guess, a[3]) for a in searches], jobs)
    for (layout, chunk), (rate, att) in zip(colocated[1:], found):
        out.append(Candidate(layout, chunk, rate, "probe", rate * gpus, att, {"probe_gpus": k}))
    phases = {}
    if gpus >= 2:
        (g_p, a_p), (g_d, a_d) = found[-2:]
        phases = {"prefill_per_worker": g_p, "decode_per_worker": g_d, "probe_workers": kp,
                  "prefill_attainment": a_p, "decode_attainment": a_d}
        for p in range(1, gpus):
            rate = min(p * g_p, (gpus - p) * g_d)
            out.append(Candidate(f"{p}p{gpus - p}d", None, rate / gpus, "phases", rate, None,
                                 {"binding": "prefill" if p * g_p <= (gpus - p) * g_d else "decode"}))
    ranked = sorted(out, key=lambda c: -c.goodput_per_gpu)
    best = ranked[0]
    other = next((c for c in ranked[1:] if c.disaggregated != best.disaggregated), None)
    runner = next((c for c in ranked[1:] if c is not other), None) if other is None else other
    checks = [lambda c=c: verify(s, cfg, c, gpus, verify_requests_per_gpu) for c in (best, runner) if c is not None]
    final = sorted(_in_processes(s, checks, jobs), key=lambda c: -c.goodput_per_gpu)
    return {"candidates": out, "best": final[0], "runner_up": final[1] if len(final) > 1 else None,
            "phases": phases, "num_sims": s.num_sims, "elapsed_s": time.perf_counter() - started,
            "costs": s.costs.source, "gpus": gpus, "target": s.target, "slo": dataclasses.asdict(s.slo),
            "steps": steps}


def _in_processes(s: Search, tasks: list, jobs: int) -> list:
    """Each task's result, in order, run by experiments/analysis/forked.py (in up to `jobs` processes);
    the simulations they made are counted in `s` wherever they ran."""
    def counted(task):
        before = s.num_sims
        return task(), s.num_sims - before

    before = s.num_sims
    done = run_all([lambda t=t: counted(t) for t in tasks], jobs)
    s.num_sims = before + sum(n for _, n in done)
    return [r for r, _ in done]


def verify(s: Search, cfg: DictConfig, c: Candidate, gpus: int, per_gpu: int) -> Candidate:
    """The candidate simulated on all N GPUs at its predicted rate, `per_gpu` requests each (the probes
    ran long enough for queues to show; this checks what only the full cluster has: placement, links,
    the split's balance); while it misses the target there, the rate is bisected down at full scale
    (at most `s.steps` more simulations)."""
    spec = _spec(cfg, c.layout, gpus, c.chunk)
    n = per_gpu * gpus
    rate = c.goodput_per_gpu * gpus
    if rate <= 0:
        return dataclasses.replace(c, how=c.how + "; no rate meets the target")
    good, a = s.meets(spec, rate, n, "both", horizon=False)
    if good:
        return dataclasses.replace(c, how=f"{c.how}; full scale at that rate: {a:.1%}", attainment=a, rate=rate)
    lo, hi, att = 0.0, rate, a
    for _ in range(s.steps):
        mid = (lo + hi) / 2
        ok, a2 = s.meets(spec, mid, n, "both", horizon=False)
        if ok:
            lo, att = mid, a2
        else:
            hi = mid
    return dataclasses.replace(c, goodput_per_gpu=lo / gpus, rate=lo, attainment=att,
                               how=f"full scale (the {c.how} estimate {c.goodput_per_gpu:.3g}/GPU missed: {a:.1%})")


# -- the command ----------------------------------------------------------------------------------
def chunk_sizes(cfg: DictConfig) -> list[int]:
    given = cfg.plan.get("chunks")
    if given:
        return [int(c) for c in given]
    base = cfg.scheduler.get("token_budget") or 256
    return sorted({max(8, int(base * f)) for f in (1, 2)})
