"""A point that fails while its pool starts releases its actors and placement group before the next point."""
import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pool import WorkerPool
from cluster.ray_cluster import ClusterError
from cluster.transfer.base import TransferConfig
from workers.config import EngineConfig
from workers.weights import ModelSpec

pytestmark = pytest.mark.usefixtures("ray_session")


def live_groups() -> set:
    return {pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def released(before: set, timeout_s: float = 30.0) -> bool:
    """No placement group made since `before` is alive and every GPU is free again (polls: removal is async)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if live_groups() <= before and ray.available_resources().get("GPU", 0) == ray.cluster_resources()["GPU"]:
            return True
        time.sleep(0.2)
    return False


def pool(device="cpu", mode="disaggregated"):
    return WorkerPool(ClusterConfig(mode=mode, log_to_driver=False, startup_timeout_s=60),
                      ModelSpec(model="tiny", device=device), EngineConfig(num_kv_blocks=64), TransferConfig())


def test_workers_that_die_at_start_are_released():
    before = live_groups()
    with pytest.raises(ClusterError, match="CUDA"):
        pool(device="cuda", mode="colocated").start()
    assert released(before)


def test_a_failure_after_the_workers_started_releases_them(monkeypatch):
    before = live_groups()

    def broken_wire(self):
        raise OSError("address already in use")
    monkeypatch.setattr(WorkerPool, "_wire", broken_wire)
    p = pool()
    with pytest.raises(OSError, match="address already in use"):
        p.start()
    assert p.workers == [] and released(before)
