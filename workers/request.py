"""A request's state inside one engine: counters, not phases (the phase is derived)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"      # not holding KV blocks; (re)computes from token 0 when admitted
    RUNNING = "running"      # holds KV blocks, gets tokens each step until finished
    HANDOFF = "handoff"      # prefill role: first token made, KV waits to be exported
    FINISHED = "finished"    # stopped on max_tokens or EOS
    FAILED = "failed"        # ended with an error; `finish_reason` says why


class InvalidRequest(ValueError):
    """A request this engine cannot serve; names the request."""

    def __init__(self, request_id, reason: str):
        super().__init__(f"request {request_id!r}: {reason}")
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        """Plain types only: what crosses to a worker (Ray) or onto the KV wire (msgpack)."""
        return {"max_tokens": self.max_tokens, "temperature": float(self.temperature), "top_p": float(self.top_p),
                "seed": self.seed, "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**{**d, "stop_token_ids": tuple(d.get("stop_token_ids", ()))})


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)   # prompt + outputs, grows by one per token
    num_computed_tokens: int = 0                         # tokens whose K/V are in this engine's cache
    status: Status = Status.WAITING
    block_ids: list[int] = field(default_factory=list)   # block table
    token_times: list[float] = field(default_factory=list)  # one per output token made here
    first_scheduled_time: float | None = None            # start of the first step that computed it here
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: object | None = None                      # torch.Generator for seeded sampling
    stop_ids: frozenset[int] = frozenset()               # EOS ids this request stops on

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token still to compute: the prompt, or a recomputation after preemption."""
        return self.num_tokens - self.num_computed_tokens > 1


def validate_request(request_id, prompt_ids, params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """The rules every engine (and the router, before any engine) applies to a request."""
    def bad(reason):
        raise InvalidRequest(request_id, reason)

    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        bad("empty prompt: prompt_ids must be a non-empty list of token ids")
    for i, tok in enumerate(prompt_ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            bad(f"prompt_ids[{i}]={tok!r} is not a token id in [0, {vocab_size})")
    mt = params.max_tokens
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        bad(f"max_tokens={mt!r} must be an integer >= 1")
    if not params.temperature >= 0:
        bad(f"temperature={params.temperature} must be >= 0")
    if not 0.0 < params.top_p <= 1.0:
        bad(f"top_p={params.top_p} must be in (0, 1]")
    n = len(prompt_ids)
    if n > max_model_len:
        bad(f"prompt has {n} tokens, more than max_model_len={max_model_len}")
    if n + mt > max_model_len:
        bad(f"prompt ({n}) + max_tokens ({mt}) exceeds max_model_len={max_model_len}")
