"""One token budget per step; the policies differ only in the order they spend it.

Every request has `num_computed_tokens` and a target (`num_tokens`); a step hands out tokens until
computed catches up. A decode is a request one token short; a prompt (or a recomputation after
preemption) is many tokens short.

- `prefill_first` (Orca / early vLLM): unfinished prompts, then waiting prompts whole, then the
  running decodes with whatever budget is left. A long prompt stalls or stretches every decode.
- `chunked` (Sarathi-Serve): running decodes first, then prompt chunks fill the rest of the budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.block_manager import BlockManager
from workers.config import EngineConfig
from workers.request import Request, Status


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_tokens: int            # computed this step, starting at request.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this chunk the request is caught up, so the step samples its next token."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledChunk] = field(default_factory=list)    # one token each
    prefills: list[ScheduledChunk] = field(default_factory=list)   # prompt chunks
    preempted: list[Request] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.num_prefill_tokens

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    __slots__ = ("cfg", "blocks", "waiting", "running", "_budget", "_scheduled")

    def __init__(self, cfg: EngineConfig, blocks: BlockManager):
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []    # admission order: the last is preempted first

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose KV was imported with its blocks already allocated."""
        req.status = Status.RUNNING
        self.running.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.cfg.token_budget
        self._scheduled: set[int] = set()
        decodes = [r for r in self.running if not r.is_prefill]
        prefills = [r for r in self.running if r.is_prefill]
        if self.cfg.policy == "prefill_first":
            self._spend_running(prefills, out)
            self._spend_waiting(out, whole=True)
            self._spend_running(decodes, out)
        else:
            self._spend_running(decodes, out)
            self._spend_running(prefills, out)
            self._spend_waiting(out, whole=False)
        return out

    # -- the one place the budget is spent ------------------------------------------------------
    def _take(self, req: Request, num_tokens: int, out: SchedulerOutput) -> None:
        chunk = ScheduledChunk(req, num_tokens)
        (out.prefills if req.is_prefill else out.decodes).append(chunk)
        self._budget -= num_tokens
        self._scheduled.add(id(req))

    def _spend_running(self, reqs: list[Request], out: SchedulerOutput) -> None:
        for req in reqs:
            if self._budget == 0:
                return
            if req.status is not Status.RUNNING:     # preempted earlier in this step
                continue
            n = min(req.num_tokens - req.num_computed_tokens, self._budget)
            if self._make_room(req, req.num_computed_tokens + n, out):
                self._take(req, n, out)

    def _spend_waiting(self, out: SchedulerOutput, whole: bool) -> None:
        while self.waiting and self._budget > 0 and len(self.running) < self.cfg.max_batch:
            req = self.waiting[0]
            remaining = req.num_tokens - req.num_computed_tokens
            if whole and remaining > self._budget:
                # A prompt larger than the whole budget still runs, alone at the head of the step.
                if self._budget < self.cfg.token_budget or out:
                    return
            n = min(remaining, self._budget)
            if not self.blocks.can_allocate(req.block_ids, req.num_computed_tokens + n):
                return                                # first come, first served: no overtaking
            self.blocks.allocate(req.block_ids, req.num_computed_tokens + n)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            self._take(req, n, out)

    def _make_room(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for `req`, preempting the latest-admitted unscheduled requests if needed."""
        while not self.blocks.can_allocate(req.block_ids, num_tokens):
            victim = next((r for r in reversed(self.running)
                           if id(r) not in self._scheduled and r is not req), None)
            if victim is None:
                self._preempt(req, out)
                return False
            self._preempt(victim, out)
        self.blocks.allocate(req.block_ids, num_tokens)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free the request's KV; it recomputes prompt and outputs so far when readmitted."""
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        out.preempted.append(req)
