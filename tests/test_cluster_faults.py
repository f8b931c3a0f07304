"""Losing whole workers on an embedded Ray with fake GPUs (frozen, killed, a whole decode pool), a
killed driver, and layouts Ray cannot place: no request is lost, no token differs, nothing outlives
its driver, and a pool that cannot start says so at once."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cluster.config import ClusterConfig
from cluster.bundles import bundle_order
from cluster.ray_cluster import ClusterError
from router.config import FaultConfig, RouterConfig
from router.router import Router
from tests.conftest import ROOT
from tests.test_cluster import MAX_TOKENS, PROMPTS, greedy, greedy_tokens, serve, start_pool

pytestmark = pytest.mark.usefixtures("ray_session")


def test_frozen_worker_is_detected_in_seconds_and_its_requests_retried():
    pool = start_pool(mode="colocated", workers=2)
    victim = pool.workers[0]
    pid = victim.info["pid"]
    try:
        router = Router(pool, RouterConfig(prefill_policy="round_robin", liveness_timeout_s=2.0)).start()
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        records = [router.submit(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
        while victim.alive and time.monotonic() - frozen_at < 60:
            time.sleep(0.05)
        detected_s = time.monotonic() - frozen_at
        assert router.wait(90), router.progress()
        router.close()
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        pool.shutdown()
    assert not victim.alive and detected_s < 20, f"frozen worker noticed after {detected_s:.1f} s (was 30+)"
    assert [r.output_ids for r in records] == greedy_tokens(MAX_TOKENS)
    retried = [r for r in records if r.attempts == 2]
    assert len(retried) == 4 and all(r.decode_worker == "colocated:1" and r.crashes == 1 for r in retried)


def test_killed_driver_leaves_no_ray_process(tmp_path_factory):
    """kill -9 of a driver that embeds Ray: its GCS, raylet, agents and workers are all gone soon after."""
    driver = textwrap.dedent("""
        import os, sys, time
        import ray
        from cluster.config import ClusterConfig
        from cluster.ray_cluster import start_ray
        start_ray(ClusterConfig(num_gpus=1, num_cpus=1, log_to_driver=False), temp_dir=sys.argv[1])
        actor = ray.remote(num_cpus=0)(type("A", (), {"pid": lambda self: os.getpid()})).remote()
        print(ray.get(actor.pid.remote()), flush=True)
        time.sleep(300)
    """)
    tmp = tmp_path_factory.mktemp("rk")          # short: Ray's socket paths must fit 107 characters
    err = open(tmp / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), open(tmp / "stderr.txt").read()[-3000:]
        actor_pid = int(line)
        family = descendants(proc.pid)
        names = {comm(p) for p in family}
        assert actor_pid in family and {"gcs_server", "raylet"} <= names, names
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and [p for p in family if alive(p)]:
        time.sleep(0.1)
    assert not [(p, comm(p)) for p in family if alive(p)], "Ray processes outlived their driver"


def descendants(pid: int) -> set[int]:
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parent[int(name)] = int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_decode_worker_loses_no_request(caplog):
    pool = start_pool(prefill=1, decode=2, cpus_per_worker="auto")
    # 3 workers on the 2 CPUs ray_session declares: nothing reserved, and the pool says what that means
    assert pool.isolation["cpus_per_worker"] == 0 and not pool.isolation["dedicated"]
    assert "workers share cores; differences between modes are confounded" in caplog.text
    assert all(p["cores"] == pool.workers[0].info["cores"] for p in pool.isolation["per_worker"])
    # a dense stream of long generations, so requests are decoding on decode:0 when it dies
    records = serve_through_a_kill(pool, copies=4, max_tokens=60, kill_after_s=1.0, spacing_s=0.05)
    assert any(r.attempts > 1 for r in records), "the kill was meant to hit requests in flight"
    assert all(r.decode_worker == "decode:1" and r.injected_fault and r.crashes == 0 for r in records if r.attempts > 1)


def test_losing_every_decode_worker_falls_back_to_whole_requests_on_prefill():
    """A node loss that takes the whole decode pool leaves no role empty: the surviving prefill worker
    serves requests whole, the records say so, and no token differs."""
    records = serve_through_a_kill(start_pool(prefill=1, decode=1), copies=2, max_tokens=40, kill_after_s=0.8,
                                   spacing_s=0.1)
    degraded = [r for r in records if r.note]
    assert degraded, "the kill was meant to leave requests with no decode worker"
    assert all(r.note == "served whole on prefill:0: no live decode worker" and r.decode_worker == "prefill:0"
               for r in degraded)
    assert all(r.crashes == 0 for r in records), "an injected kill is not counted against the requests"


def serve_through_a_kill(pool, copies: int, max_tokens: int, kill_after_s: float, spacing_s: float):
    """PROMPTS x copies served while decode:0 is killed kill_after_s in, the pool shut down after: every
    request completes, retries continuing each stream exactly."""
    try:
        records = serve(pool, prompts=PROMPTS * copies, max_tokens=max_tokens, spacing_s=spacing_s,
                        faults=FaultConfig(kill_worker="decode:0", kill_after_s=kill_after_s))
    finally:
        pool.shutdown()
    assert all(r.status == "ok" for r in records), [r.reason for r in records if r.status != "ok"]
    assert [r.output_ids for r in records] == greedy_tokens(max_tokens) * copies, "retries continue the stream exactly"
    return records


def test_too_few_gpus_fails_fast():
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"needs 17 GPUs, one per worker; the Ray cluster has 16 GPUs"):
        start_pool(prefill=9, decode=8)
    assert time.monotonic() - start < 5


def test_unplaceable_layout_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(ClusterError, match="cluster.placement=strict_spread cannot place 2 bundles"):
        start_pool(placement="strict_spread", startup_timeout_s=2.0)
    assert time.monotonic() - start < 10


def test_bundle_order_interleaves_pairs():
    roles = ClusterConfig(prefill_workers=2, decode_workers=3).roles
    assert roles == ["prefill", "prefill", "decode", "decode", "decode"]
    assert bundle_order(roles) == [0, 2, 1, 3, 4]
