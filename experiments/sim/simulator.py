"""The discrete-event simulator: a virtual clock, a SimWorker per GPU, the router's own rules.

Events sit in a heap ordered by (time, sequence number); each is a handler and its arguments. The
router side follows router/router.py: admission by workers/request.py's limits and
router/placement.never_fits, placement by router/placement.plan with router/policies.py's classes
over loads kept as the router keeps them (outstanding prompt tokens, running requests, KV tokens),
retries of a request whose worker died or whose KV transfer was lost (its prompt plus the tokens
already streamed, up to router.max_retries; two crashes and it fails), request timeouts. Faults:
fault.kill_worker at fault.kill_after_s, fault.timeout_transfer_of (that handoff's KV is never
sent; the router retries it after transfer.timeout_s).
KV handoffs (sending, link contention, their arrival) are in experiments/sim/handoff.py, each
worker's step loop (inbox, steps and decode runs, contention on its host) in experiments/sim/steps.py.

Token times are as router/records.py keeps them: when the step that made a token ended (the
simulated workers share the router's clock), and when it reached the router (`client_*`, `return_s`
later, never before the worker's previous step).

Simplifications, each small next to a step: the router's load counters change when a worker's step
ends, not `return_s` later when its tokens reach the router; KV
tokens of a decode run in flight count as the run's steps end; a streamed prefill pays no export
time after its step (its parts were exported while it ran).
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from cluster.transfer.base import TransferConfig
from experiments.sim.costs import Costs
from experiments.sim.engine import SimEngine
from experiments.sim.request import sim_request
from experiments.sim.handoff import KVTransfers
from experiments.sim.records import Attempt, Gaps, Record
from experiments.sim.steps import WorkerSteps
from experiments.sim.transfer import STREAMS, Links
from experiments.sim.worker import Handle, HostLoad, SimWorker, nodes_of
from experiments.workload import many_objects
from router.config import FaultConfig, RouterConfig
from router.journey import Journeys, why_not_retry
from router.load_index import LoadIndex
from router.placement import never_fits, plan, pool_sizes
from router.policies import DECODE_POLICIES, PREFILL_POLICIES, WorkerLoad
from workers.config import EngineConfig
from workers.request import Status


@dataclass
class SimConfig:
    """The cluster to simulate: one role per GPU, each role's engine config and KV pool."""

    roles: list[str]
    engines: dict[str, EngineConfig]
    num_blocks: dict[str, int]
    kv_bytes_per_token: int
    num_layers: int
    max_model_len: int
    router: RouterConfig = field(default_factory=RouterConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    placement: str = "pack"
    gpus_per_node: int = 0                # 0: every worker on one host (a local run)
    stream: str = "off"                   # KV streaming: off | layer | chunk
    fast_forward: bool = True             # advance runs of decode-only steps in one event
    record_steps: bool = True
    keep_tokens: bool = True              # every token's time (requests.jsonl); False: first, last, count
    pool_gaps: bool = False               # without every token's time, pool the inter-token gaps (Gaps)

    def __post_init__(self):
        if self.stream not in STREAMS:
            raise ValueError(f"stream={self.stream!r}: choose one of {list(STREAMS)}")

    @property
    def mode(self) -> str:
        return "colocated" if "colocated" in self.roles else "disaggregated"


@dataclass
class Arrival:
    id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int


class Simulator(KVTransfers, WorkerSteps):
    def __init__(self, cfg: SimConfig, costs: Costs):
        self.cfg, self.costs = cfg, costs
        self.mode = cfg.mode
        self.heap: list = []
        self._seq = itertools.count()
        self._deadlines: deque = deque()        # (sequence number, record) of arrived requests, oldest first:
                                                # while it holds any, the first one's timeout is in the heap
        self.now = 0.0
        counts: dict[str, int] = {}
        self.workers: list[SimWorker] = []
        nodes = nodes_of(cfg.roles, cfg.gpus_per_node, cfg.placement)
        for rank, role in enumerate(cfg.roles):
            index = counts.get(role, 0)
            counts[role] = index + 1
            ecfg, blocks = cfg.engines[role], cfg.num_blocks[role]
            info = {"num_kv_blocks": blocks, "block_size": ecfg.block_size, "host": f"node{nodes[rank]}",
                    "kv_bytes_per_token": cfg.kv_bytes_per_token, "num_layers": cfg.num_layers,
                    "max_model_len": cfg.max_model_len}
            engine = SimEngine(ecfg, blocks, costs.step_for(role), cfg.fast_forward, rank)
            self.workers.append(SimWorker(Handle(rank, role, index, info), engine, nodes[rank], cfg.record_steps))
        self.handles = [w.handle for w in self.workers]
        self.hosts = HostLoad(self.workers, any(getattr(w.engine.model, "shared_host", None) for w in self.workers))
        self.loads = {w.rank: WorkerLoad(w.name, w.handle.info["num_kv_blocks"] * w.handle.info["block_size"])
                      for w in self.workers}
        self.index = LoadIndex(self.handles, self.loads)    # None: plan() looks at every worker
        self.sizes = pool_sizes(self.handles)
        self.prefill_policy = PREFILL_POLICIES[cfg.router.prefill_policy]()
        self.decode_policy = DECODE_POLICIES[cfg.router.decode_policy]()
        self.pack = cfg.placement in ("pack", "strict_pack")
        self.links = Links()
        self.in_run: set[SimWorker] = set()       # workers with a decode run in flight
        self.records: dict[str, Record] = {}
        self.journeys = Journeys(self.loads)        # the attempts in flight, by id()
        self._num_attempts = self._num_handoffs = 0
        self.notes: list[str] = []
        self.num_events = 0
        Record.keep = cfg.keep_tokens
        self.gaps = Gaps() if cfg.pool_gaps and not cfg.keep_tokens else None
        Record.sink = self.gaps

    # -- the loop ---------------------------------------------------------------------------------
    def push(self, t: float, fn, *args) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), fn, args))

    def run(self, arrivals) -> list[Record]:
        """Serve `arrivals` (objects with id, arrival_s, prompt_len or prompt_ids, max_tokens) to the end."""
        with many_objects():                   # a million records made and kept
            self._queue(arrivals)
            heap, pop = self.heap, heapq.heappop
            while heap:
                t, _, fn, args = pop(heap)
                self.now = t
                fn(*args)
                self.num_events += 1
        for w in self.workers:
            self._settle(w)
        return list(self.records.values())

    def _queue(self, arrivals) -> None:
        """A record per arrival, the first arrival and the fault in the heap."""
        recs = []
        for a in arrivals:
            n = getattr(a, "prompt_len", None) or getattr(a, "num_prompt_tokens", None) or len(a.prompt_ids)
            rec = Record(str(a.id), n, a.max_tokens, float(a.arrival_s))
            if rec.id in self.records:
                raise ValueError(f"request id {rec.id!r} is used twice")
            self.records[rec.id] = rec
            recs.append(rec)
        recs.sort(key=lambda r: r.arrival_s)           # stable: equal times keep their order
        for i, rec in enumerate(recs):
            rec.index = i
        self._pending = iter(recs)                     # each arrival queues the next: the heap holds one
        self._next_arrival()
        f = self.cfg.fault
        if f.kill_worker:
            role, _, index = f.kill_worker.partition(":")
            victim = next((w for w in self.workers if w.handle.role == role and w.handle.index == int(index)), None)
            if victim is None:
                raise ValueError(f"fault.kill_worker={f.kill_worker}: no such worker in this layout")
            self.push(f.kill_after_s, self._kill, victim)

    # -- router: admission, dispatch, endings -------------------------------------------------------
    def _next_arrival(self) -> None:
        rec = next(self._pending, None)
        if rec is not None:
            self.push(rec.arrival_s, self._arrive, rec)

    def _arrive(self, rec: Record) -> None:
        self._next_arrival()
        idle = not self._deadlines
        self._deadlines.append((next(self._seq), rec))
        if idle:
            self._next_deadline()
        n, mt, limit = rec.prompt_len, rec.max_tokens, self.cfg.max_model_len
        why = None
        if n < 1 or mt < 1:
            why = f"prompt ({n}) and max_tokens ({mt}) must be >= 1"
        elif n + mt > limit:
            why = f"prompt ({n}) + max_tokens ({mt}) exceeds max_model_len={limit}"
        else:
            t = self.cfg.transfer
            fits = never_fits(self.mode, self.handles, n, mt, self.cfg.router.conditional_threshold,
                              t.max_frame_bytes, t.max_pending_bytes, self.sizes)
            why = None if fits is None else f"can never fit: {fits}"
        if why is not None:
            return self._fail(rec, f"rejected: {why}")
        self._dispatch(rec)

    def _dispatch(self, rec: Record) -> None:
        n, left = rec.prompt_len + rec.num_out, rec.max_tokens - rec.num_out
        if self.mode == "disaggregated":
            self._refresh_kv()
        chosen = plan(self.mode, self.handles, self.loads, self.prefill_policy, self.decode_policy, n, n + left,
                      self.cfg.router.conditional_threshold, self.pack, self.index)
        if isinstance(chosen, str):
            return self._fail(rec, chosen)
        if chosen.note:
            rec.note = chosen.note
            if chosen.note not in self.notes:
                self.notes.append(chosen.note)
        p, d = self.workers[chosen.prefill.rank], self.workers[chosen.decode.rank]
        rec.attempts += 1
        self._num_attempts += 1
        att = Attempt(rec, chosen.kind, p, d, n, self.now, left=left)
        self.journeys.open(id(att), att)
        rec.prefill_worker, rec.decode_worker = p.name, d.name
        if att.kind == "handoff":
            self._num_handoffs += 1
            att.drop_transfer = rec.attempts == 1 and self._num_handoffs == self.cfg.fault.timeout_transfer_of
            att.nbytes = self.cfg.kv_bytes_per_token * n
            rec.injected_fault = rec.injected_fault or att.drop_transfer
        att.preq = sim_request(f"{rec.id}#{rec.attempts}", n, left, self.now, hand_off=att.kind == "handoff")
        att.preq.attempt = att
        self.push(self.now + self.costs.dispatch_s, self._deliver, p, ("submit", att.preq))

    def _refresh_kv(self) -> None:
        """Count the KV tokens of decode runs in flight, as far as their steps have ended: as a scheduled
        step's tokens count when it ends (the simplification in the module docstring), so a run advanced in
        one event puts the loads the router places by where scheduling every step would. The clock only
        moves forward, so a run's steps counted only grow: each run keeps how many (`run_seen`) and walks
        on from there, and a load changes only when that count does."""
        now = self.now
        loads = self.loads
        for w in self.in_run:
            run = w.run
            if run is None:
                continue
            j, m, ends = w.run_seen, w.run_steps, run.ends
            if j >= m or ends[j] > now:
                continue
            while j < m and ends[j] <= now:
                j += 1
            loads[w.rank].kv_tokens += w.run_live * (j - w.run_seen)
            w.run_seen = j

    def _drop(self, att: Attempt, abort: bool = True) -> None:
        if not att.live:
            return
        for w, req in ((att.decode, att.dreq), (att.prefill, att.preq)):
            if req is not None:
                self._detach(w, req)
        att.live = False
        self.journeys.close(id(att))
        if abort:
            for w, req in ((att.prefill, att.preq), (att.decode, att.dreq)):
                if req is not None and w.alive:
                    self.push(self.now + self.costs.dispatch_s, self._deliver, w, ("abort", req))

    def _finish(self, att: Attempt, reason: str) -> None:
        self._drop(att, abort=False)
        rec = att.record
        rec.finish(reason, rec.last_time)
        for req in (att.preq, att.dreq):            # a request its engine is done with drops its attempt,
            if req is not None and req.status is Status.FINISHED:   # so the pair is freed at once, not
                req.attempt = None                  # left in a cycle for the collector to find

    def _fail(self, rec: Record, reason: str) -> None:
        if rec.done:
            return
        rec.fail(reason, self.now)

    def _retry(self, att: Attempt, reason: str, crashed: bool = False) -> None:
        if not att.live:
            return
        self._drop(att)
        rec = att.record
        final = why_not_retry(rec, reason, crashed, self.cfg.router.max_retries)
        if final is not None:
            return self._fail(rec, final)
        self._dispatch(rec)

    def _next_deadline(self) -> None:
        """Queue the timeout of the oldest arrived request not yet done. Deadlines come in arrival order,
        so one timeout event at a time is enough: each queues the next when it fires, with the sequence
        number its request took at arrival, so events keep the order one event per request would give.
        (A million requests' timeouts in the heap made every push and pop walk a heap of a million.)"""
        dl = self._deadlines
        while dl and dl[0][1].done:
            dl.popleft()
        if dl:
            seq, rec = dl[0]
            heapq.heappush(self.heap, (rec.arrival_s + self.cfg.router.request_timeout_s, seq, self._timeout, (rec,)))

    def _timeout(self, rec: Record) -> None:
        self._deadlines.popleft()
        if not rec.done:
            for att in self.journeys.of(rec):
                self._drop(att)
            self._fail(rec, f"not finished within router.request_timeout_s={self.cfg.router.request_timeout_s:g}")
        self._next_deadline()

    def _on_token(self, req, reason, start_of_first: float | None, end: float, at: float) -> None:
        """One token of `req` made in a step ending at `end` (worker clock), reaching the router at `at`."""
        att = req.attempt
        if att is None or not att.live:
            return
        att.record.add_times(end, at, 1)
        if reason == "handoff":
            att.record.prefill_end = end                   # what the real router reads off the KV's import
        if self.journeys.token(att, end, at, req.first_scheduled_time, reason):
            self._finish(att, reason)

    # -- faults -------------------------------------------------------------------------------------
    def _kill(self, w: SimWorker) -> None:
        if w.state == "run":                        # the steps of its run that ended made their tokens
            m = w.steps_ended(self.now)
            if m:
                w.run_steps = m
                self._run_end(w, w.version)
        w.handle.alive = False
        w.version += 1
        w.state, w.run, w.sched = "dead", None, None
        self._busy(w, False)
        self.in_run.discard(w)
        w.inbox.clear()
        self.push(self.now + self.costs.return_s, self._on_dead, w)

    def _on_dead(self, w: SimWorker) -> None:
        reason = f"worker {w.name} died (ActorDiedError)"
        for att in self.journeys.lost_with(w):
            att.record.injected_fault = True
            self._retry(att, reason, crashed=False)
