"""CUDA graphs for decode-only steps: one graph per batch-size bucket, captured on first use.

A decode step launches a few hundred small kernels whose launch cost, on a GPU, rivals the step
itself; replaying a captured graph launches them as one. A graph fixes its tensors' shapes and
addresses, so a step of B decodes runs in the graph of the smallest bucket >= B, its batch padded
with rows that write and read only the pool's scratch block (ModelRunner.prepare(pad_to=...)), and
every input lives in the runner's persistent buffers. Prefill-carrying steps, and batches above
the largest bucket, run eagerly. The attention backend must prepare from device tensors alone for
a decode-only step (flex does: its decode layout is derived from the batch size).

On a CPU nothing is captured: `run` executes the same padded step eagerly, which is how the tests
exercise everything up to the capture itself.
"""
from __future__ import annotations

import torch

from workers.scheduler import SchedulerOutput

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def buckets_for(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, capture: bool | None = None):
        self.runner = runner
        self.buckets = buckets_for(max_batch)
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.memory_bytes = 0              # device memory the captured graphs hold

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def eligible(self, sched: SchedulerOutput) -> bool:
        return not sched.prefills and self.bucket(len(sched.decodes)) is not None

    def prepare(self, sched: SchedulerOutput):
        """The step's inputs, padded to its bucket, in the persistent buffers the graph reads."""
        return self.runner.prepare(sched, pad_to=self.bucket(len(sched.decodes)))

    def run(self, ids: torch.Tensor, meta) -> torch.Tensor:
        """Hidden states [bucket, hidden] of a padded decode-only step (rows past the batch: padding)."""
        if not self.capture:
            return self.runner.forward(ids, meta)
        size = ids.shape[0]
        if size not in self.graphs:
            self.graphs[size] = self._capture(ids, meta)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden

    def _capture(self, ids, meta) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.runner.device
        before = torch.cuda.memory_reserved(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):                  # warm-up: lazy inits and autotuning happen here
            for _ in range(2):
                self.runner.forward(ids, meta)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.runner.forward(ids, meta)
        self.memory_bytes += torch.cuda.memory_reserved(device) - before
        return graph, hidden
