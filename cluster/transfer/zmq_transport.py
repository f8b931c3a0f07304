"""KV over ZeroMQ: msgpack headers and raw tensor frames, zero-copy on the sending side.

Each receiving worker binds one PULL socket to its own address; each sender connects one PUSH
socket per destination. A transfer is a begin, parts, and an end (or a cancel), each one message
naming its request, so transfers from several senders, and several transfers of one sender, may
interleave (wire.py):

    begin:  [b"B", header]                               header = KVHandoff (msgpack)
    part:   [b"P", msgpack([request_id, first_layer, end_layer, start, end]), raw bytes]
    end:    [b"E", msgpack([request_id, first_token, first_token_time])]
    cancel: [b"X", msgpack([request_id, reason])]

A part's frame is at most `min(chunk_bytes, max_frame_bytes)` (the sender splits larger parts;
libzmq drops and disconnects a message past `max_frame_bytes` before Python sees it). Sender frames
point into the tensor's memory (copy=False, tracked until libzmq is done with them; `end` waits).
The receiver reads every frame of a message (libzmq delivers a message whole), and a message is
exactly the frames its tag announces (2, or 3 for a part) or one rejected message: never the start
of another. It checks a part against its transfer, then takes the frame without a copy (the part's
tensor views the message libzmq filled; its bytes count against `max_pending_bytes` until the
engine releases it, whatever happens on the way) and delivers the part at once. On a GPU the
receive thread copies the frame to the device on its own stream (staging.py). (Receiving into
a recycled buffer instead, recv_into, costs one more copy of every byte: 0.69-0.77 of raw pyzmq at
256 MiB against 0.82-0.87 zero-copy, interleaved runs of benchmarks.transfer here.) A begin is refused, and
reported against its request, when `max_pending` transfers are incomplete or receive memory would
pass `max_pending_bytes`; a transfer silent for `timeout_s` is dropped and reported, checked every
100 ms whether or not the socket is busy. Any error in a message, or in the consumer's callback, is
reported (against its request when known) and the loop goes on; only a socket that fails stops
it, as a fatal problem that takes its worker out of service.
"""
from __future__ import annotations

import threading
import time

import torch
import zmq

from cluster.transfer import staging
from cluster.transfer.link import Link, LinkClock
from cluster.transfer.base import (Inbound, Part, RecvBuffers, TransferConfig, TransferProblem, TransferRefused,
                                   TransferTimeout, frames, hand_over, safe_report)
from cluster.transfer.wire import (WIRE_DTYPES, CancelMeta, EndMeta, Expect, KVHandoff, PartMeta, WireError,
                                   decode_cancel, decode_end, decode_header, decode_part, peek_request_id)
from workers.emulated import realtime, sleep_until

SWEEP_S = 0.1        # how often transfers are checked against timeout_s
FRAMES = {b"B": 2, b"P": 3, b"E": 2, b"X": 2}     # each message kind's frames, its tag included
MAX_FRAMES = max(FRAMES.values())


def _read_message(sock: zmq.Socket) -> tuple[list, int]:
    """Every frame of the next message (libzmq delivers a message whole or not at all): the first
    MAX_FRAMES kept, the rest read and dropped; (kept, how many there were)."""
    kept, count = [], 0
    while True:
        frame = sock.recv(copy=False)
        count += 1
        if len(kept) < MAX_FRAMES:
            kept.append(frame)
        if not frame.more:
            return kept, count


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


