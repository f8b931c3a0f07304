"""The simulator's requests: workers/request.py's Request with counters in place of token lists.

The scheduler reads a request's prompt and output lengths, never its tokens, so a `SimRequest` keeps
`prompt_len` and `num_out` and derives what Request derives from its lists from them.
"""
from __future__ import annotations

from dataclasses import dataclass

from workers.request import Request, SamplingParams

_PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)   # shared: a SimRequest reads max_tokens of its own


@dataclass(eq=False, slots=True)
class SimRequest(Request):
    """A Request whose prompt and outputs are counts: `num_tokens` = prompt_len + num_out."""

    prompt_len: int = 0
    max_tokens: int = 1
    num_out: int = 0
    attempt: object = None                         # the router's attempt this engine serves it for

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_out

    @property
    def num_output_tokens(self) -> int:
        return self.num_out

    @property
    def is_prefill(self) -> bool:                  # Request.is_prefill over the counters, read every step
        return self.prompt_len + self.num_out - self.num_computed_tokens > 1

    @property
    def output_ids(self) -> list[int]:
        return []


def sim_request(rid: str, prompt_len: int, max_tokens: int, arrival: float, hand_off: bool = False) -> SimRequest:
    return SimRequest(id=rid, prompt_ids=[], params=_PARAMS, arrival_time=arrival, prompt_len=prompt_len,
                      max_tokens=max_tokens, hand_off=hand_off)
