"""The distributed prototype on an embedded Ray with fake GPUs: handoff, routing, faults, fail-fast."""
import functools
import time

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.pool import WorkerPool, bundle_order
from cluster.ray_cluster import ClusterError
from cluster.transfer.base import TransferConfig
from router.config import FaultConfig, RouterConfig
from router.router import Router
from tests.conftest import random_prompts
from workers.config import EngineConfig
from workers.engine import Engine
from workers.request import SamplingParams
from workers.weights import build_model
from workers.weights import ModelSpec

pytestmark = pytest.mark.usefixtures("ray_session")

SPEC = ModelSpec(model="tiny", seed=0, device="cpu")
ENGINE = EngineConfig(num_kv_blocks=512, token_budget=256)
PROMPTS = random_prompts(8, 2048, [5, 260, 33, 120, 17, 64, 1, 200], seed=21)
MAX_TOKENS = 12
KV_BYTES_PER_TOKEN = 2 * 4 * 4 * 32 * 4          # tiny: 2 x layers x kv_heads x head_dim x float32


@functools.cache
def greedy_tokens(max_tokens: int) -> list[list[int]]:
    """Greedy tokens of PROMPTS from one in-process engine with the workers' seeded weights."""
    engine = Engine(build_model(model="tiny", seed=0), ENGINE)
    reqs = [engine.add_request(i, p, greedy(max_tokens)) for i, p in enumerate(PROMPTS)]
    engine.run()
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def reference():
    return greedy_tokens(MAX_TOKENS)


def greedy(n=MAX_TOKENS):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def start_pool(mode="disaggregated", backend="zmq", prefill=1, decode=1, workers=2, **cluster):
    cfg = ClusterConfig(mode=mode, prefill_workers=prefill, decode_workers=decode, workers=workers,
                        log_to_driver=False, **cluster)
    return WorkerPool(cfg, SPEC, ENGINE, TransferConfig(backend=backend)).start()


def serve(pool, prompts=PROMPTS, router_cfg=RouterConfig(), transfer=TransferConfig(), faults=FaultConfig(),
          max_tokens=MAX_TOKENS, spacing_s=0.0):
    router = Router(pool, router_cfg, transfer, faults).start()
    records = []
    for i, p in enumerate(prompts):
        records.append(router.submit(f"r{i}", p, greedy(max_tokens)))
        time.sleep(spacing_s)
    assert router.wait(timeout_s=90), f"requests still pending: {router.progress()}"
    router.close()
    return records


@pytest.fixture(scope="module", params=["zmq", "nccl"])
def disagg(request):
    pool = start_pool(backend=request.param)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def colocated():
    pool = start_pool(mode="colocated", workers=2)
    yield pool
    pool.shutdown()


def test_disaggregated_matches_colocated_and_counts_bytes(disagg, colocated, reference):
    dis = serve(disagg)
    col = serve(colocated)
    assert [r.output_ids for r in col] == reference
    assert [r.output_ids for r in dis] == reference
    for rec, prompt in zip(dis, PROMPTS):
        assert rec.status == "ok" and rec.attempts == 1
        assert (rec.prefill_worker, rec.decode_worker) == ("prefill:0", "decode:0")
        assert rec.transfer_bytes == KV_BYTES_PER_TOKEN * len(prompt)
        assert rec.transfer_s > 0 and rec.handoff_s >= 0 and rec.queue_s >= 0 and rec.prefill_s > 0
        assert len(rec.token_times) == MAX_TOKENS and rec.token_times == sorted(rec.token_times)
        assert rec.ttft_s > 0 and rec.e2e_s >= rec.ttft_s
    assert all(r.transfer_bytes == 0 for r in col)


def test_conditional_disaggregation_routes_short_prompts_to_decode(disagg, reference):
    records = serve(disagg, router_cfg=RouterConfig(conditional_threshold=50))
    assert [r.output_ids for r in records] == reference
    for rec, prompt in zip(records, PROMPTS):
        if len(prompt) < 50:
            assert rec.prefill_worker == rec.decode_worker == "decode:0" and rec.transfer_bytes == 0
        else:
            assert rec.prefill_worker == "prefill:0" and rec.transfer_bytes == KV_BYTES_PER_TOKEN * len(prompt)


