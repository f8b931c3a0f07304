"""Serving noise: seeded draws from the distributions a profile's calibration run measured.

On a machine shared with other work, a step's time varies from step to step, and so do the host gap
between steps and the latency of the router's messages; tails (ITL p99, TPOT p90) are made of that
variation. A calibrated profile keeps, for each, its quantiles (0% to 100%, evenly spaced): a step's
measured / predicted time (decode-only and prefill steps apart, each normalised to median 1, so the
median step is the model's), the busy host gap (after a step that made tokens, and after one that made
none), the return latency (step end to the router), the dispatch latency and a KV handoff's
measured / fitted time (experiments/analysis/calibrate.py's handoff). `Noise` draws from them
by inverse transform, linear between quantiles, with its own seeded generator, so a simulation is
deterministic for a seed (a handoff's draws come from a stream of their own, so a handoff table takes
no draw from the others; the workers still share one stream, in event order, so anything that moves
one worker's steps in time hands the others different draws). As many quantiles as values measured (up to MAX_QUANTILES): with 101 the
top percent of draws spread evenly up to the largest value measured, so one 32 ms gap among 1,587
became 1% of all gaps averaging 17 ms, and the table's mean gap (0.32 ms) was 2.4x its median.
Without tables (a datasheet GPU, or noise=false) every draw is the table-free value: factor 1, the
model's gap, the Costs' latencies.

Drift. A worker's slowness is not fresh each step: on a shared machine a slow spell lasts a few tens
of steps (the calibration measured the residuals' rank correlation k decode steps apart at 0.23, 0.25,
0.25, 0.19, 0.14, 0.15, 0.11, 0.09 for k = 1..8 here). With a `drift` fit ({weight, tau_s}: experiments/analysis/calibrate.py) a
step's factor is drawn through a latent normal z = sqrt(weight) s + sqrt(1 - weight) e, with e fresh
and s, per worker, decaying to a fresh draw with time constant tau_s (an Ornstein-Uhlenbeck process
sampled at the steps' starts), then read off the step kind's quantile table at Phi(z): each draw
keeps the table's distribution, and draws close in time on one worker are correlated as measured. It
is what makes a request's TPOT (a mean over its steps) vary as much as a real one's.

The router receives a worker's steps in order (one poll stream per worker), so a token's arrival is
never before the previous step's (`Noise.deliver`): a late message delays the steps behind it, which
then arrive together, as they do in a real run.
"""
from __future__ import annotations

import math

import numpy as np

KINDS = ("decode", "prefill", "gap", "gap_quiet", "return", "dispatch", "handoff")
OWN_STREAM = ("handoff",)   # kinds that draw from a stream of their own (added after the others)
MAX_QUANTILES = 2001


STEP_KINDS = ("decode", "prefill")
Z_GRID = np.linspace(-5.0, 5.0, 2001)
PHI_GRID = np.array([0.5 * (1.0 + math.erf(z / math.sqrt(2.0))) for z in Z_GRID])
BLOCK = 64                  # steps of a run whose latent drift is solved at once


class Noise:
    def __init__(self, tables: dict | None, seed: int = 0, drift: dict | None = None):
        self.tables = {k: [float(x) for x in v] for k, v in (tables or {}).items() if k in KINDS and v}
        self._arrays = {k: np.asarray(v) for k, v in self.tables.items()}
        self.rng = np.random.default_rng([seed, 0x5EED])
        self._own = {k: np.random.default_rng([seed, 0x5EED, i + 1]) for i, k in enumerate(OWN_STREAM)}
        self.on = bool(self.tables)
        w, tau = (drift or {}).get("weight", 0.0), (drift or {}).get("tau_s", 0.0)
        self.drift = (w, tau) if self.on and w > 0 and tau > 0 else None
        # each step kind's table read at Phi(z), on a grid of z
        self._by_z = {k: np.interp(PHI_GRID * (len(q) - 1), np.arange(len(q)), q)
                      for k, q in self._arrays.items() if k in STEP_KINDS}
        self._latent: dict = {}          # worker -> (time, s) of its latest step draw

    def step_factor(self, kind: str, who, t: float) -> float:
        """A step's noise factor for worker `who` at time t (with drift: correlated with its recent ones)."""
        if self.drift is None or kind not in self._by_z:
            return self.factor(kind)
        return float(self.step_factors(kind, who, np.array([t]))[0])

    def step_factors(self, kind: str, who, starts: np.ndarray) -> np.ndarray | float:
        """Noise factors of a worker's steps starting at `starts` (increasing)."""
        if self.drift is None or kind not in self._by_z:
            return self.factors(kind, len(starts))
        w, tau = self.drift
        n = len(starts)
        t0, s0 = self._latent.get(who, (-math.inf, 0.0))
        eps, fresh = self.rng.standard_normal(n), self.rng.standard_normal(n)
        # per step, in [0, 1]; a step before the latest drawn (a cut run drew ahead) takes its state
        decay = np.exp(-np.maximum(np.diff(np.concatenate(([t0], starts))), 0.0) / tau)
        s = np.empty(n)
        for i in range(0, n, BLOCK):          # s_j = decay_j s_{j-1} + sqrt(1 - decay_j^2) eps_j
            a = decay[i:i + BLOCK]
            logs = np.cumsum(np.log(np.maximum(a, 1e-300)))
            m = np.tril(np.exp(np.minimum(logs[:, None] - logs[None, :], 0.0)))
            s[i:i + len(a)] = m @ (np.sqrt(1.0 - a * a) * eps[i:i + BLOCK]) + np.exp(logs) * s0
            s0 = s[i + len(a) - 1]
        self._latent[who] = (float(starts[-1]), float(s0))
        z = math.sqrt(w) * s + math.sqrt(1.0 - w) * fresh
        return np.interp(z, Z_GRID, self._by_z[kind])

    def _one(self, kind: str) -> float | None:
        q = self.tables.get(kind)
        if q is None:
            return None
        x = self._own.get(kind, self.rng).random() * (len(q) - 1)
        i = int(x)
        return q[i] if i >= len(q) - 1 else q[i] + (q[i + 1] - q[i]) * (x - i)

    def _many(self, kind: str, n: int) -> np.ndarray | None:
        q = self._arrays.get(kind)
        if q is None:
            return None
        return np.interp(self._own.get(kind, self.rng).random(n) * (len(q) - 1), np.arange(len(q)), q)

    def factor(self, kind: str) -> float:
        f = self._one(kind)
        return 1.0 if f is None else f

    def factors(self, kind: str, n: int) -> np.ndarray | float:
        f = self._many(kind, n)
        return 1.0 if f is None else f

    def latency(self, kind: str, default: float) -> float:
        x = self._one(kind)
        return default if x is None else x

    def latencies(self, kind: str, default: float, n: int) -> np.ndarray | float:
        x = self._many(kind, n)
        return default if x is None else x


def quantiles(values, normalise: bool = False) -> list[float]:
    """Evenly spaced quantiles (0%..100%) of `values`, one per value up to MAX_QUANTILES (so the sorted
    values themselves, when fewer); divided by their median when `normalise`."""
    a = np.asarray(list(values), dtype=float)
    q = np.percentile(a, np.linspace(0, 100, min(max(a.size, 2), MAX_QUANTILES)))
    if normalise:
        q = q / np.median(a)
    return [float(x) for x in q]
