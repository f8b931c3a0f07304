"""The simulator's workers: each one's step loop on the virtual clock.

A part of experiments/sim/simulator.py's Simulator (a mixin: it uses the simulator's clock, event
heap, costs, host loads and the router side's token and failure handlers). A worker wakes to
its inbox (submitted requests, aborts, KV arrivals), imports the KV that fits, then either advances
a run of identical decode-only steps in one event (SimEngine.start_run) or schedules one step with
pdlab's Scheduler; a step's end hands its tokens to the router after the return latency and starts
the KV sends of its finished prefills. When another worker of the host starts or stops working (the
shared_host factor), a step in flight is rescaled to the new rate and a decode run is cut after its
current step.
"""
from __future__ import annotations

import numpy as np

from experiments.sim.records import Attempt, Record
from experiments.sim.worker import SimWorker
from workers.config import blocks_for


class WorkerSteps:
    def _deliver(self, w: SimWorker, item: tuple) -> None:
        if not w.alive:
            return
        w.inbox.append(item)
        self._wake(w)

    def _wake(self, w: SimWorker) -> None:
        if w.state == "idle":
            w.state = "start"
            self._busy(w, True)
            self.push(self.now + w.engine.gap(0), self._step_start, w, w.version)
        elif w.state == "run":
            self._cut(w)

    def _cut(self, w: SimWorker) -> None:
        """End w's decode run after the step scheduled before now: the rest is scheduled afresh."""
        m = w.engine.cut_after(w.run, self.now)
        if m < w.run_steps:
            w.run_steps = m
            w.version += 1
            self.push(float(w.run.ends[m - 1]), self._run_end, w, w.version)

    def _busy(self, w: SimWorker, busy: bool) -> None:
        """w gets work or goes idle. Each other busy worker of the host whose sharing that changes
        (HostLoad.shared) runs the rest of its step in flight at the new rate (its remaining time
        scaled by new / old factor), and its decode run is cut after that step, so the steps after it
        are timed in the new state."""
        for o in self.hosts.mark(w, busy):
            if o.state not in ("run", "step"):
                continue
            c = o.engine.contention(self.hosts.shared(o))
            if c == o.step_c:
                continue
            if o.state == "run":
                self._cut(o)
            start, end = o.in_flight()
            if end > self.now:
                end = self.now + (end - max(self.now, start)) * c / o.step_c + max(0.0, start - self.now)
                o.version += 1
                o.move_end(end)
                self.push(end, self._run_end if o.state == "run" else self._step_end, o, o.version)
            o.step_c = c

    def _idle(self, w: SimWorker) -> None:
        w.state = "idle"
        self._busy(w, False)

    def _take_inbox(self, w: SimWorker) -> None:
        e = w.engine
        for kind, x in w.inbox:
            if kind == "submit":
                ecfg = e.cfg
                total = x.prompt_len + 1 if x.hand_off else x.prompt_len + x.max_tokens
                if blocks_for(total, ecfg.block_size) > e.blocks.num_blocks:
                    self.push(self.now + self.costs.return_s, self._rejected, x.attempt, w,
                              f"needs {blocks_for(total, ecfg.block_size)} KV blocks but this engine's pool has "
                              f"{e.blocks.num_blocks}")
                    continue
                e.add(x)
            elif kind == "abort":
                if x.block_ids or x in e.scheduler.running or x in e.scheduler.waiting:
                    e.remove(x)
                w.arrivals = type(w.arrivals)(a for a in w.arrivals if a.dreq is not x)
            else:                                   # "kv": an attempt whose KV is in
                w.arrivals.append(x)
        w.inbox.clear()

    def _rejected(self, att: Attempt, w: SimWorker, reason: str) -> None:
        if att.live:
            self._drop(att)
            self._fail(att.rec, f"rejected by {w.name}: {reason}")

    def _step_start(self, w: SimWorker, version: int) -> None:
        if version != w.version or not w.alive:
            return
        t = self.now
        e = w.engine
        self._take_inbox(w)
        while w.arrivals and e.can_import(w.arrivals[0].prompt_len):
            att = w.arrivals.popleft()
            if not att.live:
                continue
            t += self.costs.import_s(att.nbytes)
            e.add_imported(att.dreq)
            att.imported = True
        if not e.has_work():
            self._idle(w)
            return
        k = e.run_length()
        shared = self.hosts.shared(w)
        w.step_c = e.contention(shared)
        if k >= 1:
            run = e.start_run(t, k, shared)
            w.run, w.run_steps, w.run_seen, w.state = run, k, 0, "run"
            self.in_run.add(w)
            self.push(float(run.ends[-1]), self._run_end, w, w.version)
            return
        sched, d = e.schedule(shared)
        if not sched:
            self._idle(w)                           # nothing it can schedule until something changes
            return
        w.sched, w.step_start, w.step_end, w.state = sched, t, t + d, "step"
        self.push(t + d, self._step_end, w, w.version)

    def _step_end(self, w: SimWorker, version: int) -> None:
        if version != w.version or not w.alive:
            return
        sched, start, end = w.sched, w.step_start, self.now
        w.last_end = end
        done = w.engine.finish(sched, start, end)
        w.log_step(start, end, sched, len(done.preempted))
        stream = self.cfg.stream != "off"
        exports = []
        t = end
        last_chunk = {id(c.request): c.num_tokens for c in sched.chunks}   # a lone last prompt token is a 'decode'
        for req, reason in done.tokens:
            if reason == "handoff":
                if not stream:
                    t += self.costs.export_s(req.attempt.nbytes)
                exports.append((req, t, last_chunk.get(id(req), req.prompt_len)))
        at = self._delivery(w, t)
        for req, reason in done.tokens:
            self._on_token(req, reason, start, end, at)
        for req, ready, last in exports:
            self._send_kv(w, req, ready, last)
        w.sched = None
        self._next(w, t, len(sched.decodes) + len(sched.prefills))

    def _run_end(self, w: SimWorker, version: int) -> None:
        if version != w.version or not w.alive:
            return
        run, m = w.run, w.run_steps
        entry = w.log_run(run, m)
        out = w.engine.apply_run(run, m)
        if entry is not None:
            entry["used"][-1] = w.engine.blocks.num_used
            entry["running_last"] = len(w.engine.scheduler.running)
        ends = run.ends[:m]
        at = self._deliveries(w, ends)
        end = w.last_end = float(run.ends[m - 1])
        b = len(run.reqs)
        self.loads[w.rank].kv_tokens += b * (m - w.run_seen)      # the steps the router had not yet counted
        w.run, w.run_seen = None, 0
        self.in_run.discard(w)
        keep, gaps = Record.keep, self.gaps
        f0, fl, c0, cl = float(ends[0]), end, float(at[0]), float(at[-1])
        owners, into, into_at, advanced = [], [], [], []
        for req, reason in out:
            att = req.attempt
            if att is None or not att.live:
                continue
            rec = att.record
            advanced.append(rec.index)
            if keep:
                rec.add_times(ends, at, m)
            else:                                   # Record.add_times inlined: a million calls in a large run
                if rec.first_time is None:
                    rec.first_time, rec.client_first = f0, c0
                elif gaps is not None:
                    into.append(f0 - rec.last_time)
                    into_at.append(c0 - rec.client_last)
                    owners.append(rec.index)
                rec.last_time, rec.client_last = fl, cl
                rec.num_out += m
            att.num_tokens += m
            if att.kind == "handoff" and att.decode_start is None:
                att.decode_start = req.first_scheduled_time
                rec.handoff_s = att.decode_start - att.first_token_worker_time
            if reason == "length":
                rec.decode_s = end - att.decode_start if att.decode_start is not None else 0.0
                self._finish(att, reason)
        if gaps is not None:
            gaps.owner += owners
            gaps.made += into
            gaps.got += into_at
            gaps.run(np.array(advanced, dtype=np.int64), ends, at)
        self._next(w, end, b)

    def _delivery(self, w: SimWorker, t: float) -> float:
        """When the router gets a step that left the worker at `t`: after the return latency, and not
        before the worker's previous step (one ordered stream per worker)."""
        w.delivered = max(t + self.costs.return_s, w.delivered)
        return w.delivered

    def _deliveries(self, w: SimWorker, ends: np.ndarray) -> np.ndarray:
        at = np.maximum(ends + self.costs.return_s, w.delivered)
        w.delivered = float(at[-1])
        return at

    def _next(self, w: SimWorker, t: float, num_seqs: int) -> None:
        if w.engine.has_work() or w.inbox or w.arrivals:
            w.state = "start"
            self.push(t + w.engine.gap(num_seqs), self._step_start, w, w.version)
        else:
            self._idle(w)

