"""The distributed prototype on an embedded Ray with fake GPUs: handoff, streaming, routing, bad input,
timeouts, isolation (losing whole workers: tests/test_cluster_faults.py)."""
import functools
import os
import socket
import threading
import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pool import WorkerPool
from cluster.transfer.base import TransferConfig
from router.config import FaultConfig, RouterConfig
from router.records import StreamUpdate
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
# The disaggregated pools: frames of at most 300 kB (one layer of a 260-token prompt is 266 kB, its KV
# 1.06 MB: it travels in four frames), and a decode pool of 3,200 tokens (less than max_model_len).
FRAME_BYTES = 300_000
DECODE_ENGINE = ENGINE.replace(num_kv_blocks=200)


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


def start_pool(mode="disaggregated", backend="zmq", prefill=1, decode=1, workers=2, engine=ENGINE,
               transfer=None, cpus_per_worker=0, **cluster):
    """cpus_per_worker=0: no Ray CPUs reserved, so that pools can coexist on the 2 CPUs ray_session declares
    (the `colocated` pool reserves them, as cluster.cpus_per_worker=auto does by default)."""
    cfg = ClusterConfig(mode=mode, prefill_workers=prefill, decode_workers=decode, workers=workers,
                        log_to_driver=False, cpus_per_worker=cpus_per_worker, **cluster)
    return WorkerPool(cfg, SPEC, engine, transfer or TransferConfig(backend=backend)).start()


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
    pool = start_pool(engine={"prefill": ENGINE.replace(role="prefill"), "decode": DECODE_ENGINE.replace(role="decode")},
                      transfer=TransferConfig(backend=request.param, max_frame_bytes=FRAME_BYTES))
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def colocated():
    pool = start_pool(mode="colocated", workers=2, cpus_per_worker="auto")
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


@pytest.mark.parametrize("backend,stream,budget", [("zmq", "layer", 256), ("nccl", "layer", 256), ("zmq", "chunk", 64)])
def test_streamed_kv_continues_identically(backend, stream, budget, reference):
    """KV streamed layer by layer as the prefill computes it (or chunk by chunk, prompts prefilled in
    64-token chunks) gives the tokens of never moving it; its last byte lands within the transfer."""
    transfer = TransferConfig(backend=backend, max_frame_bytes=FRAME_BYTES, stream=stream)
    prefill = ENGINE.replace(role="prefill", token_budget=budget, policy="chunked")
    pool = start_pool(engine={"prefill": prefill, "decode": DECODE_ENGINE.replace(role="decode")}, transfer=transfer)
    try:
        records = serve(pool, transfer=transfer)
    finally:
        pool.shutdown()
    assert [r.output_ids for r in records] == reference
    for rec, prompt in zip(records, PROMPTS):
        assert rec.status == "ok" and rec.attempts == 1, rec.retried_for
        assert rec.transfer_bytes == KV_BYTES_PER_TOKEN * len(prompt)
        assert rec.kv_arrived is not None and rec.prefill_end is not None


