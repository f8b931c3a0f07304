"""Routing policies choose as their names say; router and fault settings reject bad values by key."""
import pytest

from cluster.config import ClusterConfig
from router.config import FaultConfig, RouterConfig
from router.policies import FewestRunning, LeastKV, LeastPromptTokens, RoundRobin, WorkerLoad


def loads():
    return [WorkerLoad("a", kv_capacity_tokens=1000, prompt_tokens=300, running=1, kv_tokens=900),
            WorkerLoad("b", kv_capacity_tokens=4000, prompt_tokens=100, running=5, kv_tokens=1000),
            WorkerLoad("c", kv_capacity_tokens=1000, prompt_tokens=200, running=2, kv_tokens=500)]


def test_round_robin_cycles():
    rr, ws = RoundRobin(), loads()
    assert [rr.choose(ws, 10).name for _ in range(5)] == ["a", "b", "c", "a", "b"]


def test_least_prompt_tokens():
    assert LeastPromptTokens().choose(loads(), 10).name == "b"


def test_least_kv_compares_fractions_of_capacity():
    assert LeastKV().choose(loads(), 10).name == "b"      # 1000/4000 beats 500/1000


def test_fewest_running():
    assert FewestRunning().choose(loads(), 10).name == "a"


@pytest.mark.parametrize("make,message", [
    (lambda: RouterConfig(prefill_policy="random"), "router.prefill_policy='random'"),
    (lambda: RouterConfig(decode_policy="x"), "router.decode_policy='x'"),
    (lambda: RouterConfig(conditional_threshold=-1), "router.conditional_threshold"),
    (lambda: FaultConfig(kill_worker="decode"), "fault.kill_worker='decode'"),
    (lambda: FaultConfig(timeout_transfer_of=0), "fault.timeout_transfer_of"),
    (lambda: ClusterConfig(mode="disaggregated", prefill_workers=0), "cluster.prefill_workers=0"),
    (lambda: ClusterConfig(mode="disaggregated", decode_workers=0), "cluster.decode_workers=0"),
    (lambda: ClusterConfig(mode="colocated", workers=0), "cluster.workers=0"),
    (lambda: ClusterConfig(mode="mixed"), "cluster.mode='mixed'"),
    (lambda: ClusterConfig(placement="anywhere"), "cluster.placement='anywhere'"),
])
def test_bad_settings_name_the_key(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make()
