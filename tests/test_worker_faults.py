"""Attacks on live worker loops: the real Worker class (the Ray actor's body) run in this process, two
of them wired over ZeroMQ on loopback. A request that raises while being admitted, sampled, stepped,
exported or imported fails alone; the loop goes on and every other request gets its exact tokens."""
import functools
import sys
import time

import pytest
import torch

import workers.engine
from cluster.transfer.base import TransferConfig
from cluster.worker import Worker
from tests.conftest import random_prompts
from workers.config import EngineConfig
from workers.engine import Engine
from workers.events import RequestFailed
from workers.request import SamplingParams
from workers.weights import ModelSpec, build_model

SPEC = ModelSpec(model="tiny", seed=0, device="cpu")
ENGINE = EngineConfig(num_kv_blocks=256, token_budget=256)
PROMPTS = random_prompts(4, 2048, [9, 40, 17, 70], seed=4)
GREEDY = {"max_tokens": 6, "ignore_eos": True}


@functools.cache
def reference() -> list[list[int]]:
    engine = Engine(build_model(model="tiny", seed=0), ENGINE)
    reqs = [engine.add_request(i, p, SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)]
    engine.run()
    return [r.output_ids for r in reqs]


@pytest.fixture
def live():
    """Start in-process workers; stop their loops afterwards."""
    interval, made = sys.getswitchinterval(), []

    def start(role="colocated"):
        made.append(Worker(len(made), SPEC, ENGINE.replace(role=role), torch_threads=1))
        return made[-1]
    yield start
    for w in made:
        w._alive = False
        if w.transport is not None:
            w.transport.close()
    sys.setswitchinterval(interval)


def serve(workers: list[Worker], rids: set[str], timeout_s: float = 60) -> dict[str, dict]:
    """Poll until every rid has ended: {rid: {"tokens": [...], "end": finish reason or event kind, "reason"}}."""
    out = {rid: {"tokens": [], "end": None, "reason": None} for rid in rids}
    deadline = time.monotonic() + timeout_s
    while any(o["end"] is None for o in out.values()):
        assert time.monotonic() < deadline, {r: o for r, o in out.items() if o["end"] is None}
        for w in workers:
            for ev in w.poll(0.05)["events"]:
                assert ev["kind"] != "fatal", ev["message"]
                if ev["kind"] == "step":
                    for rid, token, finish in ev["tokens"]:
                        out[rid]["tokens"].append(token)
                        if finish in ("length", "stop"):
                            out[rid]["end"] = finish
                elif ev["kind"] in ("rejected", "failed", "import_failed", "send_failed"):
                    out[ev["rid"]].update(end=ev["kind"], reason=ev["reason"])
    return out


def forged(**fields) -> SamplingParams:
    """SamplingParams past every check, as a rule the validation missed would let through."""
    p = object.__new__(SamplingParams)
    for k, v in {**SamplingParams().to_dict(), "stop_token_ids": (), **fields}.items():
        object.__setattr__(p, k, v)
    return p


def test_loop_survives_requests_that_raise_in_admission_sampling_and_the_forward_pass(live, monkeypatch):
    w = live()
    # a gap in the rules: the engine's check lets anything through, the poison reaches the loop
    poisons = {"cold": forged(temperature=1e-40, max_tokens=6), "seed": forged(temperature=0.5, seed=2**70),
               "stop": forged(stop_token_ids=([1],), max_tokens=6)}
    monkeypatch.setattr(workers.engine, "validate_request",
                        lambda rid, prompt, params, *_: poisons.get(rid, SamplingParams(**GREEDY)))
    for rid in poisons:
        w.submit(rid, PROMPTS[0], {})
    for i, p in enumerate(PROMPTS):
        w.submit(f"g{i}", p, GREEDY)
    out = serve([w], {*poisons, *(f"g{i}" for i in range(4))})
    assert out["cold"]["end"] == "failed" and "sampling failed" in out["cold"]["reason"]
    assert out["seed"]["end"] == "rejected" and "Overflow" in out["seed"]["reason"]
    assert out["stop"]["end"] == "rejected" and "unhashable" in out["stop"]["reason"]
    assert [out[f"g{i}"]["tokens"] for i in range(4)] == reference()

    # a forward pass that fails as a whole: the requests of that step fail with the cause, no others
    real = w.engine.runner.execute

    def execute(sched, after_layer=None):
        if any(c.request.id == "bomb" for c in sched.chunks):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(sched)
    monkeypatch.setattr(w.engine.runner, "execute", execute)
    w.submit("bomb", PROMPTS[1], GREEDY)
    out = serve([w], {"bomb"})
    assert out["bomb"]["end"] == "failed" and "the step serving it failed: RuntimeError: CUDA error" in out["bomb"]["reason"]
    for i, p in enumerate(PROMPTS):
        w.submit(f"h{i}", p, GREEDY)
    out = serve([w], {f"h{i}" for i in range(4)})
    assert [out[f"h{i}"]["tokens"] for i in range(4)] == reference()
    assert w.engine.blocks.num_used == 0 and not w.engine.requests, "every failed request's blocks were freed"
    w.engine.blocks.check()


