"""The simulator's workers: each one's step loop on the virtual clock.

A part of experiments/sim/simulator.py's Simulator (a mixin: it uses the simulator's clock, event
heap, costs, host loads and the router side's token and failure handlers). A worker wakes to
its inbox (submitted requests, aborts, KV arrivals), imports the KV that fits, then either advances
a run of identical decode-only steps in one event (SimEngine.start_run) or schedules one step with
pdlab's Scheduler; a step's end hands its tokens to the router after the return latency and starts
the KV sends of its finished prefills. When another worker of the host starts or stops working (the
shared_host factor), a step in flight is rescaled to the new rate and a decode run is cut after its
current step. Between runs the batch's records wait in the worker's Ledger (experiments/sim/records.py)
and are brought up to date before the scheduler runs a step, when an attempt ends or is dropped (with
the steps of a run in flight that ended before then), and at the end.
"""
from __future__ import annotations

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
            self.push(w.run.ends[m - 1], self._run_end, w, w.version)

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
                i = e.member(x)
                if i is not None:
                    w.ledger.flush(i, x.attempt)
                    w.ledger.drop(i)
                if x.block_ids or x in e.scheduler.running or x in e.scheduler.waiting:
                    e.remove(x)
                w.arrivals = type(w.arrivals)(a for a in w.arrivals if a.dreq is not x)
            else:                                   # "kv": an attempt whose KV is in
                w.arrivals.append(x)
        w.inbox.clear()

    def _rejected(self, att: Attempt, w: SimWorker, reason: str) -> None:
        if att.live:
            self._drop(att)
            self._fail(att.record, f"rejected by {w.name}: {reason}")

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
            joiners = e.scheduler.running[run.b - run.joined:run.b]
            w.run_live = run.b - w.ledger.dead - sum(r.attempt is None or not r.attempt.live for r in joiners)
            self.in_run.add(w)
            self.push(run.ends[-1], self._run_end, w, w.version)
            return
        self._settle(w)
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
        for req, reason in done.tokens:
            if reason == "handoff":
                if not stream:
                    t += self.costs.export_s(req.attempt.nbytes)
                last = next((c.num_tokens for c in sched.chunks if c.request is req), req.prompt_len)
                exports.append((req, t, last))       # (a lone last prompt token is a 'decode' chunk)
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
        run, m, e, ledger = w.run, w.run_steps, w.engine, w.ledger
        b, joined = run.b, run.joined
        if ledger.n != b - joined:
            raise RuntimeError(f"{w.name}: the ledger holds {ledger.n} of a run's {b - joined} continuing requests")
        entry = w.log_run(run, m)
        members = e.scheduler.running[:b]
        goes_on, done, first = e.apply_run(run, m)
        if entry is not None:
            entry["used"][-1] = e.blocks.num_used
            entry["running_last"] = len(e.scheduler.running)
        ends = run.ends[:m]
        end = w.last_end = run.ends[m - 1]
        t, export = end, None
        if first is not None and first[1] == "handoff":    # the prompt's KV is exported after its last step
            if self.cfg.stream == "off":
                t += self.costs.export_s(first[0].attempt.nbytes)
            export = (first[0], t, run.prompt.chunks[m - 1])
        at = self._deliveries(w, ends)
        if t != end:                                        # its last step reaches the router after the export
            at[-1] = self._delivery(w, t)
        self.loads[w.rank].kv_tokens += w.run_live * (m - w.run_seen)   # the steps the router had not yet counted
        w.run, w.run_seen = None, 0
        self.in_run.discard(w)
        ledger.run(ends, at, m, b - joined, self.gaps)
        if joined:
            ledger.join(self._first_run(members[b - joined:], ends, at, m))
        for i in ([] if goes_on is None else [i for i, g in enumerate(goes_on) if not g]):
            req = members[i]
            att = req.attempt
            ledger.flush(i, att)
            if ledger.owner[i] >= 0:
                rec = att.record
                rec.decode_s = end - att.decode_start if att.decode_start is not None else 0.0
                self._finish(att, "length")
        if goes_on is not None:
            ledger.keep(goes_on)
        if first is not None:
            self._on_token(first[0], first[1], run.starts[m - 1], end, at[-1])
        if export is not None:
            self._send_kv(w, *export)
        self._next(w, t, b + (run.prompt is not None))

    def _first_run(self, reqs: list, ends: list, at: list, m: int) -> list[int]:
        """The records of requests in their first decode run of the batch, brought up to date one by one
        (their previous token is their own); returns each one's owner for the ledger (-1: not live)."""
        keep, gaps = Record.keep, self.gaps
        f0, fl, c0, cl = ends[0], ends[-1], at[0], at[-1]
        owners, live, into, into_at, mine = [], [], [], [], []
        for req in reqs:
            att = req.attempt
            if att is None or not att.live:
                owners.append(-1)
                continue
            rec = att.record
            owners.append(rec.index)
            live.append(rec.index)
            if keep:
                rec.add_times(ends, at, m)
            else:                                   # Record.add_times inlined
                if rec.first_time is None:
                    rec.first_time, rec.client_first = f0, c0
                elif gaps is not None:
                    into.append(f0 - rec.last_time)
                    into_at.append(c0 - rec.client_last)
                    mine.append(rec.index)
                rec.last_time, rec.client_last = fl, cl
                rec.num_out += m
            att.num_tokens += m
            if att.kind == "handoff" and att.decode_start is None:
                att.decode_start = req.first_scheduled_time
                rec.handoff_s = att.decode_start - att.first_token_worker_time
        if gaps is not None:
            gaps.owner += mine
            gaps.made += into
            gaps.got += into_at
            gaps.run(live, ends, at)
        return owners

    def _settle(self, w: SimWorker) -> None:
        """Bring the records of w's decode batch up to date and write its counters back to its requests."""
        if w.engine.batch.n:
            w.ledger.flush_all(w.engine.scheduler.running)
            w.engine.settle()

    def _detach(self, w: SimWorker, req) -> None:
        """req's attempt is over: its record is brought up to date and takes no more of w's run tokens."""
        i = w.engine.member(req)
        if i is None:
            return
        ledger, att = w.ledger, req.attempt
        live = ledger.owner[i] >= 0 if i < ledger.n else att is not None and att.live
        ledger.flush(i, att)
        ledger.detach(i)
        run = w.run
        if w.state == "run" and i < run.b and live:
            m = w.steps_ended(self.now)
            if m:                                   # the steps of the run in flight that ended before now
                ends = run.ends[:m]                 # (a copy: the run's last end may move)
                self._first_run([req], ends, self._router_times(w, ends), m)
            w.run_live -= 1                         # its later steps are no one's load; its first m are
            self.loads[w.rank].kv_tokens += m - w.run_seen       # in its count, which closing it takes off

    def _delivery(self, w: SimWorker, t: float) -> float:
        """When the router gets a step that left the worker at `t`: after the return latency, and not
        before the worker's previous step (one ordered stream per worker)."""
        w.delivered = max(t + self.costs.return_s, w.delivered)
        return w.delivered

    def _router_times(self, w: SimWorker, ends: list) -> list:
        """When the router gets steps that left the worker at `ends`, after its steps delivered so far."""
        r, d = self.costs.return_s, w.delivered
        return [max(e + r, d) for e in ends]

    def _deliveries(self, w: SimWorker, ends: list) -> list:
        at = self._router_times(w, ends)
        w.delivered = at[-1]
        return at

    def _next(self, w: SimWorker, t: float, num_seqs: int) -> None:
        if w.engine.has_work() or w.inbox or w.arrivals:
            w.state = "start"
            self.push(t + w.engine.gap(num_seqs), self._step_start, w, w.version)
        else:
            self._idle(w)

