"""Router and fault-injection settings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    prefill_policy: str = "least_prompt_tokens"   # also chooses among colocated workers
    decode_policy: str = "least_kv"
    conditional_threshold: int = 0    # prompts shorter than this skip the prefill pool (0: never)
    max_retries: int = 2              # re-prefills of one request after worker or transfer failures
    request_timeout_s: float = 600.0  # a request unfinished by then ends failed: nothing hangs
    poll_timeout_s: float = 0.2       # how often a worker is asked whether it lives (events come over ZeroMQ)
    liveness_timeout_s: float = 5.0   # a poll unanswered this long past poll_timeout_s: the worker is frozen
    clock_sync_s: float = 2.0         # re-estimate each worker's clock offset this often (nodes' clocks drift)
    clock_probes: int = 8             # round trips per estimate; the shortest gives the offset (twice at start)

    def __post_init__(self):
        from router.policies import DECODE_POLICIES, PREFILL_POLICIES
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"router.prefill_policy={self.prefill_policy!r}: choose one of {sorted(PREFILL_POLICIES)}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"router.decode_policy={self.decode_policy!r}: choose one of {sorted(DECODE_POLICIES)}")
        if self.conditional_threshold < 0:
            raise ValueError(f"router.conditional_threshold={self.conditional_threshold} must be >= 0")
        if self.max_retries < 0:
            raise ValueError(f"router.max_retries={self.max_retries} must be >= 0")
        if self.clock_probes < 1:
            raise ValueError(f"router.clock_probes={self.clock_probes} must be >= 1")
        for key in ("request_timeout_s", "poll_timeout_s", "liveness_timeout_s", "clock_sync_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"router.{key}={getattr(self, key)} must be positive")


@dataclass(frozen=True)
class FaultConfig:
    """Rehearse failures: kill a worker mid-run, or lose one request's KV transfer."""

    kill_worker: str | None = None          # "decode:0", "prefill:1", "colocated:0"
    kill_after_s: float = 2.0               # seconds after the workload starts
    timeout_transfer_of: int | None = None  # the n-th request sent through the prefill pool (1-based)

    def __post_init__(self):
        if self.kill_worker is not None:
            role, sep, index = self.kill_worker.partition(":")
            if not sep or role not in ("prefill", "decode", "colocated") or not index.isdigit():
                raise ValueError(f"fault.kill_worker={self.kill_worker!r}: write ROLE:INDEX, e.g. decode:0")
        if self.kill_after_s < 0:
            raise ValueError(f"fault.kill_after_s={self.kill_after_s} must be >= 0")
        if self.timeout_transfer_of is not None and self.timeout_transfer_of < 1:
            raise ValueError(f"fault.timeout_transfer_of={self.timeout_transfer_of} counts from 1")