def test_handoff_survives_failed_exports_and_imports(live, monkeypatch):
    cfg = TransferConfig(timeout_s=5.0)
    prefill, decode = live("prefill"), live("decode")
    prefill.rank, decode.rank = 0, 1
    address = decode.zmq_bind(cfg, "127.0.0.1")
    prefill.zmq_connect(cfg, {1: address})
    decode.start_receiving(cfg.max_frame_bytes)
    real_read, real_import = prefill.out._read_part, decode.engine.cache.import_part
    monkeypatch.setattr(prefill.out, "_read_part",  # the sender thread reading g1's KV out of the pool
                        lambda item: (_ for _ in ()).throw(RuntimeError("export broke")) if item.rid == "g1" else real_read(item))

    def import_part(block_ids, n, *part):
        if n == len(PROMPTS[2]):
            raise RuntimeError("import broke")
        return real_import(block_ids, n, *part)
    monkeypatch.setattr(decode.engine.cache, "import_part", import_part)
    for i, p in enumerate(PROMPTS):
        prefill.submit(f"g{i}", p, GREEDY, dst=1)
    out = serve([prefill, decode], {f"g{i}" for i in range(4)})
    assert out["g1"]["end"] == "failed" and "KV export failed: RuntimeError: export broke" in out["g1"]["reason"]
    assert out["g2"]["end"] == "import_failed" and "import broke" in out["g2"]["reason"]
    assert [out[f"g{i}"]["tokens"] for i in (0, 3)] == [reference()[0], reference()[3]]
    for w in (prefill, decode):
        assert w.engine.blocks.num_used == 0 and not w.engine.requests
    assert decode.transport.pending_bytes == 0, "every arrival's receive buffer was given back"


def test_non_finite_logits_fail_their_request_alone(monkeypatch):
    """A numeric blow-up in one request's row (as fp16 overflow would give) fails that request; the
    rows beside it in the same steps are sampled as usual."""
    engine = Engine(build_model(model="tiny", seed=0), ENGINE)
    reqs = [engine.add_request(i, p, SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)]
    real, calls = engine.model.logits, []

    def logits(hidden, *args):  # rows follow admission order: all four prompts share every step
        out = real(hidden, *args).clone()
        calls.append(len(out))
        if len(calls) == 3:    # the second decode step
            assert len(out) == 4
            out[2] = float("nan")
        return out
    monkeypatch.setattr(engine.model, "logits", logits)
    events = engine.run()
    failed = [e for e in events if isinstance(e, RequestFailed)]
    assert [(e.request_id, e.reason) for e in failed] == [(2, "the model produced non-finite logits (NaN or inf) "
                                                               "for this request")]
    assert [reqs[i].output_ids for i in (0, 1, 3)] == [reference()[i] for i in (0, 1, 3)]
    assert reqs[2].output_ids == reference()[2][:2], "its first two tokens were made before the blow-up"
    assert engine.blocks.num_used == 0 and not engine.requests


def test_a_receiver_that_stops_takes_its_worker_out_of_service(live):
    decode = live("decode")
    cfg = TransferConfig()
    decode.zmq_bind(cfg, "127.0.0.1")
    decode.start_receiving(cfg.max_frame_bytes)
    decode.transport._pull.close(linger=0)            # the socket fails under the receive thread
    events, deadline = [], time.monotonic() + 10
    while not any(e["kind"] == "out_of_service" for e in events) and time.monotonic() < deadline:
        events += decode.poll(0.1)["events"]
    (ev,) = [e for e in events if e["kind"] == "out_of_service"]
    assert "zmq: receiver stopped" in ev["reason"]
    decode.submit("local", PROMPTS[0], GREEDY)         # it still serves what needs no KV
    out = serve([decode], {"local"})
    assert out["local"]["tokens"] == reference()[0]


def test_an_arrival_that_could_never_be_imported_is_refused_at_once(live):
    """KV for more tokens than the decode pool holds fails its request when it arrives, instead of
    waiting for blocks forever in front of the arrivals behind it."""
    cfg = TransferConfig(timeout_s=5.0)
    prefill = live("prefill")
    decode = Worker(1, SPEC, ENGINE.replace(role="decode", num_kv_blocks=4), torch_threads=1)   # 64 tokens
    try:
        address = decode.zmq_bind(cfg, "127.0.0.1")
        prefill.zmq_connect(cfg, {1: address})
        decode.start_receiving(cfg.max_frame_bytes)
        for i in (3, 0):                                          # 70 tokens first, then 9
            prefill.submit(f"g{i}", PROMPTS[i], GREEDY, dst=1)
        out = serve([prefill, decode], {"g3", "g0"})
    finally:
        decode._alive = False
        decode.transport.close()
    assert out["g3"]["end"] == "import_failed" and "needs 5 KV blocks but this engine's pool has 4" in out["g3"]["reason"]
    assert out["g0"]["tokens"] == reference()[0]


def test_recent_ids_forget_the_oldest_beyond_their_bound():
    from cluster.kv_in import RecentIds
    seen = RecentIds(3)
    for rid in ("a", "b", "c", "a", "d"):              # "a" again: it becomes the newest
        seen.add(rid)
    assert len(seen) == 3 and "a" in seen and "d" in seen and "c" in seen and "b" not in seen