def test_never_fit_request_rejected_before_any_prefill(disagg, reference):
    router = Router(disagg).start()
    good = [router.submit(f"g{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
    too_long = router.submit("too-long", [1] * 3300, greedy())     # the decode pool holds 3,200 tokens
    too_wide = router.submit("too-wide", [1] * 300, greedy())      # one layer of its KV is 307 kB
    assert router.wait(60)
    router.close()
    assert [r.output_ids for r in good] == reference and all(r.attempts == 1 for r in good)
    assert too_long.reason == ("rejected: can never fit: prompt (3300) + max_tokens (12) needs 207 KV blocks of 16 "
                               "tokens; the largest decode worker's pool holds 200")
    assert too_wide.reason == (f"rejected: can never fit: one layer of its prompt's KV is 307200 bytes, more than "
                               f"transfer.max_frame_bytes={FRAME_BYTES}")
    for rec in (too_long, too_wide):
        assert rec.attempts == 0 and rec.prefill_worker is None and router._tag not in rec.reason


def test_nothing_of_ours_listens_on_all_interfaces(disagg):
    """Bind addresses read from the OS: the KV wires' sockets in the workers and the rendezvous store
    in the driver are bound to the node's address (loopback here). Ray's own core-worker server, which
    Ray reports per actor, is Ray's business and left out."""
    serve(disagg, prompts=PROMPTS[:2])
    nccl = disagg.transfer.backend == "nccl"
    for w in disagg.workers:
        ray_port = ray._private.state.actors(w.actor._actor_id.hex())["Address"]["Port"]
        ours = [(addr, port) for addr, port in listening(w.info["pid"]) if port != ray_port]
        assert all(addr == "127.0.0.1" for addr, _ in ours), (w.name, ours)
        assert ours or (w.role == "prefill" and not nccl), f"{w.name} listens on nothing of ours"
    if nccl:
        store = [addr for addr, port in listening(os.getpid()) if port == disagg._store.port]
        assert store == ["127.0.0.1"], "the TCPStore used to listen on every interface ('::')"


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket `pid` listens on, from /proc/<pid>/fd and /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:           # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)                               # host-order 32-bit words
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return out


def test_conditional_disaggregation_routes_short_prompts_to_decode(disagg, reference):
    records = serve(disagg, router_cfg=RouterConfig(conditional_threshold=50))
    assert [r.output_ids for r in records] == reference
    for rec, prompt in zip(records, PROMPTS):
        if len(prompt) < 50:
            assert rec.prefill_worker == rec.decode_worker == "decode:0" and rec.transfer_bytes == 0
        else:
            assert rec.prefill_worker == "prefill:0" and rec.transfer_bytes == KV_BYTES_PER_TOKEN * len(prompt)


def test_poisoned_params_fail_alone_at_router_and_worker(colocated, reference):
    """The inputs that used to crash worker after worker: refused at the router with the field named;
    sent straight to a worker actor (no router), refused there by the same rules; nothing else lost."""
    w = colocated.workers[0]
    w.actor.submit.remote("direct", [1, 2, 3], {"max_tokens": 4, "temperature": 1e-40})
    events = []
    deadline = time.monotonic() + 30
    while not any(e.get("rid") == "direct" for e in events) and time.monotonic() < deadline:
        events += ray.get(w.actor.poll.remote(0.5))["events"]
    (direct,) = [e for e in events if e.get("rid") == "direct"]
    assert direct["kind"] == "rejected" and "temperature=1e-40" in direct["reason"]
    router = Router(colocated).start()
    poisons = {"cold": ({"temperature": 1e-40}, "temperature=1e-40"),
               "seed": ({"temperature": 0.7, "seed": 2**70}, "seed=1180591620717411303424"),
               "stop": ({"stop_token_ids": [[1]]}, "stop_token_ids[0]=[1]"),
               "nan": ({"top_p": float("nan")}, "top_p=nan")}
    good, bad = [], {}
    for i, p in enumerate(PROMPTS):
        good.append(router.submit(f"g{i}", p, greedy()))
        name = list(poisons)[i % len(poisons)]
        bad[f"{name}{i}"] = router.submit(f"{name}{i}", p, {"max_tokens": MAX_TOKENS, **poisons[name][0]})
    assert router.wait(60)
    router.close()
    assert [g.output_ids for g in good] == reference
    for rid, rec in bad.items():
        assert rec.status == "failed" and rec.reason.startswith("rejected: ") and rec.attempts == 0
        assert poisons[rid.rstrip("0123456789")][1] in rec.reason
    assert all(w.alive for w in colocated.workers)


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
    assert times == rec.token_times and times == sorted(times) and times[0] >= rec.arrival_s


def test_no_gap_between_colocated_tokens_is_shorter_than_half_a_step(colocated):
    check_gaps_under_a_busy_router(colocated)


def test_no_gap_between_disaggregated_tokens_is_shorter_than_half_a_step(disagg):
    check_gaps_under_a_busy_router(disagg)


def check_gaps_under_a_busy_router(pool):
    """The router is kept too busy to poll on time (its lock held 100 ms in every 105), so poll replies
    carry several steps: their tokens arrive together (client gaps of exactly 0), yet each token's time
    is the end of the step that made it, so a gap is never shorter than half the fastest step of the
    worker that made the later token."""
    router = Router(pool).start()
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            with router._lock:
                time.sleep(0.1)
            time.sleep(0.005)
    records = [router.submit(f"gap{i}", p, greedy(16)) for i, p in enumerate(PROMPTS[:3])]
    hog = threading.Thread(target=busy, daemon=True)
    hog.start()
    try:
        assert router.wait(90), router.progress()
    finally:
        stop.set()
        hog.join()
        router.close()
    start, end = min(r.arrival_s for r in records), max(r.end_time for r in records)
    steps = {name: [s for s in trace if start <= s["end"] <= end] for name, trace in router.traces().items()}
    fastest = {name: min(s["end"] - s["start"] for s in trace) for name, trace in steps.items() if trace}
    ends = {name: {s["end"] for s in trace} for name, trace in steps.items()}
    for rec in records:
        assert rec.status == "ok" and len(rec.token_times) == 16, rec.reason
        assert all(t in ends[w] for t, w in zip(rec.token_times, rec.token_workers)), "a token's time is a step end"
        for gap, worker in zip(rec.itl_s, rec.token_workers[1:]):
            assert gap >= fastest[worker] / 2, (rec.id, worker, gap, fastest[worker])
    assert any(g == 0.0 for r in records for g in r.client_itl_s), "replies were meant to carry several steps"
    assert all(r.client_ttft_s >= r.ttft_s for r in records), "a token reaches the router after it is made"
    for name, c in router.clock_report().items():   # one host, one clock: the true offset is 0
        assert c["rounds"] >= 1 and abs(c["offset_ms"]) <= c["error_ms"], (name, c)


def test_workers_run_on_cores_of_their_own(colocated):
    """cluster.cpus_per_worker=auto with 2 workers on 2 Ray CPUs: one core each. Read back from outside:
    every thread of each worker process (after serving, so torch's threads exist) may run on its cores alone."""
    serve(colocated, prompts=PROMPTS[:2])
    iso = colocated.isolation
    node = colocated.workers[0].info["node_cores"]
    assert iso["workers"] == 2 and iso["cores"] == len(node) and iso["cpus_per_worker"] == 1
    for w in colocated.workers:
        threads = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{w.info['pid']}/task")}
        assert all(cores == w.info["cores"] for cores in threads.values()), (w.name, threads)
        inside = ray.get(w.actor.affinity.remote())
        assert all(cores == w.info["cores"] for cores in inside.values()), (w.name, inside)
    if len(node) >= 2:
        a, b = (w.info["cores"] for w in colocated.workers)
        assert iso["dedicated"] and len(a) == len(b) == 1 and not set(a) & set(b), iso
        assert iso["driver_shares_cores"] == (len(node) == 2) == (iso["driver_cores"] is None), iso   # a core left: its own
        assert all(w.info["torch_threads"] == 1 for w in colocated.workers)
        assert [p["cores"] for p in iso["per_worker"]] == [a, b]
    else:
        assert not iso["dedicated"] and "2 workers on 1 cores" in iso["reason"] and not iso["driver_shares_cores"]


def test_abort_frees_kv_and_follow_sees_the_end(colocated):
    router = Router(colocated).start()
    rec = router.submit("long", PROMPTS[1], greedy(3000), arrival_s=time.time() - 5.0)   # a front end saw it first
    seen, deadline = 0, time.monotonic() + 30
    while seen < 3 and time.monotonic() < deadline:            # follow it until it is decoding
        seen += len(router.follow({"long": seen}, 0.5).get("long", StreamUpdate([], [], False)).token_ids)
    worker = colocated.find(rec.prefill_worker)
    assert seen >= 3 and ray.get(worker.actor.stats.remote())["num_blocks_used"] > 0 and rec.ttft_s >= 5.0
    assert router.abort("long", "aborted: test") and not router.abort("long")
    assert rec.status == "failed" and rec.reason == "aborted: test" and len(rec.output_ids) < 3000
    assert router.follow({"long": seen}, 0.1)["long"].done
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ray.get(worker.actor.stats.remote())["num_blocks_used"]:
        time.sleep(0.05)
    assert ray.get(worker.actor.stats.remote())["num_blocks_used"] == 0
    assert router.forget("long") is rec and "long" not in router.records and router.forget("long") is None
    assert router.follow({"long": 0}, 0.1)["long"].done          # forgotten: ended, for a follower
    router.close()


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
    assert [r.injected_fault for r in records] == [False, False, True] + [False] * 5
    assert all(r.status == "ok" for r in records)
    (why,) = records[2].retried_for                 # the record says why it was served twice
    assert "KV transfer prefill:0 -> decode:0" in why and "timed out" in why, why
    assert not any(r.retried_for for i, r in enumerate(records) if i != 2)
