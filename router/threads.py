"""The router's threads: the events' reader, one long-poll loop per worker, clock probes, the watchdog,
fault injection.

A part of router/router.py's Router (a mixin: it uses the router's pool, config, clocks, lock and
its event, drop, retry and failure handlers). Workers push their events to one ZeroMQ PULL socket of
the router's (cluster/worker.py's send_events: a Ray call per step cost more CPU than the step itself
on a small host), bound on the driver's node (loopback for an embedded local cluster), and one thread
reads them, in each worker's order. The poll loops still ask each worker every poll_timeout_s (it
then answers empty): a worker that does not answer within poll_timeout_s + router.liveness_timeout_s
counts as dead and is killed; a router error on one event is logged and does not silence that
worker's stream. A worker lost with its node is not held against the requests it served (a node
takes all its workers at once; that says nothing of them).
"""
from __future__ import annotations

import logging
import threading

import ray

from cluster.events import BadEvent
from cluster.pool import WorkerHandle
from router.clock import best_probe

log = logging.getLogger(__name__)


def went_with_its_node(w: WorkerHandle, e: BaseException) -> bool:
    """Whether `w` was lost with its node (a machine or its raylet gone), not on its own. A worker
    process that dies on a live node is reported dead by that node's raylet (ActorDiedError); one the
    driver can no longer reach, with no death reported, is ActorUnavailableError; and a node the
    cluster has marked dead took its workers with it."""
    if isinstance(e, ray.exceptions.ActorUnavailableError):
        return True
    node = w.info.get("node_id")
    try:
        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
    except Exception:
        return False
    return node is not None and alive.get(node) is False


