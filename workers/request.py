"""A request's state inside one engine: counters, not phases (the phase is derived)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"      # not holding KV blocks; (re)computes from token 0 when admitted
    RUNNING = "running"      # holds KV blocks, gets tokens each step until finished
    HANDOFF = "handoff"      # prefill role: first token made, KV waits to be exported
    IMPORTING = "importing"  # decode role: holds blocks its KV is arriving into, not yet scheduled
    FINISHED = "finished"    # stopped on max_tokens or EOS
    FAILED = "failed"        # ended with an error; `finish_reason` says why


class InvalidRequest(ValueError):
    """A request this engine cannot serve; names the request."""

    def __init__(self, request_id, reason: str):
        super().__init__(f"request {request_id!r}: {reason}")
        self.request_id = request_id
        self.reason = reason


# The one set of rules for what a request may ask (router, KV wire, engine and workers.generate).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 100.0   # below 1e-2, logits / T overflow float32 to inf -> NaN
SEED_MAX = 2**64 - 1                              # torch.Generator and msgpack both take [0, 2^64)
MAX_STOP_IDS = 1024
MAX_ID_CHARS = 256


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Checked when built (also through `from_dict`): a bad value raises ValueError naming the field."""

    max_tokens: int = 16
    temperature: float = 0.0          # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check_sampling(self)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        """Plain types only: what crosses to a worker (Ray) or onto the KV wire (msgpack)."""
        return {"max_tokens": self.max_tokens, "temperature": float(self.temperature), "top_p": float(self.top_p),
                "seed": self.seed, "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos}

    @classmethod
    def from_dict(cls, d) -> "SamplingParams":
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a mapping, not {type(d).__name__}")
        unknown = sorted(map(str, set(d) - set(SAMPLING_FIELDS)))
        if unknown:
            raise ValueError(f"unknown sampling field(s) {unknown}; known: {list(SAMPLING_FIELDS)}")
        return cls(**d)


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "ignore_eos")


def check_sampling(p: SamplingParams) -> None:
    """Types and ranges that need no model: each failure names its field."""
    mt, t, top_p, seed, stop = p.max_tokens, p.temperature, p.top_p, p.seed, p.stop_token_ids
    if not _is_int(mt) or mt < 1:
        raise ValueError(f"max_tokens={mt!r} must be an integer >= 1")
    if not _is_number(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise ValueError(f"temperature={t!r} must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                         f"{MAX_TEMPERATURE:g}]")
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1]")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= SEED_MAX):
        raise ValueError(f"seed={seed!r} must be null or an integer in [0, 2^64)")
    if not isinstance(stop, tuple) or len(stop) > MAX_STOP_IDS:
        raise ValueError(f"stop_token_ids must be a list of at most {MAX_STOP_IDS} token ids")
    for i, tok in enumerate(stop):
        if not _is_int(tok) or tok < 0:
            raise ValueError(f"stop_token_ids[{i}]={tok!r} is not a token id")
    if not isinstance(p.ignore_eos, bool):
        raise ValueError(f"ignore_eos={p.ignore_eos!r} must be true or false")


@dataclass(eq=False, slots=True)
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
    hand_off: bool = False                               # prefill role: stop after the first token
    kv_filled: object | None = None                      # importing: bool [layers, tokens] of what has arrived

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


def check_request_id(request_id) -> None:
    if isinstance(request_id, str):
        if not 0 < len(request_id) <= MAX_ID_CHARS:
            raise InvalidRequest(_shown(request_id), f"id must have 1 to {MAX_ID_CHARS} characters")
    elif not _is_int(request_id):
        raise InvalidRequest(_shown(request_id), f"id must be a string or an integer, not {type(request_id).__name__}")


def _shown(request_id):
    """An id fit to be printed and hashed in a rejection, even when it is not a valid id."""
    if isinstance(request_id, (str, int)) and not isinstance(request_id, bool):
        return request_id if len(str(request_id)) <= MAX_ID_CHARS else str(request_id)[:MAX_ID_CHARS] + "..."
    return repr(request_id)[:64]


def validate_request(request_id, prompt_ids, params, vocab_size: int, max_model_len: int) -> SamplingParams:
    """The rules every edge (router, KV wire, engine, workers.generate) applies to a request.
    `params` is a SamplingParams or its dict; returns the checked SamplingParams. Raises
    InvalidRequest naming the request and the field."""
    check_request_id(request_id)

    def bad(reason):
        raise InvalidRequest(request_id, reason)

    try:
        if isinstance(params, SamplingParams):
            check_sampling(params)       # again: a frozen dataclass can still be forged
        else:
            params = SamplingParams.from_dict(params)
    except (TypeError, ValueError) as e:
        bad(str(e))
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        bad("empty prompt: prompt_ids must be a non-empty list of token ids")
    if not (set(map(type, prompt_ids)) == {int} and min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size):
        for i, tok in enumerate(prompt_ids):     # (the fast check above runs in C; this names the culprit)
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                bad(f"prompt_ids[{i}]={tok!r} is not a token id in [0, {vocab_size})")
    for i, tok in enumerate(params.stop_token_ids):
        if tok >= vocab_size:
            bad(f"stop_token_ids[{i}]={tok} is not a token id in [0, {vocab_size})")
    n, mt = len(prompt_ids), params.max_tokens
    if n > max_model_len:
        bad(f"prompt has {n} tokens, more than max_model_len={max_model_len}")
    if n + mt > max_model_len:
        bad(f"prompt ({n}) + max_tokens ({mt}) exceeds max_model_len={max_model_len}")
    return params
