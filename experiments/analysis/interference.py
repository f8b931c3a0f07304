"""Interference, measured: one engine's step time for B decodes at context C plus a P-token prefill chunk.

For each (B, C), B requests are prefilled to context C and left decoding; then the chunk sizes P
(0 = decode only) are measured in rounds: every round steps once with each chunk size, in an order
rotated from round to round, so that drift of the machine hits every size alike. A fresh P-token
prompt joins one step beside the B decodes and that step's duration is read from the engine's own
trace. The first round is a warm-up. The decodes' contexts grow by one token per step, which is small
next to C.

Reported per point: the median step time with its range, the roofline prediction for the same step on
`hardware`, the inflation (the median over rounds of this step / that round's decode-only step, with a
95% bootstrap interval) and the prefill throughput the chunk achieved (median of P / step time). A mixed step
measured faster than decode-only (inflation below one) is implausible: its point is re-measured, a
round at a time, up to `max_remeasure` rounds; `remeasured` records how many, `implausible` whether it
stayed so.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from experiments.hardware import Hardware, mixed_cost
from experiments.serving.stats import median_ci
from workers.config import EngineConfig
from workers.engine import Engine
from workers.model import Llama
from workers.request import SamplingParams


@dataclass
class StepPoint:
    batch: int
    context: int
    chunk: int
    step_ms: float              # median measured step time
    step_ms_min: float
    step_ms_max: float
    predicted_ms: float         # roofline lower bound on `hardware`
    bound: str                  # compute | memory, by the roofline
    inflation: float = 1.0      # median over rounds of step / decode-only step of the same round
    inflation_ci: list | None = None
    prefill_tok_s: float = 0.0  # chunk tokens / median step time
    prefill_tok_s_ci: list | None = None
    samples_ms: list = field(default_factory=list)
    remeasured: int = 0         # extra rounds run while this point was implausible
    implausible: bool = False   # after them, still a mixed step faster than decode-only

    def to_dict(self) -> dict:
        return asdict(self)


def rounds(step: Callable[[int], float], chunks: list[int], repeats: int, max_remeasure: int) -> tuple[dict, dict]:
    """Measure `step(chunk)` (ms) in interleaved rounds; returns ({chunk: [ms per round]}, {chunk: extra rounds}).

    One warm-up round, `repeats` rounds, then up to `max_remeasure` more while some chunk's median
    paired ratio to decode-only is below one. Needs chunk 0 (decode only) among `chunks`."""
    times = {c: [] for c in chunks}
    extra = {c: 0 for c in chunks}

    def one_round(k: int, keep: bool) -> None:
        shift = k % len(chunks)
        for c in chunks[shift:] + chunks[:shift]:
            ms = step(c)
            if keep:
                times[c].append(ms)

    one_round(0, keep=False)
    for k in range(repeats):
        one_round(k + 1, keep=True)
    for k in range(max_remeasure):
        bad = [c for c in chunks if c and inflation(times, c) < 1.0]
        if not bad:
            break
        for c in bad:
            extra[c] += 1
        one_round(repeats + 1 + k, keep=True)
    return times, extra


def ratios(times: dict, chunk: int) -> list[float]:
    """This chunk's step over the decode-only step of the same round, per round."""
    return [t / base for t, base in zip(times[chunk], times[0]) if base > 0]


def inflation(times: dict, chunk: int) -> float:
    r = ratios(times, chunk)
    return statistics.median(r) if r else float("nan")


def measure(model: Llama, hw: Hardware, batches: list[int], context: int, chunks: list[int],
            repeats: int = 5, seed: int = 0, max_remeasure: int = 3) -> list[StepPoint]:
    if 0 not in chunks:
        raise ValueError(f"chunks={chunks} must include 0 (the decode-only step every ratio is taken to)")
    cfg = model.cfg
    dtype_bytes = model.embed_tokens.element_size()
    gen = torch.Generator().manual_seed(seed)
    points: list[StepPoint] = []
    for batch in batches:
        budget = batch + max(chunks + [context])
        warm_up = -(-batch * context // budget) + 1          # steps until every decode reaches context C
        steps = warm_up + len(chunks) * (repeats + 1 + max_remeasure) + 4   # each step adds a token per decode
        block_size = 16
        blocks = batch * -(-(context + steps + 1) // block_size) + -(-max(chunks + [1]) // block_size) + 8
        engine = Engine(model, EngineConfig(policy="chunked", token_budget=budget, max_batch=batch + 1,
                                            block_size=block_size, num_kv_blocks=blocks,
                                            max_model_len=min(context + max(chunks) + steps + 8,
                                                              cfg.max_position_embeddings)))
        for i in range(batch):
            prompt = torch.randint(cfg.vocab_size, (context,), generator=gen).tolist()
            engine.add_request(f"d{i}", prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
        while any(r.is_prefill for r in engine.requests.values()):
            engine.step()                                         # the decodes reach context C
        count = iter(range(1 << 30))

        def step(chunk: int) -> float:
            rid = f"p{chunk}.{next(count)}"
            if chunk:
                prompt = torch.randint(cfg.vocab_size, (chunk,), generator=gen).tolist()
                engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            engine.step()
            rec = engine.trace[-1]
            assert rec.num_decode_seqs == batch and rec.num_prefill_tokens == chunk, rec
            engine.abort(rid)
            return rec.duration * 1e3

        times, extra = rounds(step, chunks, repeats, max_remeasure)
        for chunk in chunks:
            cost = mixed_cost(cfg, batch, context, chunk, dtype_bytes)
            ms = times[chunk]
            p = StepPoint(batch, context, chunk, statistics.median(ms), min(ms), max(ms), cost.time(hw) * 1e3,
                          cost.bound(hw), samples_ms=list(ms), remeasured=extra[chunk])
            if chunk:
                ci = median_ci(ratios(times, chunk), seed=seed)
                p.inflation, p.inflation_ci = ci["median"], _pair(ci)
                tok = median_ci([chunk / (t / 1e3) for t in ms], seed=seed)
                p.prefill_tok_s, p.prefill_tok_s_ci = tok["median"], _pair(tok)
                p.implausible = p.inflation < 1.0
            points.append(p)
    return points


def _pair(ci: dict) -> list | None:
    return None if ci["lo"] is None else [ci["lo"], ci["hi"]]


def gap_summary(points: list[StepPoint]) -> dict:
    """How far measurement and roofline are apart: measured / predicted, over all points, and at which
    chunk size the gap is widest and narrowest."""
    rated = [(p.step_ms / p.predicted_ms, p) for p in points if p.predicted_ms > 0]
    ratios_ = [r for r, _ in rated]
    widest, narrowest = max(rated, key=lambda x: x[0])[1], min(rated, key=lambda x: x[0])[1]
    return {"ratio_min": min(ratios_), "ratio_median": statistics.median(ratios_), "ratio_max": max(ratios_),
            "widest": {"batch": widest.batch, "chunk": widest.chunk, "step_ms": widest.step_ms},
            "narrowest": {"batch": narrowest.batch, "chunk": narrowest.chunk, "step_ms": narrowest.step_ms}}
