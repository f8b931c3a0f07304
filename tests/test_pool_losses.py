"""Workers lost while a pool starts (before wiring, during the torch.distributed rendezvous, before the
speed probe), on an embedded Ray with fake GPUs: the lost worker is dropped with a warning naming it
and the layout left, the point is served on the rest with the tokens of a local run, and a whole role
lost fails at once with a reason saying so. Across real Ray nodes: tests/test_multinode.py."""
import dataclasses
import os
import signal
import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pool import WorkerPool
from cluster.ray_cluster import ClusterError
from cluster.transfer.base import TransferConfig
from tests.test_cluster import DECODE_ENGINE, ENGINE, MAX_TOKENS, SPEC, greedy_tokens, serve
from tests.test_failed_point import live_groups, released

pytestmark = pytest.mark.usefixtures("ray_session")

ENGINES = {"prefill": ENGINE.replace(role="prefill"), "decode": DECODE_ENGINE.replace(role="decode")}


def make_pool(prefill=1, decode=2, backend="zmq", **cluster) -> WorkerPool:
    cfg = ClusterConfig(prefill_workers=prefill, decode_workers=decode, log_to_driver=False, cpus_per_worker=0,
                        **cluster)
    return WorkerPool(cfg, SPEC, ENGINES, TransferConfig(backend=backend))


def kill_before(monkeypatch, method: str, victim: str, how: str = "kill", timeout_s: float | None = None):
    """Have `victim` die (or freeze: how="stop") just before the pool's `method` runs, with
    cluster.startup_timeout_s set to `timeout_s` from there on (actors start slowly on a loaded CPU)."""
    original = getattr(WorkerPool, method)
    frozen = []

    def hooked(self, *args, **kwargs):
        if timeout_s is not None:
            self.cfg = dataclasses.replace(self.cfg, startup_timeout_s=timeout_s)
        w = self.find(victim)
        if how == "stop":
            os.kill(w.info["pid"], signal.SIGSTOP)
            frozen.append(w.info["pid"])
        else:
            ray.kill(w.actor, no_restart=True)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(WorkerPool, method, hooked)
    return frozen


@pytest.mark.parametrize("backend", ["zmq", "nccl"])
def test_worker_lost_before_wiring_is_dropped_and_the_point_served(backend, monkeypatch, caplog):
    """nccl: the others wait for it in the rendezvous until the pool closes the store, then the group
    forms again without it."""
    kill_before(monkeypatch, "_wire", "decode:0")
    pool = make_pool(backend=backend)
    start = time.monotonic()
    pool.start()
    try:
        up_s = time.monotonic() - start
        assert [w.name for w in pool.workers] == ["prefill:0", "decode:1"]
        assert [(x["worker"], x["phase"].split(" ")[0]) for x in pool.lost] == [("decode:0", "wiring")]
        assert "its actor died" in pool.lost[0]["reason"]
        assert "worker decode:0 lost during wiring" in caplog.text
        assert "the pool goes on with 1P+1D (prefill:0, decode:1)" in caplog.text
        records = serve(pool)
        assert [r.output_ids for r in records] == greedy_tokens(MAX_TOKENS)
        assert {r.decode_worker for r in records} == {"decode:1"}
        rec = pool.record()
        assert rec["asked"] == "disaggregated 1P+2D" and rec["served"] == "1P+1D (prefill:0, decode:1)"
        assert [w["worker"] for w in rec["workers"]] == ["prefill:0", "decode:1"] and rec["lost"] == pool.lost
    finally:
        pool.shutdown()
    assert up_s < 40, f"start-up took {up_s:.0f} s: something waited on the dead worker"


@pytest.mark.slow
def test_worker_lost_before_the_speed_probe_is_dropped(monkeypatch):
    kill_before(monkeypatch, "probe", "prefill:1")
    pool = make_pool(prefill=2, decode=1, speed_probe=True).start()
    try:
        assert sorted(pool.speed) == ["decode:0", "prefill:0"]
        assert all(p["decode_s"] > 0 for p in pool.speed.values())
        assert pool.lost[0]["worker"] == "prefill:1" and pool.lost[0]["phase"] == "speed probe"
        assert [r.output_ids for r in serve(pool)] == greedy_tokens(MAX_TOKENS)
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_frozen_worker_costs_a_phase_its_timeout_not_more(monkeypatch):
    frozen = kill_before(monkeypatch, "_wire", "decode:1", how="stop", timeout_s=4.0)
    pool = make_pool()
    try:
        start = time.monotonic()
        pool.start()
        wired_s = time.monotonic() - start     # from placement on: actor start included
        assert pool.lost and pool.lost[0]["worker"] == "decode:1"
        assert pool.lost[0]["reason"] == "no answer within cluster.startup_timeout_s=4"
        assert [r.output_ids for r in serve(pool)] == greedy_tokens(MAX_TOKENS)
    finally:
        for pid in frozen:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        pool.shutdown()
    assert wired_s < 40, f"start-up took {wired_s:.0f} s with a 4 s timeout on the frozen worker's phase"


