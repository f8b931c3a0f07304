"""A request's journey: admission, choice of workers, the handoff, the token stream, retries.

Every worker pushes its events (tokens, steps, transfers, failures) to the router's ZeroMQ socket, which
one thread reads; one thread per worker long-polls it as a liveness check. Every token carries two
times on the router's clock: when it was
made (the end of the worker's step that sampled it, converted from the worker's clock with an offset
measured by min-RTT probes at start and every router.clock_sync_s, router/clock.py), and when it
reached the router (what a client of the router sees; tokens of several steps that come back in one
poll share it). TTFT, ITL and the other durations use the first; `arrival_times` keep the second.
A watchdog thread times out lost transfers and overdue requests (the threads: router/threads.py;
what the workers report, tokens and transfers and deaths: router/worker_events.py).
All state is guarded by one lock.

Each try of a request is an *attempt* with its own id on the workers ("<router>:<n>"); events of a
superseded attempt are ignored. A retry re-prefills the prompt plus the tokens already streamed
and asks for the rest, so the client's stream continues without repeats.

What fails and what is retried (router/journey.py, whose rules the simulator shares):
- rejected at admission, before any worker: a request breaking the rules of workers/request.py, or
  one no worker's pool or the KV wire's limits could ever hold (placement.never_fits);
- failed, not retried: a request a worker rejected or failed while serving it (its own error is the
  cause, and would follow it to the next worker);
- retried (up to router.max_retries): its worker died, or its KV transfer failed or was refused. A
  worker that dies on its own (not by fault injection) may have been killed by one of its requests:
  a request on a second such worker is failed, not retried again, so a poison cannot cascade. A worker
  lost with its node (router/threads.py: went_with_its_node) is not counted: a node takes all its
  workers at once.
- A worker that does not answer its poll within poll_timeout_s + router.liveness_timeout_s (frozen)
  counts as dead, and is killed so that it cannot come back half-alive.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
import uuid

from cluster.pool import WorkerHandle, WorkerPool
from cluster.transfer.base import TransferConfig
from router.attempt import Attempt
from router.clock import WorkerClock
from router.config import FaultConfig, RouterConfig
from router.journey import Journeys, why_not_retry
from router.load_index import LoadIndex
from router.placement import never_fits, plan
from router.policies import DECODE_POLICIES, PREFILL_POLICIES, WorkerLoad
from router.records import RequestRecord, StreamUpdate
from router.threads import RouterThreads
from router.worker_events import RouterEvents
from workers.request import InvalidRequest, SamplingParams, validate_request


log = logging.getLogger(__name__)


class Router(RouterThreads, RouterEvents):
    def __init__(self, pool: WorkerPool, cfg: RouterConfig = RouterConfig(), transfer: TransferConfig = TransferConfig(),
                 faults: FaultConfig = FaultConfig(), clock=time.time):
        self.pool, self.cfg, self.transfer, self.faults, self.clock = pool, cfg, transfer, faults, clock
        self.mode = pool.cfg.mode
        info = pool.workers[0].info
        self.vocab_size, self.max_model_len = info["vocab_size"], min(w.info["max_model_len"] for w in pool.workers)
        self.loads = {w.rank: WorkerLoad(w.name, w.info["num_kv_blocks"] * w.info["block_size"]) for w in pool.workers}
        self.index = LoadIndex(pool.workers, self.loads)      # placement without looking at every worker
        self.journeys = Journeys(self.loads)                 # the attempts in flight, by attempt id
        self.late_sent: dict[str, Attempt] = {}             # finished handoffs whose sender has not reported
        self.prefill_policy = PREFILL_POLICIES[cfg.prefill_policy]()
        self.decode_policy = DECODE_POLICIES[cfg.decode_policy]()
        self.records: dict[str, RequestRecord] = {}
        self._params: dict[str, SamplingParams] = {}
        self._num_handoffs = 0
        self.transport_errors: list[str] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._victim = None
        if faults.kill_worker and any(x["worker"] == faults.kill_worker for x in getattr(pool, "lost", ())):
            log.warning("fault.kill_worker=%s: that worker was lost during start-up; nothing to kill", faults.kill_worker)
        elif faults.kill_worker:
            self._victim = pool.find(faults.kill_worker)
        self._killed: set[int] = set()        # ranks killed by fault injection (their deaths are expected)
        self.killed_at: float | None = None   # router clock: when fault.kill_worker was killed
        self._tag = uuid.uuid4().hex[:8]      # attempt ids stay unique when routers share a pool
        self._num_attempts = 0
        self._degraded: set[str] = set()      # notes of degraded serving already logged
        self.clocks = {w.rank: WorkerClock() for w in pool.workers}   # offset 0 until probed
        self._names = {w.rank: w.name for w in pool.workers}           # still known once the pool is shut down
        self._commands: dict = {}             # rank -> ZeroMQ socket to the worker's commands (router/threads.py)

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> "Router":
        # The events' reader waits for the GIL behind the router's other threads (polls, watchdog, clocks, the
        # caller's): at Python's default 5 ms switch interval a step's tokens reached it 1.3 ms late at the median
        sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
        self._open_events()                   # events come over ZeroMQ (router/threads.py); polls check liveness
        for w in self.pool.workers:           # each worker's clock before any token
            self._sync_clock(w, 2 * self.cfg.clock_probes)
        for w in self.pool.workers:
            self._spawn(self._poll_loop, w, name=f"poll-{w.name}")
        self._spawn(self._watchdog, name="router-watchdog")
        self._spawn(self._clock_loop, name="router-clocks")
        if self._victim is not None:
            timer = threading.Timer(self.faults.kill_after_s, self._kill_victim)
            timer.daemon = True
            timer.start()
        return self

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams | dict,
               arrival_s: float | None = None) -> RequestRecord:
        """Admit one request (`params` a SamplingParams or its dict). A request that breaks the rules or
        could never fit is recorded as failed with a reason naming the field, and no worker sees it.
        `arrival_s` (router clock; default now): when it reached the system, if a front end saw it first."""
        with self._lock:
            key = request_id if isinstance(request_id, str) else str(request_id)
            if key in self.records:
                raise InvalidRequest(request_id, "a request with this id was already submitted")
            max_tokens = params.get("max_tokens") if isinstance(params, dict) else getattr(params, "max_tokens", 0)
            rec = RequestRecord(key, list(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else [],
                                max_tokens if isinstance(max_tokens, int) else 0,
                                self.clock() if arrival_s is None else arrival_s)
            self.records[rec.id] = rec
            try:
                params = validate_request(request_id, prompt_ids, params, self.vocab_size, self.max_model_len)
                t = self.pool.transfer
                why = never_fits(self.mode, self.pool.workers, len(prompt_ids), params.max_tokens,
                                 self.cfg.conditional_threshold, t.max_frame_bytes, t.max_pending_bytes)
                if why is not None:
                    raise InvalidRequest(request_id, f"can never fit: {why}")
            except InvalidRequest as e:
                self._fail(rec, f"rejected: {e.reason}")
                return rec
            self._params[rec.id] = params
            self._dispatch(rec)
            return rec

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every submitted request has ended and its records are whole (the KV sender's report of
        a handoff can come after the decode worker's last token); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self.late_sent or any(not r.done for r in self.records.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left if left is not None else 1.0)
        return True

    def stream(self, request_id: str):
        """Yield (token, when it was made on the router's clock) as tokens arrive, until the request ends.
        The times are the steps' ends, so tokens of several steps that arrive together keep their gaps."""
        seen = 0
        with self._lock:
            rec = self.records[request_id]
            while True:
                while seen < len(rec.output_ids):
                    yield rec.output_ids[seen], rec.token_times[seen]
                    seen += 1
                if rec.done:
                    return
                self._lock.wait(1.0)

    def follow(self, seen: dict[str, int], timeout_s: float) -> dict[str, StreamUpdate]:
        """What the requests in `seen` (id -> tokens already taken) did since: new tokens on the router's
        clock, and whether each has ended. Waits up to `timeout_s` for a change when there is none yet;
        an id not (or no longer) known ends at once. For a front end that follows many streams at once."""
        with self._lock:
            out = self._updates(seen)
            if not out:
                self._lock.wait(timeout_s)
                out = self._updates(seen)
            return out

    def _updates(self, seen: dict[str, int]) -> dict[str, StreamUpdate]:
        out = {}
        for rid, n in seen.items():
            rec = self.records.get(rid)
            if rec is None:
                out[rid] = StreamUpdate([], [], True)
            elif len(rec.output_ids) > n or rec.done:
                out[rid] = StreamUpdate(rec.output_ids[n:], rec.token_times[n:], rec.done)
        return out

    def abort(self, request_id: str, reason: str = "aborted", finish_reason: str | None = None) -> bool:
        """End a pending request now: its workers drop it and free its KV (in flight too), and its record
        ends failed with `reason`, or ok with `finish_reason` when the caller has all it wanted (a stop
        string it matched itself). False if it had already ended (or is unknown)."""
        with self._lock:
            rec = self.records.get(request_id)
            if rec is None or rec.done:
                return False
            for att in self.journeys.of(rec):
                self._drop(att)
            if finish_reason is not None and rec.token_times:
                rec.finish(finish_reason, rec.token_times[-1])
            else:
                rec.fail(reason, self.clock())
            log.info("request %s %s", rec.id, reason)
            self._lock.notify_all()
            return True

    def forget(self, request_id: str) -> RequestRecord | None:
        """Drop an ended request's record (a long-running front end keeps only what is in flight);
        returns it, or None when it is unknown or still pending."""
        with self._lock:
            rec = self.records.get(request_id)
            if rec is None or not rec.done:
                return None
            del self.records[request_id]
            self._params.pop(request_id, None)
            return rec

    def progress(self) -> dict:
        with self._lock:
            recs = list(self.records.values())
            return {"submitted": len(recs), "ok": sum(r.status == "ok" for r in recs),
                    "failed": sum(r.status == "failed" for r in recs), "tokens": sum(len(r.output_ids) for r in recs)}

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.cfg.poll_timeout_s + 5)
        self._close_events()

    def on_router_clock(self, worker: WorkerHandle, t: float) -> float:
        """A time read on `worker`'s clock, on the router's."""
        return self.clocks[worker.rank].to_router(t)

    def traces(self, drain: bool = False) -> dict[str, list[dict]]:
        """The workers' engine steps (pool.traces()) with `start` and `end` on the router's clock;
        drain=True takes them out of the workers (a long-running server collects them as it goes)."""
        by_name = {w.name: w for w in self.pool.workers}
        traces = self.pool.traces(drain)
        with self._lock:                      # the clock thread may be updating an estimate
            return {name: [{**s, "start": self.on_router_clock(by_name[name], s["start"]),
                            "end": self.on_router_clock(by_name[name], s["end"])} for s in steps]
                    for name, steps in traces.items()}

    def clock_report(self) -> dict[str, dict]:
        """Each worker's clock offset in use, its error bound and the probe round trip (metrics.json)."""
        now = self.clock()
        with self._lock:
            return {self._names[rank]: clock.report(now) for rank, clock in self.clocks.items()}

    # -- dispatch -------------------------------------------------------------------------------
    def _dispatch(self, rec: RequestRecord) -> None:
        prompt = rec.prompt_ids + rec.output_ids
        n, left = len(prompt), rec.max_tokens - len(rec.output_ids)
        chosen = plan(self.mode, self.pool.workers, self.loads, self.prefill_policy, self.decode_policy, n, n + left,
                      self.cfg.conditional_threshold, self.pool.cfg.placement in ("pack", "strict_pack"), self.index)
        if isinstance(chosen, str):
            rec.injected_fault = rec.injected_fault or bool(self._killed)   # no worker left: the kills did it
            return self._fail(rec, chosen)
        kind, prefill, decode = chosen.kind, chosen.prefill, chosen.decode
        if chosen.note:
            rec.note = chosen.note
            if chosen.note not in self._degraded:
                self._degraded.add(chosen.note)
                log.warning("degraded serving: %s", chosen.note)
        rec.attempts += 1
        self._num_attempts += 1
        att = Attempt(rec, kind, prefill, decode, n, self.clock(), aid=f"{self._tag}:{self._num_attempts}")
        self.journeys.open(att.aid, att)
        rec.prefill_worker, rec.decode_worker = prefill.name, decode.name
        drop = False
        if kind == "handoff":
            self._num_handoffs += 1
            drop = rec.attempts == 1 and self._num_handoffs == self.faults.timeout_transfer_of
            rec.injected_fault = rec.injected_fault or drop
        params = dataclasses.replace(self._params[rec.id], max_tokens=left)
        self._command(prefill, "submit", att.aid, prompt, params.to_dict(), decode.rank if kind == "handoff" else None,
                      drop, kind == "whole")

    def _drop(self, att: Attempt, abort: bool = True) -> None:
        """Forget an attempt: release its load and (unless it finished) tell live workers to drop it."""
        if self.journeys.close(att.aid) is None:
            return
        for w in {att.prefill, att.decode} if abort else ():
            if w.alive:
                self._command(w, "abort", att.aid)

    def _finish(self, att: Attempt, finish_reason: str) -> None:
        self._drop(att, abort=False)
        if att.imported and not att.sent and att.prefill.alive:
            self.late_sent[att.aid] = att    # its Sent comes on another worker's stream
        att.record.finish(finish_reason, att.record.token_times[-1])
        self._lock.notify_all()

    def _fail(self, rec: RequestRecord, reason: str) -> None:
        rec.fail(reason, self.clock())
        log.warning("request %s failed: %s", rec.id, reason)
        self._lock.notify_all()

    def _retry(self, att: Attempt, reason: str, crashed: bool = False) -> None:
        if att.aid not in self.journeys.live:
            return
        self._drop(att)
        rec = att.record
        final = why_not_retry(rec, reason, crashed, self.cfg.max_retries)
        if final is not None:
            return self._fail(rec, final)
        log.info("retrying %s: %s", rec.id, reason)
        self._dispatch(rec)

    # -- events ---------------------------------------------------------------------------------
