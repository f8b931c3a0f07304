"""The KV-transfer interface both wires implement, and the config that picks one.

A sender worker owns one `Channel` per destination and uses it from one thread: `begin` a request's
transfer, send any number of `part`s (rectangles of layers x tokens, in any order), then `end` it
with the first token, or `cancel` it. A receiver worker starts receiving once and gets, through one
callback and in order per request, a `Begin`, each `Part` as it lands (a zero-copy view of a
receive buffer, released once the engine has copied it into its pool), and an `End` (or a `Cancel`),
so a decode worker places each layer into the request's blocks while the rest is still on its way.

Limits are per frame, not per request: a part is sent in frames of at most `max_frame_bytes`
(whole layers where they fit, else runs of tokens of one layer); a request's total is bounded by
the receiver's memory for KV in flight (`max_pending_bytes`) and by the decode pool. Every problem a
receive thread meets is reported as a `TransferProblem` (tied to its request when the request is
known); the message is dropped and the thread goes on, unless it cannot (`fatal`: its worker then
takes no more KV).
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from cluster.transfer.fields import MAX_INDEX, exact_int, finite_time, int_list, shown, text
from cluster.transfer.wire import WIRE_DTYPES, CancelMeta, EndMeta, Expect, KVHandoff, PartMeta, WireError
from workers.request import MAX_ID_CHARS

BACKENDS = ("nccl", "zmq")
STREAMS = ("off", "layer", "chunk")


class TransferTimeout(TimeoutError):
    pass


class TransferRefused(RuntimeError):
    """The payload was not sent: over a limit on this side, or refused by the receiver."""


@dataclass(frozen=True)
class TransferProblem:
    reason: str
    request_id: str | None = None     # the transfer it concerns, when known
    fatal: bool = False               # the receiver stopped: its worker can take no more KV


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "zmq"
    timeout_s: float = 10.0             # a handoff not imported by then is retried (router)
    chunk_bytes: int = 8 << 20          # zmq: frames of about this size, whole layers each
    max_frame_bytes: int = 256 << 20    # both: largest payload frame (one run of whole layers); nccl sends
                                        # frames this large. One layer of Llama-3-8B/70B at 8k is 32 MiB
    max_pending_bytes: int = 8 << 30    # both: receive memory for KV in flight or waiting for blocks
    max_pending: int = 64               # zmq: transfers begun and not finished, at most
    bind_host: str = "auto"             # zmq: auto = loopback for a local cluster, else the node's IP
    port: int = 0                       # zmq: 0 = any free port
    stream: str = "off"                 # off: KV after the prefill | layer: each layer as computed |
                                        # chunk: each prompt chunk's KV once its step is done
    stream_layers: int = 1              # layer: layers per streamed part (group small layers)
    link_bandwidth: float | None = None  # emulated cluster: the KV link's bytes/s (None: the cost source's link)
    link_latency_s: float | None = None  # ... and its latency per transfer (None: the cost source's)
    socket_ifname: str | None = None    # nccl: the network interface for gloo/NCCL sockets; None = the one
                                        # whose network holds the node's address (cluster/transfer/netif.py)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"transfer.backend={self.backend!r}: choose one of {list(BACKENDS)}")
        if self.bind_host in ("0.0.0.0", "*", "::"):
            raise ValueError(f"transfer.bind_host={self.bind_host!r}: binding to all interfaces is refused; "
                             "give this node's address")
        if self.socket_ifname is not None and (not isinstance(self.socket_ifname, str) or not self.socket_ifname
                                               or any(c.isspace() or c == "," for c in self.socket_ifname)):
            raise ValueError(f"transfer.socket_ifname={self.socket_ifname!r}: give one interface name (e.g. eth0), "
                             "or null to find it by the node's address")
        if self.stream not in STREAMS:
            raise ValueError(f"transfer.stream={self.stream!r}: choose one of {list(STREAMS)}")
        if self.link_bandwidth is not None and not self.link_bandwidth > 0:
            raise ValueError(f"transfer.link_bandwidth={self.link_bandwidth} must be positive bytes/s (or null)")
        if self.link_latency_s is not None and not self.link_latency_s >= 0:
            raise ValueError(f"transfer.link_latency_s={self.link_latency_s} must be >= 0 seconds (or null)")
        for key in ("timeout_s", "chunk_bytes", "max_frame_bytes", "max_pending_bytes", "max_pending",
                    "stream_layers"):
            if getattr(self, key) <= 0:
                raise ValueError(f"transfer.{key}={getattr(self, key)} must be positive")


@dataclass
class Begin:
    handoff: KVHandoff


@dataclass
class Part:
    request_id: str
    first_layer: int
    start: int
    kv: torch.Tensor                         # [layers, 2, tokens, KVH, D], a view of a receive buffer
    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)
    # the consumer calls release() once it no longer reads `kv` (the engine's import copies it): the
    # transport then receives into that memory again. From delivery on the consumer owns the part's
    # bytes; a `deliver` that raises has not taken it, and the transport releases it.
    ready: object | None = field(default=None, repr=False, compare=False)
    # CUDA: an event on the stream that filled `kv`; the importing stream waits on it (staging.py)


@dataclass
class End:
    request_id: str
    first_token: int
    first_token_time: float                  # the prefill worker's clock
    nbytes: int                              # of every part
    recv_s: float                            # begin to the last byte of the last part
    arrived: float                           # this worker's clock when the last byte was in


@dataclass
class Cancel:
    request_id: str
    reason: str


Delivery = Begin | Part | End | Cancel
Deliver = Callable[[Delivery], None]
ReportProblem = Callable[[TransferProblem], None]


def request_of(d: Delivery) -> str:
    return d.handoff.request_id if isinstance(d, Begin) else d.request_id


def checked(d: Delivery) -> None:
    """A delivery's fields by the wire decoder's rules (exact ints, finite times, a 5-d tensor of a
    wire dtype): the import path's guard against a delivery made other than by a wire's decoder."""
    if isinstance(d, Begin):
        h = d.handoff
        rid = h.request_id if isinstance(h.request_id, str) else None
        text(h.request_id, "request_id", rid, MAX_ID_CHARS, 1)
        int_list(list(h.shape), "shape", rid, 5, 0, MAX_INDEX, 5)
        int_list(list(h.prompt_ids), "prompt_ids", rid, MAX_INDEX, 0, MAX_INDEX, 1)
        if h.dtype not in WIRE_DTYPES:
            raise WireError(f"dtype {shown(h.dtype)} is not a wire dtype", rid)
    elif isinstance(d, Part):
        exact_int(d.first_layer, "first_layer", d.request_id)
        exact_int(d.start, "start", d.request_id)
        if not (isinstance(d.kv, torch.Tensor) and d.kv.dim() == 5 and d.kv.dtype in WIRE_DTYPES.values()):
            raise WireError(f"part of {type(d.kv).__name__} is not a [layers, 2, tokens, heads, dim] tensor",
                            d.request_id)
    elif isinstance(d, End):
        exact_int(d.first_token, "first_token", d.request_id)
        finite_time(d.first_token_time, "first_token_time", d.request_id)
        exact_int(d.nbytes, "nbytes", d.request_id, 0, 1 << 62)
    elif not isinstance(d, Cancel):
        raise WireError(f"delivery {type(d).__name__} is not a Begin, Part, End or Cancel")


def safe_report(report: ReportProblem, problem: TransferProblem) -> None:
    """Report from a receive or send thread; a callback that raises cannot stop the thread (what it
    would have said goes to stderr, the worker's log)."""
    try:
        report(problem)
    except Exception:
        print(f"kv wire: reporting {problem} failed:\n{traceback.format_exc(limit=4)}", file=sys.stderr, flush=True)


def hand_over(d: Delivery, deliver: Deliver, report: ReportProblem, inbound: "Inbound", where: str) -> None:
    """Deliver one message to the consumer. A consumer that raises has not taken it: a part's bytes
    are released, its transfer dropped, and the failure reported against its request."""
    try:
        deliver(d)
    except Exception as e:
        rid = request_of(d)
        if isinstance(d, Part):
            d.release()
        inbound.drop(rid)
        safe_report(report, TransferProblem(f"{where}: could not deliver: {type(e).__name__}: {str(e)[:300]}", rid))


class Channel(Protocol):
    def begin(self, handoff: KVHandoff) -> None:
        """Start a request's transfer; raises TransferRefused when the receiver will not take it."""

    def part(self, request_id: str, first_layer: int, start: int, kv: torch.Tensor) -> None:
        """Layers [first_layer, ...) of tokens [start, ...) of a begun transfer."""

    def end(self, request_id: str, first_token: int, first_token_time: float) -> None:
        """Every part is sent; raises on failure or timeout."""

    def cancel(self, request_id: str, reason: str) -> None: ...


class Transport(Protocol):
    name: str

    def channel(self, dst: int) -> Channel: ...

    def start_receiving(self, expect: Expect, deliver: Deliver, report: ReportProblem) -> None: ...

    def close(self) -> None: ...


def send(channel: Channel, handoff: KVHandoff, kv: torch.Tensor, first_token: int = 0,
         first_token_time: float = 0.0) -> float:
    """A bulk handoff, the whole [L, 2, T, KVH, D] KV at once: begin, one part, end. Seconds spent."""
    start = time.perf_counter()
    channel.begin(handoff)
    channel.part(handoff.request_id, 0, 0, kv)
    channel.end(handoff.request_id, first_token, first_token_time)
    return time.perf_counter() - start


def frames(kv: torch.Tensor, first_layer: int, start: int, max_bytes: int) -> list[tuple[int, int, torch.Tensor]]:
    """Split a part [layers, 2, tokens, KVH, D] into frames of at most `max_bytes`: (first layer,
    first token, tensor), runs of whole layers where one fits, else runs of tokens of one layer."""
    layer_bytes = kv[0].numel() * kv.element_size()
    if layer_bytes <= max_bytes:
        step = max_bytes // layer_bytes
        return [(first_layer + l0, start, kv[l0:l0 + step]) for l0 in range(0, kv.shape[0], step)]
    token_bytes = layer_bytes // kv.shape[2]
    if token_bytes > max_bytes:
        raise TransferRefused(f"one token of one layer is {token_bytes} bytes, more than transfer.max_frame_bytes="
                              f"{max_bytes}")
    step = max_bytes // token_bytes
    return [(first_layer + l, start + t0, kv[l:l + 1, :, t0:t0 + step])
            for l in range(kv.shape[0]) for t0 in range(0, kv.shape[2], step)]


@dataclass
class _Open:
    handoff: KVHandoff
    started: float                           # perf_counter at begin
    active: float                            # perf_counter at the latest message
    received: int = 0                        # bytes of parts in so far


class Inbound:
    """A receiver's book of transfers under way: every message checked against its transfer's header
    and the receiver's limits. Shared by both wires' receive threads (one lock)."""

    def __init__(self, cfg: TransferConfig, buffers: "RecvBuffers", clock: Callable[[], float] = time.perf_counter):
        self.cfg = cfg
        self.buffers = buffers
        self.clock = clock                       # for timeout_s; a test may step it by hand
        self.open: dict[str, _Open] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()   # reported once: late messages go quietly
        self._lock = threading.Lock()

    def begin(self, handoff: KVHandoff, expect: Expect) -> Begin:
        rid = handoff.request_id
        with self._lock:
            if rid in self.open:
                self.open.pop(rid)
                self._forget(rid)
                raise WireError("a second begin for a transfer already under way; both dropped", rid)
            if len(self.open) >= self.cfg.max_pending:
                raise WireError(f"refused, {len(self.open)} transfers already incomplete "
                                f"(transfer.max_pending={self.cfg.max_pending})", rid)
            coming = sum(o.handoff.nbytes - o.received for o in self.open.values())
            if self.buffers.outstanding + coming + handoff.nbytes > self.cfg.max_pending_bytes:
                raise WireError(f"refused, {handoff.nbytes} bytes more would pass transfer.max_pending_bytes="
                                f"{self.cfg.max_pending_bytes} ({self.buffers.outstanding + coming} in use or "
                                "on their way)", rid)
            now = self.clock()
            self.open[rid] = _Open(handoff, now, now)
            self._dropped.pop(rid, None)
        return Begin(handoff)

    def quiet(self, rid: str) -> bool:
        """A message for a transfer already dropped and reported: to be skipped without a word."""
        return rid in self._dropped

    def part(self, meta: PartMeta, max_frame_bytes: int | None) -> tuple[KVHandoff, int]:
        """Check a part before its bytes are received: -> (its transfer's header, its size).
        `max_frame_bytes` None: a declared part (an emulated link), which holds no memory."""
        with self._lock:
            o = self.open.get(meta.request_id)
            if o is None:
                raise WireError("part for a request with no transfer under way", meta.request_id)
            meta.check(o.handoff)
            size = meta.nbytes(o.handoff)
            if max_frame_bytes is not None and size > max_frame_bytes:
                raise WireError(f"part of {size} bytes exceeds the frame limit {max_frame_bytes}", meta.request_id)
            if o.received + size > o.handoff.nbytes:
                raise WireError(f"parts of more than the {o.handoff.nbytes} bytes announced", meta.request_id)
            return o.handoff, size

    def received_so_far(self, rid: str) -> int:
        """Bytes of a transfer's parts in so far (0 for one not under way)."""
        with self._lock:
            o = self.open.get(rid)
            return o.received if o is not None else 0

    def received(self, rid: str, nbytes: int) -> None:
        """A part's bytes are in. Its transfer may have been dropped (silent too long) while they
        arrived: then the part is refused like any other message of a dropped transfer."""
        with self._lock:
            o = self.open.get(rid)
            if o is None:
                raise WireError("transfer dropped while a part of it arrived", rid)
            if o.received + nbytes > o.handoff.nbytes:
                raise WireError(f"parts of more than the {o.handoff.nbytes} bytes announced", rid)
            o.received += nbytes
            o.active = self.clock()

    def end(self, meta: EndMeta) -> End:
        with self._lock:
            o = self.open.get(meta.request_id)
            if o is None:
                raise WireError("end for a request with no transfer under way", meta.request_id)
            if o.received != o.handoff.nbytes:
                raise WireError(f"end after {o.received} of {o.handoff.nbytes} bytes", meta.request_id)
            del self.open[meta.request_id]
            now = self.clock()
        return End(meta.request_id, meta.first_token, meta.first_token_time, o.received, now - o.started, time.time())

    def cancel(self, meta: CancelMeta) -> Cancel | None:
        with self._lock:
            if self.open.pop(meta.request_id, None) is None:
                return None
        return Cancel(meta.request_id, meta.reason)

    def drop(self, rid: str | None) -> bool:
        """Forget a transfer after an error in one of its messages; True if it was under way."""
        if rid is None:
            return False
        with self._lock:
            was = self.open.pop(rid, None) is not None
            self._forget(rid)
        return was

    def stale(self) -> list[str]:
        """Transfers with no message for `timeout_s`: dropped, their ids returned."""
        now = self.clock()
        with self._lock:
            old = [rid for rid, o in self.open.items() if now - o.active > self.cfg.timeout_s]
            for rid in old:
                del self.open[rid]
                self._forget(rid)
        return old

    def _forget(self, rid: str) -> None:
        self._dropped[rid] = None
        while len(self._dropped) > 4096:
            self._dropped.popitem(last=False)


class RecvBuffers:
    """Receive buffers recycled on CPU: a fresh buffer costs a page fault per 4 KiB on first touch,
    about as slow as the loopback wire itself. (On GPU the caching allocator already recycles.)
    `outstanding` counts the bytes taken and not yet given back: the receive memory in use."""

    def __init__(self, device: torch.device, max_free: int = 4):
        self.device, self.max_free = device, max_free
        self._free: list[torch.Tensor] = []        # uint8 [n], smallest first
        self._lock = threading.Lock()
        self.outstanding = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self.outstanding += nbytes
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.outstanding -= buf.numel()
            if self.device.type != "cpu":
                return
            base = buf if buf._base is None else buf._base
            self._free.append(base)
            self._free.sort(key=torch.Tensor.numel)
            del self._free[:-self.max_free]

    def adopt(self, nbytes: int) -> Callable[[], None]:
        """Count `nbytes` of receive memory that lives elsewhere (a message the wire library
        allocated); returns the callback that stops counting it, once."""
        with self._lock:
            self.outstanding += nbytes
        once = [nbytes]

        def release() -> None:
            if once:
                with self._lock:
                    self.outstanding -= once.pop()
        return release

    def releaser(self, buf: torch.Tensor) -> Callable[[], None]:
        """A callback that gives `buf` back once; later calls do nothing."""
        once = [buf]
        return lambda: once and self.give_back(once.pop())
