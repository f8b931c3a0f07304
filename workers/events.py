"""What an engine reports: a record of every step, and an event per request per step."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    step: int
    start: float
    end: float
    num_prefill_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_tokens: int
    num_blocks_used: int
    num_running: int
    num_waiting: int
    num_preempted: int
    prepare_s: float = 0.0     # of the step's time: building its inputs,
    forward_s: float = 0.0     # the model (emulated: the wait for its price, as measured),
    sample_s: float = 0.0      # and choosing the tokens
    price_s: float | None = None   # emulated engine: the step's price, end - start (None: it computed)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenEvent:
    """What one step did for one request: its new token, and whether it ended (and why)."""

    request_id: str
    token: int
    time: float
    finish_reason: str | None = None   # "length", "stop", or "handoff" (prefill role)
    first_scheduled: float | None = None  # on the first token made here: when its first step began


@dataclass
class KVReady:
    """Prefill role, with KV streaming on: layers [first_layer, end_layer) of tokens [start, end) of
    a request are final in the pool and may be exported (Engine.cache.export) and sent."""

    request_id: str
    first_layer: int
    end_layer: int
    start: int
    end: int


@dataclass
class KVReset:
    """Prefill role, KV streaming: the request was preempted; what was streamed of it is void and
    its KV will stream again as it is recomputed."""

    request_id: str


@dataclass
class RequestFailed:
    """A request this engine could not go on serving; it is gone from the engine, blocks freed."""

    request_id: str
    reason: str
    time: float
