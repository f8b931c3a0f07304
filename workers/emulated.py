"""The emulated engine's two parts: a KV pool that counts blocks and holds no bytes, and a runner that
waits for each step's price instead of computing it (`engine.timing=emulated`).

Everything else of the engine is the real one: its scheduler, block manager, post-processing and
handoff, run by the real worker loop beside the real router and KV wire. Only the forward pass is
replaced: the step's price (seconds, from a `StepPrice` the caller supplies, such as the
simulator's cost model for a GPU) is waited out from the step's start. The step ends, and its tokens
are made, at its start plus its price, as a GPU's kernels end whatever the host is doing; the host
thread wakes to them a little later (how much later depends on the machine's load), and that is
recorded too: the step's `forward_s` is the wait as measured, beside its `price_s`, so a reader sees
the emulator's own error, and the next step starts only once the host is back.

What it does not do: no kernel runs and no KV byte exists. A request's KV is a `meta` tensor (shape
and dtype, no storage), so an export, a transfer and an import handle its declared size alone.
Tokens are deterministic ids that are never a stop id of their request, so every request runs to
its `max_tokens`, as in the simulator.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Protocol

import torch

from workers.config import ModelConfig
from workers.scheduler import SchedulerOutput

PR_SET_TIMERSLACK = 29
TIMER_SLACK_NS = 1000     # how late Linux may wake a sleeping thread on purpose (its default: 50 us)


class StepPrice(Protocol):
    """What one engine step costs on the emulated device."""

    name: str

    def price(self, sched: SchedulerOutput) -> float:
        """Seconds the step's forward pass takes."""


REALTIME_PRIORITY = 1     # SCHED_FIFO's lowest: above every ordinary thread, below the kernel's own


def realtime() -> bool:
    """Run the calling thread under SCHED_FIFO, so that it wakes at its deadline however busy the
    machine is (a thread of ordinary priority woke up to 4 ms late beside three busy processes on two
    cores, one under SCHED_FIFO within 66 us). For the threads of an emulated worker, which sleep
    almost all the time: Linux's real-time throttling keeps them from taking a core whole. False
    where the OS refuses it (no CAP_SYS_NICE) or has no such policy."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
        return True
    except OSError:
        return False


_slack = threading.local()


def sleep_until(deadline: float, clock=time.perf_counter) -> None:
    """Sleep until `clock()` reaches `deadline` (a thread wakes 50-100 us after it on a virtual
    machine, later when every core is busy). The first call in a thread lowers its timer slack to
    TIMER_SLACK_NS."""
    if not getattr(_slack, "set", False):
        _slack.set = True
        if sys.platform == "linux":
            try:
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
            except (OSError, AttributeError):
                pass
    while (left := deadline - clock()) > 0:
        time.sleep(left)


def meta_kv(layers: int, tokens: int, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """A part of a request's KV [layers, 2, tokens, kv_heads, head_dim] with no storage."""
    return torch.empty((layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device="meta")


class EmulatedCache:
    """The KV pool of an emulated device: its blocks are counted by the engine's BlockManager, sized
    by the caller from the emulated device's memory; no byte of KV is held."""

    huge_pages = False
    nbytes = 0

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.cfg, self.num_blocks, self.block_size, self.dtype = cfg, num_blocks, block_size, dtype
        self.device = torch.device("meta")
        self.scratch_block = num_blocks
        self.pool = torch.empty((cfg.num_layers, 2, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim),
                                dtype=dtype, device="meta")

    def export(self, block_ids: list[int], num_tokens: int, layers: tuple[int, int] | None = None,
               start: int = 0) -> torch.Tensor:
        first, end = layers or (0, self.cfg.num_layers)
        return meta_kv(end - first, num_tokens - start, self.cfg, self.dtype)

    def check_part(self, first_layer: int, t: torch.Tensor, start: int, num_tokens: int) -> None:
        cfg = self.cfg
        ok = (t.dim() == 5 and t.dtype == self.dtype and t.shape[0] >= 1 and t.shape[2] >= 1
              and tuple(t.shape[1:2]) + tuple(t.shape[3:]) == (2, cfg.num_kv_heads, cfg.head_dim)
              and 0 <= first_layer and first_layer + t.shape[0] <= cfg.num_layers
              and 0 <= start and start + t.shape[2] <= num_tokens)
        if not ok:
            raise ValueError(f"KV part of shape {tuple(t.shape)} {t.dtype} at layer {first_layer}, token {start} "
                             f"does not fit: this engine holds {cfg.num_layers} layers of (2, tokens, "
                             f"{cfg.num_kv_heads}, {cfg.head_dim}) {self.dtype}, {num_tokens} tokens")

    def import_part(self, block_ids: list[int], num_tokens: int, first_layer: int, t: torch.Tensor,
                    start: int = 0) -> None:
        self.check_part(first_layer, t, start, num_tokens)


def emulated_token(req, vocab: int) -> int:
    """The next token of `req`: a fixed function of its position, never one of its stop ids."""
    token = (len(req.token_ids) * 2654435761 + 12345) % vocab
    while token in req.stop_ids:
        token = (token + 1) % vocab
    return token


class EmulatedRunner:
    """ModelRunner's place in an emulated engine: `execute` waits until the step's price has passed
    since the step's `start` (on `clock`; default: when it was called), telling `after_layer` of each
    layer as its share of the price passes."""

    graphs = None

    def __init__(self, price: StepPrice, cfg: ModelConfig):
        self.step_price = price
        self.cfg = cfg
        self.times = None
        self.price_s = 0.0           # the last step's price

    def warm_up(self) -> None:
        pass

    def execute(self, sched: SchedulerOutput, after_layer=None, start: float | None = None,
                clock=time.time) -> list[int | None]:
        from workers.model_runner import StepTimes

        t0 = clock() if start is None else start
        p = float(self.step_price.price(sched))
        if not p >= 0:
            raise ValueError(f"step price {p!r} from {self.step_price.name} is not a number of seconds")
        if after_layer is not None:             # each layer's KV is final at its share of the step
            layers = self.cfg.num_layers
            for i in range(layers):
                sleep_until(t0 + p * (i + 1) / layers, clock)
                after_layer(i)
        sleep_until(t0 + p, clock)
        tokens = [emulated_token(c.request, self.cfg.vocab_size) if c.completes else None for c in sched.chunks]
        self.price_s = p
        self.times = StepTimes(0.0, clock() - t0, 0.0)
        return tokens