class RouterThreads:
    def _open_events(self) -> None:
        """Bind the events' socket, start its reader, and point every worker at it."""
        import zmq

        host = "127.0.0.1" if self.pool.cfg.address is None else ray.util.get_node_ip_address()
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind_to_random_port(f"tcp://{host}")
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._spawn(self._event_loop, sock, name="router-events")
        local = self.pool.cfg.address is None
        calls = {w: (w.actor.send_events.remote(address), w.actor.listen.remote("127.0.0.1" if local else w.info["host"]))
                 for w in self.pool.workers if w.alive}
        ctx = zmq.Context.instance()
        for w, (pushing, listening) in calls.items():
            try:
                ray.get(pushing, timeout=self.cfg.liveness_timeout_s)
                cmd = ctx.socket(zmq.PUSH)
                cmd.setsockopt(zmq.LINGER, 0)
                cmd.connect(ray.get(listening, timeout=self.cfg.liveness_timeout_s))
                self._commands[w.rank] = cmd
            except ray.exceptions.RayError as e:     # its poll loop finds out what became of it
                log.warning("%s did not take the router's sockets: %s", w.name, type(e).__name__)

    def _command(self, w: WorkerHandle, *msg) -> None:
        """Send a worker a command over its socket (a Ray call where it has none). Under the router's lock:
        one sender at a time per socket."""
        import msgpack

        import zmq

        sock = self._commands.get(w.rank)
        if sock is not None:
            try:
                return sock.send(msgpack.packb(list(msg), use_bin_type=True), flags=zmq.NOBLOCK)
            except zmq.Again:           # its socket is full (a worker gone, not yet known dead): the slow way
                pass
        getattr(w.actor, msg[0]).remote(*msg[1:])

    def _close_events(self) -> None:
        """Tell the live workers to keep their events for a poll again (or for the next router)."""
        for sock in self._commands.values():
            sock.close(linger=0)
        self._commands.clear()
        calls = [w.actor.send_events.remote(None) for w in self.pool.workers if w.alive]
        try:
            ray.get(calls, timeout=self.cfg.liveness_timeout_s)
        except ray.exceptions.RayError:      # a worker gone meanwhile: nothing to tell it
            pass

    def _event_loop(self, sock) -> None:
        """Read every message waiting, then handle them together, stamped with one arrival time: what
        came in while the router was busy reaches it at once (as one poll reply would carry it)."""
        import zmq

        by_rank = {str(w.rank).encode(): w for w in self.pool.workers}
        if getattr(self.pool, "emulation", None) is not None:    # its workers' threads are real-time: so is this
            from workers.emulated import realtime                # reader, or they keep it from the events
            realtime()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                batch = []
                while True:
                    try:
                        batch.append(sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                now = self.clock()
                with self._lock:
                    for frames in batch:
                        self._on_message(by_rank, frames, now)
        finally:
            sock.close(linger=0)

    def _on_message(self, by_rank: dict, frames: list, now: float) -> None:
        import msgpack

        w = by_rank.get(frames[0]) if len(frames) == 2 else None
        try:
            events = msgpack.unpackb(frames[1], raw=False) if w is not None else None
        except Exception as e:
            events = None
            log.error("unreadable events from %s: %s", w.name, e)
        if not isinstance(events, list):
            log.error("an events message of %d frames from %r dropped", len(frames), frames[0][:16])
            return
        self._on_events(w, events, now)

    def _on_events(self, w: WorkerHandle, events: list, now: float) -> None:
        """A worker's events, in its order, under the router's lock (a re-entrant Condition)."""
        with self._lock:
            for ev in events:
                try:
                    self._on_event(w, ev, now)
                except BadEvent as e:   # a worker of another version, or a bug on its side
                    log.error("bad event from %s: %s", w.name, e)
                except Exception:   # a router bug must not silence this worker's stream
                    log.exception("router error on %s event from %s", ev.get("kind") if isinstance(ev, dict)
                                  else type(ev).__name__, w.name)

    def _spawn(self, target, *args, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _poll_loop(self, w: WorkerHandle) -> None:
        limit = self.cfg.poll_timeout_s + self.cfg.liveness_timeout_s
        while not self._stop.is_set() and w.alive:
            try:
                reply = ray.get(w.actor.poll.remote(self.cfg.poll_timeout_s), timeout=limit)
            except ray.exceptions.GetTimeoutError:
                with self._lock:
                    self._on_dead(w, f"worker {w.name} did not answer within {limit:g} s "
                                     "(router.liveness_timeout_s): frozen; killed")
                self.pool.kill(w)               # so that it cannot come back half-alive
                return
            except ray.exceptions.RayError as e:
                node_lost = went_with_its_node(w, e)
                with self._lock:
                    self._on_dead(w, f"worker {w.name} died ({type(e).__name__}"
                                     + (": its node was lost)" if node_lost else ")"), node_lost=node_lost)
                return
            if reply["events"]:          # a worker that still answers polls with its events
                self._on_events(w, reply["events"], self.clock())

    def _sync_clock(self, w: WorkerHandle, probes: int) -> None:
        """One round of clock probes of `w`; its best goes to the worker's WorkerClock. A worker that
        does not answer keeps its estimate (its poll loop finds out why)."""
        answers = []
        for _ in range(probes):
            if not w.alive or self._stop.is_set():
                break
            t_send = self.clock()
            try:
                worker_time = ray.get(w.actor.clock.remote(), timeout=self.cfg.liveness_timeout_s)
            except ray.exceptions.RayError:     # dead or frozen: the poll loop handles it
                break
            answers.append((t_send, worker_time, self.clock()))
        if answers:
            sample = best_probe(answers)
            with self._lock:
                self.clocks[w.rank].update(sample, self.clock())

    def _clock_loop(self) -> None:
        """Re-estimate every worker's clock offset every router.clock_sync_s (clocks of nodes drift)."""
        while not self._stop.wait(self.cfg.clock_sync_s):
            for w in self.pool.workers:
                if w.alive:
                    try:
                        self._sync_clock(w, self.cfg.clock_probes)
                    except Exception:        # a router bug must not stop the other workers' estimates
                        log.exception("clock probe of %s failed", w.name)

    def _watchdog(self) -> None:
        while not self._stop.wait(0.05):
            now = self.clock()
            with self._lock:
                for att in self.journeys.overdue(now, self.transfer.timeout_s):
                    self._retry(att, f"KV transfer {att.prefill.name} -> {att.decode.name} timed out after "
                                     f"{self.transfer.timeout_s:g} s (transfer.timeout_s)")
                for rec in self.records.values():
                    if not rec.done and now - rec.arrival_s > self.cfg.request_timeout_s:
                        for att in self.journeys.of(rec):
                            self._drop(att)
                        self._fail(rec, f"not finished within router.request_timeout_s={self.cfg.request_timeout_s:g}")

    def _kill_victim(self) -> None:
        log.warning("fault injection: killing %s", self._victim.name)
        with self._lock:
            self._killed.add(self._victim.rank)
            self.killed_at = self.clock()
        self.pool.kill(self._victim)
