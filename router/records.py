"""What the router records for each request: its token stream on the router's clock, and its journey.

Every time here is on the router's clock (workers' times are converted with their measured offsets)
except `worker_token_times`. Two times per token: `token_times`, when it was made (its worker's step
end), which TTFT, TPOT and ITL use; and `arrival_times`, when it reached the router (the client_*
values): tokens of several steps that come back in one poll share an arrival time, never a made one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float                                   # router clock: when it was submitted
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)   # router clock: when each token was made
    arrival_times: list[float] = field(default_factory=list)  # router clock: when each token reached it
    status: str = "pending"                            # pending | ok | failed
    end_time: float | None = None                      # router clock: last token made, or the failure
    reason: str | None = None                          # why it failed
    finish_reason: str | None = None                   # length | stop
    attempts: int = 0                                  # 1 = served first time
    retried_for: list[str] = field(default_factory=list)   # why each earlier attempt was given up
    crashes: int = 0                                   # workers that died on their own while serving it
    injected_fault: bool = False                       # an injected fault (kill, lost transfer) hit it
    note: str | None = None                            # degraded serving, e.g. "served whole on prefill:0: ..."
    prefill_worker: str | None = None
    decode_worker: str | None = None
    queue_s: float | None = None                       # arrival -> first step that computed it
    prefill_s: float | None = None                     # that step's start -> first token
    transfer_s: float | None = None                    # sender's wire time for the KV
    transfer_bytes: int = 0
    handoff_s: float | None = None                     # first token -> decode worker's first step with it
    kv_send_start: float | None = None                 # router clock: the prefill worker began sending KV
    kv_arrived: float | None = None                    # router clock: last KV byte in at the decode worker
    prefill_end: float | None = None                   # router clock: the prefill step that made the first token ended
    decode_s: float | None = None                      # decode worker's first step -> last token
    worker_token_times: list[float] = field(default_factory=list)  # its worker's clock: when each token was made
    token_workers: list[str] = field(default_factory=list)  # the worker that made each token ("decode:0")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.status != "pending"

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times[-1] - self.arrival_s if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        return _gaps(self.token_times)

    @property
    def client_ttft_s(self) -> float | None:
        return self.arrival_times[0] - self.arrival_s if self.arrival_times else None

    @property
    def client_e2e_s(self) -> float | None:
        return self.arrival_times[-1] - self.arrival_s if self.arrival_times else None

    @property
    def client_itl_s(self) -> list[float]:
        return _gaps(self.arrival_times)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["prompt_ids"]
        d.update(prompt_len=self.prompt_len, ttft_s=self.ttft_s, e2e_s=self.e2e_s)
        return d


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


@dataclass
class StreamUpdate:
    """What one request did since a follower last looked (Router.follow)."""

    token_ids: list[int]        # new tokens, in order
    token_times: list[float]    # router clock, one per new token
    done: bool                  # it has ended (ok or failed: read the record)
