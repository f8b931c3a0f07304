"""One worker per GPU: an engine, the thread that steps it, and its ends of the KV wires.

Runs inside a threaded Ray actor (see pool.py); the engine it steps (workers/) knows nothing of Ray or
the wires. Only the loop thread touches the engine; remote calls put work in an inbox and read events
from an outbox. `poll` is a long poll: it
returns every event since the last poll (whole steps' tokens at once), or waits for the next.

No request takes the worker down: an exception while admitting, stepping, exporting or importing one
request fails that request (a `failed`, `rejected` or `import_failed` event naming it) and the loop
goes on. Every exception on a sender or receiver thread ends in an event too.

Events (plain dicts, one per kind):
    step      end, tokens [[rid, token, finish_reason|None]], first_scheduled {rid: t}
    rejected  rid, reason                         the engine refused the request
    failed    rid, reason                         it failed while being served; its blocks are freed
    sent      rid, dst, bytes, seconds, start     KV handed to the wire and delivered to it
    send_failed rid, dst, reason                  (a refusal by the receiver included)
    imported  rid, bytes, recv_s, time            KV arrived and is in this engine's pool
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
from dataclasses import dataclass

import torch

from cluster.transfer.base import Arrival, TransferConfig, TransferProblem
from cluster.transfer.wire import Expect, handoff_for
from workers.config import EngineConfig
from workers.engine import Engine, RequestFailed
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
    arrival: Arrival


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
        self._arrivals: list[Arrival] = []            # waiting for free blocks (loop thread only)
        self._dst: dict[str, int] = {}                # prefill role: where each request's KV goes
        self._drop: set[str] = set()                  # fault injection: transfers that never happen
        self._aborted: set[str] = set()
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
                "torch_threads": torch.get_num_threads()}

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
        self.transport.start_receiving(expect, lambda a: self._inbox.put(Arrived(a)), self._on_transfer_problem)

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
        elif p.request_id is not None:
            self._emit({"kind": "import_failed", "rid": p.request_id, "reason": p.reason})
        else:
            self._emit({"kind": "transport_error", "message": p.reason})

    def _run(self) -> None:
        try:
            while self._alive:
                idle = not (self.engine.has_work() or self._arrivals)
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
                self._import_arrivals()
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
            self.engine.abort(rid)
            for a in self._arrivals:
                if a.handoff.request_id == rid:
                    a.release()
            self._arrivals = [a for a in self._arrivals if a.handoff.request_id != rid]
        elif isinstance(item, Arrived):
            a, h = item.arrival, item.arrival.handoff
            if h.request_id in self._aborted:
                a.release()
                return
            try:   # refused at once if it could never be imported here: waiting would block those behind it
                self.engine.validate(h.request_id, h.prompt_ids, h.params)
            except Exception as e:
                a.release()
                self._emit({"kind": "import_failed", "rid": h.request_id, "reason": _reason(e)})
                return
            self._arrivals.append(a)

    def _import_arrivals(self) -> None:
        keep = []
        for a in self._arrivals:
            h = a.handoff
            if not keep and self.engine.can_import(len(h.prompt_ids)):   # in arrival order
                try:
                    self.engine.import_request(h.request_id, h.prompt_ids, h.first_token, h.params, a.parts)
                    self._emit({"kind": "imported", "rid": h.request_id, "bytes": a.nbytes,
                                "recv_s": a.recv_s, "arrived": a.arrived, "time": time.time()})
                except Exception as e:   # refused, or failed while copying in: blocks are freed either way
                    self._emit({"kind": "import_failed", "rid": h.request_id, "reason": _reason(e)})
                finally:
                    a.release()                   # imported (copied into the pool) or refused: done with it
            else:
                keep.append(a)
        self._arrivals = keep

    def _step(self) -> None:
        events = self.engine.step()
        if not events:
            return
        first_scheduled, tokens, handoffs, failed = {}, [], [], []
        for ev in events:
            if isinstance(ev, RequestFailed):
                failed.append(ev)
                continue
            tokens.append([ev.request_id, ev.token, ev.finish_reason])
            if ev.first_scheduled is not None:
                first_scheduled[ev.request_id] = ev.first_scheduled
            if ev.finish_reason == "handoff":
                handoffs.append(ev)
        for ev in handoffs:          # start the KV on its way before telling the router
            try:
                self._hand_off(ev.request_id, ev.time)
            except Exception as e:   # export or header failed: this request alone ends here
                failed.append(self.engine.fail(ev.request_id, f"KV export failed: {_reason(e)}"))
        if tokens:
            self._emit({"kind": "step", "end": events[0].time, "tokens": tokens, "first_scheduled": first_scheduled})
        for ev in failed:
            self._dst.pop(ev.request_id, None)
            self._emit({"kind": "failed", "rid": ev.request_id, "reason": ev.reason})

    def _hand_off(self, rid: str, first_token_time: float) -> None:
        req = self.engine.requests[rid]
        dst = self._dst.pop(rid, None)
        if rid in self._drop or dst is None:           # fault injection: this transfer never happens
            self._drop.discard(rid)
            self.engine.release(rid)
            return
        kv = self.engine.export_kv(rid)
        if kv.device.type == "cuda":
            torch.cuda.current_stream(kv.device).synchronize()
        handoff = handoff_for(req, kv, first_token_time)
        self.engine.release(rid)
        self._sender(dst).put((handoff, kv))

    def _sender(self, dst: int) -> queue.Queue:
        if dst not in self._senders:
            q: queue.Queue = queue.Queue()
            threading.Thread(target=self._send_loop, args=(dst, q), name=f"kv-send-{dst}", daemon=True).start()
            self._senders[dst] = q
        return self._senders[dst]

    def _send_loop(self, dst: int, q: queue.Queue) -> None:
        channel = None
        while True:
            handoff, kv = q.get()
            start = time.time()
            try:
                if channel is None:
                    channel = self.transport.channel(dst)
                seconds = channel.send(handoff, kv)
            except Exception as e:   # this request's KV is not delivered; the thread serves the next
                self._emit({"kind": "send_failed", "rid": handoff.request_id, "dst": dst,
                            "reason": f"{type(e).__name__}: {e}"})
                continue
            finally:
                del kv
            self._emit({"kind": "sent", "rid": handoff.request_id, "dst": dst, "bytes": handoff.nbytes,
                        "seconds": seconds, "start": start})


def _node_ip() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
