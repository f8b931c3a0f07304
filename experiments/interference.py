"""Interference, measured: one engine's step time for B decodes at context C plus a P-token prefill chunk.

For each (B, C), B requests are prefilled to context C and left decoding; then, for each chunk size
P (0 = decode only), a fresh P-token prompt joins one step beside the B decodes and that step's
duration is read from the engine's own trace (median of `repeats`, after a warm-up step). The
decodes' contexts grow by one token per measured step, which is small next to C.

Reported per point: the measured step, the roofline prediction for the same step on `hardware`,
the decode inter-token-latency inflation (mixed step / decode-only step), and the prefill
throughput the chunk achieved (P / step time).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from experiments.roofline import Hardware, mixed_cost
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
    inflation: float = 1.0      # step / decode-only step at the same (B, C)
    prefill_tok_s: float = 0.0  # chunk tokens / step time

    def to_dict(self) -> dict:
        return asdict(self)


def measure(model: Llama, hw: Hardware, batches: list[int], context: int, chunks: list[int],
            repeats: int = 5, seed: int = 0) -> list[StepPoint]:
    cfg = model.cfg
    dtype_bytes = model.embed_tokens.element_size()
    gen = torch.Generator().manual_seed(seed)
    points: list[StepPoint] = []
    for batch in batches:
        budget = batch + max(chunks + [context])
        warm_up = -(-batch * context // budget) + 1          # steps until every decode reaches context C
        steps = warm_up + len(chunks) * (repeats + 1) + 4    # every step adds a token to each decode
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
        base = None
        for chunk in chunks:
            times = []
            for rep in range(repeats + 1):                        # the first is a warm-up
                rid = f"p{chunk}.{rep}"
                if chunk:
                    prompt = torch.randint(cfg.vocab_size, (chunk,), generator=gen).tolist()
                    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                engine.step()
                rec = engine.trace[-1]
                assert rec.num_decode_seqs == batch and rec.num_prefill_tokens == chunk, rec
                engine.abort(rid)
                if rep:
                    times.append(rec.duration * 1e3)
            cost = mixed_cost(cfg, batch, context, chunk, dtype_bytes)
            point = StepPoint(batch, context, chunk, statistics.median(times), min(times), max(times),
                              cost.time(hw) * 1e3, cost.bound(hw))
            if chunk == 0:
                base = point.step_ms
            point.inflation = point.step_ms / base if base else float("nan")
            point.prefill_tok_s = chunk / (point.step_ms / 1e3)
            points.append(point)
    return points


def gap_summary(points: list[StepPoint]) -> dict:
    """How far measurement and roofline are apart: measured / predicted, over all points."""
    ratios = [p.step_ms / p.predicted_ms for p in points if p.predicted_ms > 0]
    return {"ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios)}
