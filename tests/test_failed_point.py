"""A point that fails while its pool starts releases its actors and placement group before the next point.
(Workers that die in their constructor, e.g. model.device=cuda without a GPU, were already released; the
sweep test in test_experiments.py serves such a point and the next one after it.)"""
import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pool import WorkerPool
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


def pool():
    return WorkerPool(ClusterConfig(mode="disaggregated", log_to_driver=False, startup_timeout_s=60),
                      ModelSpec(model="tiny", device="cpu"), EngineConfig(num_kv_blocks=64), TransferConfig())


def test_a_failure_after_the_workers_started_releases_them(monkeypatch):
    before = live_groups()

    def broken_wire(self):
        raise OSError("address already in use")
    monkeypatch.setattr(WorkerPool, "_wire", broken_wire)
    p = pool()
    with pytest.raises(OSError, match="address already in use"):
        p.start()
    assert p.workers == [] and released(before)