class ZmqChannel:
    """One sender's socket to one receiver. `end` returns once libzmq has taken every frame of the
    transfer (small frames are batched, so "taken" can precede "written"): keep the channel open
    while the peer reads, as a worker's sender thread does for its whole life. With a `link` (an
    emulated cluster, link.py) a part is one message declaring its bytes, sent once the sender's
    `egress` has carried them."""

    def __init__(self, ctx: zmq.Context, address: str, cfg: TransferConfig, link: Link | None = None,
                 egress: LinkClock | None = None):
        self.cfg = cfg
        self.link, self.egress = link, egress
        self._declared: set[str] = set()          # emulated: transfers that have sent a part
        self.frame_bytes = min(cfg.chunk_bytes, cfg.max_frame_bytes)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(address)
        self._inflight: dict[str, list] = {}      # request -> [(tracker, tensor kept alive)]

    def begin(self, handoff: KVHandoff) -> None:
        self.sock.send_multipart([b"B", handoff.encode()])
        self._inflight[handoff.request_id] = []

    def part(self, request_id: str, first_layer: int, start: int, kv: torch.Tensor) -> None:
        if self.link is not None:
            return self._declared_part(request_id, first_layer, start, kv)
        kv = kv.cpu().contiguous() if kv.device.type != "cpu" else kv.contiguous()
        kept = self._inflight.setdefault(request_id, [])
        for l0, t0, frame in frames(kv, first_layer, start, self.frame_bytes):
            frame = frame.contiguous()
            meta = PartMeta(request_id, l0, l0 + frame.shape[0], t0, t0 + frame.shape[2])
            self.sock.send_multipart([b"P", meta.encode()], flags=zmq.SNDMORE)
            kept.append((self.sock.send(_as_bytes_view(frame), copy=False, track=True), frame))

    def _declared_part(self, request_id: str, first_layer: int, start: int, kv: torch.Tensor) -> None:
        """An emulated part: its rectangle (which declares its bytes) and an empty payload, once the
        egress has carried those bytes."""
        first = request_id not in self._declared
        self._declared.add(request_id)
        sleep_until(self.egress.egress(self.link.seconds(kv.numel() * kv.element_size(), first)), time.time)
        meta = PartMeta(request_id, first_layer, first_layer + kv.shape[0], start, start + kv.shape[2])
        self.sock.send_multipart([b"P", meta.encode(), b""])

    def end(self, request_id: str, first_token: int, first_token_time: float) -> None:
        self._declared.discard(request_id)
        self.sock.send_multipart([b"E", EndMeta(request_id, first_token, first_token_time).encode()])
        deadline = time.monotonic() + self.cfg.timeout_s
        for tracker, _ in self._inflight.pop(request_id, []):   # libzmq holds our memory until sent
            left = deadline - time.monotonic()
            if left <= 0 or not _wait(tracker, left):
                raise TransferTimeout(f"zmq send of {request_id} not done in {self.cfg.timeout_s} s")

    def cancel(self, request_id: str, reason: str) -> None:
        self._declared.discard(request_id)
        self.sock.send_multipart([b"X", CancelMeta(request_id, reason).encode()])
        self._inflight.pop(request_id, None)

    def close(self):
        self.sock.close(linger=0)


def _wait(tracker: zmq.MessageTracker, timeout_s: float) -> bool:
    try:
        tracker.wait(timeout_s)
        return True
    except zmq.NotDone:
        return False


