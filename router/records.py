"""What the router records for each request: its token stream on the router's clock, and its journey."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float                                   # router clock: when it was submitted
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)   # router clock: when each token reached it
    status: str = "pending"                            # pending | ok | failed
    end_time: float | None = None                      # router clock: last token, or the failure
    reason: str | None = None                          # why it failed
    finish_reason: str | None = None                   # length | stop
    attempts: int = 0                                  # 1 = served first time
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
    kv_send_start: float | None = None                 # prefill worker's clock: KV send began
    kv_arrived: float | None = None                    # decode worker's clock: last KV byte in
    decode_s: float | None = None                      # decode worker's first step -> last token
    worker_token_times: list[float] = field(default_factory=list)  # worker clock: when each token was made

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
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["prompt_ids"]
        d.update(prompt_len=self.prompt_len, ttft_s=self.ttft_s, e2e_s=self.e2e_s)
        return d


@dataclass
class StreamUpdate:
    """What one request did since a follower last looked (Router.follow)."""

    token_ids: list[int]        # new tokens, in order
    token_times: list[float]    # router clock, one per new token
    done: bool                  # it has ended (ok or failed: read the record)