def test_a_whole_role_lost_fails_the_point_and_releases_it(monkeypatch):
    before = live_groups()
    kill_before(monkeypatch, "_wire", "decode:0")
    pool = make_pool(decode=1)
    with pytest.raises(ClusterError, match=r"every decode worker was lost during start-up \(wiring \(zmq bind\)\): "
                                           r"the layout disaggregated 1P\+1D cannot be served without one "
                                           r"\(decode:0: its actor died"):
        pool.start()
    assert pool.workers == [] and released(before)


def test_fractional_gpus_shape_bundles_and_actors_and_nothing_probes_unasked():
    assert ClusterConfig().speed_probe is False
    pool = make_pool(decode=1, gpus_per_worker=0.5).start()
    try:
        bundles = ray.util.placement_group_table(pool._pg)["bundles"]
        assert [b.get("GPU") for b in bundles.values()] == [0.5, 0.5]
        assert [r.output_ids for r in serve(pool)] == greedy_tokens(MAX_TOKENS)
        assert pool.speed is None, "cluster.speed_probe is opt-in"
    finally:
        pool.shutdown()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1"])
def test_gpus_per_worker_must_be_a_fraction_or_whole(value):
    with pytest.raises(ValueError, match=r"cluster.gpus_per_worker=.* must be a fraction in \(0, 1\]"):
        ClusterConfig(gpus_per_worker=value)


def test_gpus_per_worker_counts_in_the_resource_check():
    assert ClusterConfig(prefill_workers=3, decode_workers=1, gpus_per_worker=0.5).num_gpus_needed == 2
    assert ClusterConfig(mode="colocated", workers=2, gpus_per_worker=2).num_gpus_needed == 4
    with pytest.raises(ClusterError, match=r"needs 32 GPUs, 2 per worker \(cluster.gpus_per_worker\); "
                                           r"the Ray cluster has 16 GPUs"):
        make_pool(prefill=8, decode=8, gpus_per_worker=2).start()


def test_fractional_gpus_share_a_nodes_cpus_among_the_workers_it_hosts():
    from cluster.isolation import bundle_cpus
    one_gpu = [{"id": "A", "cpus": 16, "gpus": 1}]
    assert bundle_cpus("auto", one_gpu, 2, "elsewhere", gpus_per_worker=0.5) == 8     # two workers on the GPU
    assert bundle_cpus("auto", one_gpu, 2, "elsewhere") == 16                          # one: the other goes elsewhere
    assert bundle_cpus("auto", [{"id": "A", "cpus": 16, "gpus": 1}], 1, "A", gpus_per_worker=2) == 0.0


@pytest.mark.parametrize("num_gpus", [1, 2])
def test_gpu_checks_main_job_composes_on_one_gpu_or_two(num_gpus):
    """experiments/gpu_stages.py's main job: on one GPU both workers of each point share it (0.5 each)."""
    from hydra import compose, initialize_config_dir
    from experiments.config import parse
    from experiments.gpu_stages import main_job_overrides, shapes
    from tests.conftest import ROOT

    overrides = main_job_overrides("cuda", shapes("cuda"), num_gpus)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        spec = parse(compose("config", overrides=overrides))
    need = spec.cluster.num_gpus_needed
    if num_gpus == 1:
        assert (spec.cluster.gpus_per_worker, spec.cluster.num_gpus, spec.transfer.backend) == (0.5, 1, "zmq")
    else:
        assert (spec.cluster.gpus_per_worker, spec.transfer.backend) == (1, "nccl")
    assert need <= num_gpus and spec.scheduler.gpu_memory_utilization == 0.4


def test_a_worker_unreachable_or_on_a_dead_node_went_with_its_node(monkeypatch):
    """What the router does not hold against requests (router/threads.py): a worker Ray cannot reach
    with no death reported, or one on a node marked dead; a worker that died on a live node counts."""
    from cluster.pool import WorkerHandle
    from router.threads import went_with_its_node

    live = ray.get_runtime_context().get_node_id()
    here = WorkerHandle(0, "decode", 0, None, {"node_id": live})
    assert went_with_its_node(here, ray.exceptions.ActorUnavailableError("connection reset", None))
    assert not went_with_its_node(here, ray.exceptions.ActorDiedError())
    table = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: [{**n, "Alive": False} if n["NodeID"] == live else n for n in table])
    assert went_with_its_node(here, ray.exceptions.ActorDiedError()), "its node is marked dead"
