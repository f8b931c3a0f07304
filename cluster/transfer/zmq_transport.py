"""KV over ZeroMQ: msgpack headers and raw tensor frames, zero-copy on both ends, streamed in chunks.

Each receiving worker binds one PULL socket to its own address; each sender connects one PUSH
socket per destination. A request travels as a "begin" message (the handoff header) and then one
message per run of layers, each naming its request, so chunks from several senders may
interleave. Sender frames point into the tensor's memory (copy=False, tracked until libzmq is
done with them). The receiver copies each payload frame straight into its place in a recycled
request buffer (recv_into): on CPU one copy into warm memory is cheaper than keeping zero-copy
frames alive until the request completes, which faults in fresh pages for every request.

    begin: [b"B", header]                              header = KVHandoff (msgpack)
    chunk: [b"C", msgpack([request_id, index, first_layer, end_layer]), raw bytes]

Chunks are at most `max_frame_bytes` (the sender refuses a KV whose single layer is larger; libzmq
drops and disconnects a larger message before Python sees it). A begin is refused, and reported
against its request, when `max_pending` transfers are already incomplete or the receive memory in
use would pass `max_pending_bytes`. Incomplete transfers older than `timeout_s` are dropped and
reported, checked every 100 ms whether or not the socket is busy. Any error in a message is reported
(against its request when known), the rest of the message skipped, and the loop goes on; only a
socket that fails stops it, as a fatal problem that takes its worker out of service.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict

import msgpack
import torch
import zmq

from cluster.transfer.base import (Arrival, RecvBuffers, TransferConfig, TransferProblem, TransferTimeout,
                                   check_frame, layer_chunks)
from cluster.transfer.wire import WIRE_DTYPES, Expect, KVHandoff, WireError, decode_header


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


class ZmqChannel:
    """One sender's socket to one receiver. `send` returns once libzmq has taken every frame (small
    frames are batched, so "taken" can precede "written"): keep the channel open while the peer
    reads, as a worker's sender thread does for its whole life."""

    def __init__(self, ctx: zmq.Context, address: str, cfg: TransferConfig):
        self.cfg = cfg
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(address)

    def send(self, handoff: KVHandoff, kv: torch.Tensor) -> float:
        check_frame(kv, self.cfg.max_frame_bytes)
        header = handoff.encode()
        kv = kv.cpu().contiguous() if kv.device.type != "cpu" else kv.contiguous()
        deadline = time.monotonic() + self.cfg.timeout_s
        start = time.perf_counter()
        self.sock.send_multipart([b"B", header])
        trackers = []
        chunk = min(self.cfg.chunk_bytes, self.cfg.max_frame_bytes)
        for index, (l0, l1) in enumerate(layer_chunks(kv, chunk)):
            meta = msgpack.packb([handoff.request_id, index, l0, l1])
            self.sock.send_multipart([b"C", meta], flags=zmq.SNDMORE)
            trackers.append(self.sock.send(_as_bytes_view(kv[l0:l1]), copy=False, track=True))
        for tracker in trackers:      # libzmq holds our memory until each frame is on the wire
            left = deadline - time.monotonic()
            if left <= 0 or not _wait(tracker, left):
                raise TransferTimeout(f"zmq send of {handoff.request_id} not done in {self.cfg.timeout_s} s")
        return time.perf_counter() - start

    def close(self):
        self.sock.close(linger=0)


def _wait(tracker: zmq.MessageTracker, timeout_s: float) -> bool:
    try:
        tracker.wait(timeout_s)
        return True
    except zmq.NotDone:
        return False


