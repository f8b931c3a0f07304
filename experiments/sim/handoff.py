"""The simulator's KV handoffs: a handed-off request's KV sent from its prefill worker to its decode worker.

A part of experiments/sim/simulator.py's Simulator (a mixin: it uses the simulator's clock, event
heap, costs, noise and links). A send holds the sender's egress and the receiver's ingress
(experiments/sim/transfer.py's Links), widens both workers' KV-transfer window (their steps
meanwhile take the kv_transfer factor), and goes `costs.handoff_busy` slower while its sender runs
another step (its sender thread then shares the worker's core with it: experiments/analysis/calibrate.py's
handoff fit); the KV's arrival goes to the decode worker's inbox.
A transfer that never completes (fault.timeout_transfer_of) or runs past transfer.timeout_s is
retried by the router.
"""
from __future__ import annotations

from experiments.sim.engine import sim_request
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
        rec = att.rec
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
                                      req.first_scheduled_time if stream != "off" else None, last,
                                      self.noise.factor("handoff"))
        rec.transfer_s, rec.transfer_bytes = done - start, att.nbytes
        for x in (w, d):                        # both ends' threads work on it from the prefill's end
            x.transfer = (x.transfer[0], max(x.transfer[1], done)) if x.transfer[1] >= ready else (ready, done)
        if d.state == "run" and d.engine.transfer_factor("decode") != 1.0:
            self._cut(d)                        # its steps from now on are in the transfer's window
        att.dreq = sim_request(req.id, att.prompt_len, att.left, att.submitted_at)
        att.dreq.num_out, att.dreq.attempt = 1, att
        att.kv_due = done
        if self.costs.handoff_busy != 1.0:
            w.sending.append((att, start))
        self.push(done, self._kv_arrived, att, done)
        if done - att.handoff_at > timeout:
            self.push(att.handoff_at + timeout, self._transfer_check, att)

    def _sender_steps(self, w: SimWorker, t: float, end: float) -> None:
        """w steps from t to `end`: the KV it is still sending goes handoff_busy slower meanwhile (its
        sender thread shares the worker's core with the step, as calibrate measures it), at full speed
        again after it."""
        c = self.costs.handoff_busy
        left = []
        for att, start in w.sending:
            old = att.kv_due
            if not att.live or att.sent or old <= t:
                continue
            left.append((att, start))
            begin = max(t, start)
            if begin >= end:
                continue
            rest = old - begin                        # at full speed
            new = begin + rest * c if rest <= (end - begin) / c else end + rest - (end - begin) / c
            att.kv_due = new
            att.rec.transfer_s += new - old
            self.links.moved(w.rank, att.decode.rank, old, new)
            for x in (w, att.decode):
                if x.transfer[1] == old:
                    x.transfer = (x.transfer[0], new)
            self.push(new, self._kv_arrived, att, new)
        w.sending[:] = left

    def _kv_arrived(self, att: Attempt, due: float) -> None:
        if not att.live or due != att.kv_due:
            return
        att.sent = True
        att.rec.kv_arrived = self.now
        self._deliver(att.decode, ("kv", att))

    def _transfer_check(self, att: Attempt) -> None:
        if att.live and att.phase == "transfer" and not att.sent:
            self._retry(att, f"KV transfer {att.prefill.name} -> {att.decode.name} timed out after "
                             f"{self.cfg.transfer.timeout_s:g} s (transfer.timeout_s)")
