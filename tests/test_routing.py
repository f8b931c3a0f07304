"""The router's decisions across nodes and failures, on a pool of fake workers with fake hosts: no Ray,
no threads (the router is driven through its event handler, as its poll threads drive it)."""
from dataclasses import dataclass, field

import pytest

from cluster.config import ClusterConfig
from cluster.bundles import assign_bundles
from cluster.pool import WorkerHandle
from cluster.transfer.base import TransferConfig
from router.config import RouterConfig
from router.placement import never_fits
from router.router import Router
from workers.request import SamplingParams


class FakeActor:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name
        self.submit = self._method("submit")
        self.abort = self._method("abort")

    def _method(self, what):
        outer = self

        class Method:
            def remote(self, *args):
                outer.log.append((what, outer.name, args))
        return Method()


@dataclass
class FakePool:
    cfg: ClusterConfig
    workers: list
    transfer: TransferConfig = TransferConfig()
    log: list = field(default_factory=list)

    def find(self, name):
        return next(w for w in self.workers if w.name == name)

    def kill(self, w):
        self.log.append(("kill", w.name, ()))


def fake_pool(hosts: dict[str, str], placement="pack", blocks=64) -> FakePool:
    """hosts: {"prefill:0": "10.0.0.1", "decode:0": ...}; ranks in prefill-first order."""
    names = sorted(hosts, key=lambda n: (n.split(":")[0] != "prefill", n))
    mode = "colocated" if names[0].startswith("colocated") else "disaggregated"
    roles = [n.split(":")[0] for n in names]
    cfg = ClusterConfig(mode=mode, prefill_workers=max(1, roles.count("prefill")),
                        decode_workers=max(1, roles.count("decode")), workers=max(1, roles.count("colocated")),
                        placement=placement)
    pool = FakePool(cfg, [])
    for rank, name in enumerate(names):
        role, index = name.split(":")
        info = {"host": hosts[name], "num_kv_blocks": blocks, "block_size": 16, "max_model_len": 4096,
                "vocab_size": 2048, "kv_bytes_per_token": 4096, "num_layers": 4}
        pool.workers.append(WorkerHandle(rank, role, int(index), FakeActor(pool.log, name), info))
    return pool


def submitted(pool) -> list[tuple[str, str, str]]:
    """(attempt id, the worker it went to, its decode destination) of every submit so far."""
    by_rank = {w.rank: w.name for w in pool.workers}
    return [(args[0], name, by_rank.get(args[3])) for what, name, args in pool.log if what == "submit"]


def greedy(n=8):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_pack_prefers_a_decode_worker_on_the_prefill_workers_node():
    pool = fake_pool({"prefill:0": "A", "prefill:1": "B", "decode:0": "A", "decode:1": "B"})
    router = Router(pool, RouterConfig(prefill_policy="round_robin"))
    for i in range(6):
        router.submit(f"r{i}", [1] * 100, greedy())
    host = {w.name: w.info["host"] for w in pool.workers}
    pairs = [(p, d) for _, p, d in submitted(pool)]
    assert [p for p, _ in pairs] == ["prefill:0", "prefill:1"] * 3
    assert all(host[p] == host[d] for p, d in pairs), pairs
    # the node's decode worker is full: the prefill worker's KV goes to the other node
    router.loads[pool.find("decode:0").rank].kv_tokens = 64 * 16
    router.submit("far", [1] * 100, greedy())
    assert submitted(pool)[-1][1:] == ("prefill:0", "decode:1")


def test_spread_sends_to_the_least_loaded_decode_worker_anywhere():
    pool = fake_pool({"prefill:0": "A", "prefill:1": "B", "decode:0": "A", "decode:1": "B"}, placement="spread")
    router = Router(pool, RouterConfig(prefill_policy="round_robin"))
    router.loads[pool.find("decode:0").rank].kv_tokens = 500
    for i in range(2):
        router.submit(f"r{i}", [1] * 100, greedy())
    assert [d for _, _, d in submitted(pool)] == ["decode:1", "decode:1"]


