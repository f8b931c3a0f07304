"""A request's journey, one attempt at a time: the states, the load they put on workers and the failure
rules, which the real router (router/router.py) and the simulator (experiments/sim/simulator.py) share.

An attempt goes prefill -> (transfer ->) decode; its phase is derived from what has been seen of it,
in whatever order its workers' reports come. `Journeys` holds the attempts in flight and the load
each puts on its workers, as placement reads it (router/policies.py's WorkerLoad: outstanding prompt
tokens on the prefill worker, running requests and KV tokens on the decode worker), and says which
attempts a failure takes down:
- a worker's death: the attempts it decodes, and those whose prompt only it holds (still
  prefilling, or prefilled with their KV not yet on the wire);
- a decode worker that stops receiving KV: the handoffs to it whose KV it has not imported;
- a KV transfer not on the wire `timeout_s` after its first token (transfer.timeout_s).
Whether the request of an attempt taken down is tried again: `why_not_retry`. What the journey writes
into a request's record (its end, attempts, workers and durations) is `JourneyRecord`, which the
router's and the simulator's records extend with their own token times; each owner keeps its own
clock and messages to workers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_CRASHES = 2      # a request on this many workers that died on their own is not retried again


@dataclass(eq=False, kw_only=True, slots=True)
class JourneyRecord:
    """What a request's journey writes into its record: how it ended, its attempts, where it ran, and the
    durations of its last attempt. The router's RequestRecord and the simulator's Record are this with
    their own token times (so requests.jsonl rows of both read the same fields)."""

    status: str = "pending"                            # pending | ok | failed
    end_time: float | None = None                      # last token made, or the failure
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
    decode_s: float | None = None                      # decode worker's first step -> last token
    prefill_end: float | None = None                   # the prefill step that made the first token ended
    kv_arrived: float | None = None                    # the last KV byte reached the decode worker

    @property
    def done(self) -> bool:
        return self.status != "pending"

    def finish(self, finish_reason: str, end_time: float) -> None:
        self.status, self.finish_reason, self.end_time = "ok", finish_reason, end_time

    def fail(self, reason: str, end_time: float) -> None:
        self.status, self.reason, self.end_time = "failed", reason, end_time


@dataclass(eq=False, slots=True)
class Journey:
    """One attempt of a request: on which workers, and what has been seen of it."""

    record: object                 # the request's record (router: RequestRecord; simulator: Record)
    kind: str                      # colocated | local (prefilled on its decode worker) | handoff | whole
    prefill: object                # the worker computing the prompt (anything with a `rank`)
    decode: object                 # the worker making the remaining tokens (the same one unless handoff)
    prompt_len: int                # prompt + tokens streamed before this attempt
    submitted_at: float
    handoff_at: float | None = None            # the first token reached the router (set once it has)
    first_token_time: float | None = None      # when the first token was made
    decode_start: float | None = None          # the decode worker's first step with it
    sent: bool = False                         # the prefill worker put the KV on the wire
    imported: bool = False                     # the decode worker has it (may be known before the
    num_tokens: int = 0                        # first token: the workers report separately)

    @property
    def phase(self) -> str:
        """prefill -> (transfer ->) decode, derived from what has been seen, in whatever order."""
        if self.handoff_at is None:
            return "prefill"
        return "transfer" if self.kind == "handoff" and not self.imported else "decode"

    def lost_with(self, worker) -> bool:
        """Whether this attempt dies with `worker`."""
        phase = self.phase
        holds_prompt = self.prefill is worker and (phase == "prefill" or (phase == "transfer" and not self.sent))
        return self.decode is worker or holds_prompt

    def stranded_by(self, worker) -> bool:
        """Whether this attempt is lost when `worker` stops receiving KV."""
        return self.decode is worker and self.kind == "handoff" and not self.imported

    def transfer_overdue(self, now: float, timeout_s: float) -> bool:
        return self.phase == "transfer" and not self.sent and now - self.handoff_at > timeout_s


class Journeys:
    """The attempts in flight (by their owner's key) and the load they put on each worker."""

    def __init__(self, loads: dict):
        self.loads = loads                    # worker rank -> WorkerLoad
        self.live: dict = {}

    def open(self, key, att: Journey) -> None:
        self.live[key] = att
        self.loads[att.prefill.rank].prompt_tokens += att.prompt_len
        decode = self.loads[att.decode.rank]
        decode.running += 1
        decode.kv_tokens += att.prompt_len

    def close(self, key) -> Journey | None:
        """Forget an attempt and release its load; None when it had already ended."""
        att = self.live.pop(key, None)
        if att is None:
            return None
        if att.phase == "prefill":
            self.loads[att.prefill.rank].prompt_tokens -= att.prompt_len
        decode = self.loads[att.decode.rank]
        decode.running -= 1
        decode.kv_tokens -= att.prompt_len + att.num_tokens
        return att

    def token(self, att: Journey, made: float, arrived: float, started: float | None, finish: str | None,
              count: int = 1) -> bool:
        """`count` tokens of `att` made by a step that ended at `made` (one token, unless a run of decode
        steps), reaching the router at `arrived`; `started`: when the first step that scheduled it on
        this worker began (None when not this worker's first). True when the attempt has finished
        (finish reason length or stop): its owner then closes it and ends the record."""
        rec = att.record
        att.num_tokens += count
        self.loads[att.decode.rank].kv_tokens += count
        if att.phase == "prefill":
            if started is not None:
                rec.queue_s, rec.prefill_s = max(0.0, started - att.submitted_at), made - started
            self.loads[att.prefill.rank].prompt_tokens -= att.prompt_len
            att.handoff_at, att.first_token_time = arrived, made
            if finish != "handoff":
                att.decode_start = made
        elif started is not None and att.kind == "handoff" and att.decode_start is None:
            att.decode_start = started                 # the decode worker's first step with it
            rec.handoff_s = started - att.first_token_time
        if finish in ("length", "stop"):
            rec.decode_s = made - att.decode_start if att.decode_start is not None else 0.0
            return True
        return False

    def of(self, record) -> list[Journey]:
        return [a for a in self.live.values() if a.record is record]

    def lost_with(self, worker) -> list[Journey]:
        return [a for a in self.live.values() if a.lost_with(worker)]

    def stranded_by(self, worker) -> list[Journey]:
        return [a for a in self.live.values() if a.stranded_by(worker)]

    def overdue(self, now: float, timeout_s: float) -> list[Journey]:
        return [a for a in self.live.values() if a.transfer_overdue(now, timeout_s)]


def why_not_retry(rec, reason: str, crashed: bool, max_retries: int) -> str | None:
    """After an attempt of `rec` failed for `reason`: the reason it fails for good instead of being
    retried, or None when it is retried (the reason then noted in `rec.retried_for`)."""
    rec.crashes += crashed
    if rec.crashes >= MAX_CRASHES:
        return (f"{reason}; not retried: it was on {rec.crashes} workers that died while serving it, "
                "and may be what killed them")
    if rec.attempts > max_retries:
        return f"{reason}; gave up after {rec.attempts} attempts (router.max_retries={max_retries})"
    rec.retried_for.append(reason)
    return None
