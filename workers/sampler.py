"""Next-token choice: greedy rows in one argmax; seeded temperature/top-p rows one by one on the CPU.

Each sampling request owns a CPU generator seeded once, so its tokens do not depend on which
other requests share its steps, nor on the device.
"""
from __future__ import annotations

import torch

from workers.request import Request


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def top_p_sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)       # [V]
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs   # mass of strictly more likely tokens
        sorted_probs[before >= top_p] = 0.0              # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))


class SampleFailure:
    """In place of a token: this row could not be sampled; only its request fails."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"SampleFailure({self.reason!r})"


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int | SampleFailure]:
    """logits [N, V] float32, one row per request -> N token ids (or a SampleFailure for a row that
    cannot be sampled: non-finite logits, or an error in that row's sampling)."""
    best, tokens = logits.max(dim=-1)                             # one pass: the greedy token and its logit
    tokens = tokens.tolist()
    # a NaN anywhere in a row makes its max NaN, a +inf makes it inf, and a row of -inf has max -inf:
    # the max is finite exactly when the row can be sampled
    finite = torch.isfinite(best).tolist()                        # [N]
    for i, req in enumerate(requests):
        p = req.params
        if not finite[i]:
            tokens[i] = SampleFailure("the model produced non-finite logits (NaN or inf) for this request")
        elif not p.greedy:
            try:
                tokens[i] = top_p_sample(logits[i], p.temperature, p.top_p, req.generator)
            except Exception as e:   # one row's sampling must not take the step's other rows with it
                tokens[i] = SampleFailure(f"sampling failed: {type(e).__name__}: {e}")
    return tokens