def test_round_robin_alternates_colocated_workers(colocated):
    records = serve(colocated, router_cfg=RouterConfig(prefill_policy="round_robin"))
    assert [r.prefill_worker for r in records] == ["colocated:0", "colocated:1"] * 4


def test_stream_yields_tokens_as_recorded(colocated):
    router = Router(colocated).start()
    rec = router.submit("s", PROMPTS[1], greedy(20))
    streamed = list(router.stream("s"))
    router.close()
    assert [t for t, _ in streamed] == rec.output_ids and len(streamed) == 20
    times = [t for _, t in streamed]
    assert times == sorted(times) and times[0] >= rec.arrival_s


def test_bad_requests_rejected_at_router_alone(colocated, reference):
    router = Router(colocated).start()
    bad = {"empty": [], "vocab": [1, 2, 4096], "long": [1] * 5000}
    good = [router.submit(f"g{i}", p, greedy()) for i, p in enumerate(PROMPTS[:3])]
    failed = {name: router.submit(name, p, greedy()) for name, p in bad.items()}
    failed["zero"] = router.submit("zero", [1, 2], {"max_tokens": 0})
    assert router.wait(60)
    router.close()
    assert [g.output_ids for g in good] == reference[:3]
    assert "empty prompt" in failed["empty"].reason
    assert "prompt_ids[2]=4096" in failed["vocab"].reason
    assert "max_model_len" in failed["long"].reason
    assert "max_tokens=0" in failed["zero"].reason
    assert all(f.status == "failed" and f.reason.startswith("rejected") for f in failed.values())


def test_transfer_timeout_is_recovered(disagg, reference):
    records = serve(disagg, transfer=TransferConfig(timeout_s=1.0), faults=FaultConfig(timeout_transfer_of=3))
    assert [r.output_ids for r in records] == reference
    assert [r.attempts for r in records] == [1, 1, 2, 1, 1, 1, 1, 1]
    assert all(r.status == "ok" for r in records)


def test_killed_decode_worker_loses_no_request():
    pool = start_pool(prefill=1, decode=2)
    try:
        # a dense stream of long generations, so requests are decoding on decode:0 when it dies
        records = serve(pool, prompts=PROMPTS * 4, faults=FaultConfig(kill_worker="decode:0", kill_after_s=1.0),
                        max_tokens=60, spacing_s=0.05)
    finally:
        pool.shutdown()
    assert all(r.status == "ok" for r in records), [r.reason for r in records if r.status != "ok"]
    assert [r.output_ids for r in records] == greedy_tokens(60) * 4, "retries continue the stream exactly"
    assert any(r.attempts > 1 for r in records), "the kill was meant to hit requests in flight"
    assert all(r.decode_worker == "decode:1" for r in records if r.attempts > 1)


def test_losing_every_decode_worker_falls_back_to_whole_requests_on_prefill():
    """A node loss that takes the whole decode pool leaves no role empty: the surviving prefill worker
    serves requests whole, the records say so, and no token differs."""
    pool = start_pool(prefill=1, decode=1)
    try:
        records = serve(pool, prompts=PROMPTS * 2, faults=FaultConfig(kill_worker="decode:0", kill_after_s=0.8),
                        max_tokens=40, spacing_s=0.1)
    finally:
        pool.shutdown()
    assert all(r.status == "ok" for r in records), [r.reason for r in records if r.status != "ok"]
    assert [r.output_ids for r in records] == greedy_tokens(40) * 2
    degraded = [r for r in records if r.note]
    assert degraded, "the kill was meant to leave requests with no decode worker"
    assert all(r.note == "served whole on prefill:0: no live decode worker" and r.decode_worker == "prefill:0"
               for r in degraded)
    assert all(r.crashes == 0 for r in records), "an injected kill is not counted against the requests"


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
