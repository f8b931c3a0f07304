"""A live ZeroMQ KV receiver on loopback and the raw messages to throw at it (shared by the wire's
hostile-input tests and its fuzzer). The consumer copies and releases every part as it lands, as a
decode worker does, and keeps what each transfer delivered."""
from __future__ import annotations

import math
import threading
import time

import msgpack
import torch
import zmq

from cluster.transfer.base import Begin, Cancel, End, Part, TransferConfig, request_of, send
from cluster.transfer.wire import EndMeta, Expect, KVHandoff, PartMeta
from cluster.transfer.zmq_transport import ZmqTransport

EXPECT = Expect(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float32", vocab_size=2048, max_tokens=4096,
                max_frame_bytes=1 << 20)
PARAMS = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop_token_ids": [], "ignore_eos": True}
TOKEN_BYTES = 2 * 4 * 32 * 4           # one layer of one token


def handoff(rid: str, n: int = 10, **params) -> KVHandoff:
    return KVHandoff(rid, list(range(n)), {**PARAMS, **params}, "float32", (4, 2, n, 4, 32))


def header(rid: str, n: int = 10, **over) -> bytes:
    d = msgpack.unpackb(handoff(rid, n).encode())
    d.update(over)
    return msgpack.packb(d)


def begin(rid: str, n: int = 10, **over) -> list[bytes]:
    return [b"B", header(rid, n, **over)]


def part(rid: str, l0: int, l1: int, t0: int = 0, t1: int = 10, nbytes: int | None = None, fill: int = 0):
    size = (l1 - l0) * (t1 - t0) * TOKEN_BYTES if nbytes is None else nbytes
    return [b"P", PartMeta(rid, l0, l1, t0, t1).encode(), bytes([fill]) * size]


def end(rid: str, token: int = 7, t: float = 1.0) -> list[bytes]:
    return [b"E", EndMeta(rid, token, t).encode()]


def cancel(rid: str, reason: str = "gave up") -> list[bytes]:
    return [b"X", msgpack.packb([rid, reason])]


def whole(rid: str, n: int = 10) -> list[list[bytes]]:
    """A well-formed transfer of zeros, as raw messages."""
    return [begin(rid, n), part(rid, 0, 4, 0, n), end(rid)]


def nested(depth: int):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


class ManualClock:
    """Inbound's clock, stepped by the test: nothing goes stale unless the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Live:
    """A ZmqTransport receiving on loopback; `senders` raw PUSH sockets (attackers or not) and a
    real ZmqChannel. `deliver_hook(d)` may raise, to play a consumer that fails."""

    def __init__(self, senders: int = 1, deliver_hook=None, report_hook=None, device=torch.device("cpu"), **cfg):
        self.cfg = TransferConfig(**{"chunk_bytes": 2 * 10 * TOKEN_BYTES, "max_frame_bytes": 1 << 20, **cfg})
        self.rx = ZmqTransport(self.cfg, "127.0.0.1", device=device)
        self.clock = ManualClock()
        self.rx.inbound.clock = self.clock
        self.address = self.rx.bind()
        self.lock = threading.Lock()
        self.got: list = []                       # deliveries, parts as (rid, first_layer, start, copy)
        self.problems: list = []
        self.violations: list[str] = []          # delivered values of the wrong type (must stay empty)
        self.deliver_hook, self.report_hook = deliver_hook, report_hook
        self.rx.start_receiving(EXPECT, self._deliver, self._report)
        ctx = zmq.Context.instance()
        self.push = []
        for _ in range(senders):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self.push.append(sock)
        self.channel = ZmqTransport(self.cfg, "127.0.0.1", {1: self.address}).channel(1)

    def _deliver(self, d) -> None:
        if self.deliver_hook is not None:
            self.deliver_hook(d)
        bad = typed_wrong(d)
        if bad:
            with self.lock:
                self.violations.append(bad)
        if isinstance(d, Part):          # a decode worker copies the part into its pool, then releases it
            copy = d.kv.clone()
            d.release()
            d = ("part", d.request_id, d.first_layer, d.start, copy)
        with self.lock:
            self.got.append(d)

    def _report(self, p) -> None:
        with self.lock:
            self.problems.append(p)
        if self.report_hook is not None:
            self.report_hook(p)

    def send(self, frames: list[bytes], sender: int = 0) -> None:
        self.push[sender].send_multipart(frames)

    def of(self, rid: str) -> list:
        with self.lock:
            return [d for d in self.got if (d[1] if isinstance(d, tuple) else request_of(d)) == rid]

    def reasons(self, rid: str | None = None) -> list[str]:
        with self.lock:
            return [p.reason for p in self.problems if rid is None or p.request_id == rid]

    def ended(self, rid: str) -> End | None:
        return next((d for d in self.of(rid) if isinstance(d, End)), None)

    def send_good(self, rid: str, n: int = 10, seed: int = 0) -> torch.Tensor:
        """A real channel's transfer: returns once it is delivered; asserts it arrived byte for byte."""
        kv = torch.randn(4, 2, n, 4, 32, generator=torch.Generator().manual_seed(seed))
        send(self.channel, handoff(rid, n), kv, first_token=7, first_token_time=1.5)
        assert wait_for(lambda: self.ended(rid) is not None), self.reasons()[-5:]
        assert intact(self, rid, kv)
        return kv

    def close(self) -> None:
        for sock in self.push:
            sock.close(linger=0)
        self.channel.close()
        self.rx.close()


def typed_wrong(d) -> str | None:
    """What of a delivery has other than its exact type (a value that passed the decoder must never
    fail later on its type), or None."""
    ints = lambda *vs: all(type(v) is int for v in vs)          # noqa: E731
    if isinstance(d, Begin):
        h = d.handoff
        ok = (ints(*h.shape, *h.prompt_ids, h.nbytes, h.params["max_tokens"], *h.params["stop_token_ids"])
              and type(h.params["temperature"]) is float and type(h.params["top_p"]) is float
              and (h.params["seed"] is None or ints(h.params["seed"])) and type(h.params["ignore_eos"]) is bool)
    elif isinstance(d, Part):
        ok = ints(d.first_layer, d.start) and d.kv.dtype == torch.float32 and d.kv.dim() == 5
    elif isinstance(d, End):
        ok = ints(d.first_token, d.nbytes) and type(d.first_token_time) is float and math.isfinite(d.first_token_time)
    else:
        ok = isinstance(d, Cancel) and isinstance(d.reason, str)
    return None if ok else repr(d)[:200]


def assembled(live: Live, rid: str, shape) -> tuple[torch.Tensor, int]:
    """What the parts of `rid`'s last delivered transfer put together (NaN where none), and bytes."""
    got = live.of(rid)
    starts = [i for i, d in enumerate(got) if isinstance(d, Begin)]
    kv, nbytes = torch.full(shape, float("nan")), 0
    for d in got[starts[-1] if starts else 0:]:
        if isinstance(d, tuple):
            _, _, l0, t0, t = d
            kv[l0:l0 + t.shape[0], :, t0:t0 + t.shape[2]] = t
            nbytes += t.numel() * t.element_size()
    return kv, nbytes


def intact(live: Live, rid: str, kv: torch.Tensor) -> bool:
    back, nbytes = assembled(live, rid, kv.shape)
    e = live.ended(rid)
    return bool(torch.equal(back, kv)) and e is not None and e.nbytes == nbytes == kv.numel() * kv.element_size()


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return bool(cond())
