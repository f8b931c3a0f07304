"""The simulated router's records, and the files a run writes from them (docs/run-directory.md).

`Record` is router/journey.py's JourneyRecord (the fields requests.jsonl shows, as the router's), with the token
times kept as floats and numpy arrays (a decode run's steps, shared by its requests): as there, two
times per token, when it was made (its step's end: TTFT, TPOT, ITL) and when it reached the router
(`client_*`); the simulated router's clock is the workers' clock;
`Attempt` is router/journey.py's Journey with the simulator's own fields. `request_row` writes a row exactly as
experiments/serving/serve.py's request_row does; `step_rows` expands every worker's steps, decode runs
included, into steps.jsonl rows.

Without every token's time (`Record.keep` False: large runs, the planner), a record keeps its first
and last times and its count, and `Gaps` (when given) pools the inter-token gaps the metrics need: a
decode run's gaps once for all the requests it advanced (their owners kept, so only completed
requests count), each request's gap into a run or a scheduled step one by one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from experiments.serving.metrics import request_fields
from router.journey import Journey, JourneyRecord


@dataclass(eq=False, slots=True)
class Record(JourneyRecord):
    id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float
    times: list = field(default_factory=list)      # when each token was made: floats and arrays, in order
    client: list = field(default_factory=list)     # when each reached the router, likewise
    num_out: int = 0
    first_time: float | None = None
    last_time: float | None = None
    client_first: float | None = None
    client_last: float | None = None
    index: int = 0                                 # its place in the run's arrivals (Gaps' owner)

    def add_times(self, t, at, n: int) -> None:
        """n tokens made at time(s) t, reaching the router at `at` (floats, or arrays of n)."""
        if n == 0:
            return
        if self.keep:
            self.times.append(t)
            self.client.append(at)
        if isinstance(t, float):
            first, last, cfirst, clast = t, t, at, at
        else:
            first, last, cfirst, clast = float(t[0]), float(t[-1]), float(at[0]), float(at[-1])
        if self.first_time is None:
            self.first_time, self.client_first = first, cfirst
        elif self.sink is not None:
            self.sink.one(self.index, first - self.last_time, cfirst - self.client_last)
        self.last_time, self.client_last = last, clast
        self.num_out += n

    keep = True                                    # a class default; large runs and the planner switch it off
    sink = None                                    # a Gaps pooling the gaps when tokens are not kept

    def token_times(self) -> np.ndarray:
        return _joined(self.times)

    def client_times(self) -> np.ndarray:
        return _joined(self.client)


class Gaps:
    """Inter-token gaps pooled over requests, made (steps' ends) and as the router got them."""

    def __init__(self):
        self.owner: list[int] = []
        self.made: list[float] = []
        self.got: list[float] = []
        self.runs: list[tuple] = []            # (owners [b], made gaps [m - 1], got gaps [m - 1])

    def one(self, owner: int, made: float, got: float) -> None:
        self.owner.append(owner)
        self.made.append(made)
        self.got.append(got)

    def run(self, owners: np.ndarray, ends: np.ndarray, at: np.ndarray) -> None:
        """A decode run's steps ending at `ends` (reaching the router at `at`) advanced these owners."""
        if len(ends) > 1 and len(owners):
            self.runs.append((owners, np.diff(ends), np.diff(at)))

    def pooled(self, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(made gaps, got gaps, weights) of the requests where `ok` (a bool per owner) holds: each
        one-by-one gap of such a request once, each run gap as often as the run advanced such requests."""
        mine = ok[np.asarray(self.owner, dtype=np.int64)]
        made = np.asarray(self.made, dtype=np.float64)[mine]
        got = np.asarray(self.got, dtype=np.float64)[mine]
        if not self.runs:
            return made, got, np.ones(len(made))
        sizes = np.array([len(r[0]) for r in self.runs])
        owners = np.concatenate([r[0] for r in self.runs])
        w = np.bincount(np.repeat(np.arange(len(self.runs)), sizes), weights=ok[owners], minlength=len(self.runs))
        lens = np.array([len(r[1]) for r in self.runs])
        weights = np.concatenate([np.ones(len(made)), np.repeat(w, lens)])
        return (np.concatenate([made] + [r[1] for r in self.runs]),
                np.concatenate([got] + [r[2] for r in self.runs]), weights)


def weighted_percentiles(values: np.ndarray, weights: np.ndarray) -> dict:
    """metrics.percentiles of the sample in which each value appears `weights` times (whole numbers):
    the same mean and linearly interpolated p50, p90, p99, without expanding it."""
    from experiments.serving.metrics import PERCENTILES

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


def _joined(times: list) -> np.ndarray:
    parts = [np.atleast_1d(np.asarray(t, dtype=float)) for t in times]
    return np.concatenate(parts) if parts else np.zeros(0)


@dataclass(eq=False, slots=True)
class Attempt(Journey):
    """router/journey.py's Journey (phases, loads, failure rules: the router's own), with what the
    simulator adds: the requests on its workers and its KV transfer in flight. Its workers are SimWorkers."""

    left: int = field(default=0, kw_only=True)                 # tokens this attempt is asked for
    preq: object = field(default=None, kw_only=True)           # SimRequest on the prefill worker
    dreq: object = field(default=None, kw_only=True)           # SimRequest on the decode worker (handoff)
    kv_due: float | None = field(default=None, kw_only=True)   # when its KV is due in (may move while in flight)
    nbytes: int = field(default=0, kw_only=True)
    live: bool = field(default=True, kw_only=True)
    drop_transfer: bool = field(default=False, kw_only=True)

    @property
    def rec(self) -> Record:
        return self.record

    @property
    def first_token_worker_time(self) -> float | None:
        return self.first_token_time                # the simulated workers share the router's clock


def request_row(rec: Record, t0: float = 0.0) -> dict:
    """One requests.jsonl row, as experiments.serving.serve.request_row writes it (output_ids are
    not simulated: a list of zeros of the output's length)."""
    times, client = rec.token_times(), rec.client_times()
    n = len(times)
    return request_fields(
        rec, t0, [0] * n,
        float(times[0] - rec.arrival_s) if n else None, float(times[-1] - rec.arrival_s) if n else None,
        np.diff(times).tolist() if n >= 2 else [],
        float(client[0] - rec.arrival_s) if len(client) else None,
        float(client[-1] - rec.arrival_s) if len(client) else None,
        np.diff(client).tolist() if len(client) >= 2 else [])


def step_rows(worker: str, log: list):
    """steps.jsonl rows of one worker from its step log: tuples for scheduled steps, dicts of arrays
    for decode runs (experiments/sim/engine.py's run_steps)."""
    index = 0
    for entry in log:
        if isinstance(entry, tuple):
            start, end, p_tok, p_seqs, d_seqs, used, running, waiting, preempted = entry
            yield _row(worker, index, start, end, p_tok, p_seqs, d_seqs, used, running, waiting, preempted)
            index += 1
            continue
        b, waiting = entry["b"], entry["waiting"]
        starts, ends, used = entry["start"].tolist(), entry["end"].tolist(), entry["used"].tolist()
        last = len(starts) - 1
        for i, (s, e, u) in enumerate(zip(starts, ends, used)):
            running = entry["running_last"] if i == last else b
            yield _row(worker, index, s, e, 0, 0, b, int(u), running, waiting, 0)
            index += 1


def _row(worker, index, start, end, p_tok, p_seqs, d_seqs, used, running, waiting, preempted) -> dict:
    return {"worker": worker, "step": index, "num_prefill_tokens": p_tok, "num_prefill_seqs": p_seqs,
            "num_decode_seqs": d_seqs, "num_tokens": p_tok + d_seqs, "num_blocks_used": used,
            "num_running": running, "num_waiting": waiting, "num_preempted": preempted,
            "prepare_s": 0.0, "forward_s": end - start, "sample_s": 0.0, "start_s": start, "end_s": end}
