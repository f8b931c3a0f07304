"""The workers in the order a policy ranks them, kept as their loads change: placement without a scan.

router/placement.plan asks a view of the workers three things: whether a group has a live member
(`colocated`, `prefill`, `decode`, and `receiving`: live decode workers still in service), which
member a policy picks, and which receiving workers on a host have room. `ScanView` (placement.py)
answers by looking at every worker, as the router always did; `LoadIndex` answers the same from a
heap per (group, policy) of (policy.key(load), position) entries, so a pick costs O(log n) instead
of O(n) and 1,000 simulated GPUs are not 1,000 steps per request.

The same worker, tie for tie: a policy's `choose` is min(loads, key=policy.key), the first worker
with the least key, and the heap's least (key, position) is that worker. Entries are updated by
each WorkerLoad telling the index when a field that a ranking's key reads changes (the policy's
`fields`; policies.WorkerLoad.__setattr__: the worker is marked, and the marked workers' entries are
brought up to date at the next pick, as a load changes on every token and is read once a request); an entry
whose key is no longer its worker's is dropped when it reaches the top, and the heap is rebuilt
when it holds over twice its members. Whether a worker belongs to a group is checked when it
reaches the top: a worker only ever leaves a group (a dead worker is not revived, a decode worker
whose receiver stopped takes no more KV), so one that left is dropped for good. A policy without a
key (round_robin, whose pick depends on how many workers are live) gets the scan.
"""
from __future__ import annotations

import heapq

from router.placement import pick
from router.policies import LOAD_FIELDS

GROUPS = {
    "colocated": lambda w: w.alive and w.role == "colocated",
    "prefill": lambda w: w.alive and w.role == "prefill",
    "decode": lambda w: w.alive and w.role == "decode",
    "receiving": lambda w: w.alive and w.role == "decode" and w.in_service,
}
ROLE = {"colocated": "colocated", "prefill": "prefill", "decode": "decode", "receiving": "decode"}


class _Ranked:
    """The members of one group ordered by (key(load), position); see the module docstring."""

    def __init__(self, members: list[int], workers: list, loads: list, key, eligible):
        self.workers, self.loads, self.key, self.eligible = workers, loads, key, eligible
        self.members = members
        self.gone: set[int] = set()
        self.current = {i: key(loads[i]) for i in members}
        self._rebuild()

    def _rebuild(self) -> None:
        self.heap = [(k, i) for i, k in self.current.items() if i not in self.gone]
        heapq.heapify(self.heap)

    def changed(self, i: int) -> None:
        k = self.key(self.loads[i])
        if k != self.current[i]:
            self.current[i] = k
            heapq.heappush(self.heap, (k, i))
            if len(self.heap) > 2 * len(self.members) + 16:
                self._rebuild()

    def least(self):
        heap = self.heap
        while heap:
            k, i = heap[0]
            if i in self.gone or k != self.current[i]:
                heapq.heappop(heap)
            elif not self.eligible(self.workers[i]):
                self.gone.add(i)
                heapq.heappop(heap)
            else:
                return self.workers[i]
        return None


class LoadIndex:
    """plan()'s view of `workers` (handles with rank, role, alive, in_service, info["host"]) and their
    `loads` ({rank: WorkerLoad}), kept up to date as the loads change."""

    def __init__(self, workers: list, loads: dict):
        self.workers = list(workers)
        self._loads = [loads[w.rank] for w in self.workers]
        self.loads = loads
        self._members = {g: [i for i, w in enumerate(self.workers) if w.role == ROLE[g]] for g in GROUPS}
        self._first = dict.fromkeys(GROUPS, 0)          # members before this index have left the group
        self._ranked: dict[tuple, _Ranked] = {}
        self._of: list[list[_Ranked]] = [[] for _ in self.workers]   # the rankings each worker is in
        self._hosts: dict = {}
        for i in self._members["decode"]:
            self._hosts.setdefault(self.workers[i].info.get("host"), []).append(i)
        position = {id(load): i for i, load in enumerate(self._loads)}
        if len(position) != len(self._loads):
            raise ValueError("each worker needs a WorkerLoad of its own")
        self._dirty: set[int] = set()                  # workers whose ranked fields changed since the last pick
        mark = self._dirty.add
        for i, load in enumerate(self._loads):
            object.__setattr__(load, "_watch", lambda i=i: mark(i))
            object.__setattr__(load, "_watched", frozenset())

    def _update(self) -> None:
        for i in self._dirty:
            for r in self._of[i]:
                r.changed(i)
        self._dirty.clear()

    def has(self, group: str) -> bool:
        members, ok, j = self._members[group], GROUPS[group], self._first[group]
        while j < len(members) and not ok(self.workers[members[j]]):
            j += 1
        self._first[group] = j
        return j < len(members)

    def pick(self, group: str, policy, prompt_len: int):
        """The member of `group` that `policy` chooses (None when the group has no live member)."""
        key = getattr(policy, "key", None)
        if key is None:
            ok = GROUPS[group]
            live = [self.workers[i] for i in self._members[group] if ok(self.workers[i])]
            return pick(policy, self.loads, live, prompt_len) if live else None
        self._update()
        ranked = self._ranked.get((group, key))
        if ranked is None:
            ranked = _Ranked(self._members[group], self.workers, self._loads, key, GROUPS[group])
            self._ranked[(group, key)] = ranked
            fields = frozenset(getattr(policy, "fields", LOAD_FIELDS))
            for i in ranked.members:
                self._of[i].append(ranked)
                load = self._loads[i]
                object.__setattr__(load, "_watched", load._watched | fields)
        return ranked.least()

    def near(self, host, total: int) -> list:
        """Receiving workers on `host` with room for `total` more KV tokens, in worker order."""
        ok = GROUPS["receiving"]
        return [self.workers[i] for i in self._hosts.get(host, ())
                if ok(self.workers[i]) and self._loads[i].kv_capacity_tokens - self._loads[i].kv_tokens >= total]
