"""pdlab on a real two-node Ray cluster on this machine (tests/multinode_driver.py): a head started with
`ray start --head` on 127.0.0.2 and a node joined by address on 127.0.0.3, one fake GPU each, two
workers per GPU (cluster.gpus_per_worker=0.5), 2P+2D spread over both. Over both wires the tokens
are a local run's; node 2 lost while requests decode on it loses none; node 2 lost between placement
and wiring leaves a 1P+1D that serves the point (the torch.distributed group formed again without
it). The second node's address lies in loopback's network without being its address: the gloo
interface is found by network. Only processes the driver started are stopped, and none outlives it."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_cluster_faults import alive, descendants
from cluster.ray_watchdog import holding

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                  reason="loopback aliases (127.0.0.2, 127.0.0.3) are Linux's")]

HEAD, NODE2 = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("mn")              # short: Ray's socket paths must fit 107 characters
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "multinode_driver.py"), str(work)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=open(work / "driver.log", "w"), text=True)
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        family = descendants(proc.pid)
        proc.kill()
        for pid in holding([str(work)]) + sorted(family):
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)
        raise
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, (work / "driver.log").read_text()[-4000:]
    result = json.loads(lines[-1])
    assert "error" not in result, result["error"] + (work / "driver.log").read_text()[-3000:]
    return result, work


def all_ok(part: dict) -> bool:
    return part["done"] and set(part["status"]) == {"ok"} and part["tokens_equal"]


@pytest.mark.parametrize("wire", ["zmq", "nccl"])
def test_both_wires_across_nodes_give_local_tokens(run, wire):
    result, _ = run
    part = result[wire]
    assert all_ok(part), part
    places = part["places"]
    for role in ("prefill", "decode"):               # spread: every role on both nodes
        assert {places[f"{role}:{i}"] for i in (0, 1)} == {HEAD, NODE2}, places
    assert part["decode_workers"] == ["decode:0", "decode:1"]
    assert result["driver_node_ip"] == HEAD


def test_node_lost_while_serving_loses_no_request(run):
    result, _ = run
    part = result["kill_serving"]
    assert result["kill_serving_hit"], "node 2 was meant to go while it decoded requests"
    assert all_ok(part), part
    assert any(a > 1 for a in part["attempts"]), "requests were meant to be retried off node 2"
    assert set(part["crashes"]) == {0}, "a lost node is not held against the requests it served"
    lost = {name for name, up in part["alive"].items() if not up}
    assert lost == {name for name, host in result["zmq"]["places"].items() if host == NODE2}   # the same pool


def test_node_lost_during_start_up_is_dropped_and_the_point_served(run):
    result, _ = run
    part = result["kill_startup"]
    assert all_ok(part), part
    rec = part["record"]
    assert rec["asked"] == "disaggregated 2P+2D" and rec["served"].startswith("1P+1D")
    assert {w["host"] for w in rec["workers"]} == {HEAD}
    assert sorted(x["host"] for x in rec["lost"]) == [NODE2, NODE2]
    assert all(x["phase"].startswith("wiring") and "actor" in x["reason"] for x in rec["lost"])
    assert part["up_s"] < 60


def test_nothing_the_driver_started_outlives_it(run):
    _, work = run
    assert not [p for p in holding([str(work)]) if alive(p)], "a Ray process of the test cluster is still up"
