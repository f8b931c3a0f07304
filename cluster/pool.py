"""The worker pools: one Ray actor per GPU, pinned through a placement group, wired for KV transfer.

Ranks: prefill workers first, then decode workers (colocated: all ranks do both). Once Ray has
placed the bundles, ranks are given to bundles by node (`assign_bundles`): under `pack` each
prefill/decode pair shares a node where it can, and under `spread` every role is spread over the
nodes, so that no node holds a whole role while another node has workers (losing one node then never
takes a role with it). Then each worker is given cores of its own on its node, and the driver the
cores no worker holds (cluster/isolation.py); `pool.isolation` says what was achieved.

Every phase of start-up (actor start, pinning, wiring the KV transfers, the optional speed probe)
asks all workers at once and waits at most cluster.startup_timeout_s for their answers. A worker
whose actor dies (its node lost) or that does not answer in time is dropped from the pool (killed,
so it cannot come back half-alive), with a warning naming it and the layout left; the pool goes on
with the others and fails only when a whole role is gone. `pool.lost` lists what was dropped, when
and why; `pool.record()` is what metrics.json keeps of it (cluster/pool_losses.py, docs/faults.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.bundles import assign_bundles, bundle_order
from cluster.config import PLACEMENTS, ClusterConfig
from cluster.isolation import (DRIVER_WARNING, SHARED_WARNING, assign_cores, bundle_cpus, pin_process, threads_for,
                               usable_cores)
from cluster.ray_cluster import ClusterError, check_resources
from cluster.transfer.base import TransferConfig
from workers.config import EngineConfig
from cluster.worker import Emulation, Worker
from cluster.pool_losses import PoolLosses
from cluster.wiring import wire
from workers.weights import ModelSpec

log = logging.getLogger(__name__)

# Cores held by the live pools of this driver, by node id: a second pool pins around them.
_HELD: dict[str, set[int]] = {}
_DRIVER_CORES: list[int] | None = None      # the driver's own cores before any pool pinned it


@dataclass(eq=False)
class WorkerHandle:
    rank: int
    role: str
    index: int          # within its role: "decode:1" is the second decode worker
    actor: object
    info: dict = field(default_factory=dict)
    alive: bool = True
    in_service: bool = True     # False once its KV receiver has stopped: it takes no more handoffs

    @property
    def name(self) -> str:
        return f"{self.role}:{self.index}"


class WorkerPool(PoolLosses):
    def __init__(self, cfg: ClusterConfig, spec: ModelSpec, engine_cfg: EngineConfig | dict[str, EngineConfig],
                 transfer: TransferConfig, emulation: Emulation | None = None):
        """`engine_cfg`: one EngineConfig for every role, or one per role ("colocated", "prefill", "decode");
        `emulation`: the step prices and KV link of engines with timing=emulated (cluster/worker.py)."""
        self.cfg = cfg
        self.emulation = emulation
        self.spec = spec
        self.engine_cfg = engine_cfg
        self.transfer = transfer
        self.workers: list[WorkerHandle] = []
        self._pg = None
        self._store = None
        self._held: dict[str, set[int]] = {}
        self.isolation: dict | None = None
        self.speed: dict | None = None         # {worker: the speed probe's result} (cluster.speed_probe)
        self.lost: list[dict] = []             # workers dropped: {worker, host, phase, reason}
        self.started = False                   # start-up over: a loss now is the router's to handle

    # -- bring-up -------------------------------------------------------------------------------
    def start(self) -> "WorkerPool":
        """Place and start the workers; on any failure the actors and placement group made so far are released."""
        try:
            return self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> "WorkerPool":
        roles = self.cfg.roles
        driver_node = ray.get_runtime_context().get_node_id()
        emulated = self.emulation is not None       # its workers wait, they do not compute: no cores of their own
        cpus = 0.0 if emulated else bundle_cpus(self.cfg.cpus_per_worker, _nodes(), len(roles), driver_node,
                                                self.cfg.gpus_per_worker)
        check_resources(self.cfg, cpus)
        order = bundle_order(roles)
        gpus = self.cfg.gpus_per_worker
        bundle = {"GPU": gpus} | ({"CPU": cpus} if cpus else {})
        self._pg = placement_group([bundle] * len(roles), strategy=PLACEMENTS[self.cfg.placement])
        if not self._pg.wait(timeout_seconds=self.cfg.startup_timeout_s):
            remove_placement_group(self._pg)
            self._pg = None
            raise ClusterError(f"cluster.placement={self.cfg.placement} cannot place {len(roles)} bundles of "
                               f"{bundle} within {self.cfg.startup_timeout_s:g} s; cluster resources: "
                               f"{_resources()}")
        threads = 1 if emulated else (self.cfg.torch_threads
                                      or max(1, int(ray.cluster_resources().get("CPU", 1)) // len(roles)))
        nodes = ray.util.placement_group_table(self._pg)["bundles_to_node_id"]
        bundles = assign_bundles(roles, [nodes[b] for b in range(len(roles))], self.cfg.placement)
        remote = ray.remote(Worker)
        counters: dict[str, int] = {}
        for rank in order:
            role = roles[rank]
            index = counters.get(role, 0)
            counters[role] = index + 1
            actor = remote.options(
                num_gpus=gpus, num_cpus=cpus, max_concurrency=16, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundles[rank]),
            ).remote(rank, self.spec, self._engine(role), threads, self.emulation)
            self.workers.append(WorkerHandle(rank, role, index, actor))
        self.workers.sort(key=lambda w: w.rank)
        for w, info in self.gather({w: w.actor.info.remote() for w in self.workers}, "actor start").items():
            w.info = info
        if emulated:
            self.isolation = {"dedicated": False, "workers": len(self.workers), "emulated": True,
                              "reason": "emulated workers wait for their steps' prices: none is pinned to cores",
                              "realtime": {w.name: w.info.get("realtime") for w in self.workers}}
            if not all(all(w.info.get("realtime", {}).values()) for w in self.workers):
                log.warning("emulated workers could not all take real-time priority (SCHED_FIFO needs "
                            "CAP_SYS_NICE): their steps start late when the machine is busy (docs/emulation.md)")
        else:
            self._isolate(cpus, driver_node)
        if self.cfg.mode == "disaggregated":
            self._wire()
        if self.cfg.speed_probe:
            self.speed = self.probe()
        self.started = True
        log.info("workers up: %s", ", ".join(f"{w.name}@{w.info['host']}/{w.info['device']}" for w in self.workers))
        return self

    def _isolate(self, cpus: float, driver_node: str) -> None:
        """Pin each worker to cores of its own on its node (what is free of other pools of this driver),
        the driver to the cores left; record it in `self.isolation` and warn when workers share cores."""
        by_node = self._by_node()
        plans, reasons = [], []
        for node, ws in by_node.items():
            cores = ws[0].info["node_cores"]
            free = [c for c in cores if c not in _HELD.get(node, ())]
            got = assign_cores(free or cores, len(ws), cpus, node == driver_node)
            if not got.dedicated:
                reasons.append(f"{got.reason} on {ws[0].info['host']}")
            for w, mine in zip(ws, got.per_worker):
                plans.append((w, mine, threads_for(mine, 1 if got.dedicated else len(ws), self.cfg.torch_threads)))
            if got.dedicated:
                mine = set().union(*map(set, got.per_worker))
                self._held[node] = mine
                _HELD.setdefault(node, set()).update(mine)
        results = self.gather({w: w.actor.isolate.remote(mine, threads) for w, mine, threads in plans}, "pinning")
        for w, mine, _ in plans:
            if w not in results:
                continue
            r = results[w]
            w.info.update(cores=r["cores"], torch_threads=r["torch_threads"])
            if r["error"] or r["cores"] != sorted(mine):
                got_cores = r["cores"]
                reasons.append(f"{w.name}: " + (r["error"] or f"asked for cores {mine}, runs on {got_cores}"))
        dedicated = not reasons
        driver = _pin_driver(driver_node)
        beside = dedicated and driver is None and bool(_HELD.get(driver_node))   # workers hold its node's cores
        self.isolation = {
            "dedicated": dedicated, "workers": len(self.workers),
            "cores": sum(len(ws[0].info["node_cores"]) for ws in by_node.values()), "nodes": len(by_node),
            "cpus_per_worker": cpus, "driver_cores": driver, "driver_shares_cores": beside,
            "reason": "; ".join(reasons) or None,
            "per_worker": [{"worker": w.name, "host": w.info["host"], "cores": w.info["cores"],
                            "torch_threads": w.info["torch_threads"],
                            "cpu_gemm_rows": w.info["memory"].get("cpu_gemm_rows")} for w in self.workers]}
        if not dedicated:
            log.warning("%s (%s)", SHARED_WARNING, self.isolation["reason"])
        elif beside:
            log.info(DRIVER_WARNING)           # the run's summary and report warn once per point

    def _by_node(self) -> dict[str, list[WorkerHandle]]:
        """The live workers of each node, in rank order."""
        out: dict[str, list[WorkerHandle]] = {}
        for w in self.workers:
            if not w.alive:
                continue
            out.setdefault(w.info["node_id"], []).append(w)
        return out

    def probe(self) -> dict:
        """{worker: its speed probe} (workers/probe.py; the workers must be idle), workers of one node
        one after another (so none is timed beside another's probe), nodes at once. A worker lost
        meanwhile is dropped (start-up) or left out (after serving)."""
        by_node = self._by_node()
        speed = {}
        for place in range(max(map(len, by_node.values()), default=0)):
            ws = [ws[place] for ws in by_node.values() if place < len(ws)]
            for w, r in self.gather({w: w.actor.probe.remote() for w in ws if w.alive}, "speed probe").items():
                speed[w.name] = r
                if "error" in r:
                    log.warning("%s: no speed probe (%s)", w.name, r["error"])
        return speed

    def _engine(self, role: str) -> EngineConfig:
        cfg = self.engine_cfg[role] if isinstance(self.engine_cfg, dict) else self.engine_cfg.replace(role=role)
        # a prefill engine streams its KV out as the transfer config says
        return cfg.replace(kv_stream=self.transfer.stream) if role == "prefill" else cfg

    def _wire(self) -> None:
        wire(self)

    # -- use ------------------------------------------------------------------------------------
    def by_role(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role == role]

    def find(self, name: str) -> WorkerHandle:
        """'decode:0' -> the first decode worker."""
        role, _, index = name.partition(":")
        for w in self.workers:
            if w.role == role and str(w.index) == index:
                return w
        raise ValueError(f"no worker {name!r}; workers are {[w.name for w in self.workers]}")

    def kill(self, w: WorkerHandle) -> None:
        ray.kill(w.actor, no_restart=True)

    def traces(self, drain: bool = False, timeout_s: float = 30.0) -> dict[str, list[dict]]:
        """Each live worker's engine steps; drain=True takes them out of the workers. Asked of all at
        once: a dead or silent worker costs at most `timeout_s` in all and is left out (marked dead)."""
        calls = {w: w.actor.trace.remote(drain) for w in self.workers if w.alive}
        got = self.gather(calls, "collecting traces", timeout_s, errors={}) if calls else {}
        return {w.name: steps for w, steps in got.items()}

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception:
                pass
        self.workers = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        self._store = None
        if self._held:
            for node, cores in self._held.items():
                _HELD.get(node, set()).difference_update(cores)
            self._held = {}
            _pin_driver(ray.get_runtime_context().get_node_id() if ray.is_initialized() else None)


def _nodes() -> list[dict]:
    return [{"id": n["NodeID"], "cpus": n["Resources"].get("CPU", 0), "gpus": n["Resources"].get("GPU", 0)}
            for n in ray.nodes() if n.get("Alive")]


def _pin_driver(driver_node: str | None) -> list[int] | None:
    """Keep the driver (the router's threads) off the cores workers of this driver's pools hold on its
    node, where some core is left; back on all its cores once none is held. Returns its cores when
    pinned apart, else None."""
    global _DRIVER_CORES
    if _DRIVER_CORES is None:
        _DRIVER_CORES = usable_cores()
    held = _HELD.get(driver_node, set()) if driver_node is not None else set()
    left = [c for c in _DRIVER_CORES if c not in held]
    apart = bool(held) and bool(left)
    try:
        pin_process(left if apart else _DRIVER_CORES)
    except OSError as e:
        log.warning("could not pin the driver: %s", e)
        return None
    if not held:
        _DRIVER_CORES = None            # read afresh next time
    return left if apart else None


def _resources() -> dict:
    return {k: v for k, v in ray.cluster_resources().items() if k in ("GPU", "CPU")}
