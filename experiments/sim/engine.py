"""One simulated worker's engine: pdlab's own Scheduler and BlockManager, a step-time model for the forward.

`SimEngine` holds a real `workers.scheduler.Scheduler` over `workers.block_manager.BlockManager`'s
decisions (over counts of blocks: experiments/sim/blocks.py) and post-processes each scheduled step
as `workers.engine.Engine.step` does (computed tokens advance, a chunk that catches its request up
samples a token, a request ends on `max_tokens` or, on a prefill worker, hands off after its first
token), with the step's duration from the step model instead of a forward pass. Requests are
`SimRequest`s (experiments/sim/request.py): workers.request.Request with counters in place of token
lists, so a million requests fit in memory.
Token values are not simulated: every request runs to its `max_tokens` (the workloads ask ignore_eos).

Runs of steps that are certain without scheduling them (decode runs, chunk runs) are advanced in
one event: `run_length` finds them, `start_run` prices them, `apply_run` advances the requests by the
steps that ran; experiments/sim/runs.py holds their records and arithmetic.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from experiments.sim.blocks import CountingBlockManager
from workers.config import EngineConfig
from workers.request import Status
from workers.scheduler import Scheduler, SchedulerOutput

from experiments.sim.request import SimRequest
from experiments.sim.runs import Batch, DecodeRun, PromptChunks, blocks_needed, chunk_step_times, prompt_chunks
from experiments.sim.stepmodel import features, step_jitter


@dataclass(slots=True)
class StepDone:
    """What one step did: tokens made (request, finish reason or None), requests preempted."""

    tokens: list
    preempted: list


class SimEngine:
    __slots__ = ("cfg", "model", "blocks", "scheduler", "fast_forward", "num_steps", "batch", "_found", "_chunks",
                 "_shared", "_spread", "_stream")

    def __init__(self, cfg: EngineConfig, num_blocks: int, model, fast_forward: bool = True, stream: int = 0):
        self.cfg = cfg
        self.model = model
        self.blocks = CountingBlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.fast_forward = fast_forward
        self.num_steps = 0
        self.batch = Batch()
        self._found = 0                       # the run run_length found, until start_run takes it
        self._chunks = None                   # the prompt chunks of the run run_length found, if any
        self._shared = getattr(model, "shared_host", None) or 1.0
        self._spread = getattr(model, "spread", None)   # steps vary around the model's time (None: they do not)
        self._stream = stream                            # this worker's draws (its rank)

    # -- admission (workers.engine.Engine.add_request / begin_import + finish_import) ------------
    def add(self, req: SimRequest) -> None:
        self.scheduler.add(req)

    def can_import(self, prompt_len: int) -> bool:
        return len(self.scheduler.running) < self.cfg.max_batch and self.blocks.can_allocate([], prompt_len)

    def add_imported(self, req: SimRequest) -> None:
        """A request prefilled elsewhere: its prompt's blocks allocated, its first token in hand."""
        self.blocks.allocate(req.block_ids, req.prompt_len)
        req.num_computed_tokens = req.prompt_len
        self.scheduler.add_running(req)

    def remove(self, req: SimRequest) -> None:
        """Abort: out of the scheduler, blocks freed."""
        i = self.member(req)
        if i is not None:
            self._settle_one(i)
            self.batch.keep([j != i for j in range(self.batch.n)])
        self.scheduler.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.status = Status.FAILED

    def release(self, req: SimRequest) -> None:
        """A handed-off request's KV has been exported: its blocks go back."""
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.status = Status.FINISHED

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one scheduled step ----------------------------------------------------------------------
    def schedule(self, shared: bool = False) -> tuple[SchedulerOutput, float]:
        """The real scheduler's next step and its modelled duration (0.0 for an empty step); `shared`:
        another worker of its host has work at the step's start (the simulator rescales the step if
        that changes before it ends)."""
        self.settle()
        sched = self.scheduler.schedule()
        if not sched:
            return sched, 0.0
        d = self.model.time(features(sched)) * self.contention(shared)
        return sched, d * step_jitter(self._spread, self._stream, self.num_steps) if self._spread else d

    def contention(self, shared: bool) -> float:
        """How much slower a step's work goes while another worker of its host has work (`shared`):
        the model's shared_host factor, 1.0 where it has none."""
        return self._shared if shared else 1.0

    def gap(self, num_seqs: int) -> float:
        """Host time after a step of `num_seqs` sequences, before the next step starts."""
        return self.model.gap(num_seqs)

    def finish(self, sched: SchedulerOutput, start: float, end: float) -> StepDone:
        """Post-process a step as Engine.step does: counters, first-scheduled times, tokens, endings."""
        tokens = []
        for chunk in sched.decodes + sched.prefills:
            req = chunk.request
            completes = req.num_computed_tokens + chunk.num_tokens == req.num_tokens
            req.num_computed_tokens += chunk.num_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
            if completes:
                tokens.append((req, self._token(req, end)))
        self.num_steps += 1
        return StepDone(tokens, list(sched.preempted))

    def _token(self, req: SimRequest, now: float) -> str | None:
        req.num_out += 1
        if req.num_out >= req.max_tokens:
            self.scheduler.remove(req)
            self.blocks.free(req.block_ids)
            req.block_ids = []
            req.status = Status.FINISHED
            return "length"
        if req.hand_off:
            self.scheduler.remove(req)
            req.status = Status.HANDOFF          # keeps its blocks until the KV is exported (release)
            return "handoff"
        return None

    # -- runs of decode-only steps ---------------------------------------------------------------
    def member(self, req: SimRequest) -> int | None:
        """req's place in the batch, None when it is not a member."""
        batch, running = self.batch, self.scheduler.running
        if batch.n == 0 or req.status is not Status.RUNNING:
            return None
        for i in range(batch.n):
            if running[i] is req:
                return i
        return None

    def settle(self) -> None:
        """Write the batch's counters back to its requests and empty it."""
        batch = self.batch
        if batch.n:
            for r, c, o in zip(self.scheduler.running, batch.computed, batch.out):
                r.num_computed_tokens, r.num_out = c, o
            batch.clear()

    def _settle_one(self, i: int) -> None:
        r, batch = self.scheduler.running[i], self.batch
        r.num_computed_tokens, r.num_out = batch.computed[i], batch.out[i]

    def run_length(self) -> int:
        """How many steps, decode-only or beside one prompt's chunks, are certain from here (0: schedule
        the next step for real)."""
        self._found = 0
        self._chunks = None
        if not self.fast_forward:
            return 0
        s, cfg, batch = self.scheduler, self.cfg, self.batch
        running = s.running
        prompt = self._chunking()
        b = len(running) - (prompt is not None and prompt.status is Status.RUNNING)
        if (b == 0 and prompt is None) or b > cfg.token_budget:
            return 0
        if b > batch.n:
            computed, held, out, max_tokens, fewest = [], [], [], [], 1 << 62
            for r in running[batch.n:b]:
                c, n, o = r.num_computed_tokens, r.prompt_len, r.num_out
                if n + o - c != 1 or c < n or r.hand_off:
                    return 0   # (a lone last prompt token makes the first token: a step of its own)
                computed.append(c)
                held.append(len(r.block_ids))
                out.append(o)
                max_tokens.append(r.max_tokens)
                if r.max_tokens - o < fewest:
                    fewest = r.max_tokens - o
            batch.join(computed, held, out, max_tokens, fewest)
        if prompt is not None:
            return self._chunk_run_length(prompt, b)
        if s.waiting and not self._waiting_blocked(b):
            return 0
        if batch.min_left is None:
            batch.min_left = min(t - o for t, o in zip(batch.max_tokens, batch.out))
        k = batch.min_left
        free, bs = self.blocks.num_free, self.blocks.block_size
        computed, held = batch.computed, batch.held
        if b * -(-k // bs) > free and blocks_needed(computed, held, k, bs) > free:   # (k tokens take
            # at most ceil(k / block_size) new blocks a request: most runs need no exact count)
            lo, hi = 0, k                      # the longest run whose new blocks are free
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if blocks_needed(computed, held, mid, bs) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        self._found = k
        return k

    def _chunking(self) -> SimRequest | None:
        """Under the chunked policy, a prompt the next steps chunk beside the running decodes: the last
        running request when it is a prompt, or else the first waiting one (the scheduler would admit
        it next). None when there is none with more than its last token left."""
        s = self.scheduler
        if self.cfg.policy != "chunked":
            return None
        if s.running:
            r = s.running[-1]
            if r.prompt_len + r.num_out - r.num_computed_tokens > 1:
                return r
        if s.waiting and len(s.running) < self.cfg.max_batch:
            r = s.waiting[0]
            if r.prompt_len + r.num_out - r.num_computed_tokens > 1:
                return r
        return None

    def _chunk_run_length(self, p: SimRequest, b: int) -> int:
        """Steps of b decodes beside prompt p's chunks that are certain from here (0: schedule for real).
        The chunked policy gives the decodes a token each, then p what the budget leaves, min(left,
        budget - b); nothing waiting is admitted while p's chunks take the whole budget, so the run
        reaches p's last chunk only when nothing else waits for the budget that chunk leaves. It ends
        at p's last chunk, at the step where the first decode finishes, or before the blocks run out."""
        s, cfg, batch = self.scheduler, self.cfg, self.batch
        room = cfg.token_budget - b
        if room < 1:
            return 0
        from_waiting = p.status is not Status.RUNNING
        if from_waiting and not self.blocks.can_allocate(p.block_ids, p.num_computed_tokens + min(
                p.num_tokens - p.num_computed_tokens, room)):
            return 0
        chunks, left = prompt_chunks(p.num_tokens - p.num_computed_tokens, room, len(s.waiting) > from_waiting)
        k = len(chunks)
        if b:
            if batch.min_left is None:
                batch.min_left = min(t - o for t, o in zip(batch.max_tokens, batch.out))
            k = min(k, batch.min_left)
        bs, free, c0 = self.blocks.block_size, self.blocks.num_free, p.num_computed_tokens
        while k and (blocks_needed(batch.computed, batch.held, k, bs) if b else 0) \
                + max(0, -(-(c0 + sum(chunks[:k])) // bs) - len(p.block_ids)) > free:
            k -= 1
        if k < 2:                                  # one step: the scheduler's own is as cheap
            return 0
        self._chunks = PromptChunks(p, chunks[:k], c0, left == 0 and k == len(chunks))
        self._found = k
        return k

    def _waiting_blocked(self, b: int) -> bool:
        """The scheduler could not admit the first waiting request in any step of the run."""
        cfg, head = self.cfg, self.scheduler.waiting[0]
        if b >= cfg.max_batch:
            return True
        left = cfg.token_budget if cfg.policy == "prefill_first" else cfg.token_budget - b
        if left <= 0:
            return True
        n = min(head.num_tokens - head.num_computed_tokens, left)
        if cfg.policy == "prefill_first" and head.num_tokens - head.num_computed_tokens > left:
            return False                     # it would run alone at the head of a step: not a run
        return not self.blocks.can_allocate(head.block_ids, head.num_computed_tokens + n)

    def start_run(self, start: float, k: int, shared: bool = False) -> DecodeRun:
        """k steps from `start` (decode-only, or beside the chunks of the prompt run_length found), at
        schedule()'s contention (`shared` holds for the whole run: the simulator cuts it when that
        changes on the host)."""
        if not 1 <= k <= self._found:
            raise RuntimeError(f"start_run({k}) follows a run_length that found a run of {self._found}")
        self._found = 0
        batch, pc = self.batch, self._chunks
        b, joined = batch.n, batch.joined
        if pc is None:
            d = self.model.decode_run(b, sum(batch.computed), k)
            c = self.contention(shared)
            if c != 1.0:
                d = [x * c for x in d]
            if self._spread:
                d = [x * j for x, j in zip(d, step_jitter(self._spread, self._stream, self.num_steps, k).tolist())]
            gap, at = self.model.gap(b), 0.0
            starts, ends = [], []
            for i, x in enumerate(d):                          # the first step starts at `start`
                at += x + gap if i else x
                end = start + at
                ends.append(end)
                starts.append(end - x)
        else:
            starts, ends = self._chunk_steps(pc, b, k, start, self.contention(shared))
        first = float(starts[0])
        for r in self.scheduler.running[b - joined:b]:
            if r.first_scheduled_time is None:       # an imported request's first step here
                r.first_scheduled_time = first
        batch.joined = 0
        return DecodeRun(b, starts, ends, batch.computed, batch.held, self.blocks.num_used,
                         batch.min_left if b else 1 << 62, joined, pc)

    def _chunk_steps(self, pc: PromptChunks, b: int, k: int, start: float, contention: float):
        """The k steps of a chunk run, each priced and spaced as a scheduled step is (the same features
        in the same arithmetic); the prompt is admitted now when it was waiting."""
        p, s = pc.req, self.scheduler
        if k < len(pc.chunks):
            del pc.chunks[k:]
            pc.completes = False
        if p.status is not Status.RUNNING:          # the scheduler admits it in the run's first step
            s.waiting.popleft()
            p.status = Status.RUNNING
            s.running.append(p)
        if p.first_scheduled_time is None:
            p.first_scheduled_time = start
        pc.held = len(p.block_ids)
        jitter = [step_jitter(self._spread, self._stream, self.num_steps + i) for i in range(k)] \
            if self._spread else None
        return chunk_step_times(self.model, pc, b, sum(self.batch.computed), start, contention, jitter)

    def cut_after(self, run: DecodeRun, t: float) -> int:
        """Steps of the run that still go ahead when new work reaches the worker at `t`: every step
        scheduled before t (the work waits for the first step scheduled after it)."""
        return max(1, min(bisect_left(run.starts, t), run.k))

    def apply_run(self, run: DecodeRun, m: int) -> tuple[list | None, list[tuple[SimRequest, str]], tuple | None]:
        """Advance the batch, and a chunk run's prompt, by the run's first m steps (blocks allocated
        through the BlockManager). Returns which of the run's b requests go on (a bool each; None: all
        of them), the others with their finish reason, settled and out of the batch, and the prompt's
        first token (request, finish reason or None) when its last chunk ran."""
        if not 1 <= m <= run.k:
            raise ValueError(f"a run of {run.k} steps cannot advance {m}")
        batch = self.batch
        if batch.n != run.b or batch.computed is not run.computed:
            raise RuntimeError("the batch changed while its decode run was in flight")
        bs, blocks = self.blocks.block_size, self.blocks
        after = [c + m for c in run.computed]
        grow = []                                            # (request, blocks it needs) of those that grow
        for i, (a, h) in enumerate(zip(after, run.blocks0)):
            need = -(-a // bs)
            if need > h:
                grow.append((i, need))
        running = self.scheduler.running
        if grow:
            if len(grow) > blocks.num_free:
                raise RuntimeError(f"a decode run needs {len(grow)}+ KV blocks with {blocks.num_free} free")
            held = list(run.blocks0)
            for i, need in grow:
                blocks.allocate(running[i].block_ids, after[i])
                held[i] = need
            batch.held = held
        batch.computed, batch.out = after, [o + m for o in batch.out]
        self.num_steps += m
        last = run.ends[m - 1]
        first_token = None
        pc = run.prompt
        if pc is not None:
            p = pc.req
            p.num_computed_tokens = pc.start + sum(pc.chunks[:m])
            self.blocks.allocate(p.block_ids, p.num_computed_tokens)
            if m == run.k and pc.completes:
                first_token = (p, self._token(p, last))
        if m < run.finishing:                       # nobody's last token before the run's full length
            batch.min_left = run.finishing - m
            return None, [], first_token
        goes_on = [o < t for o, t in zip(batch.out, batch.max_tokens)]
        ending = [i for i, g in enumerate(goes_on) if not g]
        for i in ending:
            self._settle_one(i)
        ending = [running[i] for i in ending]
        batch.keep(goes_on)
        done = []
        for r in ending:                            # each leaves the running list (and the batch's head)
            r.num_out -= 1
            done.append((r, self._token(r, last)))   # the last step's token, and the request's end
        return goes_on, done, first_token
