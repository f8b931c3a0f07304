"""KV transfer in the simulator: a transport's time for b bytes, and links that carry one transfer at a time.

`TransferModel`: seconds = latency + bytes / bandwidth, one per transport. Fitted by
experiments/analysis/profile.py from `benchmarks.transfer`'s measurements (several payload sizes,
least squares on time against bytes), or from datasheet link bandwidths for a GPU cluster (NVLink
within a node, the NIC between nodes; the latency is an assumption, stated where it is set).

`Links`: contention. Every worker has one egress and one ingress, each carrying one transfer at a
time, first come first served: a transfer leaves the sender once its egress is free and has carried
it (latency + bytes / bandwidth), and is in once the receiver's ingress, free after the transfer
before it, has carried it too. So transfers out of one prefill worker (or into one decode worker)
queue behind each other, and one that finds the receiver busy waits there without holding its
sender's egress (the emulated wire's rule too: cluster/transfer/link.py).

Streaming (`stream` "layer" or "chunk", the KV of a prompt sent as the prefill computes it): the
transfer may start once the prefill's first step has begun and the link is free; it ends no earlier
than its full wire time after that start, nor earlier than the last part's wire time after the
prefill ends (the last part is final only then: one group of `stream_layers` layers, a 1/L share of
the bytes for L layers, or the last prompt chunk). So the transfer a request waits for after its
prefill, the exposed transfer, is about max(last part, transfer - overlap), the overlap being the
prefill's duration. Off: it starts after the prefill and the export, all of it exposed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

STREAMS = ("off", "layer", "chunk")


@dataclass(frozen=True)
class TransferModel:
    latency_s: float
    bandwidth: float           # bytes/s
    name: str = "transfer"

    def __post_init__(self):
        if not self.bandwidth > 0 or self.latency_s < 0:
            raise ValueError(f"transfer model {self.name}: bandwidth {self.bandwidth} must be positive and "
                             f"latency {self.latency_s} >= 0")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


def fit_transfer(sizes_bytes: list[float], seconds: list[float], name: str) -> tuple[TransferModel, dict]:
    """Least squares of seconds = latency + bytes / bandwidth over measured transfers; the latency is
    clipped at 0. Returns the model and its fit error (relative, as stepmodel.relative_errors)."""
    import numpy as np

    from experiments.sim.stepmodel import relative_errors

    x, y = np.asarray(sizes_bytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError("fitting a transfer model needs measurements at two payload sizes at least")
    slope, latency = np.polyfit(x, y, 1, w=1.0 / y)
    if latency < 0:
        slope, latency = float((x * y).sum() / (x * x).sum()), 0.0
    model = TransferModel(float(latency), float(1.0 / slope), name)
    return model, relative_errors([model.seconds(b) for b in x], y)


class Links:
    """Each worker's egress and ingress carry one transfer at a time, first come first served."""

    def __init__(self):
        self.egress: dict[int, float] = {}
        self.ingress: dict[int, float] = {}

    def send(self, src: int, dst: int, nbytes: float, model: TransferModel, ready: float,
             stream_start: float | None = None, last_part: float = 1.0) -> tuple[float, float]:
        """(start, done) of a transfer whose KV is complete at `ready`; with streaming, whose first part
        may go at `stream_start` and whose last part (a `last_part` share of the bytes) is final at `ready`."""
        if not 0 < last_part <= 1:
            raise ValueError(f"last_part={last_part} must be a share of the bytes in (0, 1]")
        e, i = self.egress.get(src, 0.0), self.ingress.get(dst, 0.0)
        s = model.seconds(nbytes)

        def finish(free: float) -> tuple[float, float]:
            if stream_start is None:
                return max(ready, free), max(ready, free) + s
            start = max(stream_start, free)
            return start, max(start + s, max(ready, free) + model.seconds(nbytes * last_part))
        _, out = finish(e)                       # it has left the sender
        start, done = finish(max(e, i))          # and is in once the receiver's ingress has taken it
        self.egress[src], self.ingress[dst] = out, done
        return start, done
