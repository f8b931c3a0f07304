"""What the workers report to the router: each step's tokens, KV sent and imported, failures, a
worker's death or its KV receiver stopping.

A part of router/router.py's Router (a mixin: it uses the router's attempts, records, loads, clocks
and lock, and its drop, finish, failure and retry handlers). Called under the router's lock by the
poll threads (router/threads.py), one event at a time per worker, in the order the worker sent them.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cluster.pool import WorkerHandle

if TYPE_CHECKING:
    from router.router import Attempt

log = logging.getLogger(__name__)


class RouterEvents:
    def _on_event(self, w: WorkerHandle, ev: dict, now: float) -> None:
        kind = ev["kind"]
        if kind == "step":
            return self._on_step(w, ev, now)
        if kind == "transport_error":
            self.transport_errors.append(f"{w.name}: {ev['message']}")
            log.warning("%s: %s", w.name, ev["message"])
            return
        if kind == "out_of_service":
            return self._on_out_of_service(w, ev["reason"])
        if kind == "fatal":
            return self._on_dead(w, f"worker {w.name} failed: {ev['message'].strip().splitlines()[-1]}")
        att = self._attempts.get(ev["rid"])
        if kind in ("send_failed", "import_failed"):
            self.transport_errors.append(f"{w.name}: {ev['reason']}")
        if att is None or w not in (att.prefill, att.decode):
            return
        if kind == "rejected":
            self._drop(att)
            self._fail(att.record, f"rejected by {w.name}: {ev['reason']}")
        elif kind == "failed":
            self._drop(att)
            self._fail(att.record, f"failed on {w.name}: {ev['reason']}")
        elif kind == "sent":
            att.sent = True
            rec = att.record
            rec.transfer_s, rec.transfer_bytes = ev["seconds"], ev["bytes"]
            rec.kv_send_start = self.on_router_clock(w, ev["start"])
        elif kind == "imported":
            att.imported = True
            att.record.kv_arrived = self.on_router_clock(w, ev["arrived"])
            if ev.get("prefill_end") is not None:            # stamped by the prefill worker's clock
                att.record.prefill_end = self.on_router_clock(att.prefill, ev["prefill_end"])
        elif kind in ("send_failed", "import_failed") and att.kind == "handoff":
            self._retry(att, f"KV transfer {att.prefill.name} -> {att.decode.name} failed: {ev['reason']}")

    def _on_step(self, w: WorkerHandle, ev: dict, now: float) -> None:
        ev = {**ev, "made": self.on_router_clock(w, ev["end"])}
        for aid, token, finish in ev["tokens"]:
            att = self._attempts.get(aid)
            if att is None:
                continue
            if att.phase == "prefill" and w is not att.prefill:
                # the decode worker's tokens overtook the prefill worker's first token: hold them
                att.early.append((w, token, finish, ev, now))
                continue
            self._on_token(att, w, token, finish, ev, now)
            if att.early and att.phase != "prefill":
                for early in att.early:
                    self._on_token(att, *early)
                att.early.clear()
        self._lock.notify_all()

    def _on_token(self, att: Attempt, w: WorkerHandle, token: int, finish, ev: dict, now: float) -> None:
        """`ev["made"]`: the step's end on the router's clock; `now`: when its poll reply came in."""
        rec, made = att.record, ev["made"]
        rec.output_ids.append(token)
        rec.token_times.append(made)
        rec.arrival_times.append(now)
        rec.worker_token_times.append(ev["end"])
        rec.token_workers.append(w.name)
        att.num_tokens += 1
        self.loads[att.decode.rank].kv_tokens += 1
        started = ev["first_scheduled"].get(att.aid)
        if started is not None:
            started = self.on_router_clock(w, started)
        if att.phase == "prefill":
            if started is not None:
                rec.queue_s, rec.prefill_s = max(0.0, started - att.submitted_at), made - started
            self.loads[att.prefill.rank].prompt_tokens -= att.prompt_len
            att.handoff_at, att.first_token_time = now, made
            if finish != "handoff":
                att.decode_start = made
        elif started is not None and att.kind == "handoff":   # decode worker's first step with it
            att.decode_start = started
            rec.handoff_s = started - att.first_token_time
        if finish in ("length", "stop"):
            rec.decode_s = made - att.decode_start if att.decode_start is not None else 0.0
            self._finish(att, finish)

    def _on_dead(self, w: WorkerHandle, reason: str, node_lost: bool = False) -> None:
        """`w` is gone; its attempts are retried. Its death counts against their requests (a poison may
        have killed it) unless the router killed it on purpose or it went with its node."""
        if not w.alive:
            return
        w.alive = False
        injected = w.rank in self._killed
        log.warning("%s", reason)
        for att in list(self._attempts.values()):
            lost_prompt = att.prefill is w and (att.phase == "prefill" or (att.phase == "transfer" and not att.sent))
            if att.decode is w or lost_prompt:
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
        for att in list(self._attempts.values()):
            if att.decode is w and att.kind == "handoff" and not att.imported:
                self._retry(att, f"{w.name} stopped receiving KV: {reason}")
