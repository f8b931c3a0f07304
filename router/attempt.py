"""One try of a request on its workers: which workers, what has been seen of it, and its phase.

Each try has its own id on the workers ("<router>:<n>"); the router keeps the ones in flight
(router/router.py) and the worker events move them on (router/worker_events.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.pool import WorkerHandle
from router.records import RequestRecord


@dataclass(eq=False)
class Attempt:
    aid: str
    record: RequestRecord
    kind: str                      # colocated | local (prefilled on its decode worker) | handoff | whole
    prefill: WorkerHandle          # computes the prompt
    decode: WorkerHandle           # makes the remaining tokens (the same worker unless handoff)
    prompt_len: int                # prompt + tokens streamed before this attempt
    submitted_at: float
    handoff_at: float | None = None             # router clock: first token in (set once it is)
    first_token_time: float | None = None       # router clock: when the first token was made
    decode_start: float | None = None           # router clock
    sent: bool = False                          # the prefill worker put the KV on the wire
    imported: bool = False                      # the decode worker has it (may be known before
    num_tokens: int = 0                         # the first token: the workers report separately)
    early: list = field(default_factory=list)   # decode-worker tokens that overtook the first token

    @property
    def phase(self) -> str:
        """prefill -> (transfer ->) decode, derived from what has been seen, in whatever order."""
        if self.handoff_at is None:
            return "prefill"
        return "transfer" if self.kind == "handoff" and not self.imported else "decode"