class ZmqTransport:
    name = "zmq"

    def __init__(self, cfg: TransferConfig, host: str, peers: dict[int, str] | None = None,
                 device: torch.device = torch.device("cpu"), link: Link | None = None):
        self.cfg = cfg
        self.link = link                   # an emulated cluster's: parts declare their bytes (link.py)
        self.egress, self.ingress = LinkClock(), LinkClock()
        self.host = host
        self.device = device               # where received parts go: a GPU's copied off the loop thread
        self.peers = dict(peers or {})     # rank -> address of its receiving socket
        self.ctx = zmq.Context.instance()
        self.address: str | None = None
        self._pull: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._buffers = RecvBuffers(torch.device("cpu"))
        self.inbound = Inbound(cfg, self._buffers)

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
        return ZmqChannel(self.ctx, self.peers[dst], self.cfg, self.link, self.egress)

    def start_receiving(self, expect: Expect, deliver, report) -> None:
        if self._pull is None:
            self.bind()
        self._thread = threading.Thread(target=self._receive_loop, args=(expect, deliver, report),
                                        name="kv-recv-zmq", daemon=True)
        self._thread.start()

    @property
    def receiving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending_bytes(self) -> int:
        """Receive memory in use: parts received and not yet released by the engine."""
        return self._buffers.outstanding

    def _receive_loop(self, expect: Expect, deliver, report) -> None:
        """Until closed: one message at a time; nothing but the socket failing ends the loop."""
        staging.own_stream(self.device)
        if self.link is not None:           # its waits are an emulated link's: on time, however busy the host
            realtime()
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            try:
                if poller.poll(100):
                    self._receive_one(expect, deliver, report)
                if time.monotonic() - last_sweep >= SWEEP_S:
                    last_sweep = time.monotonic()
                    for rid in self.inbound.stale():
                        safe_report(report, TransferProblem(f"zmq: transfer silent for {self.cfg.timeout_s:g} s "
                                                            "(transfer.timeout_s), dropped", rid))
            except zmq.ZMQError as e:   # the socket itself failed: nothing more can arrive here
                if not self._stop.is_set():
                    safe_report(report, TransferProblem(f"zmq: receiver stopped: {e}", fatal=True))
                return
            except Exception as e:      # a bug of this loop's own: said, and the loop goes on
                safe_report(report, TransferProblem(f"zmq: receive loop: {type(e).__name__}: {str(e)[:300]}"))
                time.sleep(0.01)

    def _receive_one(self, expect: Expect, deliver, report) -> None:
        frames_, count = _read_message(self._pull)
        named = [None]                    # the request the message names, once decoded
        try:
            delivery = self._on_message(frames_, count, expect, named)
        except Exception as e:   # a bad message, or a bug it triggered: this message alone is dropped
            rid = getattr(e, "request_id", None) or named[0]
            self.inbound.drop(rid)
            what = str(e) if isinstance(e, WireError) else f"{type(e).__name__}: {str(e)[:300]}"
            safe_report(report, TransferProblem(f"zmq: rejected message: {what}", rid))   # the id travels beside
            return
        if delivery is not None:
            hand_over(delivery, deliver, report, self.inbound, "zmq")

    def _on_message(self, frames_: list, count: int, expect: Expect, named: list):
        """One whole message (`count` frames, the first MAX_FRAMES of them kept) -> what to deliver.
        It is exactly the frames its tag announces, or one rejected message: never the start of
        another."""
        tag = bytes(frames_[0].buffer[:8])
        if tag not in FRAMES:
            raise WireError(f"unknown message tag {tag!r}")
        if count != FRAMES[tag]:
            rid = peek_request_id(frames_[1].buffer) if count > 1 else None
            raise WireError(f"message tag {tag!r} with {count} frames; it takes {FRAMES[tag]}", rid)
        head = frames_[1].buffer
        if tag == b"B":
            h = decode_header(head, expect)
            named[0] = h.request_id
            return self.inbound.begin(h, expect)
        if tag == b"E":
            meta = decode_end(head, expect)
            named[0] = meta.request_id
            return None if self.inbound.quiet(meta.request_id) else self.inbound.end(meta)
        if tag == b"X":
            return self.inbound.cancel(decode_cancel(head))
        meta = decode_part(head)
        named[0] = meta.request_id
        if self.inbound.quiet(meta.request_id):        # its transfer's failure was reported once already
            return None
        if self.link is not None:
            return self._declared_part(meta, frames_[2])
        handoff, size = self.inbound.part(meta, expect.max_frame_bytes)
        frame = frames_[2]
        if len(frame) != size:
            raise WireError(f"part of {len(frame)} bytes; its header announced {size}", meta.request_id)
        release = self._buffers.adopt(size)      # from here the part's bytes count, until release()
        try:
            self.inbound.received(meta.request_id, size)
            shape = (meta.end_layer - meta.first_layer, 2, meta.end - meta.start, *handoff.shape[3:])
            data = torch.frombuffer(frame.buffer, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
            kv, ready = data.view(WIRE_DTYPES[handoff.dtype]).view(shape), None   # no copy: views libzmq's message
            if self.device.type == "cuda":
                kv, ready = staging.to_device(kv, self.device)
            return Part(meta.request_id, meta.first_layer, meta.start, kv, release, ready)
        except BaseException:
            release()
            raise

    def _declared_part(self, meta: PartMeta, frame) -> Part:
        """An emulated part, delivered once the ingress has carried its declared bytes (link.py): a
        `meta` tensor of its shape, which holds no memory."""
        handoff, size = self.inbound.part(meta, None)
        if len(frame):
            raise WireError(f"part of {len(frame)} bytes on an emulated link, whose parts declare their bytes "
                            "and carry none", meta.request_id)
        first = self.inbound.received_so_far(meta.request_id) == 0
        self.inbound.received(meta.request_id, size)
        shape = (meta.end_layer - meta.first_layer, 2, meta.end - meta.start, *handoff.shape[3:])
        kv = torch.empty(shape, dtype=WIRE_DTYPES[handoff.dtype], device="meta")
        sleep_until(self.ingress.ingress(time.time(), self.link.seconds(size, first)), time.time)
        return Part(meta.request_id, meta.first_layer, meta.start, kv)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._pull is not None:
            self._pull.close(linger=0)


__all__ = ["ZmqChannel", "ZmqTransport", "TransferRefused"]
