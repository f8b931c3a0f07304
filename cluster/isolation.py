"""Cores for each worker: Ray CPU bundles sized to the layout, thread affinity, the driver on spare cores.

Ray counts CPUs but pins nothing, so two workers on one node compete for whatever cores the OS gives
them, and with them the driver (the router's poll threads). Here the pool reserves `cpus_per_worker`
Ray CPUs per worker (`auto`: each node's cores shared out among the workers it can host, one kept
for the driver on its node when there are more cores than workers), then pins each worker's every
thread to cores of its own and sets torch's threads to match; the driver is pinned to the cores no
worker holds. Where a layout cannot have dedicated cores (more workers than cores, or no cores
reserved), every worker may use every core of its node and the pool says so: differences between
modes are then confounded with the workers' competition for cores.

The pure parts (sizing, assignment) are separate from the system calls, so they can be tested.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

SHARED_WARNING = "workers share cores; differences between modes are confounded"
DRIVER_WARNING = ("the router has no core of its own: its threads run on the workers' cores and slow the worker "
                  "beside them, so where they land moves the modes' token latencies")


def usable_cores(pid: int = 0) -> list[int]:
    """The cores this process (or thread `pid`) may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(pid))
    return list(range(os.cpu_count() or 1))


def bundle_cpus(setting: float | str, nodes: list[dict], num_workers: int, driver_node: str | None,
                gpus_per_worker: float = 1) -> float:
    """Ray CPUs to reserve per worker. `nodes`: alive Ray nodes as {"id", "cpus", "gpus"}.

    auto: on every node with GPUs, its CPUs (less one for the driver on the driver's node, when it has
    more CPUs than workers) divided by the workers it can host (its GPUs over `gpus_per_worker`, at
    most all workers); the
    smallest share over the nodes, floored, since a bundle may land on any of them. 0 when some node
    has fewer CPUs than workers: nothing is reserved and the workers share cores."""
    if setting != "auto":
        return float(setting)
    shares = []
    for n in nodes:
        hosted = min(int(n["gpus"] / gpus_per_worker + 1e-9), num_workers)
        if hosted < 1:
            continue
        cpus = n["cpus"] - (1 if n["id"] == driver_node and n["cpus"] > hosted else 0)
        shares.append(math.floor(cpus / hosted))
    return float(max(0, min(shares))) if shares else 0.0


@dataclass(frozen=True)
class NodeCores:
    per_worker: list[list[int]]      # each worker's cores, in the order asked
    dedicated: bool                  # no two workers (of this pool or another) share a core
    reason: str | None               # why not, when not


def assign_cores(cores: list[int], num_workers: int, per_worker: float, driver_here: bool) -> NodeCores:
    """Cores for `num_workers` workers on one node whose free cores are `cores`.

    Each worker gets floor(per_worker) cores of its own, fewer when the node has fewer (the Ray CPUs
    reserved can exceed the real cores), and one core is left for the driver on its node when there
    are more cores than workers. With no reservation, or fewer cores than workers, each worker may run
    on all of them."""
    cores = sorted(cores)
    want = math.floor(per_worker)
    if num_workers > len(cores):
        return NodeCores([cores] * num_workers, False, f"{num_workers} workers on {len(cores)} cores")
    if want < 1:
        return NodeCores([cores] * num_workers, False,
                         f"{per_worker:g} CPUs reserved per worker (cluster.cpus_per_worker): no core of its own")
    spare = 1 if driver_here and len(cores) > num_workers else 0
    each = min(want, (len(cores) - spare) // num_workers)
    return NodeCores([cores[i * each:(i + 1) * each] for i in range(num_workers)], True, None)


def threads_for(cores: list[int], workers_sharing: int, setting: int) -> int:
    """torch threads of a worker: as set, else one per core of its own (shared cores: an equal share)."""
    if setting > 0:
        return setting
    return max(1, len(cores) // max(1, workers_sharing))


def pin_process(cores: list[int]) -> list[int]:
    """Pin every thread of this process to `cores` (threads made later inherit it from their maker);
    returns the calling thread's affinity read back. Raises OSError where the system refuses."""
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("this system has no sched_setaffinity: threads cannot be pinned")
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:       # the thread ended meanwhile
            pass
    os.sched_setaffinity(0, cores)
    return usable_cores()
