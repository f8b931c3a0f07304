"""The KV-transfer interface both wires implement, and the config that picks one.

A sender worker owns one `Channel` per destination and uses it from one thread; a receiver
worker starts receiving once and gets each complete request through a callback, as a list of
(first layer, tensor) parts that together cover all layers: zero-copy views where the wire
allows it. The receiving engine scatters them into its pool.

Limits are per frame, not per request: both wires send a request's KV in frames of whole layers,
each at most `max_frame_bytes`; a request's total is bounded by the receiver's memory for KV in
flight (`max_pending_bytes`) and by the decode pool. Every problem a receive thread meets is
reported as a `TransferProblem` (tied to its request when the request is known); the message is
dropped and the thread goes on, unless it cannot (`fatal`: its worker then takes no more KV).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from cluster.transfer.wire import Expect, KVHandoff

BACKENDS = ("nccl", "zmq")


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

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"transfer.backend={self.backend!r}: choose one of {list(BACKENDS)}")
        if self.bind_host in ("0.0.0.0", "*", "::"):
            raise ValueError(f"transfer.bind_host={self.bind_host!r}: binding to all interfaces is refused; "
                             "give this node's address")
        for key in ("timeout_s", "chunk_bytes", "max_frame_bytes", "max_pending_bytes", "max_pending"):
            if getattr(self, key) <= 0:
                raise ValueError(f"transfer.{key}={getattr(self, key)} must be positive")


@dataclass
class Arrival:
    handoff: KVHandoff
    parts: list[tuple[int, torch.Tensor]]   # (first layer, [layers, 2, T, KVH, D]) covering all layers
    nbytes: int
    recv_s: float                           # first byte of the payload to the last
    arrived: float                          # wall clock when the last byte was in
    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)
    # the consumer calls release() once it no longer reads `parts` (the engine's import copies them):
    # the transport then receives into that memory again. Without it the memory is simply freed.


Deliver = Callable[[Arrival], None]
ReportProblem = Callable[[TransferProblem], None]


class Channel(Protocol):
    def send(self, handoff: KVHandoff, kv: torch.Tensor) -> float:
        """Send one request's KV; returns seconds spent; raises on failure or timeout."""


class Transport(Protocol):
    name: str

    def channel(self, dst: int) -> Channel: ...

    def start_receiving(self, expect: Expect, deliver: Deliver, report: ReportProblem) -> None: ...

    def close(self) -> None: ...


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

    def releaser(self, buf: torch.Tensor) -> Callable[[], None]:
        """A callback that gives `buf` back once; later calls do nothing."""
        once = [buf]
        return lambda: once and self.give_back(once.pop())


def layer_chunks(kv: torch.Tensor, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split [layers, ...] into runs of whole layers of at most chunk_bytes (at least one layer)."""
    per_layer = kv[0].numel() * kv.element_size()
    step = max(1, chunk_bytes // max(per_layer, 1))
    return [(l0, min(l0 + step, kv.shape[0])) for l0 in range(0, kv.shape[0], step)]


def check_frame(kv: torch.Tensor, max_frame_bytes: int) -> None:
    """Sender side: refuse, before sending a byte, a payload whose single layer exceeds a frame."""
    per_layer = kv[0].numel() * kv.element_size()
    if per_layer > max_frame_bytes:
        raise TransferRefused(f"one layer of this KV is {per_layer} bytes, more than transfer.max_frame_bytes="
                              f"{max_frame_bytes}")
