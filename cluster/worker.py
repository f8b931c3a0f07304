"""One worker per GPU: an engine, the thread that steps it, and its ends of the KV wires.

Runs inside a threaded Ray actor (see pool.py); the engine it steps (workers/) knows nothing of Ray or
the wires. Only the loop thread touches the engine; remote calls put work in an inbox and read events
from an outbox. `poll` is a long poll: it
returns every event since the last poll (whole steps' tokens at once), or waits for the next.

No request takes the worker down: an exception while admitting, stepping, exporting or importing one
request fails that request (a `failed`, `rejected` or `import_failed` event naming it) and the loop
goes on. Every exception on a sender or receiver thread ends in an event too.

The KV of a handoff goes out from a sender thread per destination, which reads it from the pool:
after the prefill (`transfer.stream=off`), or as the prefill computes it: each layer during the
last chunk's step (`layer`; groups of `stream_layers` layers), or each chunk after its step
(`chunk`). A prefill worker keeps a request's blocks until its sender has read all of them. A
decode worker begins the import when the transfer begins (blocks allowing; else it keeps the parts
until blocks free up, in arrival order), copies each part into the request's blocks as it lands,
and schedules the request once the end brings its first token.

Times in events are this worker's clock (time.time()); the router reads it through `clock` probes and
converts every time to its own clock (router/clock.py).

Events (plain dicts, one per kind):
    step      end, tokens [[rid, token, finish_reason|None]], first_scheduled {rid: t}
              end: when the step's forward pass and sampling finished, the time of each of its tokens
    rejected  rid, reason                         the engine refused the request
    failed    rid, reason                         it failed while being served; its blocks are freed
    sent      rid, dst, bytes, seconds, start     KV handed to the wire, the end included (start: its begin)
    send_failed rid, dst, reason                  (a refusal by the receiver included)
    imported  rid, bytes, recv_s, arrived, prefill_end, time   every part is in this engine's pool
                                                  (arrived: last byte in; prefill_end: the prefill
                                                  worker's clock when its step made the first token)
    import_failed rid, reason                     (a transfer the receiver dropped included)
    transport_error message                       a wire problem tied to no request
    out_of_service reason                         this worker can receive no more KV
    fatal     message                             the loop died; the worker is out of service
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from cluster.isolation import pin_process, usable_cores
from cluster.transfer.base import Begin, Cancel, Delivery, End, Part, TransferConfig, TransferProblem
from cluster.transfer.wire import Expect, KVHandoff, handoff_for
from workers.config import EngineConfig
from workers.engine import Engine
from workers.events import KVReady, KVReset, RequestFailed
from workers.request import InvalidRequest
from workers.weights import ModelSpec, build_model, parse_device, resolve_dtype


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
class Exported:
    rid: str                             # its sender has read every part: the blocks may go
    failure: str | None = None           # or could not read them: the request fails here


# What the loop thread asks of a sender thread, in order per destination.
@dataclass
class SendBegin:
    handoff: KVHandoff


@dataclass
class SendPart:
    rid: str
    layers: tuple[int, int]
    tokens: tuple[int, int]
    block_ids: list[int]                 # the request's blocks when the part was final
    ready: object | None = None          # GPU: an event on the compute stream after which it is final


@dataclass
class SendEnd:
    rid: str
    first_token: int
    first_token_time: float


@dataclass
class SendCancel:
    rid: str
    reason: str


@dataclass
class Incoming:
    """A request's KV arriving here: its import begun once blocks allowed, parts waiting till then."""

    handoff: KVHandoff
    began: bool = False
    staged: list[Part] = field(default_factory=list)
    end: End | None = None


@dataclass
class Isolate:
    """Pin this process to `cores` and set torch's threads, done by the loop thread (torch's thread
    count is per thread); the caller waits on `done` for `result`."""
    cores: list
    threads: int
    done: threading.Event
    result: dict


def _reason(e: Exception) -> str:
    return e.reason if isinstance(e, InvalidRequest) else f"{type(e).__name__}: {e}"


