"""The simulator's KV handoffs: a handed-off request's KV sent from its prefill worker to its decode worker.

A part of experiments/sim/simulator.py's Simulator (a mixin: it uses the simulator's clock, event
heap, costs and links). A send holds the sender's egress and the receiver's ingress
(experiments/sim/transfer.py's Links: latency + bytes / bandwidth, queued behind the transfers
already on either link, overlapped with the prefill when streamed); the KV's arrival goes to the
decode worker's inbox.
A transfer that never completes (fault.timeout_transfer_of) or runs past transfer.timeout_s is
retried by the router.
"""
from __future__ import annotations

from experiments.sim.request import sim_request
from experiments.sim.records import Attempt
from experiments.sim.worker import SimWorker


class KVTransfers:
    def _send_kv(self, w: SimWorker, req, ready: float, last_chunk: int) -> None:
        """Send a handed-off request's KV, complete at `ready`. Streamed, its parts go as they are final
        from the prefill's first step on; the last one is final only when the prefill ends: a group of
        transfer.stream_layers layers (layer) or the last prompt chunk, `last_chunk` tokens (chunk)."""
        att = req.attempt
        w.engine.release(req)
        if att is None or not att.live:
            return
        rec = att.record
        timeout = self.cfg.transfer.timeout_s
        if att.drop_transfer:                      # fault injection: this transfer never happens
            self.push(att.handoff_at + timeout, self._transfer_check, att)
            return
        d = att.decode
        kind = "local" if not self.cfg.gpus_per_node else ("node" if d.node == w.node else "network")
        stream = self.cfg.stream
        if stream == "layer":
            last = min(1.0, self.cfg.transfer.stream_layers / self.cfg.num_layers)
        else:
            last = min(1.0, last_chunk / max(att.prompt_len, 1))
        start, done = self.links.send(w.rank, d.rank, att.nbytes, self.costs.link(kind), ready,
                                      req.first_scheduled_time if stream != "off" else None, last)
        rec.transfer_s, rec.transfer_bytes = done - start, att.nbytes
        att.dreq = sim_request(req.id, att.prompt_len, att.left, att.submitted_at)
        att.dreq.num_out, att.dreq.attempt = 1, att
        att.kv_due = done
        self.push(done, self._kv_arrived, att, done)
        if done - att.handoff_at > timeout:
            self.push(att.handoff_at + timeout, self._transfer_check, att)

    def _kv_arrived(self, att: Attempt, due: float) -> None:
        if not att.live or due != att.kv_due:
            return
        att.sent = True
        att.record.kv_arrived = self.now
        self._deliver(att.decode, ("kv", att))

    def _transfer_check(self, att: Attempt) -> None:
        if att.live and att.phase == "transfer" and not att.sent:
            self._retry(att, f"KV transfer {att.prefill.name} -> {att.decode.name} timed out after "
                             f"{self.cfg.transfer.timeout_s:g} s (transfer.timeout_s)")
