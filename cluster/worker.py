"""One worker per GPU: an engine, the thread that steps it, and its ends of the KV wires.

Runs inside a threaded Ray actor (see pool.py); the engine it steps (workers/) knows nothing of Ray or
the wires. Only the loop thread touches the engine; remote calls put work in an inbox and read events
from an outbox. Events reach the router one of two ways: `poll`, a long poll that returns every event
since the last one (whole steps' tokens at once), or, once the router has called `send_events`, a
ZeroMQ socket to the router's, onto which a thread pushes every batch of events as it forms (msgpack;
one Ray call costs about 1.5 ms of CPU on a 2-core machine, one push tens of microseconds, and a
step's tokens are an event); `poll` then answers empty, as the router's liveness check.

No request takes the worker down: an exception while admitting, stepping, exporting or importing one
request fails that request (a `failed`, `rejected` or `import_failed` event naming it) and the loop
goes on. Every exception on a sender or receiver thread ends in an event too.

A prefill worker's KV goes out through kv_out.py (sender threads that read it out of the pool,
after the prefill or as it is computed); a decode worker takes it in through kv_in.py (each part
into the request's blocks as it lands).

Times in events are this worker's clock (time.time()); the router reads it through `clock` probes and
converts every time to its own clock (router/clock.py).

Events: the records of cluster/events.py (step, rejected, failed, sent, send_failed, imported,
import_failed, transport_error, out_of_service, fatal), sent as tagged dicts (`to_wire`).
"""
from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from cluster.events import (Failed, Fatal, ImportFailed, OutOfService, Rejected, Step, TransportError, WorkerEvent,
                            to_wire)
from cluster.isolation import pin_process, usable_cores
from cluster.kv_in import KVIn, RecentIds, reason_of
from cluster.kv_out import Exported, KVOut
from cluster.transfer.base import Delivery, TransferConfig, TransferProblem
from cluster.transfer.link import Link
from cluster.transfer.wire import Expect
from workers.config import EngineConfig
from workers.emulated import realtime
from workers.engine import Engine
from workers.events import RequestFailed
from workers.probe import speed_probe
from workers.weights import ModelSpec, build_model, model_config, parse_device, resolve_dtype

ABORTED_KEPT = 65536     # aborted request ids remembered, newest first: far more than are ever in flight


@dataclass(frozen=True)
class Emulation:
    """What the workers of an emulated cluster are given (engine.timing=emulated, workers/emulated.py):
    each role's step price (a workers.emulated.StepPrice) and the KV link (cluster/transfer/link.py)."""

    price: dict
    link: Link

    def __post_init__(self):
        missing = [r for r in ("colocated", "prefill", "decode") if r not in self.price]
        if missing:
            raise ValueError(f"emulation: no step price for role(s) {missing}")


@dataclass
class Submit:
    rid: str
    prompt_ids: list
    params: dict
    dst: int | None          # prefill role: where its KV goes (None: no transfer)
    drop_transfer: bool      # fault injection: the transfer never happens
    whole: bool              # serve it to the end here, whatever the role
    time: float


@dataclass
class Abort:
    rid: str


@dataclass
class Arrived:
    delivery: Delivery                   # from a receive thread: Begin, Part, End or Cancel


@dataclass
class Dropped:
    rid: str
    reason: str                          # a receive thread dropped this transfer


@dataclass
class SetStream:
    mode: str                            # off | layer | chunk
    stream_layers: int


@dataclass
class Isolate:
    """Pin this process to `cores` and set torch's threads, done by the loop thread (torch's thread
    count is per thread); the caller waits on `done` for `result`."""
    cores: list
    threads: int
    done: threading.Event
    result: dict


@dataclass
class Probe:
    """Time the speed probe's steps (workers/probe.py) in the loop thread, before serving."""
    done: threading.Event
    result: dict




