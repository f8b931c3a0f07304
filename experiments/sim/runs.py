"""The runs of a simulated worker: steps certain without scheduling them, advanced in one event.

Decode runs. When every running request is a decode that fits the token budget, nothing is waiting
that the scheduler could admit (the queue is empty, the batch is full, or the first waiting prompt
cannot get its blocks: free blocks only shrink while decodes run), and the blocks the decodes will
take over the next k steps are free, then the next k steps are known without scheduling them: each
request gains one token per step, the first to finish ends the run. `start_run` computes those k
steps' times; `apply_run` advances every request by the m <= k steps that ran (a run
is cut short when work arrives) and allocates their blocks through the BlockManager. The step sequence
is the one the scheduler would have produced (tests/test_sim_validate.py replays a recorded engine trace).

Chunk runs. Under the chunked policy a prompt beside running decodes is as certain: each step gives
every decode a token and the prompt what the budget leaves, and nothing waiting is admitted while the
prompt's chunks take the whole budget. So when the only thing to schedule besides the decodes is one
prompt (the last running request, or the first waiting one the scheduler would admit), its chunks run
as one run too, each step priced and spaced exactly as a scheduled step, up to the step that makes its
first token (where that step leaves budget to a waiting prompt, up to the step before), or the first
decode's last token, or the free blocks' end. Scheduling every step gives the same steps, records and
loads (tests/test_sim_runs.py).

Between runs the decodes' counters live in a `Batch` (lists over the first n running requests), so
a run costs a pass over its requests plus what changed: a request joining, finishing or taking a block.
They are written back to the requests (`settle`) before anything else reads them: the scheduler's
next step, an abort, the end of the simulation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def blocks_needed(computed: list, held: list, steps: int, block_size: int) -> int:
    """New blocks that requests at `computed` tokens holding `held` blocks take over `steps` more tokens."""
    n = 0
    for c, h in zip(computed, held):
        x = -(-(c + steps) // block_size) - h
        if x > 0:
            n += x
    return n


@dataclass(slots=True)
class DecodeRun:
    """k steps of the same decodes (and, in a chunk run, one prompt's chunks), advanced in one event."""

    b: int                     # the running decodes: the first b of the scheduler's running list
    starts: list               # [k] step start times
    ends: list                 # [k] step end times
    computed: list             # [b] num_computed_tokens of each request at the run's start
    blocks0: list              # [b] blocks each held at the start
    used0: int                 # blocks in use at the start
    finishing: int             # steps until the first request finishes (the run's length, or more
                               # when the free blocks cut it shorter)
    joined: int                # requests in no earlier run of this batch: the last `joined` of the b
    prompt: "PromptChunks | None" = None   # a prompt chunked beside the decodes, one chunk a step

    @property
    def k(self) -> int:
        return len(self.ends)


@dataclass(slots=True)
class PromptChunks:
    """The prompt of a chunk run: its chunk in each step (the budget the decodes leave it, its last chunk
    what is left), from `start` computed tokens; `completes`: the last chunk catches it up (its first
    token, at the run's last step)."""

    req: object                # the SimRequest
    chunks: list               # [k] tokens a step
    start: int                 # num_computed_tokens at the run's start
    completes: bool
    held: int = 0              # blocks it held at the run's start


class Batch:
    """The counters of the running decodes between runs, for the first n of the scheduler's running list
    in its order (requests join at its end; `settle` writes them back): tokens computed, KV blocks held,
    outputs made and asked for. Plain lists: a batch is mostly a few requests, where a numpy call costs
    more than a loop over them. Each change makes new lists (a run in flight holds the ones it began with)."""

    __slots__ = ("n", "computed", "held", "out", "max_tokens", "joined", "min_left")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.n = 0
        self.computed, self.held, self.out, self.max_tokens = [], [], [], []
        self.joined = 0                        # the last `joined` members have run in no decode run yet
        self.min_left = 1 << 62                # the fewest tokens a member has left (None: not known)

    def join(self, computed: list, held: list, out: list, max_tokens: list, min_left: int) -> None:
        """Requests appended to the scheduler's running list become members, in that order: their
        tokens computed, blocks held, outputs made and asked for (the fewest left: min_left)."""
        if self.min_left is not None:
            self.min_left = min(self.min_left, min_left)
        self.computed, self.held = self.computed + computed, self.held + held
        self.out, self.max_tokens = self.out + out, self.max_tokens + max_tokens
        self.n += len(computed)
        self.joined += len(computed)

    def keep(self, mask: list) -> None:
        """Only the members where `mask` holds stay, in order."""
        self.computed = [x for x, k in zip(self.computed, mask) if k]
        self.held = [x for x, k in zip(self.held, mask) if k]
        self.out = [x for x, k in zip(self.out, mask) if k]
        self.max_tokens = [x for x, k in zip(self.max_tokens, mask) if k]
        self.n = len(self.computed)
        self.min_left = None


def prompt_chunks(left: int, room: int, others_wait: bool) -> tuple[list[int], int]:
    """A prompt's chunks while `left` of its tokens are to compute and the decodes leave `room` of the
    budget a step: min(left, room) each, while more than its last token is left (that one runs as a
    decode, a step of its own), and not the last chunk when it leaves budget that a waiting prompt
    (`others_wait`) may take. Returns (chunks, tokens left after them)."""
    chunks = []
    while left > 1:
        c = min(left, room)
        if c == left and others_wait and c < room:
            break
        chunks.append(c)
        left -= c
    return chunks, left


def chunk_step_times(model, pc: PromptChunks, b: int, context: int, start: float, contention: float,
                     jitter: list | None) -> tuple[list, list]:
    """(starts, ends) of a chunk run's steps: b decodes at `context` summed tokens (growing by b a step)
    beside pc's chunks, each step priced as a scheduled one (the same features, the same arithmetic,
    times its `jitter`) and the next one starting the host gap of b + 1 sequences after it."""
    gap, total = model.gap(b + 1), pc.req.num_tokens
    at, done = start, pc.start
    starts, ends = [], []
    for i, n in enumerate(pc.chunks):
        f = (b, context + b * i, n, 1, done, n * done + n * (n + 1) // 2, b + (done + n == total), n * done)
        starts.append(at)
        d = model.time(f) * contention
        at += d * jitter[i] if jitter is not None else d
        ends.append(at)
        at += gap
        done += n
    return starts, ends


def logged_steps(run: DecodeRun, m: int, block_size: int, num_waiting: int) -> dict:
    """The run's first m steps as steps.jsonl columns (arrays), blocks counted step by step."""
    i = np.arange(1, m + 1)
    blocks0 = np.array(run.blocks0, dtype=np.int64)[:, None]
    computed = np.array(run.computed, dtype=np.int64)[:, None]
    held = np.maximum(blocks0, -(-(computed + i[None, :]) // block_size))   # [b, m]
    used = run.used0 + (held - blocks0).sum(axis=0)
    pc, prefill = run.prompt, None
    if pc is not None:
        prefill = np.array(pc.chunks[:m], dtype=np.int64)
        used = used + np.maximum(0, -(-(pc.start + np.cumsum(prefill)) // block_size) - pc.held)
    return {"start": np.array(run.starts[:m]), "end": np.array(run.ends[:m]), "b": run.b, "used": used,
            "waiting": num_waiting, "prefill": prefill}
