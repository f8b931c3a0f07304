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
from typing import Callable

import numpy as np
import torch

from workers.block_manager import BlockManager
from workers.config import EngineConfig, ModelConfig, blocks_for
from workers.emulated import EmulatedCache, EmulatedRunner, StepPrice
from workers.events import KVReady, KVReset, RequestFailed, StepRecord, TokenEvent
from workers.kv_cache import KVCache, num_blocks_for
from workers.model import Llama
from workers.model_runner import ModelRunner
from workers.request import InvalidRequest, Request, SamplingParams, Status, validate_request
from workers.sampler import SampleFailure, make_generator
from workers.scheduler import Scheduler


class Engine:
    def __init__(self, model: Llama, cfg: EngineConfig, clock: Callable[[], float] = time.time):
        device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
        max_len = self._max_len(model.cfg, cfg)
        cache = KVCache(model.cfg, num_blocks_for(model.cfg, cfg, dtype, device), cfg.block_size, dtype, device)
        runner = ModelRunner(model, cache, max_len, max_tokens=cfg.token_budget, max_seqs=cfg.max_batch,
                             attention=cfg.attention, compile=cfg.compile, cuda_graphs=cfg.cuda_graphs,
                             kernels=cfg.kernels, cpu_gemm_rows=cfg.cpu_gemm_rows)
        self.model = model
        self._setup(model.cfg, cfg, clock, device, dtype, cache, runner)

    @classmethod
    def emulated(cls, mcfg: ModelConfig, cfg: EngineConfig, price: StepPrice, dtype: torch.dtype = torch.bfloat16,
                 clock: Callable[[], float] = time.time) -> "Engine":
        """An engine of model `mcfg` whose steps wait for `price` instead of computing (workers/emulated.py):
        the same scheduler, blocks and post-processing, a pool of `cfg.num_kv_blocks` counted blocks."""
        if cfg.num_kv_blocks is None:
            raise ValueError("an emulated engine holds no memory to size its pool by: give num_kv_blocks")
        self = cls.__new__(cls)
        self.model = None
        cls._max_len(mcfg, cfg)
        self._setup(mcfg, cfg, clock, torch.device("cpu"), dtype,
                    EmulatedCache(mcfg, cfg.num_kv_blocks, cfg.block_size, dtype), EmulatedRunner(price, mcfg))
        return self

    @staticmethod
    def _max_len(mcfg: ModelConfig, cfg: EngineConfig) -> int:
        max_len = cfg.max_model_len or mcfg.max_position_embeddings
        if max_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        return max_len

    def _setup(self, mcfg, cfg, clock, device, dtype, cache, runner) -> None:
        self.mcfg = mcfg
        self.cfg = cfg
        self.clock = clock
        self.device = device
        self.dtype = dtype
        self.max_model_len = self._max_len(mcfg, cfg)
        self.cache = cache
        self.blocks = BlockManager(cache.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.runner = runner
        self.emulated = isinstance(runner, EmulatedRunner)
        self.runner.warm_up()        # compiles and CUDA graphs now, before any other thread uses the device
        self.requests: dict[str, Request] = {}     # not yet finished here (handoffs included)
        self.trace: list[StepRecord] = []          # this engine's steps, oldest first (take_trace drains it)
        self.num_steps = self.num_preempted = 0     # since the start, drained or not
        # Prefill role with cfg.kv_stream on: told (KVReady) when a part of a request's KV is final in
        # the pool, during the step for "layer", after it for "chunk"; told (KVReset) when a request
        # whose KV was streaming is preempted and will be recomputed. Set by whoever sends the KV.
        self.kv_listener: Callable[[KVReady | KVReset], None] | None = None

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
        start; whether Linux agreed to back it with huge pages), the step buffers, the CUDA graphs captured so far, and the weights' packed copies
        (the panel layout of the CPU kernels) and the layer outputs' reused buffers (CPU kernels only,
        grown to the largest step so far); `cpu_gemm_rows`: with the CPU kernels, the rows from which a
        linear runs as MKL's GEMM (None: the panel kernel at every size, or not the CPU kernels)."""
        if self.emulated:
            return {"kv_pool_bytes": 0, "kv_pool_huge_pages": False, "num_kv_blocks": self.blocks.num_blocks,
                    "block_size": self.cfg.block_size, "timing": "emulated", "step_price": self.runner.step_price.name}
        graphs = self.runner.graphs
        return {"kv_pool_bytes": self.cache.nbytes, "kv_pool_huge_pages": self.cache.huge_pages,
                "num_kv_blocks": self.blocks.num_blocks,
                "block_size": self.cfg.block_size, "step_buffer_bytes": self.runner.buffers.nbytes,
                "cuda_graph_bytes": graphs.memory_bytes if graphs else 0,
                "cuda_graphs": sorted(graphs.graphs) if graphs else [],
                "packed_weight_bytes": self.runner.ops.packed_bytes,
                "activation_buffer_bytes": self.runner.ops.workspace_bytes + self.runner.backend.workspace_bytes,
                "attention": self.runner.backend.name, "kernels": self.runner.ops.name, "compiled": self.cfg.compile,
                "cpu_gemm_rows": getattr(self.runner.ops, "gemm_rows", None)}

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent | RequestFailed]:
        """One step: schedule, run the model (streaming KV as configured), post-process."""
        sched = self.scheduler.schedule()
        for req in sched.preempted:          # (a step can preempt and then have nothing to run)
            if req.hand_off and self.cfg.kv_stream != "off":
                self._tell_kv(KVReset(req.id), {})
        if not sched:
            return []
        start = self.clock()
        streams = self._kv_streams(sched)
        stream_failed: dict[str, str] = {}
        after_layer = None
        if streams and self.cfg.kv_stream == "layer":   # each layer's KV goes out while the next computes
            def after_layer(i):
                for rid, s, n in streams:
                    self._tell_kv(KVReady(rid, i, i + 1, s, s + n), stream_failed)
        try:
            tokens = (self.runner.execute(sched, after_layer, start, self.clock) if self.emulated   # waits for its price
                      else self.runner.execute(sched, after_layer))    # returns once the step's stream is done
        except Exception as e:  # the whole pass failed and no row is to blame: its requests end, the engine goes on
            reason = f"the step serving it failed: {type(e).__name__}: {e}"
            return [self.fail(c.request.id, reason) for c in sched.chunks]
        # an emulated step ends when its price says, as a GPU's kernels end whenever the host wakes to them;
        # how late the host woke is in forward_s (its measured wait) and delays the next step's start
        end = start + self.runner.price_s if self.emulated else self.clock()
        if self.cfg.kv_stream == "chunk":                 # the chunk's KV, every layer, once it is done
            for rid, s, n in streams:
                self._tell_kv(KVReady(rid, 0, self.mcfg.num_layers, s, s + n), stream_failed)
        events = [self.fail(rid, reason) for rid, reason in stream_failed.items()]
        for chunk, token in zip(sched.chunks, tokens):
            if chunk.request.id in stream_failed:
                continue
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
        self.num_preempted += len(sched.preempted)
        self.trace.append(StepRecord(
            step=self.num_steps, start=start, end=end, num_prefill_tokens=sched.num_prefill_tokens,
            num_prefill_seqs=len(sched.prefills), num_decode_seqs=len(sched.decodes),
            num_tokens=sched.num_tokens, num_blocks_used=self.blocks.num_used,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preempted=len(sched.preempted), prepare_s=self.runner.times.prepare_s,
            forward_s=self.runner.times.forward_s, sample_s=self.runner.times.sample_s,
            price_s=self.runner.price_s if self.emulated else None))
        self.num_steps += 1
        return events

    def take_trace(self) -> list[StepRecord]:
        """The steps recorded so far, removed from `trace`, so a long-running server's memory does
        not grow with its steps. Safe beside a step running in another thread: a slice and its
        deletion are each one operation under the GIL, and a step appends after them or before."""
        n = len(self.trace)
        taken = self.trace[:n]
        del self.trace[:n]
        return taken

    def _kv_streams(self, sched) -> list[tuple[str, int, int]]:
        """Prompt chunks whose KV streams out as it is computed: (request id, first token, tokens).
        Every chunk of a prompt, including a last token left alone for a step of its own, which the
        scheduler counts with the decodes (`Request.is_prefill`)."""
        if self.cfg.kv_stream == "off" or self.kv_listener is None:
            return []
        return [(c.request.id, c.request.num_computed_tokens, c.num_tokens) for c in sched.chunks
                if c.request.hand_off and c.request.num_computed_tokens < c.request.num_prompt_tokens]

    def _tell_kv(self, event, failed: dict[str, str]) -> None:
        """Hand a KV event to the listener; a listener that raises fails that request alone."""
        if self.kv_listener is None or event.request_id in failed:
            return
        try:
            self.kv_listener(event)
        except Exception as e:
            failed[event.request_id] = f"KV streaming failed: {type(e).__name__}: {e}"

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

    def begin_import(self, request_id, prompt_ids, params: SamplingParams | dict,
                     arrival_time: float | None = None) -> Request:
        """Take a request prefilled elsewhere whose KV arrives in parts (`import_kv`): its blocks are
        allocated now, and it is scheduled once `finish_import` has its first token."""
        params = self.validate(request_id, prompt_ids, params)
        if not self.can_import(len(prompt_ids)):
            raise RuntimeError(f"request {request_id!r}: no free KV blocks to import into; check can_import")
        req = self._new_request(request_id, prompt_ids, params, arrival_time)
        self.blocks.allocate(req.block_ids, len(prompt_ids))
        req.status = Status.IMPORTING
        req.kv_filled = np.zeros((self.mcfg.num_layers, len(prompt_ids)), dtype=bool)
        self.requests[request_id] = req
        return req

    def import_kv(self, request_id, first_layer: int, kv: torch.Tensor, start: int = 0) -> None:
        """One part of an importing request's KV: [layers, 2, tokens, KVH, D] from `first_layer` and
        token `start`. Parts may come in any order; none may overlap another."""
        req = self._importing(request_id)
        try:
            self.cache.check_part(first_layer, kv, start, req.num_prompt_tokens)
        except ValueError as e:
            raise InvalidRequest(request_id, str(e)) from None
        span = req.kv_filled[first_layer:first_layer + kv.shape[0], start:start + kv.shape[2]]
        if span.any():
            raise InvalidRequest(request_id, f"KV part at layer {first_layer}, token {start} overlaps one already in")
        self.cache.import_part(req.block_ids, req.num_prompt_tokens, first_layer, kv, start)
        span[:] = True

    def finish_import(self, request_id, first_token: int) -> Request:
        """Every part is in: the request joins the running decodes with its first token."""
        req = self._importing(request_id)
        missing = int((~req.kv_filled).sum())
        if missing:
            raise InvalidRequest(request_id, f"KV incomplete: {missing} of {req.kv_filled.size} (layer, token) "
                                             "entries never arrived")
        req.kv_filled = None
        req.token_ids.append(int(first_token))
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.add_running(req)
        return req

    def _importing(self, request_id) -> Request:
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.IMPORTING:
            raise InvalidRequest(request_id, "no import of this request is under way")
        return req

    def import_request(self, request_id, prompt_ids, first_token: int, params: SamplingParams,
                       kv: torch.Tensor | list[tuple[int, torch.Tensor]],
                       arrival_time: float | None = None) -> Request:
        """Continue a request prefilled elsewhere, its KV at hand: one [L, 2, T, KVH, D] tensor, or
        (first layer, tensor) parts covering all layers. Nothing stays allocated if it fails."""
        self.begin_import(request_id, prompt_ids, params, arrival_time)
        try:
            for first, part in [(0, kv)] if isinstance(kv, torch.Tensor) else kv:
                self.import_kv(request_id, first, part)
            return self.finish_import(request_id, first_token)
        except Exception:
            self.abort(request_id, "import failed")
            raise