class Worker:
    def __init__(self, rank: int, spec: ModelSpec, engine_cfg: EngineConfig, torch_threads: int = 0):
        # The loop thread holds the GIL between torch calls; without this, the sender, receiver and
        # poll threads wait up to Python's default 5 ms for it, which shows up in every handoff.
        sys.setswitchinterval(2e-4)
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.rank = rank
        self.role = engine_cfg.role
        self.node_cores = usable_cores()          # before any pinning: the cores of this node we may use
        device = parse_device(spec.device)
        dtype = resolve_dtype(spec.dtype, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = build_model(model=spec.model if spec.checkpoint is None else None,
                            checkpoint=spec.checkpoint, dtype=dtype, device=device, seed=spec.seed)
        self.engine = Engine(model, engine_cfg)
        self.transport = None
        self._inbox: queue.Queue = queue.Queue()
        self._events: list[dict] = []
        self._cond = threading.Condition()
        self._senders: dict[int, queue.Queue] = {}
        self._incoming: dict[str, Incoming] = {}      # decode role, arrival order (loop thread only)
        self._dst: dict[str, int] = {}                # prefill role: where each request's KV goes
        self._drop: set[str] = set()                  # fault injection: transfers that never happen
        self._aborted: set[str] = set()
        self._streaming: dict[str, list] = {}         # prefill role: begun transfers -> layers not yet sent
        self._cancelled: set[str] = set()             # aborted while its sender may still be busy with it
        self.stream_layers = 1
        self._alive = True
        self._stats_steps = self._num_preempted = 0   # steps of the trace counted by stats()
        self._stats_lock = threading.Lock()
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
                "memory": e.memory()}

    def clock(self) -> float:
        """This worker's clock, for the router's offset probes."""
        return time.time()

    def isolate(self, cores: list[int], threads: int, timeout_s: float = 30.0) -> dict:
        """Pin every thread of this worker to `cores` and run torch with `threads` threads; returns what
        the loop thread reads back: {cores, torch_threads, error}."""
        item = Isolate(list(cores), threads, threading.Event(), {})
        self._inbox.put(item)
        if not item.done.wait(timeout_s):
            raise RuntimeError(f"{self.role} worker {self.rank}: the loop thread did not pin itself within "
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
        self.transport = ZmqTransport(cfg, host)
        return self.transport.bind()

    def zmq_connect(self, cfg: TransferConfig, peers: dict[int, str]) -> None:
        from cluster.transfer.zmq_transport import ZmqTransport
        if self.transport is None:
            self.transport = ZmqTransport(cfg, "127.0.0.1")
        self.transport.connect(peers)

    def nccl_init(self, cfg: TransferConfig, world_size: int, store_host: str, store_port: int,
                  pairs: list[tuple[int, int]], bind_host: str = "127.0.0.1") -> None:
        from cluster.transfer.nccl_transport import NcclTransport
        self.transport = NcclTransport(cfg, self.rank, world_size, store_host, store_port, pairs,
                                       self.engine.device, bind_host)

    def start_receiving(self, max_frame_bytes: int) -> None:
        expect = Expect.for_engine(self.engine, max_frame_bytes)
        self.transport.start_receiving(expect, lambda d: self._inbox.put(Arrived(d)), self._on_transfer_problem)

    def start_streaming(self, stream_layers: int = 1) -> None:
        """Prefill role: let the engine hand over KV as it is computed (its config's kv_stream)."""
        self.stream_layers = stream_layers
        if self.engine.cfg.kv_stream != "off":
            self.engine.kv_listener = self._on_kv

    def submit(self, rid: str, prompt_ids: list[int], params: dict, dst: int | None = None,
               drop_transfer: bool = False, whole: bool = False) -> None:
        self._inbox.put(Submit(rid, prompt_ids, params, dst, drop_transfer, whole, time.time()))

    def abort(self, rid: str) -> None:
        self._inbox.put(Abort(rid))

    def poll(self, timeout_s: float = 0.5) -> dict:
        with self._cond:
            if not self._events:
                self._cond.wait(timeout_s)
            events, self._events = self._events, []
        return {"events": events}

    def trace(self) -> list[dict]:
        return [s.to_dict() for s in list(self.engine.trace)]

    def stats(self) -> dict:
        """Live gauges for a front end's /metrics, read without stopping the loop (each value is
        atomic; together they may be one step apart)."""
        e, trace = self.engine, self.engine.trace
        with self._stats_lock:
            n = len(trace)
            self._num_preempted += sum(s.num_preempted for s in trace[self._stats_steps:n])
            self._stats_steps = n
        return {"num_blocks_used": e.blocks.num_used, "num_kv_blocks": e.blocks.num_blocks,
                "num_running": len(e.scheduler.running), "num_waiting": len(e.scheduler.waiting),
                "num_steps": n, "num_preempted": self._num_preempted}

    # -- the loop thread ------------------------------------------------------------------------
    def _emit(self, event: dict) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def _on_transfer_problem(self, p: TransferProblem) -> None:
        """From a receive thread: tie the problem to its request when known, else to this worker."""
        if p.fatal:
            self._emit({"kind": "out_of_service", "reason": p.reason})
        elif p.request_id is not None:    # the loop thread ends its import (if begun) and says so
            self._inbox.put(Dropped(p.request_id, p.reason))
        else:
            self._emit({"kind": "transport_error", "message": p.reason})

    def _run(self) -> None:
        try:
            while self._alive:
                idle = not (self.engine.has_work() or any(not i.began for i in self._incoming.values()))
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
                self._admit_incoming()
                if self.engine.has_work():
                    self._step()
        except Exception:
            self._emit({"kind": "fatal", "message": traceback.format_exc(limit=8)})
            self._alive = False

    def _handle(self, item) -> None:
        if isinstance(item, Submit):
            try:
                self.engine.add_request(item.rid, item.prompt_ids, item.params, arrival_time=item.time,
                                        whole=item.whole)
            except Exception as e:   # InvalidRequest, or anything the rules missed: this request alone
                self._emit({"kind": "rejected", "rid": item.rid, "reason": _reason(e)})
                return
            if item.dst is not None and not item.whole:
                self._dst[item.rid] = item.dst
            if item.drop_transfer:
                self._drop.add(item.rid)
        elif isinstance(item, Abort):
            rid = item.rid
            self._aborted.add(rid)
            self._cancel_send(rid, "aborted")
            self.engine.abort(rid)
            self._end_incoming(rid)
        elif isinstance(item, Isolate):
            error = None
            try:
                pin_process(item.cores)
            except OSError as e:
                error = f"could not pin to cores {item.cores}: {e}"
            torch.set_num_threads(max(1, item.threads))
            item.result.update(cores=usable_cores(), torch_threads=torch.get_num_threads(), error=error)
            item.done.set()
        elif isinstance(item, Arrived):
            self._receive(item.delivery)
        elif isinstance(item, Dropped):
            if self._end_incoming(item.rid):
                self._emit({"kind": "import_failed", "rid": item.rid, "reason": item.reason})
        elif isinstance(item, Exported):
            req = self.engine.requests.get(item.rid)
            if item.failure is not None:
                if req is not None:
                    self.engine.abort(item.rid, item.failure)
                self._emit({"kind": "failed", "rid": item.rid, "reason": item.failure})
            elif req is not None and req.status.value == "handoff":
                self.engine.release(item.rid)

    # -- receiving KV (decode role) ---------------------------------------------------------------
    def _receive(self, d: Delivery) -> None:
        rid = d.handoff.request_id if isinstance(d, Begin) else d.request_id
        inc = self._incoming.get(rid)
        if isinstance(d, Begin):
            if rid in self._aborted:
                return
            try:   # refused at once if it could never be imported here: waiting would block those behind it
                self.engine.validate(rid, d.handoff.prompt_ids, d.handoff.params)
            except Exception as e:
                self._emit({"kind": "import_failed", "rid": rid, "reason": _reason(e)})
                return
            self._incoming[rid] = Incoming(d.handoff)
        elif isinstance(d, Part):
            if inc is None:                     # refused, aborted or dropped: its parts just go
                d.release()
            elif inc.began:
                self._import_part(rid, d)
            else:
                inc.staged.append(d)
        elif isinstance(d, End):
            if inc is not None:
                inc.end = d
                if inc.began:
                    self._finish_import(rid)
        elif isinstance(d, Cancel):
            self._end_incoming(rid)             # the sender gave up; it will retry or has told the router

    def _admit_incoming(self) -> None:
        """Begin imports in arrival order while blocks allow; a waiting one keeps its parts."""
        for rid, inc in list(self._incoming.items()):
            if inc.began:
                continue
            if not self.engine.can_import(len(inc.handoff.prompt_ids)):
                return                           # first come, first served: no overtaking
            h = inc.handoff
            try:
                self.engine.begin_import(rid, h.prompt_ids, h.params)
            except Exception as e:
                self._end_incoming(rid)
                self._emit({"kind": "import_failed", "rid": rid, "reason": _reason(e)})
                continue
            inc.began = True
            staged, inc.staged = inc.staged, []
            for part in staged:
                if not self._import_part(rid, part):
                    for rest in staged:
                        rest.release()
                    break
            if rid in self._incoming and inc.end is not None:
                self._finish_import(rid)

    def _import_part(self, rid: str, part: Part) -> bool:
        try:
            self.engine.import_kv(rid, part.first_layer, part.kv, part.start)
            return True
        except Exception as e:   # refused, or failed while copying in: its blocks are freed
            self._end_incoming(rid)
            self._emit({"kind": "import_failed", "rid": rid, "reason": _reason(e)})
            return False
        finally:
            part.release()                        # copied into the pool, or refused: done with it

    def _finish_import(self, rid: str) -> None:
        end = self._incoming.pop(rid).end
        try:
            self.engine.finish_import(rid, end.first_token)
        except Exception as e:
            self.engine.abort(rid, "import failed")
            self._emit({"kind": "import_failed", "rid": rid, "reason": _reason(e)})
            return
        self._emit({"kind": "imported", "rid": rid, "bytes": end.nbytes, "recv_s": end.recv_s,
                    "arrived": end.arrived, "prefill_end": end.first_token_time, "time": time.time()})

    def _end_incoming(self, rid: str) -> bool:
        """Forget a transfer here: its import (if begun) aborted, its waiting parts released."""
        inc = self._incoming.pop(rid, None)
        if inc is None:
            return False
        for part in inc.staged:
            part.release()
        if inc.began:
            self.engine.abort(rid, "transfer ended")
        return True

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
            end = ev.time if end is None else end
            tokens.append([ev.request_id, ev.token, ev.finish_reason])
            if ev.first_scheduled is not None:
                first_scheduled[ev.request_id] = ev.first_scheduled
            if ev.finish_reason == "handoff":
                try:          # start the KV on its way (or finish streaming it) before telling the router
                    self._hand_off(ev.request_id, ev.token, ev.time)
                except Exception as e:   # the header could not be made: this request alone ends here
                    failed.append(self.engine.fail(ev.request_id, f"KV export failed: {_reason(e)}"))
            elif ev.finish_reason is not None:
                self._cancel_send(ev.request_id, "finished on the prefill worker")
        if tokens:
            self._emit({"kind": "step", "end": end, "tokens": tokens, "first_scheduled": first_scheduled})
        for ev in failed:
            self._cancel_send(ev.request_id, f"failed on the prefill worker: {ev.reason}")
            self._dst.pop(ev.request_id, None)
            self._emit({"kind": "failed", "rid": ev.request_id, "reason": ev.reason})

    def _on_kv(self, ev: KVReady | KVReset) -> None:
        """The engine's listener, in the loop thread during a step: queue each final part of a
        streaming request's KV for its sender (which reads it from the pool)."""
        rid = ev.request_id
        dst = self._dst.get(rid)
        if dst is None or rid in self._drop:
            return
        if isinstance(ev, KVReset):
            if self._streaming.pop(rid, None) is not None:
                self._sender(dst).put(SendCancel(rid, "preempted on the prefill worker; its KV streams again"))
            return
        req = self.engine.requests[rid]
        if rid not in self._streaming:
            self._streaming[rid] = []
            self._sender(dst).put(SendBegin(handoff_for(req, self.engine.mcfg, self.engine.dtype)))
        held = self._streaming[rid]                # a run of layers of one token range, not yet queued
        if held and (held[1] != ev.first_layer or held[2:] != [ev.start, ev.end]):
            self._queue_part(rid, dst, req, *held)
            held.clear()
        if held:
            held[1] = ev.end_layer
        else:
            held[:] = [ev.first_layer, ev.end_layer, ev.start, ev.end]
        if held[1] - held[0] >= self.stream_layers or held[1] == self.engine.mcfg.num_layers:
            self._queue_part(rid, dst, req, *held)
            held.clear()

    def _queue_part(self, rid, dst, req, l0, l1, t0, t1) -> None:
        ready = None
        if self.engine.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self._sender(dst).put(SendPart(rid, (l0, l1), (t0, t1), list(req.block_ids), ready))

    def _hand_off(self, rid: str, first_token: int, first_token_time: float) -> None:
        req = self.engine.requests[rid]
        dst = self._dst.pop(rid, None)
        if rid in self._drop or dst is None:           # fault injection: this transfer never happens
            self._drop.discard(rid)
            self.engine.release(rid)
            return
        q = self._sender(dst)
        if self._streaming.pop(rid, None) is None:     # not streamed: all of it goes now
            q.put(SendBegin(handoff_for(req, self.engine.mcfg, self.engine.dtype)))
            self._queue_part(rid, dst, req, 0, self.engine.mcfg.num_layers, 0, req.num_prompt_tokens)
        q.put(SendEnd(rid, first_token, first_token_time))

    def _cancel_send(self, rid: str, reason: str) -> None:
        """A transfer begun (streaming) or queued whose request will not hand off: its sender says so."""
        dst = self._dst.pop(rid, None)
        if dst is None:
            return
        self._cancelled.add(rid)
        self._streaming.pop(rid, None)
        self._sender(dst).put(SendCancel(rid, reason))

    def _sender(self, dst: int) -> queue.Queue:
        if dst not in self._senders:
            q: queue.Queue = queue.Queue()
            threading.Thread(target=self._send_loop, args=(dst, q), name=f"kv-send-{dst}", daemon=True).start()
            self._senders[dst] = q
        return self._senders[dst]

    def _send_loop(self, dst: int, q: queue.Queue) -> None:
        """One destination's transfers, message by message; every failure ends in an event."""
        channel, begun, failed = None, {}, set()      # begun: rid -> [start wall time, perf start, bytes]
        while True:
            item = q.get()
            rid = item.handoff.request_id if isinstance(item, SendBegin) else item.rid
            try:
                if channel is None:
                    channel = self.transport.channel(dst)
                if isinstance(item, SendCancel):
                    if rid in begun:
                        channel.cancel(rid, item.reason)
                    begun.pop(rid, None)
                    failed.discard(rid)
                    self._cancelled.discard(rid)
                    continue
                if rid in failed:
                    failed.discard(rid) if isinstance(item, SendEnd) else None
                    continue
                if isinstance(item, SendBegin):
                    begun[rid] = [time.time(), time.perf_counter(), 0]
                    channel.begin(item.handoff)
                elif isinstance(item, SendPart):
                    try:
                        kv = self._read_part(item)
                    except Exception as e:   # not the wire's fault: the request fails, and is not retried
                        if rid in begun:
                            channel.cancel(rid, "its KV could not be read on the prefill worker")
                        begun.pop(rid, None)
                        failed.add(rid)
                        self._inbox.put(Exported(rid, f"KV export failed: {_reason(e)}"))
                        continue
                    channel.part(rid, item.layers[0], item.tokens[0], kv)
                    begun[rid][2] += kv.numel() * kv.element_size()
                    del kv
                elif isinstance(item, SendEnd):
                    if rid in self._cancelled:          # aborted while we were sending it
                        continue
                    channel.end(rid, item.first_token, item.first_token_time)
                    wall, perf, nbytes = begun.pop(rid)
                    self._inbox.put(Exported(rid))
                    self._emit({"kind": "sent", "rid": rid, "dst": dst, "bytes": nbytes,
                                "seconds": time.perf_counter() - perf, "start": wall})
            except Exception as e:   # this request's KV is not delivered; the thread serves the next
                begun.pop(rid, None)
                failed.add(rid)
                if isinstance(item, SendEnd):
                    failed.discard(rid)
                self._inbox.put(Exported(rid))           # its blocks go; the router retries it
                self._emit({"kind": "send_failed", "rid": rid, "dst": dst, "reason": f"{type(e).__name__}: {e}"})

    def _read_part(self, item: SendPart) -> torch.Tensor:
        """The part's KV out of the pool, in this thread (on a GPU: on this thread's stream, after
        the compute stream's event; staged in pinned memory for a wire that sends from the host)."""
        (l0, l1), (t0, t1) = item.layers, item.tokens
        if item.ready is None:
            return self.engine.cache.export(item.block_ids, t1, layers=(l0, l1), start=t0)
        torch.cuda.current_stream().wait_event(item.ready)
        kv = self.engine.cache.export(item.block_ids, t1, layers=(l0, l1), start=t0)
        if self.transport.name == "zmq":
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            return host
        return kv


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
