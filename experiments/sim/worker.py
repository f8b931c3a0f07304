"""A simulated worker: cluster/worker.py's loop on the virtual clock, stepping a SimEngine.

The real loop, between two steps, takes what its inbox holds (new requests, aborts, KV that has
arrived), imports arrived KV in arrival order while the engine has room, then steps the engine; after
a step it exports the KV of requests that handed off, and only then tells the router the step's
tokens. Here the same: inbox items wait for the next step start (a decode run in progress is cut
after the step that was scheduled before they came); an import costs host time before the step; a
step's tokens reach the router `return_s` after the step's exports are done.

States: idle (nothing to do; new work wakes it after the host gap), step (one scheduled step in
flight), run (a decode run in flight; cut short by new work), start (a step start is queued).
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

from cluster.bundles import assign_bundles
from experiments.sim.engine import SimEngine
from experiments.sim.runs import DecodeRun, logged_steps
from experiments.sim.records import Ledger


@dataclass(eq=False, slots=True)
class Handle:
    """What router/placement.py and router/policies.py read of a worker."""

    rank: int
    role: str
    index: int
    info: dict
    alive: bool = True
    in_service: bool = True

    @property
    def name(self) -> str:
        return f"{self.role}:{self.index}"


@dataclass(eq=False, slots=True)
class SimWorker:
    handle: Handle
    engine: SimEngine
    node: int = 0
    record_steps: bool = True
    state: str = "idle"
    version: int = 0                       # bumped to void queued events of a cut run
    inbox: list = field(default_factory=list)
    arrivals: deque = field(default_factory=deque)   # attempts whose KV is here, waiting for blocks
    sched: object = None                   # the scheduled step in flight
    step_start: float = 0.0
    step_end: float = 0.0
    step_c: float = 1.0                    # the contention factor its step in flight runs at now
    last_end: float = 0.0                  # when its latest step ended (idle since then, when idle)
    run: DecodeRun | None = None
    run_steps: int = 0                     # steps of the run in flight that go ahead
    run_live: int = 0                      # its requests whose attempts are live (their tokens count)
    run_seen: int = 0                      # steps of the run in flight that ended and count in the router's
                                           # load (their KV tokens, run_seen x its live requests)
    delivered: float = 0.0                 # when the router got this worker's latest step
    ledger: Ledger = field(default_factory=Ledger)   # the records of its decode batch
    log: list = field(default_factory=list)
    rank: int = field(init=False)          # its handle's, read on every load change

    def __post_init__(self):
        self.rank = self.handle.rank

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def alive(self) -> bool:
        return self.handle.alive

    def in_flight(self) -> tuple[float, float]:
        """(start, end) of its step in flight: the scheduled one, or the last one of its run that goes ahead."""
        if self.state == "run":
            m = self.run_steps
            return self.run.starts[m - 1], self.run.ends[m - 1]
        return self.step_start, self.step_end

    def steps_ended(self, now: float) -> int:
        """Steps of its run in flight that go ahead and ended by `now`."""
        return bisect_right(self.run.ends, now, 0, self.run_steps)

    def move_end(self, end: float) -> None:
        """Its step in flight now ends at `end` (the caller queues the event for it)."""
        if self.state == "run":
            self.run.ends[self.run_steps - 1] = end
        else:
            self.step_end = end

    def log_step(self, start: float, end: float, sched, preempted: int) -> None:
        if self.record_steps:
            e, s = self.engine, self.engine.scheduler
            self.log.append((start, end, sched.num_prefill_tokens, len(sched.prefills), len(sched.decodes),
                             e.blocks.num_used, len(s.running), len(s.waiting), preempted))

    def log_run(self, run: DecodeRun, m: int) -> dict | None:
        if not self.record_steps:
            return None
        entry = logged_steps(run, m, self.engine.blocks.block_size, len(self.engine.scheduler.waiting))
        self.log.append(entry)
        return entry


class HostLoad:
    """Which workers of each host have work (are not idle). While another worker of its host has work,
    a step's work goes the step model's `shared_host` factor slower (on a CPU they share caches,
    memory bandwidth and the router's cores); the simulator rescales a step in flight when that
    changes. `on` is False when the model has no such factor, and then nothing is tracked."""

    def __init__(self, workers: list[SimWorker], on: bool):
        self.on = on
        self._busy: dict[int, set] = {w.node: set() for w in workers}

    def shared(self, w: SimWorker) -> bool:
        """Whether another worker of w's host has work."""
        if not self.on:
            return False
        b = self._busy[w.node]
        return len(b) > (w in b)

    def mark(self, w: SimWorker, busy: bool) -> list[SimWorker]:
        """Mark w busy or idle; returns the host's other busy workers for which `shared` changes: only
        when the host goes from one busy worker to two or back, so most moves on a busy host cost nothing."""
        if not self.on:
            return []
        b = self._busy[w.node]
        if (w in b) == busy:
            return []
        others = [o for o in b if o is not w]
        (b.add if busy else b.discard)(w)
        return others if len(others) == 1 else []


def nodes_of(roles: list[str], gpus_per_node: int, placement: str) -> list[int]:
    """The node of each rank: one host when gpus_per_node is 0, else bundles filled node by node (pack)
    or dealt round-robin (spread), and ranks given to bundles as the real pool gives them."""
    if not gpus_per_node or len(roles) <= gpus_per_node:
        return [0] * len(roles)
    num_nodes = -(-len(roles) // gpus_per_node)
    spread = placement in ("spread", "strict_spread")
    bundle_nodes = [str(b % num_nodes if spread else b // gpus_per_node) for b in range(len(roles))]
    bundles = assign_bundles(roles, bundle_nodes, placement)
    return [int(bundle_nodes[b]) for b in bundles]
