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
    """logits: one row [V], float32, on the host (where the request's generator lives)."""
    probs = torch.softmax(logits / temperature, dim=-1)                      # [V]
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
    cannot be sampled: non-finite logits, or an error in that row's sampling). On a GPU the step
    waits for the device once for every greedy row together, and once more for the sampling rows'
    logits (copied to the host together), never once per request."""
    best, tokens = logits.max(dim=-1)                             # one pass: the greedy token and its logit
    # a NaN anywhere in a row makes its max NaN, a +inf makes it inf, and a row of -inf has max -inf:
    # the max is finite exactly when the row can be sampled; -1 marks the others
    tokens = torch.where(torch.isfinite(best), tokens, -1).tolist()
    sampled = [i for i, req in enumerate(requests) if not req.params.greedy and tokens[i] >= 0]
    rows = logits[sampled].float().cpu() if sampled else None   # [len(sampled), V] on the host
    for i, tok in enumerate(tokens):
        if tok < 0:
            tokens[i] = SampleFailure("the model produced non-finite logits (NaN or inf) for this request")
    for j, i in enumerate(sampled):
        p = requests[i].params
        try:
            tokens[i] = top_p_sample(rows[j], p.temperature, p.top_p, requests[i].generator)
        except Exception as e:   # one row's sampling must not take the step's other rows with it
            tokens[i] = SampleFailure(f"sampling failed: {type(e).__name__}: {e}")
    return tokens
