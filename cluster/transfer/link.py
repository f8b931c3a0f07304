"""The link of an emulated cluster: what moving declared KV bytes would take (engine.timing=emulated).

An emulated engine holds no KV bytes, so its parts travel the real wire declaring their size alone
(zmq_transport.py, `link` given). Their time on the link is waited out on both ends, as the
simulator's links charge it (experiments/sim/transfer.py's `Links`):

- the sender's egress carries one part at a time, first come first served over every destination:
  a part leaves `latency + bytes / bandwidth` after the egress is free (the latency once, on a
  transfer's first part), and the sender thread sends it then;
- the receiver's ingress takes one part at a time: a part is delivered at the later of when it is
  read and when the ingress, free once the part before it was delivered, has carried its bytes.

A part that finds the ingress free is delivered as it arrives; one that finds it busy waits the
part before it out and then its own time on the link, so a decode worker taking KV from several
prefill workers at once receives it one transfer after another.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Link:
    latency_s: float
    bandwidth: float            # bytes/s
    name: str = "link"

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.latency_s >= 0):
            raise ValueError(f"link {self.name}: bandwidth {self.bandwidth} must be positive and latency "
                             f"{self.latency_s} >= 0")

    def seconds(self, nbytes: int, first: bool = True) -> float:
        """A part's time on the link: its bytes, and the latency when it opens its transfer."""
        return (self.latency_s if first else 0.0) + nbytes / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


class LinkClock:
    """When one end of a link is next free; parts take it first come first served."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self.free = 0.0
        self._lock = threading.Lock()

    def egress(self, seconds: float) -> float:
        """Reserve the next `seconds` of a sender's egress from now or when it frees: when the part has left."""
        with self._lock:
            self.free = max(self.clock(), self.free) + seconds
            return self.free

    def ingress(self, read_at: float, seconds: float) -> float:
        """A part read at `read_at` that takes `seconds` of a receiver's ingress: when it is in."""
        with self._lock:
            self.free = max(read_at, self.free + seconds)
            return self.free
