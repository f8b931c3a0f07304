"""The simulated router's records, and the files a run writes from them (docs/run-directory.md).

`Record` is router/journey.py's JourneyRecord (the fields requests.jsonl shows, as the router's), with the token
times kept as floats and numpy arrays (a decode run's steps, shared by its requests): as there, two
times per token, when it was made (its step's end: TTFT, TPOT, ITL) and when it reached the router
(`client_*`); the simulated router's clock is the workers' clock;
`Attempt` is router/journey.py's Journey with the simulator's own fields. `request_row` writes a row exactly as
experiments/serving/serve.py's request_row does; `step_rows` expands every worker's steps, decode runs
included, into steps.jsonl rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from experiments.serving.metrics import request_fields
from router.journey import Journey, JourneyRecord


@dataclass(eq=False)
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

    def add_times(self, t, at, n: int) -> None:
        """n tokens made at time(s) t, reaching the router at `at` (floats, or arrays of n)."""
        if n == 0:
            return
        if self.keep:
            self.times.append(t)
            self.client.append(at)
        first = t if isinstance(t, float) else float(t[0])
        if self.first_time is None:
            self.first_time = first
        self.last_time = t if isinstance(t, float) else float(t[-1])
        self.num_out += n

    keep = True                                    # a class default; the planner switches it off

    def token_times(self) -> np.ndarray:
        return _joined(self.times)

    def client_times(self) -> np.ndarray:
        return _joined(self.client)


def _joined(times: list) -> np.ndarray:
    parts = [np.atleast_1d(np.asarray(t, dtype=float)) for t in times]
    return np.concatenate(parts) if parts else np.zeros(0)


@dataclass(eq=False)
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
