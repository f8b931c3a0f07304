"""router/load_index.LoadIndex picks exactly the workers router/placement's scan picks, tie for tie,
on random sequences of the events that change loads and membership."""
import random
from dataclasses import dataclass, field

import pytest

from router.load_index import LoadIndex
from router.placement import ScanView, plan
from router.policies import DECODE_POLICIES, PREFILL_POLICIES, WorkerLoad


@dataclass(eq=False)
class FakeHandle:
    rank: int
    role: str
    info: dict = field(default_factory=dict)
    alive: bool = True
    in_service: bool = True

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}"


def _pool(rng: random.Random, mode: str, n: int):
    roles = ["colocated"] * n if mode == "colocated" else [rng.choice(["prefill", "decode"]) for _ in range(n)]
    handles = [FakeHandle(i, r, {"host": f"node{i // 4}"}) for i, r in enumerate(roles)]
    # few distinct capacities and small loads: many workers tie on every key
    loads = {h.rank: WorkerLoad(h.name, rng.choice([64, 64, 128])) for h in handles}
    return handles, loads


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return (a.kind, a.prefill, a.decode, a.note) == (b.kind, b.prefill, b.decode, b.note)


def _ties(view, group, policy) -> bool:
    """More than one live member of the group shares the least key: the pick rests on the tie-break."""
    members = view.groups[group]
    keys = [policy.key(view.loads[w.rank]) for w in members]
    return len(keys) > 1 and keys.count(min(keys)) > 1


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("prefill_name", sorted(PREFILL_POLICIES))
@pytest.mark.parametrize("decode_name", sorted(DECODE_POLICIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_index_picks_what_the_scan_picks(mode, prefill_name, decode_name, seed):
    rng = random.Random(seed)
    handles, loads = _pool(rng, mode, 24)
    index = LoadIndex(handles, loads)
    pp, dp = PREFILL_POLICIES[prefill_name](), DECODE_POLICIES[decode_name]()
    pp_scan, dp_scan = PREFILL_POLICIES[prefill_name](), DECODE_POLICIES[decode_name]()   # round robin has state
    live = []                       # (prefill load, decode load, prompt, tokens made)
    picks = ties = 0
    for _ in range(3000):
        r = rng.random()
        if r < 0.45 or not live:
            n = rng.randint(1, 3)
            total = n + rng.randint(1, 40)
            threshold, pack = rng.choice([0, 0, 2]), rng.random() < 0.5
            scan = ScanView(handles, loads)
            want = plan(mode, handles, loads, pp_scan, dp_scan, n, total, threshold, pack)
            got = plan(mode, handles, loads, pp, dp, n, total, threshold, pack, index)
            assert _same(got, want), (got, want)
            if isinstance(want, str):
                continue
            picks += 1
            group = "colocated" if mode == "colocated" else "prefill"
            ties += hasattr(pp, "key") and _ties(scan, group, pp)
            loads[want.prefill.rank].prompt_tokens += n           # as router.py and the simulator do
            loads[want.decode.rank].running += 1
            loads[want.decode.rank].kv_tokens += n
            live.append([loads[want.prefill.rank], loads[want.decode.rank], n, 0])
        elif r < 0.75:
            a = rng.choice(live)
            if a[3] == 0:
                a[0].prompt_tokens -= a[2]
            a[1].kv_tokens += 1
            a[3] += 1
        elif r < 0.97:
            a = live.pop(rng.randrange(len(live)))
            if a[3] == 0:
                a[0].prompt_tokens -= a[2]
            a[1].running -= 1
            a[1].kv_tokens -= a[2] + a[3]
        elif r < 0.985:
            rng.choice(handles).alive = False
        else:
            rng.choice(handles).in_service = False
    assert picks > 500
    if hasattr(pp, "key"):
        assert ties > 50            # the tie-break was exercised, not only distinct minima


def test_index_follows_loads_set_directly_and_workers_that_die():
    handles = [FakeHandle(i, "colocated") for i in range(5)]
    loads = {h.rank: WorkerLoad(h.name, 100) for h in handles}
    index = LoadIndex(handles, loads)
    policy = PREFILL_POLICIES["least_prompt_tokens"]()
    assert index.pick("colocated", policy, 1) is handles[0]        # all equal: the first
    loads[0].prompt_tokens = 5
    loads[1].running = 1
    assert index.pick("colocated", policy, 1) is handles[2]
    handles[2].alive = False
    assert index.pick("colocated", policy, 1) is handles[3]
    for h in handles:
        h.alive = False
    assert not index.has("colocated") and index.pick("colocated", policy, 1) is None
    assert plan("colocated", handles, loads, policy, policy, 1, 2, index=index) == "no live colocated worker left"


@pytest.mark.parametrize("roles", [["colocated"] * 6, ["prefill"] * 2 + ["decode"] * 6])
@pytest.mark.parametrize("placement", ["pack", "spread"])
def test_a_simulation_places_every_request_as_the_scan_would(roles, placement):
    """The simulator with its index and with plan() looking at every worker: the same records."""
    from experiments.sim.costs import Costs
    from experiments.sim.records import request_row
    from experiments.sim.simulator import Arrival, SimConfig, Simulator
    from experiments.sim.stepmodel import LinearStepModel
    from experiments.sim.transfer import TransferModel
    from router.config import FaultConfig
    from workers.config import EngineConfig

    rng = random.Random(5)
    arrivals = [Arrival(f"r{i}", 0.002 * i, rng.randint(8, 200), rng.randint(1, 30)) for i in range(300)]
    engines = {"colocated": EngineConfig(policy="chunked", token_budget=64),
               "prefill": EngineConfig(policy="prefill_first", token_budget=4096),
               "decode": EngineConfig(policy="chunked", token_budget=64)}

    def rows(indexed: bool):
        cfg = SimConfig(roles, engines, dict.fromkeys(engines, 300), kv_bytes_per_token=1000, num_layers=4,
                        max_model_len=4096, gpus_per_node=4, placement=placement, fault=FaultConfig(kill_worker=f"{roles[-1]}:1",
                                                                              kill_after_s=0.2))
        costs = Costs(LinearStepModel([1e-3, 1e-4, 0.0, 1e-5, 0.0, 0.0]), {"local": TransferModel(5e-4, 1e9)})
        sim = Simulator(cfg, costs)
        if not indexed:
            sim.index = None
        return [request_row(r) for r in sim.run(arrivals)]

    indexed, scanned = rows(True), rows(False)
    assert indexed == scanned
    assert len({r["decode_worker"] for r in scanned}) >= 2 and any(r["attempts"] == 2 for r in scanned)
