"""CUDA streams and fences of the KV wires: copies off the compute stream, waits on events, never
on the device.

- Every sender and receive thread works on a side stream of its own (`own_stream`): a receive
  waiting for its peer, or a copy of a part, never holds up the engine's kernels.
- Sender, for a wire that sends from host memory (ZeroMQ): the part is read out of the pool on the
  side stream after the compute stream's event (kv_out.py), copied device-to-host into pinned
  staging without blocking (`to_host`), and only that copy's event is waited for; the socket then
  sends it while the next part is read, so streaming overlaps.
- Receiver (ZeroMQ on a GPU): a part's host frame goes into pinned staging and on to the device on
  the receive thread's side stream (`to_device`), with an event recorded after the copy; the loop
  thread never copies pageable memory.
- Import (the engine's stream, `fence_import`): waits on the part's event, and marks the receive
  buffer as used by that stream (`record_stream`), so the caching allocator cannot hand its memory
  to the next receive while the import copy is still queued.

Pinned staging comes from torch's caching host allocator, which records an event for every
non-blocking copy out of or into a pinned block and reuses the block only once it has passed, so a
staging tensor may be dropped as soon as its copy is queued.

All CUDA calls go through the module attribute `cuda` (torch.cuda), so a CPU test can put a
recording fake in its place and check the order of streams, events and copies.
"""
from __future__ import annotations

import threading

import torch

cuda = torch.cuda
_local = threading.local()


def own_stream(device: torch.device) -> None:
    """Give the calling thread a CUDA stream of its own, once (a no-op off CUDA)."""
    if device.type == "cuda" and getattr(_local, "stream", None) is None:
        _local.stream = cuda.Stream(device)
        cuda.set_stream(_local.stream)


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def device_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def to_host(kv: torch.Tensor) -> torch.Tensor:
    """A device tensor -> pinned host memory, copied on the calling thread's stream; returns once
    that copy (its event, not the device) is done."""
    stream = cuda.current_stream(kv.device)
    host = pinned_empty(kv.shape, kv.dtype)
    host.copy_(kv, non_blocking=True)
    done = cuda.Event()
    done.record(stream)
    done.synchronize()
    return host


def to_device(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
    """Host memory (a wire's receive frame) -> a device tensor, via pinned staging, on the calling
    thread's stream: (the tensor, the event after its copy). Returns without waiting for it."""
    stream = cuda.current_stream(device)
    staged = pinned_empty(host.shape, host.dtype)
    staged.copy_(host)                                    # out of the wire's (pageable) frame
    out = device_empty(host.shape, host.dtype, device)
    out.copy_(staged, non_blocking=True)
    ready = cuda.Event()
    ready.record(stream)
    return out, ready


def fence_import(kv: torch.Tensor, ready) -> None:
    """Before the importing thread reads a received part on its current stream: wait for the
    stream that filled it, and keep its memory from reuse until this stream is past the import."""
    if kv.device.type != "cuda":
        return
    stream = cuda.current_stream(kv.device)
    if ready is not None:
        stream.wait_event(ready)
    kv.record_stream(stream)


def filled(device: torch.device):
    """After a receive on the calling thread's stream: an event the importer waits on (None off CUDA)."""
    if device.type != "cuda":
        return None
    ready = cuda.Event()
    ready.record(cuda.current_stream(device))
    return ready