def test_spread_never_leaves_a_whole_role_on_one_node():
    roles = ClusterConfig(prefill_workers=2, decode_workers=2).roles
    for nodes in (["A", "A", "B", "B"], ["A", "B", "A", "B"], ["B", "A", "A", "B"]):
        bundles = assign_bundles(roles, nodes, "spread")
        assert sorted(bundles) == [0, 1, 2, 3]
        for role in ("prefill", "decode"):
            assert {nodes[bundles[r]] for r, x in enumerate(roles) if x == role} == {"A", "B"}, (nodes, bundles)
    # 1P+3D over three nodes: every node gets a decode worker
    roles = ClusterConfig(prefill_workers=1, decode_workers=3).roles
    nodes = ["A", "A", "B", "C"]
    bundles = assign_bundles(roles, nodes, "spread")
    assert {nodes[bundles[r]] for r in (1, 2, 3)} == {"A", "B", "C"}
    # pack keeps each prefill/decode pair on one node
    roles = ClusterConfig(prefill_workers=2, decode_workers=2).roles
    bundles = assign_bundles(roles, ["A", "A", "B", "B"], "pack")
    assert {(["A", "A", "B", "B"][bundles[p]], ["A", "A", "B", "B"][bundles[d]]) for p, d in [(0, 2), (1, 3)]} \
        == {("A", "A"), ("B", "B")}


def test_losing_a_node_leaves_no_role_empty():
    """Node B held the only decode worker, then node A lost its prefill worker: requests keep being
    served by whoever survives, and their records say how."""
    pool = fake_pool({"prefill:0": "A", "prefill:1": "B", "decode:0": "B", "decode:1": "B"})
    router = Router(pool, RouterConfig(prefill_policy="round_robin"))
    with router._lock:
        for name in ("prefill:1", "decode:0", "decode:1"):        # node B is gone
            router._on_dead(pool.find(name), f"worker {name} died")
    rec = router.submit("a", [1] * 100, greedy())
    assert submitted(pool)[-1][1:] == ("prefill:0", None)
    assert pool.log[-1][2][-1] is True, "asked to serve it whole"
    assert rec.note == "served whole on prefill:0: no live decode worker" and rec.status == "pending"
    # with decode workers alive but none receiving KV, a prompt is prefilled on a decode worker
    pool = fake_pool({"prefill:0": "A", "decode:0": "B"})
    router = Router(pool)
    with router._lock:
        router._on_out_of_service(pool.find("decode:0"), "receiver stopped")
    rec = router.submit("b", [1] * 100, greedy())
    assert submitted(pool)[-1][1:] == ("decode:0", None) and "no decode worker can receive KV" in rec.note
    router._killed |= {w.rank for w in pool.workers}              # killed on purpose: no crash counted
    with router._lock:
        router._on_dead(pool.find("decode:0"), "died")
        assert submitted(pool)[-1][1:] == ("prefill:0", None), "then served whole on the prefill worker"
        router._on_dead(pool.find("prefill:0"), "died")
    assert rec.status == "failed" and "no live worker left" in rec.reason


def test_a_request_on_two_workers_that_died_is_not_retried_again():
    pool = fake_pool({f"colocated:{i}": "A" for i in range(4)})
    router = Router(pool, RouterConfig(prefill_policy="round_robin", max_retries=5))
    poison, other = router.submit("poison", [1] * 10, greedy()), router.submit("other", [2] * 10, greedy())
    with router._lock:
        router._on_event(pool.find("colocated:0"), {"kind": "fatal", "message": "Traceback ...\nRuntimeError: boom"}, 0.0)
        assert poison.status == "pending" and poison.attempts == 2 and poison.crashes == 1
        where = submitted(pool)[-1][1]
        assert where != "colocated:1", "the retry went to a third worker"
        router._on_event(pool.find(where), {"kind": "fatal", "message": "RuntimeError: boom again"}, 0.0)
        assert poison.status == "failed" and "not retried: it was on 2 workers that died" in poison.reason
        assert "boom again" in poison.reason
        assert other.status == "pending" and other.attempts == 1, "a request elsewhere is untouched"
        # a worker the router killed on purpose (fault injection) is not held against its requests
        router._killed.add(pool.find("colocated:1").rank)
        router._on_dead(pool.find("colocated:1"), "killed")
    assert other.status == "pending" and other.crashes == 0 and other.attempts == 2