class _Assembly:
    """One request's chunks arriving in order."""

    def __init__(self, handoff: KVHandoff, started: float):
        self.handoff = handoff
        self.started = started
        self.next_layer = 0
        self.parts: list[tuple[int, torch.Tensor]] = []
        dtype = WIRE_DTYPES[handoff.dtype]
        self.layer_bytes = math.prod(handoff.shape[1:]) * torch.tensor([], dtype=dtype).element_size()
        self.buf: torch.Tensor | None = None      # uint8 [nbytes]: the whole request, chunks land in place
        self.kv: torch.Tensor | None = None       # the same memory as [L, 2, T, KVH, D]

    def allocate(self, buffers: RecvBuffers) -> None:
        self.buf = buffers.take(self.handoff.nbytes)
        self.kv = self.buf.view(WIRE_DTYPES[self.handoff.dtype]).view(self.handoff.shape)


SWEEP_S = 0.1        # how often incomplete transfers are checked against timeout_s


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ZmqTransport:
    name = "zmq"

    def __init__(self, cfg: TransferConfig, host: str, peers: dict[int, str] | None = None):
        self.cfg = cfg
        self.host = host
        self.peers = dict(peers or {})     # rank -> address of its receiving socket
        self.ctx = zmq.Context.instance()
        self.address: str | None = None
        self._pull: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._buffers = RecvBuffers(torch.device("cpu"))
        self._refused: OrderedDict[str, None] = OrderedDict()   # transfers already reported: their late
                                                                # chunks are dropped without a report each

    def bind(self) -> str:
        """Bind the receiving socket to this node's address; returns where senders connect."""
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes + (1 << 20))
        if self.cfg.port:
            sock.bind(f"tcp://{self.host}:{self.cfg.port}")
        else:
            sock.bind_to_random_port(f"tcp://{self.host}")
        self._pull = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def connect(self, peers: dict[int, str]) -> None:
        self.peers.update(peers)

    def channel(self, dst: int) -> ZmqChannel:
        if dst not in self.peers:
            raise KeyError(f"no zmq address for worker rank {dst}")
        return ZmqChannel(self.ctx, self.peers[dst], self.cfg)

    def start_receiving(self, expect: Expect, deliver, report) -> None:
        if self._pull is None:
            self.bind()
        self._thread = threading.Thread(target=self._receive_loop, args=(expect, deliver, report),
                                        name="kv-recv-zmq", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        """Receive memory in use: incomplete transfers, and complete ones not yet released."""
        return self._buffers.outstanding

    def _receive_loop(self, expect: Expect, deliver, report) -> None:
        pending: dict[str, _Assembly] = {}
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            try:
                if poller.poll(100):
                    self._receive_one(pending, expect, deliver, report)
            except zmq.ZMQError as e:   # the socket itself failed: nothing more can arrive here
                if not self._stop.is_set():
                    report(TransferProblem(f"zmq: receiver stopped: {e}", fatal=True))
                return
            if time.monotonic() - last_sweep >= SWEEP_S:
                self._drop_stale(pending, report)
                last_sweep = time.monotonic()

    def _receive_one(self, pending: dict[str, _Assembly], expect: Expect, deliver, report) -> None:
        try:
            done = self._on_message(pending, expect)
        except zmq.ZMQError:
            raise
        except Exception as e:   # a bad message, or a bug it triggered: drop the message, keep serving
            rid = getattr(e, "request_id", None)
            while self._pull.getsockopt(zmq.RCVMORE):      # skip the rest of the message
                self._pull.recv(copy=False)
            if rid in pending:
                self._buffers.give_back(pending.pop(rid).buf)
            if rid is not None:
                self._forget(rid)
            what = str(e) if isinstance(e, WireError) else f"{type(e).__name__}: {e}"
            report(TransferProblem(f"zmq: rejected message: {what}", rid))   # the id travels beside the text
            return
        if done is not None:
            try:
                deliver(done)
            except Exception as e:
                done.release()
                report(TransferProblem(f"zmq: could not deliver: {type(e).__name__}: {e}", done.handoff.request_id))

    def _on_message(self, pending: dict[str, _Assembly], expect: Expect) -> Arrival | None:
        """Reads one message frame by frame: a chunk's payload is received straight into its place in
        the request's buffer (one copy out of libzmq's message, into memory that is reused)."""
        sock = self._pull
        tag = sock.recv()
        head = sock.recv() if sock.getsockopt(zmq.RCVMORE) else None
        more = sock.getsockopt(zmq.RCVMORE)
        if tag == b"B":
            if head is None or more:
                raise WireError("begin message without exactly 2 frames")
            handoff = decode_header(head, expect)
            rid = handoff.request_id
            if rid in pending:
                raise WireError("a second begin for a transfer already under way; both dropped", rid)
            asm = _Assembly(handoff, time.perf_counter())
            if asm.layer_bytes > expect.max_frame_bytes:
                raise WireError(f"one layer of {asm.layer_bytes} bytes exceeds the "
                                f"frame limit {expect.max_frame_bytes}", rid)
            if len(pending) >= self.cfg.max_pending:
                raise WireError(f"refused, {len(pending)} transfers already incomplete "
                                f"(transfer.max_pending={self.cfg.max_pending})", rid)
            if self._buffers.outstanding + handoff.nbytes > self.cfg.max_pending_bytes:
                raise WireError(f"refused, {handoff.nbytes} bytes more would pass transfer.max_pending_bytes="
                                f"{self.cfg.max_pending_bytes} ({self._buffers.outstanding} in use)", rid)
            asm.allocate(self._buffers)
            pending[rid] = asm
            return None
        if tag != b"C" or head is None or not more:
            raise WireError(f"unknown message tag {tag[:8]!r}, or not 3 frames")
        try:
            meta = msgpack.unpackb(head, raw=False, max_bin_len=0, max_ext_len=0)
        except Exception as e:
            raise WireError(f"chunk header is not msgpack: {e}") from None
        if not (isinstance(meta, list) and len(meta) == 4 and isinstance(meta[0], str)):
            raise WireError(f"chunk header {str(meta)[:80]} is not [request_id, index, first_layer, end_layer]")
        rid, index, l0, l1 = meta
        asm = pending.get(rid)
        if asm is None and rid in self._refused:       # its failure was reported once already
            sock.recv(copy=False)
            return None
        if asm is None:
            raise WireError(f"chunk for unknown request {rid!r}")     # nothing under way to fail
        if not (_int(index) and _int(l0) and _int(l1)):
            raise WireError(f"chunk index and layers {[index, l0, l1]} are not integers", rid)
        in_order = index == len(asm.parts) and l0 == asm.next_layer and l0 < l1 <= asm.handoff.shape[0]
        expected = (l1 - l0) * asm.layer_bytes
        if in_order and expected <= expect.max_frame_bytes:
            start = l0 * asm.layer_bytes
            size = sock.recv_into(memoryview(asm.buf[start:start + expected].numpy()))
        else:
            size = len(sock.recv(copy=False))
        if not in_order or size != expected or sock.getsockopt(zmq.RCVMORE):
            raise WireError(f"chunk {index} layers [{l0}, {l1}) of {size} bytes does not follow "
                            f"layer {asm.next_layer} ({expected} bytes expected)", rid)
        asm.parts.append((l0, asm.kv[l0:l1]))
        asm.next_layer = l1
        if l1 < asm.handoff.shape[0]:
            return None
        del pending[rid]
        return Arrival(asm.handoff, asm.parts, asm.handoff.nbytes, time.perf_counter() - asm.started, time.time(),
                       self._buffers.releaser(asm.buf))

    def _drop_stale(self, pending: dict[str, _Assembly], report) -> None:
        now = time.perf_counter()
        for rid in [r for r, a in pending.items() if now - a.started > self.cfg.timeout_s]:
            self._buffers.give_back(pending.pop(rid).buf)
            self._forget(rid)
            report(TransferProblem(f"zmq: transfer incomplete after {self.cfg.timeout_s:g} s (transfer.timeout_s), "
                                   "dropped", rid))

    def _forget(self, rid: str) -> None:
        self._refused[rid] = None
        while len(self._refused) > 4096:
            self._refused.popitem(last=False)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._pull is not None:
            self._pull.close(linger=0)
