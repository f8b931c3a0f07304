"""The simulated router's records, and the files a run writes from them (docs/run-directory.md).

`Record` is router/journey.py's JourneyRecord (the fields requests.jsonl shows, as the router's), with the token
times kept as floats and lists (a decode run's steps, shared by its requests): as there, two
times per token, when it was made (its step's end: TTFT, TPOT, ITL) and when it reached the router
(`client_*`); the simulated router's clock is the workers' clock;
`Attempt` is router/journey.py's Journey with the simulator's own fields. `request_row` writes a row exactly as
experiments/serving/serve.py's request_row does; `step_rows` expands every worker's steps, decode runs
included, into steps.jsonl rows.

Without every token's time (`Record.keep` False: large runs, the planner), a record keeps its first
and last times and its count, and `Gaps` (when given) pools the inter-token gaps the metrics need: a
decode run's gaps once for all the requests it advanced (their owners kept, so only completed
requests count), each request's gap into a scheduled step or into its first run of a batch one by one.

`Ledger` holds the records of a worker's decode batch while its runs go on: every member gains the
same tokens at the same times, so a record is brought up to date only when it is read.
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
    times: list = field(default_factory=list)      # when each token was made: floats and lists, in order
    client: list = field(default_factory=list)     # when each reached the router, likewise
    num_out: int = 0
    first_time: float | None = None
    last_time: float | None = None
    client_first: float | None = None
    client_last: float | None = None
    index: int = 0                                 # its place in the run's arrivals (Gaps' owner)

    def add_times(self, t, at, n: int) -> None:
        """n tokens made at time(s) t, reaching the router at `at` (floats, or lists of n)."""
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
        self.runs: list[tuple] = []            # (owners [b], step ends [m], router times [m], lead (made, got))

    def one(self, owner: int, made: float, got: float) -> None:
        self.owner.append(owner)
        self.made.append(made)
        self.got.append(got)

    def run(self, owners: list, ends: list, at: list, lead: tuple[float, float] = (np.nan, np.nan)) -> None:
        """A decode run's steps ending at `ends` (reaching the router at `at`) advanced these owners,
        whose previous tokens were all made at lead[0] and got at lead[1] (NaN: none in common).
        Kept as arrays: a large run keeps many."""
        if len(owners) and (len(ends) > 1 or lead[0] == lead[0]):
            self.runs.append((np.array(owners, dtype=np.int64), np.array(ends), np.array(at), lead))

    def pooled(self, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(made gaps, got gaps, weights) of the requests where `ok` (a bool per owner) holds: each
        one-by-one gap of such a request once, each run gap as often as the run advanced such requests."""
        mine = ok[np.asarray(self.owner, dtype=np.int64)]
        made = np.asarray(self.made, dtype=np.float64)[mine]
        got = np.asarray(self.got, dtype=np.float64)[mine]
        runs = self.runs
        if not runs:
            return made, got, np.ones(len(made))
        sizes = np.array([len(r[0]) for r in runs])
        owners = np.concatenate([r[0] for r in runs])
        w = np.bincount(np.repeat(np.arange(len(runs)), sizes), weights=ok[owners], minlength=len(runs))
        ends, at = np.concatenate([r[1] for r in runs]), np.concatenate([r[2] for r in runs])
        lens = np.array([len(r[1]) for r in runs])
        first = np.cumsum(lens) - lens                    # each run's first step in ends
        inner = np.ones(max(len(ends) - 1, 0), dtype=bool)
        inner[first[1:] - 1] = False                      # a gap across two runs is no one's
        lead = np.array([r[3] for r in runs], dtype=np.float64)
        has = ~np.isnan(lead[:, 0])
        return (np.concatenate([made, np.diff(ends)[inner], ends[first[has]] - lead[has, 0]]),
                np.concatenate([got, np.diff(at)[inner], at[first[has]] - lead[has, 1]]),
                np.concatenate([np.ones(len(made)), np.repeat(w, lens - 1), w[has]]))