def test_failed_and_rejected_events_fail_only_their_request():
    pool = fake_pool({"colocated:0": "A", "colocated:1": "A"})
    router = Router(pool, RouterConfig(prefill_policy="round_robin"))
    a, b = router.submit("client-a", [1] * 10, greedy()), router.submit("client-b", [2] * 10, greedy())
    aid_a, aid_b = (aid for aid, _, _ in submitted(pool))
    assert "client" not in aid_a, "attempt ids do not carry the client id (nor grow with it)"
    with router._lock:
        router._on_event(pool.find("colocated:1"), {"kind": "failed", "rid": aid_a, "reason": "spoofed"}, 0.0)
        assert a.status == "pending", "an event from a worker not serving the attempt is ignored"
        router._on_event(pool.find("colocated:0"), {"kind": "failed", "rid": aid_a, "reason": "sampling failed"}, 0.0)
    assert a.status == "failed" and a.reason == "failed on colocated:0: sampling failed" and a.attempts == 1
    assert b.status == "pending" and len(submitted(pool)) == 2, "not retried"


def test_never_fits_names_what_is_too_small():
    pool = fake_pool({"prefill:0": "A", "decode:0": "A"}, blocks=64)      # 1024 tokens per pool
    ws, t = pool.workers, TransferConfig()
    assert never_fits("disaggregated", ws, 1000, 24, 0, t.max_frame_bytes, t.max_pending_bytes) is None
    why = never_fits("disaggregated", ws, 1000, 25, 0, t.max_frame_bytes, t.max_pending_bytes)
    assert why == "prompt (1000) + max_tokens (25) needs 65 KV blocks of 16 tokens; the largest decode worker's pool holds 64"
    why = never_fits("disaggregated", ws, 500, 8, 0, 500 * 1024 - 1, t.max_pending_bytes)
    assert "one layer of its prompt's KV is 512000 bytes, more than transfer.max_frame_bytes=511999" == why
    assert never_fits("disaggregated", ws, 500, 8, 600, 1000, 1000) is None, "a local prefill needs no transfer"
    router = Router(pool)
    rec = router.submit("big", [1] * 1020, greedy(10))
    assert rec.status == "failed" and rec.reason.startswith("rejected: can never fit: prompt (1020) + max_tokens (10)")
    assert rec.attempts == 0 and not submitted(pool)


@pytest.mark.parametrize("params,field", [({"temperature": 1e-40}, "temperature=1e-40"), ({"seed": 2**70}, "seed="),
                                          ({"stop_token_ids": [[1]]}, "stop_token_ids[0]=[1]"),
                                          ({"max_tokens": 4094}, "exceeds max_model_len=4096")])
def test_router_rejects_poisoned_params_before_any_worker(params, field):
    pool = fake_pool({"colocated:0": "A"})
    router = Router(pool)
    rec = router.submit("p", [1, 2, 3], {"max_tokens": 4, **params})
    assert rec.status == "failed" and rec.reason.startswith("rejected: ") and field in rec.reason
    assert not submitted(pool)


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b"])
def test_default_limits_take_full_context_requests_of_the_large_presets(name):
    """bf16 KV of a full-context prompt: every layer fits the default frame, the whole within a receiver's
    default memory for KV; only the pools can refuse it."""
    from workers.config import preset

    cfg, t = preset(name), TransferConfig()
    n = cfg.max_position_embeddings - 1
    pool = fake_pool({"prefill:0": "A", "decode:0": "A"}, blocks=100_000)
    for w in pool.workers:
        w.info.update(kv_bytes_per_token=cfg.kv_bytes_per_token(2), num_layers=cfg.num_layers)
    assert never_fits("disaggregated", pool.workers, n, 1, 0, t.max_frame_bytes, t.max_pending_bytes) is None
    assert cfg.kv_bytes_per_token(2) // cfg.num_layers * n <= t.max_frame_bytes < cfg.kv_bytes_per_token(2) * n
