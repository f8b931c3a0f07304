"""Turns a scheduler output into one forward pass over the paged cache, and samples.

Step preparation touches Python once per sequence, never per token: ids are sliced out of each
request's token list, block tables copied row by row, and positions and slot mappings computed
with array arithmetic, all into buffers allocated once for the largest step the engine can run.
On a GPU those buffers live in pinned host memory and are copied to persistent device buffers,
so the addresses a CUDA graph captured stay valid (workers/cuda_graphs.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from workers.attention import AttentionMetadata, make_backend, set_serving, size_bucket
from workers.cuda_graphs import DecodeGraphs
from workers.kv_cache import KVCache
from workers.model import Llama
from workers.ops import make_ops
from workers.sampler import sample
from workers.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class StepTimes:
    prepare_s: float = 0.0     # building the step's inputs
    forward_s: float = 0.0     # the model (and the attention backend's per-step setup)
    sample_s: float = 0.0      # logits of the rows that complete, and the choice of tokens


WARM_CHUNKS = 16     # warm_up compiles every attention shape a step of up to this many prompt chunks takes


class StepBuffers:
    """Host arrays for the largest step, and the device tensors the model reads (the same memory on
    a CPU; persistent device copies on a GPU)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"

        def host(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.device = device
        self._host = {"ids": host(max_tokens, dtype=torch.long), "positions": host(max_tokens, dtype=torch.long),
                      "slots": host(max_tokens, dtype=torch.long), "q_start": host(max_seqs + 1, dtype=torch.int32),
                      "ctx_len": host(max_seqs, dtype=torch.int32),
                      "block_tables": host(max_seqs, max_blocks, dtype=torch.int32)}
        self.np = {k: v.numpy() for k, v in self._host.items()}
        self._dev = self._host if not pin else {k: torch.zeros_like(v, device=device) for k, v in self._host.items()}

    @property
    def nbytes(self) -> int:
        tensors = list(self._host.values()) + ([] if self._dev is self._host else list(self._dev.values()))
        return sum(t.numel() * t.element_size() for t in tensors)

    def device_view(self, name: str, *shape: int) -> torch.Tensor:
        """The first `shape` of buffer `name` on the device (copied there from the host on a GPU)."""
        index = tuple(slice(0, n) for n in shape)
        dev = self._dev[name][index]
        if self._dev is not self._host:
            dev.copy_(self._host[name][index], non_blocking=True)
        return dev


class ModelRunner:
    def __init__(self, model: Llama, cache: KVCache, max_model_len: int, max_tokens: int, max_seqs: int,
                 attention: str = "auto", compile: bool = False, cuda_graphs: bool = True, kernels: str = "auto",
                 cpu_gemm_rows: int | str | None = "auto"):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.backend = make_backend(attention, self.device, cache.dtype, cache.block_size)
        self.ops = make_ops(kernels, model, self.device, cache.dtype, compile, cpu_gemm_rows)
        model.set_max_len(max_model_len, self.device)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.buffers = StepBuffers(max_tokens, max_seqs, -(-max_model_len // self.block_size), self.device)
        self.times = StepTimes()
        self._model = torch.compile(model, dynamic=True) if compile else model
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs = DecodeGraphs(self, max_seqs, max_tokens) if use_graphs else None

    def warm_up(self) -> None:
        """Compile the attention kernels for every padded shape a step can take, then capture the
        decode graphs, so that nothing compiles while serving. Run once, before any other thread uses
        the device. Nothing to do on a CPU, whose flex attention runs eagerly."""
        set_serving(False)
        if getattr(self.backend, "compiled", None):
            # prompt chunks are padded to whole tiles each, so k chunks of B tokens in all fill at most
            # k - 1 + ceil((B - k + 1) / tile) tiles; every bucket up to WARM_CHUNKS chunks compiles now
            tile, budget = self.backend.q_tile, self.max_tokens
            k = min(self.max_seqs, budget, WARM_CHUNKS)
            most = k - 1 + -(-(budget - k + 1) // tile)
            for b in sorted({size_bucket(t) for t in range(1, most + 1)}):
                self.forward(*self.prepare(self._dummy_step(min(b, most), k)))
            if self.graphs is None:       # decode attention pads its batch to a bucket: one step per bucket
                cap = min(self.max_seqs, self.max_tokens)
                for b in sorted({min(size_bucket(b), cap) for b in range(1, cap + 1)}):
                    self.forward(*self.prepare(SchedulerOutput(), pad_to=b))
        if self.graphs is not None:
            self.graphs.capture_all()
        set_serving(True)

    def _dummy_step(self, tiles: int, most_chunks: int) -> SchedulerOutput:
        """A prompt-only step whose chunks fill exactly `tiles` tiles with the fewest tokens: single
        tokens, then one chunk for the rest; padding sequences that touch only the scratch block."""
        c = min(tiles, most_chunks)
        sizes = [1] * (c - 1) + [(tiles - c) * self.backend.q_tile + 1]

        def chunk(n):
            req = SimpleNamespace(num_computed_tokens=0, token_ids=[0] * n,
                                  block_ids=[self.cache.scratch_block] * -(-n // self.block_size))
            return ScheduledChunk(req, n)
        return SchedulerOutput(prefills=[chunk(n) for n in sizes])

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's input ids [T] and attention metadata, on the device. `pad_to` (a decode-only step
        of at most that many sequences) adds padding sequences up to it and uses the block tables'
        full width, so every tensor has the shape, and address, a CUDA graph of that size captured:
        a padding row is token 0 at position 0, writing and reading the pool's scratch block."""
        chunks, bs, buf = sched.chunks, self.block_size, self.buffers.np
        S = len(chunks) if pad_to is None else pad_to
        starts = np.zeros(S, np.int64)
        lens = np.ones(S, np.int64)
        starts[:len(chunks)] = [c.request.num_computed_tokens for c in chunks]
        lens[:len(chunks)] = [c.num_tokens for c in chunks]
        T = int(lens.sum())
        ctx = starts + lens
        num_blocks = (ctx + bs - 1) // bs
        tables, ids, row = buf["block_tables"], buf["ids"], 0
        for i, c in enumerate(chunks):                            # decodes first, then prefills
            req, n, start = c.request, c.num_tokens, int(starts[i])
            ids[row:row + n] = req.token_ids[start:start + n]
            tables[i, :num_blocks[i]] = req.block_ids[:num_blocks[i]]
            row += n
        ids[row:T] = 0
        tables[len(chunks):S, 0] = self.cache.scratch_block
        q_start = buf["q_start"][:S + 1]
        q_start[0] = 0
        np.cumsum(lens, out=q_start[1:])
        buf["ctx_len"][:S] = ctx
        seq = np.repeat(np.arange(S), lens)                       # sequence of each row
        positions = buf["positions"][:T]
        np.add(np.arange(T) - q_start[seq], starts[seq], out=positions)
        np.add(tables[seq, positions // bs] * bs, positions % bs, out=buf["slots"][:T])

        b = self.buffers
        static = pad_to is not None or self.backend.static_shapes      # compiled kernels see the full width
        width = tables.shape[1] if static else int(num_blocks.max())
        meta = AttentionMetadata(
            positions=b.device_view("positions", T), slot_mapping=b.device_view("slots", T),
            block_tables=b.device_view("block_tables", S, width), q_start=b.device_view("q_start", S + 1),
            ctx_len=b.device_view("ctx_len", S), num_decodes=len(sched.decodes) + S - len(chunks),
            q_lens=lens.tolist(), ctx_lens=ctx.tolist())
        return b.device_view("ids", T), meta

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, after_layer=None) -> torch.Tensor:
        meta.cos, meta.sin = self.model.rotary.tables(meta.positions, self.cache.dtype)
        self.backend.prepare(meta, self.block_size, self.cache.pool.shape[2])
        with torch.no_grad():       # not inference_mode: compiled graphs mutate the pool in place
            if after_layer is not None:     # a callback between layers: eager (it would break a graph)
                return self.model(input_ids, self.cache.pool, meta, self.backend, after_layer, self.ops)
            return self._model(input_ids, self.cache.pool, meta, self.backend, ops=self.ops)

    def execute(self, sched: SchedulerOutput, after_layer=None) -> list[int | None]:
        """Run the step; one entry per chunk (decodes, then prefills): its new token, or None
        for a prompt chunk that leaves the request short of its next token. `after_layer(i)` is
        called once layer i's K/V are in the pool."""
        t0 = time.perf_counter()
        graphed = self.graphs is not None and after_layer is None and self.graphs.eligible(sched)
        input_ids, meta = self.graphs.prepare(sched) if graphed else self.prepare(sched)
        t1 = time.perf_counter()
        hidden = self.graphs.run(input_ids, meta) if graphed else self.forward(input_ids, meta, after_layer)
        if self.device.type == "cuda":     # this stream only: a transfer thread may keep a receive posted
            torch.cuda.current_stream(self.device).synchronize()
        t2 = time.perf_counter()
        rows, reqs, last = [], [], 0
        for chunk in sched.chunks:
            last += chunk.num_tokens
            if chunk.completes:
                rows.append(last - 1)
                reqs.append(chunk.request)
        tokens = sample(self.model.logits(hidden[rows], self.ops), reqs) if rows else []
        self.times = StepTimes(t1 - t0, t2 - t1, time.perf_counter() - t2)
        it = iter(tokens)
        return [next(it) if chunk.completes else None for chunk in sched.chunks]