class Ledger:
    """The records of a worker's decode batch (experiments/sim/engine.py's Batch), member for member.

    Every member of a decode run gains the same tokens at the same times, so a run appends itself to
    the history (its steps, last times, and its token times when kept) and a member's record is
    brought up to date from there only when it is read (`flush`): when its attempt ends or is dropped,
    and when the batch settles. A member's gap into a run is the run's own first gap (its previous
    token ended the previous run), so a run's gaps are pooled once for all its continuing members.
    `owner` is the record's index, -1 once its attempt is no longer live (its tokens are not recorded)."""

    __slots__ = ("n", "owner", "since", "dead", "behind", "steps", "made", "got", "parts")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.n = 0
        self.owner, self.since = [], []       # since: history runs the record has
        self.dead = 0                         # members whose attempt is no longer live (owner -1)
        self.behind = False                   # some member's record lacks a run of the history
        self.steps = [0]                      # steps before each run of the history, and after the last
        self.made, self.got = [], []          # each run's last step end and when the router got it
        self.parts = []                       # each run's (ends, router times) when every token is kept

    def join(self, owners: list[int]) -> None:
        """Members whose records are up to date with the history so far."""
        self.owner = self.owner + owners
        self.since = self.since + [len(self.made)] * len(owners)
        self.n += len(owners)
        self.dead += owners.count(-1)

    def run(self, ends: np.ndarray, at: np.ndarray, m: int, continuing: int, gaps: "Gaps | None") -> None:
        """A decode run of m steps that advanced the first `continuing` members with the rest."""
        if gaps is not None and continuing and self.made:
            gaps.run([o for o in self.owner[:continuing] if o >= 0], ends, at, (self.made[-1], self.got[-1]))
        self.behind = self.behind or continuing > 0
        self.steps.append(self.steps[-1] + m)
        self.made.append(ends[-1])
        self.got.append(at[-1])
        if Record.keep:
            self.parts.append((ends, at))

    def flush(self, i: int, att: "Attempt | None") -> None:
        """Bring member i's record (and its attempt's token count) up to date with the history."""
        if i >= self.n:
            return
        j0, j = self.since[i], len(self.made)
        if self.owner[i] >= 0 and j > j0 and att is not None:
            self._bring(att, j0, j)
        self.since[i] = j

    def _bring(self, att: "Attempt", j0: int, j: int) -> None:
        """The tokens of history runs j0 .. j - 1 into att's record and count."""
        rec, n = att.record, self.steps[j] - self.steps[j0]
        rec.num_out += n
        att.num_tokens += n
        rec.last_time, rec.client_last = self.made[-1], self.got[-1]
        if Record.keep:
            rec.times.extend(p[0] for p in self.parts[j0:j])
            rec.client.extend(p[1] for p in self.parts[j0:j])

    def flush_all(self, reqs: list) -> None:
        """flush every member (requests `reqs`, in the batch's order), then forget them."""
        j = len(self.made)
        if self.behind:
            for req, owner, j0 in zip(reqs, self.owner, self.since):
                if owner >= 0 and j > j0 and req.attempt is not None:
                    self._bring(req.attempt, j0, j)
        self.clear()

    def detach(self, i: int) -> None:
        """Member i's attempt is over: its later tokens are not its record's."""
        if i < self.n and self.owner[i] >= 0:
            self.owner[i] = -1
            self.dead += 1

    def drop(self, i: int) -> None:
        """Member i leaves (an abort), if it has an entry yet."""
        if i < self.n:
            self.keep([j != i for j in range(self.n)])

    def keep(self, mask: list) -> None:
        """Only the members where `mask` holds stay (flushed first by the caller where it matters)."""
        self.owner = [x for x, k in zip(self.owner, mask) if k]
        self.since = [x for x, k in zip(self.since, mask) if k]
        self.n = len(self.owner)
        if not self.n:
            self.clear()
        elif self.dead:
            self.dead = self.owner.count(-1)


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
    for runs (experiments/sim/runs.py's logged_steps: decode-only, or beside a prompt's chunks)."""
    index = 0
    for entry in log:
        if isinstance(entry, tuple):
            start, end, p_tok, p_seqs, d_seqs, used, running, waiting, preempted = entry
            yield _row(worker, index, start, end, p_tok, p_seqs, d_seqs, used, running, waiting, preempted)
            index += 1
            continue
        b, waiting, prefill = entry["b"], entry["waiting"], entry["prefill"]
        starts, ends, used = entry["start"].tolist(), entry["end"].tolist(), entry["used"].tolist()
        tokens = [0] * len(starts) if prefill is None else prefill.tolist()
        seqs = 0 if prefill is None else 1                 # a chunk run's prompt runs beside the b decodes
        last = len(starts) - 1
        for i, (s, e, u, p) in enumerate(zip(starts, ends, used, tokens)):
            running = entry["running_last"] if i == last else b + seqs
            yield _row(worker, index, s, e, p, seqs, b, int(u), running, waiting, 0)
            index += 1


def _row(worker, index, start, end, p_tok, p_seqs, d_seqs, used, running, waiting, preempted) -> dict:
    return {"worker": worker, "step": index, "num_prefill_tokens": p_tok, "num_prefill_seqs": p_seqs,
            "num_decode_seqs": d_seqs, "num_tokens": p_tok + d_seqs, "num_blocks_used": used,
            "num_running": running, "num_waiting": waiting, "num_preempted": preempted,
            "prepare_s": 0.0, "forward_s": end - start, "sample_s": 0.0, "start_s": start, "end_s": end}