class Worker:
    def __init__(self, rank: int, spec: ModelSpec, engine_cfg: EngineConfig, torch_threads: int = 0,
                 emulation: Emulation | None = None):
        # The loop thread holds the GIL between torch calls; without this, the sender, receiver and
        # poll threads wait up to Python's default 5 ms for it, which shows up in every handoff.
        sys.setswitchinterval(2e-4)
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.rank = rank
        self.role = engine_cfg.role
        self.node_cores = usable_cores()          # before any pinning: the cores of this node we may use
        self.link = None
        if engine_cfg.timing == "emulated":        # no model: steps wait for their price (workers/emulated.py)
            if emulation is None:
                raise ValueError("engine.timing=emulated: the worker was given no step price")
            self.link = emulation.link
            dtype = torch.bfloat16 if spec.dtype == "auto" else getattr(torch, spec.dtype)
            self.engine = Engine.emulated(model_config(spec), engine_cfg, emulation.price[engine_cfg.role], dtype)
        else:
            device = parse_device(spec.device)
            dtype = resolve_dtype(spec.dtype, device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            model = build_model(model=spec.model if spec.checkpoint is None else None,
                                checkpoint=spec.checkpoint, dtype=dtype, device=device, seed=spec.seed)
            self.engine = Engine(model, engine_cfg)
        self.transport = None
        self._inbox: queue.Queue = queue.Queue()
        self._events: list[dict] = []     # to_wire(event) of each WorkerEvent
        self._cond = threading.Condition()
        self._push_to: str | None = None  # the router's event socket, once it asked (send_events)
        self._pushing = False             # the thread that pushes events there has started
        self._aborted = RecentIds(ABORTED_KEPT)      # late KV of these is dropped on arrival
        self.realtime: dict[str, bool] = {}   # emulated: which of its threads run at real-time priority
        self.kv_in = KVIn(self.engine, self._emit)                    # decode role: KV arriving
        self.out = KVOut(self.engine, self._emit, self._inbox.put, lambda: self.transport)   # prefill role
        self._alive = True
        # What start-up made (torch, Ray, the model or step tables) lives as long as the worker: the cycle
        # collector need never scan it again, as vLLM does after loading (a collection scanned it every
        # few hundred steps, which cost an emulated decode step of 32 requests 0.8 ms instead of 0.16)
        gc.freeze()
        self._loop = threading.Thread(target=self._run, name=f"engine-{rank}", daemon=True)
        self._loop.start()

    # -- remote API -----------------------------------------------------------------------------
    def info(self) -> dict:
        e = self.engine
        return {"rank": self.rank, "role": self.role, "pid": os.getpid(), "host": _node_ip(),
                "device": str(e.device), "dtype": str(e.dtype).removeprefix("torch."),
                "gpu": torch.cuda.get_device_name(e.device) if e.device.type == "cuda" else None,
                "num_kv_blocks": e.blocks.num_blocks, "block_size": e.cfg.block_size,
                "max_model_len": e.max_model_len, "vocab_size": e.mcfg.vocab_size, "num_layers": e.mcfg.num_layers,
                "kv_bytes_per_token": e.mcfg.kv_bytes_per_token(e.cache.pool.element_size()),
                "torch_threads": torch.get_num_threads(), "node_id": _node_id(), "node_cores": self.node_cores,
                "memory": e.memory(), "realtime": dict(self.realtime)}

    def clock(self) -> float:
        """This worker's clock, for the router's offset probes."""
        return time.time()

    def isolate(self, cores: list[int], threads: int, timeout_s: float = 30.0) -> dict:
        """Pin every thread of this worker to `cores` and run torch with `threads` threads; returns what
        the loop thread reads back: {cores, torch_threads, error}."""
        return self._ask(Isolate(list(cores), threads, threading.Event(), {}), "pin itself", timeout_s)

    def probe(self, timeout_s: float = 60.0) -> dict:
        """The speed probe's medians (workers/probe.py), timed by the loop thread before any request:
        {decode_s, prefill_s, context, prompt_tokens, rounds}, or {error} where it could not run."""
        return self._ask(Probe(threading.Event(), {}), "time the speed probe", timeout_s)

    def _ask(self, item, what: str, timeout_s: float) -> dict:
        self._inbox.put(item)
        if not item.done.wait(timeout_s):
            raise RuntimeError(f"{self.role} worker {self.rank}: the loop thread did not {what} within "
                               f"{timeout_s:g} s (alive: {self._loop.is_alive()})")
        return item.result

    def affinity(self) -> dict:
        """The cores each thread of this process may run on, read back: {thread id: [cores]}."""
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                out[int(tid)] = usable_cores(int(tid))
            except OSError:
                pass
        return out

    def zmq_bind(self, cfg: TransferConfig, host: str) -> str:
        from cluster.transfer.zmq_transport import ZmqTransport
        self.transport = ZmqTransport(cfg, host, device=self.engine.device, link=self.link)
        return self.transport.bind()

    def zmq_connect(self, cfg: TransferConfig, peers: dict[int, str]) -> None:
        from cluster.transfer.zmq_transport import ZmqTransport
        if self.transport is None:
            self.transport = ZmqTransport(cfg, "127.0.0.1", device=self.engine.device, link=self.link)
        self.transport.connect(peers)

    def nccl_init(self, cfg: TransferConfig, world_size: int, store_host: str, store_port: int,
                  pairs: list[tuple[int, int]], bind_host: str = "127.0.0.1", members: list[int] | None = None) -> None:
        """Join the torch.distributed group of `members` (worker ranks; None: ranks 0..world_size-1)."""
        from cluster.transfer.nccl_transport import NcclTransport
        if self.link is not None:
            raise ValueError("engine.timing=emulated: its KV parts declare their bytes, which only the zmq wire "
                             "carries (transfer=zmq)")
        self.transport = NcclTransport(cfg, self.rank, world_size, store_host, store_port, pairs,
                                       self.engine.device, bind_host, members)

    def nccl_leave(self) -> None:
        """Leave a torch.distributed group that could not form (a member was lost), so it can form again."""
        from cluster.transfer.nccl_transport import leave_group
        self.transport = None
        leave_group()

    def start_receiving(self, max_frame_bytes: int) -> None:
        expect = Expect.for_engine(self.engine, max_frame_bytes)
        self.transport.start_receiving(expect, lambda d: self._inbox.put(Arrived(d)), self._on_transfer_problem)

    def start_streaming(self, stream_layers: int = 1) -> None:
        """Prefill role: let the engine hand over KV as it is computed (its config's kv_stream)."""
        self._inbox.put(SetStream(self.engine.cfg.kv_stream, stream_layers))

    def set_stream(self, mode: str, stream_layers: int = 1) -> None:
        """Prefill role: change how KV streams (off | layer | chunk), from the next step on."""
        self._inbox.put(SetStream(mode, stream_layers))

    def submit(self, rid: str, prompt_ids: list[int], params: dict, dst: int | None = None,
               drop_transfer: bool = False, whole: bool = False) -> None:
        self._inbox.put(Submit(rid, prompt_ids, params, dst, drop_transfer, whole, time.time()))

    def abort(self, rid: str) -> None:
        self._inbox.put(Abort(rid))

    def poll(self, timeout_s: float = 0.5) -> dict:
        with self._cond:
            if self._push_to is None:
                if not self._events:
                    self._cond.wait(timeout_s)
                events, self._events = self._events, []
                return {"events": events}
        time.sleep(timeout_s)                 # the events go to the router's socket: an answer is a heartbeat
        return {"events": []}

    def listen(self, host: str) -> str:
        """Bind a ZeroMQ PULL socket on `host` for the router's commands (submit, abort: msgpack lists, as
        the calls of the same names take them) and serve it from a thread; returns its address. Commands
        over one socket arrive in the order they were sent, and skip a Ray call each."""
        import zmq

        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind_to_random_port(f"tcp://{host}")
        threading.Thread(target=self._command_loop, args=(sock,), name=f"commands-{self.rank}", daemon=True).start()
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _command_loop(self, sock) -> None:
        import msgpack

        self._timed_thread("commands")
        commands = {"submit": self.submit, "abort": self.abort}
        while True:
            try:
                msg = msgpack.unpackb(sock.recv(), raw=False)
                commands[msg[0]](*msg[1:])
            except Exception as e:   # a malformed command is said, and the next one served
                self._emit(TransportError(f"command socket: {type(e).__name__}: {str(e)[:200]}"))

    def send_events(self, address: str | None) -> None:
        """Push every event from now on (and any not yet taken) to the router's ZeroMQ socket at `address`,
        a batch per message: [this worker's rank, msgpack list of to_wire dicts]. A later call points the
        pusher at another router's socket; None (a router closing) keeps them for `poll` again."""
        with self._cond:
            self._push_to = address
            self._cond.notify_all()
            start = address is not None and not self._pushing
            self._pushing = self._pushing or start
        if start:
            threading.Thread(target=self._push_loop, name=f"events-{self.rank}", daemon=True).start()

    def _push_loop(self) -> None:
        import msgpack
        import zmq

        self._timed_thread("events")
        ctx, sock, where = zmq.Context.instance(), None, None
        rank = str(self.rank).encode()
        while True:
            with self._cond:
                while (not self._events or self._push_to is None) and self._push_to == where:
                    self._cond.wait(1.0)
                target = self._push_to
                events, self._events = (self._events, []) if target is not None else ([], self._events)
            try:
                if target != where:
                    if sock is not None:
                        sock.close(linger=0)
                    sock, where = None, target
                    if target is not None:
                        sock = ctx.socket(zmq.PUSH)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(target)
                if events:
                    sock.send_multipart([rank, msgpack.packb(events, use_bin_type=True)], flags=zmq.NOBLOCK)
            except zmq.Again:       # the router's end is full or gone: they wait here for it, or for another
                with self._cond:
                    self._events[:0] = events
                time.sleep(0.01)
            except Exception:   # nothing may stop the events; what this one would have said goes to the log
                print(f"worker {self.rank}: pushing events to {target}: {traceback.format_exc(limit=4)}",
                      file=sys.stderr, flush=True)
                time.sleep(0.05)

    def trace(self, drain: bool = False) -> list[dict]:
        """The engine's step records; drain=True also drops them here (a long-running server
        collects them as it goes, so they do not pile up in the worker)."""
        steps = self.engine.take_trace() if drain else list(self.engine.trace)
        return [s.to_dict() for s in steps]

    def memory_used(self) -> dict:
        """This worker process's resident memory now and at its peak (/proc/self/status), in bytes."""
        out = {}
        try:
            for line in open("/proc/self/status"):
                key = {"VmRSS:": "rss_bytes", "VmHWM:": "peak_rss_bytes"}.get(line.split(None, 1)[0])
                if key:
                    out[key] = int(line.split()[1]) * 1024
        except OSError:
            pass
        return out

    def stats(self) -> dict:
        """Live gauges for a front end's /metrics, read without stopping the loop (each value is
        atomic; together they may be one step apart)."""
        e = self.engine
        return {"num_blocks_used": e.blocks.num_used, "num_kv_blocks": e.blocks.num_blocks,
                "num_running": len(e.scheduler.running), "num_waiting": len(e.scheduler.waiting),
                "num_steps": e.num_steps, "num_preempted": e.num_preempted}

    # -- the loop thread ------------------------------------------------------------------------
    def _emit(self, event: WorkerEvent) -> None:
        with self._cond:
            self._events.append(to_wire(event))
            self._cond.notify_all()

    def _on_transfer_problem(self, p: TransferProblem) -> None:
        """From a receive thread: tie the problem to its request when known, else to this worker."""
        if p.fatal:
            self._emit(OutOfService(p.reason))
        elif p.request_id is not None:    # the loop thread ends its import (if begun) and says so
            self._inbox.put(Dropped(p.request_id, p.reason))
        else:
            self._emit(TransportError(p.reason))

    def _timed_thread(self, name: str) -> None:
        """An emulated worker's thread whose waits time the emulation takes real-time priority."""
        if self.engine.emulated:
            self.realtime[name] = realtime()

    def _run(self) -> None:
        self._timed_thread("loop")
        try:
            while self._alive:
                idle = not (self.engine.has_work() or self.kv_in.waiting)
                try:
                    item = self._inbox.get(timeout=0.05) if idle else self._inbox.get_nowait()
                except queue.Empty:
                    item = None
                while item is not None:
                    self._handle(item)
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        item = None
                self.kv_in.admit()
                if self.engine.has_work():
                    self._step()
        except Exception:
            self._emit(Fatal(traceback.format_exc(limit=8)))
            self._alive = False

    def _handle(self, item) -> None:
        if isinstance(item, Submit):
            try:
                self.engine.add_request(item.rid, item.prompt_ids, item.params, arrival_time=item.time,
                                        whole=item.whole)
            except Exception as e:   # InvalidRequest, or anything the rules missed: this request alone
                self._emit(Rejected(item.rid, reason_of(e)))
                return
            if item.dst is not None and not item.whole:
                self.out.dst[item.rid] = item.dst
            if item.drop_transfer:
                self.out.drop.add(item.rid)
        elif isinstance(item, Abort):
            rid = item.rid
            self._aborted.add(rid)
            self.out.cancel(rid, "aborted")
            self.engine.abort(rid)
            self.kv_in.end(rid)
        elif isinstance(item, Isolate):
            error = None
            try:
                pin_process(item.cores)
            except OSError as e:
                error = f"could not pin to cores {item.cores}: {e}"
            torch.set_num_threads(max(1, item.threads))
            item.result.update(cores=usable_cores(), torch_threads=torch.get_num_threads(), error=error)
            item.done.set()
        elif isinstance(item, Probe):
            try:
                item.result.update(speed_probe(self.engine))
            except Exception as e:      # a worker that cannot probe still serves; the run says why
                item.result.update(error=f"{type(e).__name__}: {e}")
            item.done.set()
        elif isinstance(item, SetStream):
            self.engine.cfg = self.engine.cfg.replace(kv_stream=item.mode)
            self.engine.kv_listener = self.out.on_kv if item.mode != "off" else None
            self.out.stream_layers = item.stream_layers
        elif isinstance(item, Arrived):
            self.kv_in.receive(item.delivery, self._aborted)
        elif isinstance(item, Dropped):
            if self.kv_in.end(item.rid):
                self._emit(ImportFailed(item.rid, item.reason))
            else:   # a message naming a request with no import here (hostile, or late): still said
                self._emit(TransportError(f"request {str(item.rid)[:80]!r}: {item.reason}"))
        elif isinstance(item, Exported):
            req = self.engine.requests.get(item.rid)
            if item.failure is not None:
                if req is not None:
                    self.engine.abort(item.rid, item.failure)
                self._emit(Failed(item.rid, item.failure))
            elif req is not None and req.status.value == "handoff":
                self.engine.release(item.rid)

    # -- the step, and sending KV (prefill role) --------------------------------------------------
    def _step(self) -> None:
        events = self.engine.step()
        if not events:
            return
        first_scheduled, tokens, failed = {}, [], []
        end = None                   # the step's end: every token's time (a failure's is later)
        for ev in events:
            if isinstance(ev, RequestFailed):
                failed.append(ev)
                continue
            end = ev.time if end is None else end
            tokens.append((ev.request_id, ev.token, ev.finish_reason))
            if ev.first_scheduled is not None:
                first_scheduled[ev.request_id] = ev.first_scheduled
            if ev.finish_reason == "handoff":
                try:          # start the KV on its way (or finish streaming it) before telling the router
                    self.out.hand_off(ev.request_id, ev.token, ev.time)
                except Exception as e:   # the header could not be made: this request alone ends here
                    failed.append(self.engine.fail(ev.request_id, f"KV export failed: {reason_of(e)}"))
            elif ev.finish_reason is not None:
                self.out.cancel(ev.request_id, "finished on the prefill worker")
        if tokens:
            self._emit(Step(end, tokens, first_scheduled))
        for ev in failed:
            self.out.cancel(ev.request_id, f"failed on the prefill worker: {ev.reason}")
            self.out.dst.pop(ev.request_id, None)
            self._emit(Failed(ev.request_id, ev.reason))

def _node_id() -> str | None:
    try:
        import ray
        # asking an uninitialized Ray for its context would start one (a Worker run in-process, in tests)
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def _node_ip() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
