"""One simulated worker's engine: pdlab's own Scheduler and BlockManager, a step-time model for the forward.

`SimEngine` holds a real `workers.scheduler.Scheduler` over `workers.block_manager.BlockManager`'s
logic (with storage for the blocks in use only: experiments/sim/blocks.py) and post-processes each scheduled step as `workers.engine.Engine.step` does (computed tokens advance,
a chunk that catches its request up samples a token, a request ends on `max_tokens` or, on a prefill
worker, hands off after its first token), with the step's duration from the step model instead of a
forward pass. Requests are `SimRequest`s: workers.request.Request with counters in place of token
lists (prompt and output lengths are all the scheduler reads), so a million requests fit in memory.
Token values are not simulated: every request runs to its `max_tokens` (the workloads ask ignore_eos).

Decode runs. When every running request is a decode that fits the token budget, nothing is waiting
that the scheduler could admit (the queue is empty, the batch is full, or the first waiting prompt
cannot get its blocks: free blocks only shrink while decodes run), and the blocks the decodes will
take over the next k steps are free, then the next k steps are known without scheduling them: each
request gains one token per step, the first to finish ends the run. `start_run` computes those k
steps' times in one numpy call; `apply_run` advances every request by the m <= k steps that ran (a run
is cut short when work arrives) and allocates their blocks through the BlockManager. The step sequence
is the one the scheduler would have produced (tests/test_sim_validate.py replays a recorded engine trace).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from experiments.sim.blocks import LazyBlockManager
from workers.config import EngineConfig
from workers.request import Request, SamplingParams, Status
from workers.scheduler import Scheduler, SchedulerOutput

from experiments.sim.stepmodel import features

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


def _blocks_needed(computed: np.ndarray, held: np.ndarray, steps: int, block_size: int) -> int:
    """New blocks that requests at `computed` tokens holding `held` blocks take over `steps` more tokens."""
    return int(np.maximum(0, -(-(computed + steps) // block_size) - held).sum())


@dataclass(slots=True)
class StepDone:
    """What one step did: tokens made (request, finish reason or None), requests preempted."""

    tokens: list
    preempted: list


@dataclass(slots=True)
class DecodeRun:
    """k decode-only steps of the same requests, advanced in one event."""

    reqs: list                 # the running decodes, scheduler order
    starts: np.ndarray         # [k] step start times
    ends: np.ndarray           # [k] step end times
    computed: np.ndarray       # [b] num_computed_tokens of each request at the run's start
    blocks0: np.ndarray        # [b] blocks each held at the start
    used0: int                 # blocks in use at the start
    finishing: int             # steps until the first request finishes (the run's full length)

    @property
    def k(self) -> int:
        return len(self.ends)


class SimEngine:
    def __init__(self, cfg: EngineConfig, num_blocks: int, model, fast_forward: bool = True):
        self.cfg = cfg
        self.model = model
        self.blocks = LazyBlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.fast_forward = fast_forward
        self.num_steps = 0
        self._ahead = None                    # (requests, computed, blocks) of the run run_length found
        self._shared = getattr(model, "shared_host", None) or 1.0

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
        sched = self.scheduler.schedule()
        if not sched:
            return sched, 0.0
        return sched, self.model.time(features(sched)) * self.contention(shared)

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
    def run_length(self) -> int:
        """How many decode-only steps are certain from here (0: schedule the next step for real)."""
        self._ahead = None
        if not self.fast_forward:
            return 0
        s, cfg = self.scheduler, self.cfg
        running = s.running
        b = len(running)
        if b == 0 or b > cfg.token_budget:
            return 0
        k = 1 << 62
        computed, held = [], []
        for r in running:
            c, n = r.num_computed_tokens, r.prompt_len
            if n + r.num_out - c != 1 or c < n:
                return 0       # (a lone last prompt token makes the first token: a step of its own)
            left = r.max_tokens - r.num_out
            if left < k:
                k = left
            computed.append(c)
            held.append(len(r.block_ids))
        if s.waiting and not self._waiting_blocked(b):
            return 0
        computed, held = np.array(computed, dtype=np.int64), np.array(held, dtype=np.int64)
        self._ahead = (list(running), computed, held)       # what start_run reads, unchanged meanwhile
        free, bs = self.blocks.num_free, self.blocks.block_size
        if _blocks_needed(computed, held, k, bs) <= free:
            return k
        lo, hi = 0, k                          # the longest run whose new blocks are free
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _blocks_needed(computed, held, mid, bs) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

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
        """k decode-only steps from `start`, at schedule()'s contention (`shared` holds for the whole
        run: the simulator cuts it when that changes on the host)."""
        if self._ahead is None:
            raise RuntimeError("start_run follows a run_length that found a run")
        reqs, computed, blocks0 = self._ahead
        self._ahead = None
        b = len(reqs)
        d = self.model.decode_run(b, int(computed.sum()), k) * self.contention(shared)
        gap = np.full(k, self.model.gap(b))
        gap[0] = 0.0                                       # the first step starts at `start`
        ends = start + np.cumsum(d + gap)
        return DecodeRun(reqs, ends - d, ends, computed, blocks0, self.blocks.num_used, k)

    def cut_after(self, run: DecodeRun, t: float) -> int:
        """Steps of the run that still go ahead when new work reaches the worker at `t`: every step
        scheduled before t (the work waits for the first step scheduled after it)."""
        m = int(np.searchsorted(run.starts, t, side="left"))
        return max(1, min(m, run.k))

    def apply_run(self, run: DecodeRun, m: int) -> list[tuple[SimRequest, str | None]]:
        """Advance the run's requests by their first m steps (blocks allocated through the BlockManager);
        returns each request with its finish reason after the last of them (None: it goes on)."""
        if not 1 <= m <= run.finishing:
            raise ValueError(f"a run of {run.finishing} steps cannot advance {m}")
        last = float(run.ends[m - 1])
        out = []
        first = float(run.starts[0])
        bs = self.blocks.block_size
        after = run.computed + m
        grow = np.flatnonzero(-(-after // bs) > run.blocks0)       # requests that need a new block
        reqs = run.reqs
        if len(grow) > self.blocks.num_free:
            raise RuntimeError(f"a decode run needs {len(grow)}+ KV blocks with {self.blocks.num_free} free")
        self.blocks.grow([reqs[i].block_ids for i in grow.tolist()], after[grow].tolist())
        token = self._token
        for r, c in zip(reqs, after.tolist()):
            r.num_computed_tokens = c
            if r.first_scheduled_time is None:       # an imported request's first step here
                r.first_scheduled_time = first
            n = r.num_out + m
            if n < r.max_tokens and not r.hand_off:
                r.num_out = n                        # it goes on
                out.append((r, None))
            else:
                r.num_out = n - 1
                out.append((r, token(r, last)))      # the last step's token, and the request's end
        self.num_steps += m
        return out

    def run_steps(self, run: DecodeRun, m: int, num_waiting: int) -> dict:
        """The run's first m steps as steps.jsonl columns (arrays), blocks counted step by step."""
        bs = self.blocks.block_size
        b = len(run.reqs)
        i = np.arange(1, m + 1)
        held = np.maximum(run.blocks0[:, None], -(-(run.computed[:, None] + i[None, :]) // bs))   # [b, m]
        used = run.used0 + (held - run.blocks0[:, None]).sum(axis=0)
        return {"start": run.starts[:m], "end": run.ends[:m], "b": b, "used": used, "waiting": num_waiting}
