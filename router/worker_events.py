"""What the workers report to the router: each step's tokens, KV sent and imported, failures, a
worker's death or its KV receiver stopping.

A part of router/router.py's Router (a mixin: it uses the router's attempts, records, loads, clocks
and lock, and its drop, finish, failure and retry handlers). Called under the router's lock by the
poll threads (router/threads.py), one event at a time per worker, in the order the worker sent them.
"""
from __future__ import annotations

import logging

from cluster.events import (Failed, Fatal, Imported, ImportFailed, OutOfService, Rejected, SendFailed, Sent, Step,
                            TransportError, from_wire)
from cluster.pool import WorkerHandle
from router.attempt import Attempt

log = logging.getLogger(__name__)


class RouterEvents:
    def _on_event(self, w: WorkerHandle, raw: dict, now: float) -> None:
        """One event off the wire (a dict): checked once (cluster/events.py), then handled by its type."""
        ev = from_wire(raw)
        on_worker = self._ON_WORKER_EVENT.get(type(ev))
        if on_worker is not None:
            return on_worker(self, w, ev, now)
        if isinstance(ev, (SendFailed, ImportFailed)):
            self.transport_errors.append(f"{w.name}: {ev.reason}")
        att = self.journeys.live.get(ev.rid)
        if att is None and ev.rid in self.late_sent and isinstance(ev, (Sent, SendFailed)):
            return self._on_late_sent(w, ev)
        if att is None or w not in (att.prefill, att.decode):
            return                                   # a superseded attempt's, or a spoofed one
        self._ON_REQUEST_EVENT[type(ev)](self, att, w, ev)

    # -- events of one request ------------------------------------------------------------------

    def _on_rejected(self, att: Attempt, w: WorkerHandle, ev: Rejected) -> None:
        self._drop(att)
        self._fail(att.record, f"rejected by {w.name}: {ev.reason}")

    def _on_failed(self, att: Attempt, w: WorkerHandle, ev: Failed) -> None:
        self._drop(att)
        self._fail(att.record, f"failed on {w.name}: {ev.reason}")

    def _on_sent(self, att: Attempt, w: WorkerHandle, ev: Sent) -> None:
        att.sent = True
        rec = att.record
        rec.transfer_s, rec.transfer_bytes = ev.seconds, ev.bytes
        rec.kv_send_start = self.on_router_clock(w, ev.start)

    def _on_late_sent(self, w: WorkerHandle, ev: Sent | SendFailed) -> None:
        """The sender's report of a handoff whose request has ended (the decode worker imported the KV
        and made its last token before the prefill worker's stream caught up)."""
        if w is not self.late_sent[ev.rid].prefill:
            return                                       # a spoofed one
        att = self.late_sent.pop(ev.rid)
        if isinstance(ev, Sent):
            self._on_sent(att, w, ev)
        self._lock.notify_all()

    def _on_imported(self, att: Attempt, w: WorkerHandle, ev: Imported) -> None:
        att.imported = True
        att.record.transfer_bytes = ev.bytes             # the receiver's count, before its first token
        att.record.kv_arrived = self.on_router_clock(w, ev.arrived)
        if ev.prefill_end is not None:                   # stamped by the prefill worker's clock
            att.record.prefill_end = self.on_router_clock(att.prefill, ev.prefill_end)

    def _on_transfer_failed(self, att: Attempt, w: WorkerHandle, ev: SendFailed | ImportFailed) -> None:
        if att.kind == "handoff":
            self._retry(att, f"KV transfer {att.prefill.name} -> {att.decode.name} failed: {ev.reason}")

    _ON_REQUEST_EVENT = {Rejected: _on_rejected, Failed: _on_failed, Sent: _on_sent, Imported: _on_imported,
                         SendFailed: _on_transfer_failed, ImportFailed: _on_transfer_failed}

    # -- events of the worker: its steps, its wires, its end --------------------------------------
    def _on_step(self, w: WorkerHandle, ev: Step, now: float) -> None:
        made = self.on_router_clock(w, ev.end)
        for aid, token, finish in ev.tokens:
            att = self.journeys.live.get(aid)
            if att is None:
                continue
            if att.phase == "prefill" and w is not att.prefill:
                # the decode worker's tokens overtook the prefill worker's first token: hold them
                att.early.append((w, token, finish, ev, made, now))
                continue
            self._on_token(att, w, token, finish, ev, made, now)
            if att.early and att.phase != "prefill":
                for early in att.early:
                    self._on_token(att, *early)
                att.early.clear()
        self._lock.notify_all()

    def _on_token(self, att: Attempt, w: WorkerHandle, token: int, finish, ev: Step, made: float, now: float) -> None:
        """`made`: the step's end on the router's clock; `now`: when its poll reply came in."""
        rec = att.record
        rec.output_ids.append(token)
        rec.token_times.append(made)
        rec.arrival_times.append(now)
        rec.worker_token_times.append(ev.end)
        rec.token_workers.append(w.name)
        started = ev.first_scheduled.get(att.aid)
        if started is not None:
            started = self.on_router_clock(w, started)
        if self.journeys.token(att, made, now, started, finish):
            self._finish(att, finish)

    def _on_dead(self, w: WorkerHandle, reason: str, node_lost: bool = False) -> None:
        """`w` is gone; its attempts are retried. Its death counts against their requests (a poison may
        have killed it) unless the router killed it on purpose or it went with its node."""
        if not w.alive:
            return
        w.alive = False
        injected = w.rank in self._killed
        log.warning("%s", reason)
        for aid in [aid for aid, att in self.late_sent.items() if att.prefill is w]:
            del self.late_sent[aid]                      # its report will not come
        self._lock.notify_all()
        for att in self.journeys.lost_with(w):
            att.record.injected_fault = att.record.injected_fault or injected
            self._retry(att, reason, crashed=not (injected or node_lost))

    def _on_out_of_service(self, w: WorkerHandle, reason: str) -> None:
        """Its KV receiver stopped: no more handoffs to it; those under way go elsewhere. What it is
        already decoding goes on."""
        self.transport_errors.append(f"{w.name}: {reason}")
        if not w.in_service:
            return
        w.in_service = False
        log.warning("%s takes no more KV: %s", w.name, reason)
        for att in self.journeys.stranded_by(w):
            self._retry(att, f"{w.name} stopped receiving KV: {reason}")

    def _on_transport_error(self, w: WorkerHandle, ev: TransportError, now: float) -> None:
        self.transport_errors.append(f"{w.name}: {ev.message}")
        log.warning("%s: %s", w.name, ev.message)

    def _on_fatal(self, w: WorkerHandle, ev: Fatal, now: float) -> None:
        self._on_dead(w, f"worker {w.name} failed: {ev.message.strip().splitlines()[-1]}")

    def _on_receiver_stopped(self, w: WorkerHandle, ev: OutOfService, now: float) -> None:
        self._on_out_of_service(w, ev.reason)

    _ON_WORKER_EVENT = {Step: _on_step, TransportError: _on_transport_error, Fatal: _on_fatal,
                        OutOfService: _on_receiver_stopped}
