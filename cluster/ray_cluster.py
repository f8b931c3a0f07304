"""Ray bring-up: an embedded local instance by default, an existing cluster by address.

Every check that can fail is made before any worker starts, and names what is needed and
what the cluster has; nothing waits for resources that will not come. An embedded Ray dies with its
driver, however the driver dies (cluster/ray_watchdog.py).
"""
from __future__ import annotations

import logging
import math
import os

import ray

from cluster import ray_watchdog
from cluster.config import ClusterConfig
from cluster.isolation import usable_cores

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster cannot host the asked layout; the message says what is missing."""


def start_ray(cfg: ClusterConfig, temp_dir: str | None = None) -> dict:
    """Start (or join) Ray once per process; returns the cluster's total resources."""
    if not ray.is_initialized():
        common = dict(logging_level=logging.ERROR, log_to_driver=cfg.log_to_driver)
        if cfg.address:
            # ship the project's packages to every node of an existing cluster
            ray.init(address=cfg.address, runtime_env={"py_modules": _packages()}, **common)
        else:
            import torch
            gpus = cfg.num_gpus
            if gpus is None:
                gpus = torch.cuda.device_count() or math.ceil(cfg.num_gpus_needed)
                if not torch.cuda.device_count():
                    log.info("no GPU found: declaring %d GPU resources; workers run torch on CPU", gpus)
            # the cores this process may use (a container's cpuset), not every core of the host
            cpus = cfg.num_cpus or len(usable_cores())
            ray.init(num_gpus=gpus, num_cpus=cpus, include_dashboard=False,
                     _temp_dir=temp_dir, runtime_env={"env_vars": {"PYTHONPATH": _pythonpath()}}, **common)
            ray_watchdog.watch(ray._private.worker._global_node.get_session_dir_path())
    return ray.cluster_resources()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pythonpath() -> str:
    """Local workers import the project from the driver's checkout."""
    return os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p)


def _packages() -> list[str]:
    return [os.path.join(ROOT, name) for name in ("workers", "cluster", "router", "experiments")]


def check_resources(cfg: ClusterConfig, cpus_per_worker: float, grace_s: float = 15.0) -> None:
    """Fail at once if the cluster can never host the layout (`cpus_per_worker` Ray CPUs with each
    worker's cluster.gpus_per_worker GPUs, `cluster.cpus_per_worker` resolved); wait up to `grace_s` for resources that exist
    but are still being released (a previous pool's), then fail naming them."""
    import time

    total = ray.cluster_resources()
    need_gpus = cfg.num_gpus_needed
    each = "one per worker" if cfg.gpus_per_worker == 1 else f"{cfg.gpus_per_worker:g} per worker (cluster.gpus_per_worker)"
    need_cpus = cfg.num_workers * cpus_per_worker
    what = f"cluster.mode={cfg.mode} ({cfg.describe()})"

    def have():
        free = ray.available_resources()
        return (f"the Ray cluster has {total.get('GPU', 0):g} GPUs ({free.get('GPU', 0):g} free) and "
                f"{total.get('CPU', 0):g} CPUs ({free.get('CPU', 0):g} free)")

    if total.get("GPU", 0) < need_gpus:
        raise ClusterError(f"{what} needs {need_gpus:g} GPUs, {each}; {have()}")
    if total.get("CPU", 0) < need_cpus:
        raise ClusterError(f"{what} needs {need_cpus:g} CPUs (cluster.cpus_per_worker="
                           f"{cfg.cpus_per_worker}: {cpus_per_worker:g} each); {have()}")
    deadline = time.monotonic() + grace_s
    while True:
        free = ray.available_resources()
        if free.get("GPU", 0) >= need_gpus and free.get("CPU", 0) >= need_cpus:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} needs {need_gpus:g} free GPUs and {need_cpus:g} free CPUs; {have()}: "
                               "other jobs hold the rest")
        time.sleep(0.1)


def stop_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()
