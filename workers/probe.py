"""A speed probe: the same two steps timed on an engine before it serves (and after), so a run can say
how fast its machine was then. Opt-in (`cluster.speed_probe=true`): nothing in the simulator or the
report needs it.

Each worker times a decode step (`DECODE_CONTEXT` tokens of context, batch 1) and a prompt chunk
(`PROMPT_TOKENS` from token 0), cells a profile's grid also fits, `ROUNDS` times alternately; the
medians go into the repeat's metrics.json. The steps run on the engine's own runner, pool and weights
with blocks taken from its free list and given back, and leave no trace record.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from workers.request import Request, SamplingParams
from workers.scheduler import ScheduledChunk, SchedulerOutput

DECODE_CONTEXT = 256
PROMPT_TOKENS = 64
ROUNDS = 8


def speed_probe(engine, rounds: int = ROUNDS) -> dict:
    """{"decode_s", "prefill_s": median seconds of each probe step, "context", "prompt_tokens": its
    size, "rounds"}, after one untimed round. The engine must be idle (nothing running or waiting)."""
    if engine.has_work():
        raise RuntimeError("the speed probe needs an idle engine")
    context = min(DECODE_CONTEXT, engine.max_model_len - 2)
    prompt = min(PROMPT_TOKENS, engine.cfg.token_budget or PROMPT_TOKENS, engine.max_model_len - 1)
    if context < 1 or prompt < 1:
        raise ValueError(f"max_model_len={engine.max_model_len} leaves no room for a probe step")
    rng = np.random.default_rng(0)
    vocab = engine.mcfg.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    decode = Request(id="probe-decode", prompt_ids=rng.integers(0, vocab, context + 1).tolist(), params=params)
    chunk = Request(id="probe-prompt", prompt_ids=rng.integers(0, vocab, prompt).tolist(), params=params)
    blocks = engine.blocks
    if not blocks.can_allocate([], context + 1 + engine.cfg.block_size + prompt):
        raise RuntimeError(f"the speed probe needs {context + 1 + prompt} tokens of free KV blocks")
    blocks.allocate(decode.block_ids, context + 1)
    blocks.allocate(chunk.block_ids, prompt)
    times: dict[str, list[float]] = {"decode": [], "prefill": []}
    try:
        for k in range(rounds + 1):
            for kind in ("decode", "prefill"):
                out = SchedulerOutput()
                if kind == "decode":
                    decode.token_ids, decode.num_computed_tokens = list(decode.prompt_ids), context
                    out.decodes.append(ScheduledChunk(decode, 1))
                else:
                    chunk.token_ids, chunk.num_computed_tokens = list(chunk.prompt_ids), 0
                    out.prefills.append(ScheduledChunk(chunk, prompt))
                t = time.perf_counter()
                engine.runner.execute(out)
                if k:
                    times[kind].append(time.perf_counter() - t)
    finally:
        blocks.free(decode.block_ids)
        blocks.free(chunk.block_ids)
    return {"decode_s": statistics.median(times["decode"]), "prefill_s": statistics.median(times["prefill"]),
            "context": context, "prompt_tokens": prompt, "rounds": rounds}


def usable(probes: dict | None) -> list[dict]:
    """The results that timed both steps among {worker: speed_probe result} (a failed one holds an error)."""
    return [r for r in (probes or {}).values() if r.get("decode_s") and r.get("prefill_s")]
