"""A prefill worker's side of the KV wire: a sender thread per destination, which reads each part of
a request's KV out of the pool and puts it on the wire.

The KV goes after the prefill (`transfer.stream=off`: a begin, the whole KV, the end), or as the
prefill computes it: the engine tells `on_kv` when a part is final (each layer during the last
chunk's step for `layer`, grouped `stream_layers` at a time; each chunk after its step for `chunk`),
and the end follows once the step has made the first token (`hand_off`). A request that will not
hand off after all (finished on the prefill worker, failed, aborted, preempted) is cancelled at the
receiver. The blocks stay until the sender has read every part: it then reports `Exported` to the
loop thread, which releases them. Every failure ends in an event: `send_failed` (the wire: the
router retries) or `failed` (the KV could not be read: not retried).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from cluster.events import SendFailed, Sent, TransportError, WorkerEvent
from cluster.kv_in import reason_of
from cluster.transfer import staging
from cluster.transfer.wire import KVHandoff, handoff_for
from workers.emulated import realtime
from workers.engine import Engine
from workers.events import KVReady, KVReset


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


class KVOut:
    def __init__(self, engine: Engine, emit: Callable[[WorkerEvent], None], done: Callable[[Exported], None],
                 transport: Callable[[], object]):
        self.engine = engine
        self.emit = emit
        self.done = done                              # to the loop thread: a request's sender is done
        self.transport = transport                    # the worker's transport, once it has one
        self.dst: dict[str, int] = {}                 # where each request's KV goes
        self.drop: set[str] = set()                   # fault injection: transfers that never happen
        self._senders: dict[int, queue.Queue] = {}
        self._streaming: dict[str, list] = {}         # begun transfers -> a run of layers not yet queued
        self._cancelled: set[str] = set()             # aborted while its sender may still be busy with it
        self.stream_layers = 1

    def on_kv(self, ev: KVReady | KVReset) -> None:
        """The engine's listener, in the loop thread during a step: queue each final part of a
        streaming request's KV for its sender (which reads it from the pool)."""
        rid = ev.request_id
        dst = self.dst.get(rid)
        if dst is None or rid in self.drop:
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
            ready = staging.cuda.Event()
            ready.record(staging.cuda.current_stream(self.engine.device))   # the compute stream
        self._sender(dst).put(SendPart(rid, (l0, l1), (t0, t1), list(req.block_ids), ready))

    def hand_off(self, rid: str, first_token: int, first_token_time: float) -> None:
        req = self.engine.requests[rid]
        dst = self.dst.pop(rid, None)
        if rid in self.drop or dst is None:           # fault injection: this transfer never happens
            self.drop.discard(rid)
            self.engine.release(rid)
            return
        q = self._sender(dst)
        if self._streaming.pop(rid, None) is None:     # not streamed: all of it goes now
            q.put(SendBegin(handoff_for(req, self.engine.mcfg, self.engine.dtype)))
            self._queue_part(rid, dst, req, 0, self.engine.mcfg.num_layers, 0, req.num_prompt_tokens)
        q.put(SendEnd(rid, first_token, first_token_time))

    def cancel(self, rid: str, reason: str) -> None:
        """A transfer begun (streaming) or queued whose request will not hand off: its sender says so."""
        dst = self.dst.pop(rid, None)
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
        """One destination's transfers, message by message, on a CUDA stream of its own; every
        failure ends in an event, and nothing ends the thread."""
        staging.own_stream(self.engine.device)
        if getattr(self.engine, "emulated", False):    # its waits are an emulated link's: on time, however busy
            realtime()
        state = ({}, set(), [None])       # begun: rid -> [start wall time, perf start, bytes]; failed; channel
        while True:
            item = q.get()
            try:
                self._send_one(dst, item, *state)
            except Exception as e:   # a bug of this loop's own (or of a callback): said, and on to the next
                rid = getattr(item, "rid", None) or getattr(getattr(item, "handoff", None), "request_id", None)
                try:
                    why = f"sender thread to {dst}: {type(e).__name__}: {str(e)[:300]}"
                    self.emit(SendFailed(rid, dst, why) if isinstance(rid, str) else TransportError(why))
                except Exception:
                    print(f"kv sender to {dst}: {traceback.format_exc(limit=4)}", file=sys.stderr, flush=True)

    def _send_one(self, dst: int, item, begun: dict, failed: set, channel: list) -> None:
        rid = item.handoff.request_id if isinstance(item, SendBegin) else item.rid
        try:
            if channel[0] is None:
                channel[0] = self.transport().channel(dst)
            ch = channel[0]
            if isinstance(item, SendCancel):
                if rid in begun:
                    ch.cancel(rid, item.reason)
                begun.pop(rid, None)
                failed.discard(rid)
                self._cancelled.discard(rid)
                return
            if rid in failed:
                failed.discard(rid) if isinstance(item, SendEnd) else None
                return
            if isinstance(item, SendBegin):
                begun[rid] = [time.time(), time.perf_counter(), 0]
                ch.begin(item.handoff)
            elif isinstance(item, SendPart):
                try:
                    kv = self._read_part(item)
                except Exception as e:   # not the wire's fault: the request fails, and is not retried
                    if rid in begun:
                        ch.cancel(rid, "its KV could not be read on the prefill worker")
                    begun.pop(rid, None)
                    failed.add(rid)
                    self.done(Exported(rid, f"KV export failed: {reason_of(e)}"))
                    return
                ch.part(rid, item.layers[0], item.tokens[0], kv)
                begun[rid][2] += kv.numel() * kv.element_size()
                del kv
            elif isinstance(item, SendEnd):
                if rid in self._cancelled:          # aborted while we were sending it
                    return
                ch.end(rid, item.first_token, item.first_token_time)
                wall, perf, nbytes = begun.pop(rid)
                self.done(Exported(rid))
                self.emit(Sent(rid, dst, nbytes, seconds=time.perf_counter() - perf, start=wall))
        except Exception as e:   # this request's KV is not delivered; the thread serves the next
            begun.pop(rid, None)
            failed.add(rid)
            if isinstance(item, SendEnd):
                failed.discard(rid)
            self.done(Exported(rid))           # its blocks go; the router retries it
            self.emit(SendFailed(rid, dst, f"{type(e).__name__}: {str(e)[:300]}"))

    def _read_part(self, item: SendPart) -> torch.Tensor:
        """The part's KV out of the pool, in this thread (on a GPU: on this thread's stream, after
        the compute stream's event; staged in pinned memory for a wire that sends from the host)."""
        (l0, l1), (t0, t1) = item.layers, item.tokens
        if item.ready is None:
            return self.engine.cache.export(item.block_ids, t1, layers=(l0, l1), start=t0)
        staging.cuda.current_stream(self.engine.device).wait_event(item.ready)   # this thread's side stream
        kv = self.engine.cache.export(item.block_ids, t1, layers=(l0, l1), start=t0)
        if self.transport().name == "zmq":
            return staging.to_host(kv)       # pinned; the socket sends it while the next part is read
        return kv
