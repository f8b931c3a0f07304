"""The engine step loop: schedule, run the model, post-process; plus KV export/import for handoff.

Every step is recorded (the raw evidence of interference); every request records its token times.
Roles: `colocated` does both phases; `prefill` stops a request after its first token and keeps its
KV for export (unless it is asked to serve a request whole); `decode` takes requests whose KV was
imported and only decodes them.

Failures are per request: an exception while serving one request (its sampling row, its append) fails
that request alone, frees its blocks and is returned as a `RequestFailed` event; a forward pass that
fails as a whole (the culprit unknown) fails the requests of that step with the cause. The engine
stays usable either way.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from workers.block_manager import BlockManager
from workers.config import EngineConfig, blocks_for
from workers.kv_cache import KVCache, num_blocks_for
from workers.model import Llama
from workers.model_runner import ModelRunner
from workers.request import InvalidRequest, Request, SamplingParams, Status, validate_request
from workers.sampler import SampleFailure, make_generator
from workers.scheduler import Scheduler


@dataclass
class StepRecord:
    step: int
    start: float
    end: float
    num_prefill_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_tokens: int
    num_blocks_used: int
    num_running: int
    num_waiting: int
    num_preempted: int
    prepare_s: float = 0.0     # of the step's time: building its inputs,
    forward_s: float = 0.0     # the model,
    sample_s: float = 0.0      # and choosing the tokens

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenEvent:
    """What one step did for one request: its new token, and whether it ended (and why)."""

    request_id: str
    token: int
    time: float
    finish_reason: str | None = None   # "length", "stop", or "handoff" (prefill role)
    first_scheduled: float | None = None  # on the first token made here: when its first step began


@dataclass
class RequestFailed:
    """A request this engine could not go on serving; it is gone from the engine, blocks freed."""

    request_id: str
    reason: str
    time: float


class Engine:
    def __init__(self, model: Llama, cfg: EngineConfig, clock: Callable[[], float] = time.time):
        self.model = model
        self.mcfg = model.cfg
        self.cfg = cfg
        self.clock = clock
        self.device = model.embed_tokens.device
        self.dtype = model.embed_tokens.dtype
        self.max_model_len = cfg.max_model_len or self.mcfg.max_position_embeddings
        if self.max_model_len > self.mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={self.mcfg.max_position_embeddings}")
        num_blocks = num_blocks_for(self.mcfg, cfg, self.dtype, self.device)
        self.cache = KVCache(self.mcfg, num_blocks, cfg.block_size, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.runner = ModelRunner(model, self.cache, self.max_model_len, max_tokens=cfg.token_budget,
                                  max_seqs=cfg.max_batch, attention=cfg.attention, compile=cfg.compile,
                                  cuda_graphs=cfg.cuda_graphs)
        self.requests: dict[str, Request] = {}     # not yet finished here (handoffs included)
        self.trace: list[StepRecord] = []

    # -- admission ------------------------------------------------------------------------------
    def validate(self, request_id, prompt_ids, params: SamplingParams | dict, whole: bool = False) -> SamplingParams:
        """Raise InvalidRequest naming the request if this engine could never serve it; returns the
        checked parameters. `whole`: a prefill-role engine serves it to the end (no handoff)."""
        params = validate_request(request_id, prompt_ids, params, self.mcfg.vocab_size, self.max_model_len)
        if request_id in self.requests:
            raise InvalidRequest(request_id, "a request with this id is already in flight")
        n = len(prompt_ids)
        total = n + 1 if self.cfg.role == "prefill" and not whole else n + params.max_tokens
        need = blocks_for(total, self.cfg.block_size)
        if need > self.blocks.num_blocks:
            raise InvalidRequest(request_id, f"needs {need} KV blocks but this engine's pool has "
                                             f"{self.blocks.num_blocks}")
        return params

    def _new_request(self, request_id, prompt_ids, params, arrival_time, whole: bool = False) -> Request:
        req = Request(id=request_id, prompt_ids=list(prompt_ids), params=params,
                      arrival_time=self.clock() if arrival_time is None else arrival_time)
        req.hand_off = self.cfg.role == "prefill" and not whole
        if not params.greedy:
            req.generator = make_generator(params.seed if params.seed is not None else 0)
        eos = () if params.ignore_eos else self.mcfg.eos_token_ids
        req.stop_ids = frozenset(params.stop_token_ids) | frozenset(eos)
        return req

    def add_request(self, request_id, prompt_ids, params: SamplingParams | dict,
                    arrival_time: float | None = None, whole: bool = False) -> Request:
        params = self.validate(request_id, prompt_ids, params, whole)
        req = self._new_request(request_id, prompt_ids, params, arrival_time, whole)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id, reason: str = "aborted") -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req)
        self._free(req)
        req.status, req.finish_reason = Status.FAILED, reason
        return req

    def fail(self, request_id, reason: str) -> RequestFailed:
        """End a request that cannot go on (abort, with the reason recorded)."""
        self.abort(request_id, reason)
        return RequestFailed(request_id, reason, self.clock())

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def memory(self) -> dict:
        """What this engine holds on its device besides the weights: the KV pool (sized once, at
        start), the step buffers, and the CUDA graphs captured so far."""
        graphs = self.runner.graphs
        return {"kv_pool_bytes": self.cache.nbytes, "num_kv_blocks": self.blocks.num_blocks,
                "block_size": self.cfg.block_size, "step_buffer_bytes": self.runner.buffers.nbytes,
                "cuda_graph_bytes": graphs.memory_bytes if graphs else 0,
                "cuda_graphs": sorted(graphs.graphs) if graphs else [],
                "attention": self.runner.backend.name, "compiled": self.cfg.compile}

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent | RequestFailed]:
        sched = self.scheduler.schedule()
        if not sched:
            return []
        start = self.clock()
        try:
            tokens = self.runner.execute(sched)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:  # the whole pass failed and no row is to blame: its requests end, the engine goes on
            reason = f"the step serving it failed: {type(e).__name__}: {e}"
            return [self.fail(c.request.id, reason) for c in sched.chunks]
        end = self.clock()
        events = []
        for chunk, token in zip(sched.chunks, tokens):
            req = chunk.request
            try:
                if isinstance(token, SampleFailure):
                    events.append(self.fail(req.id, token.reason))
                    continue
                req.num_computed_tokens += chunk.num_tokens
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = start
                if token is not None:
                    events.append(self._append(req, token, end))
            except Exception as e:
                events.append(self.fail(req.id, f"{type(e).__name__}: {e}"))
        self.trace.append(StepRecord(
            step=len(self.trace), start=start, end=end, num_prefill_tokens=sched.num_prefill_tokens,
            num_prefill_seqs=len(sched.prefills), num_decode_seqs=len(sched.decodes),
            num_tokens=sched.num_tokens, num_blocks_used=self.blocks.num_used,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preempted=len(sched.preempted), prepare_s=self.runner.times.prepare_s,
            forward_s=self.runner.times.forward_s, sample_s=self.runner.times.sample_s))
        return events

    def _append(self, req: Request, token: int, now: float) -> TokenEvent:
        req.token_ids.append(token)
        req.token_times.append(now)
        reason = None
        if req.num_output_tokens >= req.params.max_tokens:
            reason = "length"
        elif token in req.stop_ids:
            reason = "stop"
        elif req.hand_off:
            reason = "handoff"
        if reason == "handoff":
            self.scheduler.remove(req)
            req.status = Status.HANDOFF            # keeps its blocks until export_kv / release
        elif reason is not None:
            self.scheduler.remove(req)
            self._free(req)
            req.status, req.finish_reason = Status.FINISHED, reason
            del self.requests[req.id]
        first = req.first_scheduled_time if len(req.token_times) == 1 else None
        return TokenEvent(req.id, token, now, reason, first)

    def _free(self, req: Request) -> None:
        self.blocks.free(req.block_ids)
        req.block_ids = []

    def run(self) -> list[TokenEvent | RequestFailed]:
        """Step until no work is left; returns every event."""
        events = []
        while self.has_work():
            events += self.step()
        return events

    # -- handoff --------------------------------------------------------------------------------
    def export_kv(self, request_id) -> torch.Tensor:
        """The prompt's KV of a request in HANDOFF, as one contiguous tensor [L, 2, T, KVH, D]."""
        req = self.requests[request_id]
        if req.status is not Status.HANDOFF:
            raise RuntimeError(f"request {request_id!r} is {req.status.value}, not waiting for handoff")
        return self.cache.export(req.block_ids, req.num_computed_tokens)

    def release(self, request_id) -> None:
        """Drop a handed-off request and its blocks (after its KV was exported)."""
        req = self.requests.pop(request_id)
        self._free(req)
        req.status, req.finish_reason = Status.FINISHED, "handoff"

    def can_import(self, num_tokens: int) -> bool:
        return len(self.scheduler.running) < self.cfg.max_batch and self.blocks.can_allocate([], num_tokens)

    def import_request(self, request_id, prompt_ids, first_token: int, params: SamplingParams,
                       kv: torch.Tensor | list[tuple[int, torch.Tensor]],
                       arrival_time: float | None = None) -> Request:
        """Continue a request prefilled elsewhere: its prompt's KV goes into fresh blocks here.
        `kv` is one [L, 2, T, KVH, D] tensor, or (first layer, tensor) parts covering all layers."""
        params = self.validate(request_id, prompt_ids, params)
        parts = [(0, kv)] if isinstance(kv, torch.Tensor) else list(kv)
        try:
            self.cache.check_importable(parts, len(prompt_ids))
        except ValueError as e:
            raise InvalidRequest(request_id, str(e)) from None
        if not self.can_import(len(prompt_ids)):
            raise RuntimeError(f"request {request_id!r}: no free KV blocks to import into; check can_import")
        req = self._new_request(request_id, prompt_ids, params, arrival_time)
        self.blocks.allocate(req.block_ids, len(prompt_ids))
        try:
            self.cache.import_(req.block_ids, parts, len(prompt_ids))
        except Exception:
            self._free(req)
            raise
        req.token_ids.append(int(first_token))
        req.num_computed_tokens = len(prompt_ids)
        self.requests[request_id] = req
        self.scheduler.add_running(req)
        return req
