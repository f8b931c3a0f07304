"""What the router records for each request: its token stream on the router's clock, and its journey.

Every time here is on the router's clock (workers' times are converted with their measured offsets)
except `worker_token_times`. Two times per token: `token_times`, when it was made (its worker's step
end), which TTFT, TPOT and ITL use; and `arrival_times`, when it reached the router (the client_*
values): tokens of several steps that come back in one poll share an arrival time, never a made one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from router.journey import JourneyRecord


@dataclass
class RequestRecord(JourneyRecord):
    id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float                                   # router clock: when it was submitted
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)   # router clock: when each token was made
    arrival_times: list[float] = field(default_factory=list)  # router clock: when each token reached it
    kv_send_start: float | None = None                 # router clock: the prefill worker began sending KV
    worker_token_times: list[float] = field(default_factory=list)  # its worker's clock: when each token was made
    token_workers: list[str] = field(default_factory=list)  # the worker that made each token ("decode:0")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

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
