"""CUDA graphs for decode-only steps: one graph per batch-size bucket, all captured at start-up.

A decode step launches a few hundred small kernels whose launch cost, on a GPU, rivals the step
itself; replaying a captured graph launches them as one. A graph fixes its tensors' shapes and
addresses, so a step of B decodes runs in the graph of the smallest bucket >= B, its batch padded
with rows that write and read only the pool's scratch block (ModelRunner.prepare(pad_to=...)), and
every input lives in the runner's persistent buffers. Prefill-carrying steps run eagerly. The
attention backend must prepare from device tensors alone for a decode-only step (`graph_safe`:
flex is; the reference reads host-side lengths, which a replay would freeze at the capture's).

Every bucket is captured when the engine starts (`capture_all`), before any other thread of the
worker touches the device: capture synchronizes the whole device, which would wait forever on a
receive posted by a transfer thread, and a capture must not see another thread's allocations.
The buckets stop at the largest batch a step can hold: `max_batch`, and no more than the token
budget (a decode step of B sequences computes B tokens).

On a CPU nothing is captured: `run` executes the same padded step eagerly, which is how the tests
exercise everything up to the capture itself.
"""
from __future__ import annotations

import torch

from workers.attention import size_bucket
from workers.scheduler import SchedulerOutput


def buckets_for(max_batch: int, token_budget: int | None = None) -> list[int]:
    """Batch buckets of decode-only steps: the attention's size buckets below the cap, then the cap."""
    cap = max_batch if token_budget is None else min(max_batch, token_budget)
    out, b = [], 1
    while b < cap:
        out.append(b)
        b = size_bucket(b + 1)
    return out + [cap]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, token_budget: int | None = None, capture: bool | None = None):
        self.runner = runner
        self.buckets = buckets_for(max_batch, token_budget)
        self.capture = runner.device.type == "cuda" if capture is None else capture
        if self.capture and not getattr(runner.backend, "graph_safe", False):
            raise ValueError(f"engine.attention={runner.backend.name} cannot run in CUDA graphs (a replay would "
                             f"reuse the lengths of the captured step): use attention=flex, or cuda_graphs=false")
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

    def capture_all(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool), on padding rows."""
        if not self.capture:
            return
        for size in sorted(self.buckets, reverse=True):
            ids, meta = self.runner.prepare(SchedulerOutput(), pad_to=size)
            self.graphs[size] = self._capture(ids, meta)

    def run(self, ids: torch.Tensor, meta) -> torch.Tensor:
        """Hidden states [bucket, hidden] of a padded decode-only step (rows past the batch: padding)."""
        if not self.capture:
            return self.runner.forward(ids, meta)
        graph, hidden = self.graphs[ids.shape[0]]    # captured at start-up (capture_all)
        graph.replay()
        return hidden

    def _capture(self, ids, meta) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.runner.device
        before = torch.cuda.memory_reserved(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):                  # warm-up: lazy inits and compilation happen here
            for _ in range(2):
                self.runner.forward(ids, meta)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (none should run now) cannot invalidate the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden = self.runner.forward(ids, meta)
        self.memory_bytes += torch.cuda.memory_reserved(device) - before
        return graph, hidden
