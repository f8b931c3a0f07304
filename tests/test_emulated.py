"""The emulated engine and wire (engine.timing=emulated): steps that wait for their price, a KV pool of
counted blocks, parts that declare their bytes and take the link's time for them."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from cluster.transfer.base import Begin, End, Part, TransferConfig
from cluster.transfer.link import Link, LinkClock
from cluster.transfer.wire import Expect, handoff_for
from cluster.transfer.zmq_transport import ZmqTransport
from experiments.sim.transfer import Links, TransferModel
from workers.config import PRESETS, EngineConfig
from workers.emulated import emulated_token
from workers.engine import Engine
from workers.request import InvalidRequest, SamplingParams

LLAMA = PRESETS["llama-3-8b"]


class Price:
    """2 ms a step and 10 us a token: a price a test can check by hand."""

    name = "test price"

    def __init__(self):
        self.seen = []

    def price(self, sched):
        self.seen.append(sched.num_tokens)
        return 2e-3 + 1e-5 * sched.num_tokens


def engine(role="colocated", blocks=4000, price=None, **kw):
    cfg = EngineConfig(num_kv_blocks=blocks, token_budget=512, max_model_len=8192, role=role, timing="emulated", **kw)
    return Engine.emulated(LLAMA, cfg, price or Price())


def test_each_step_waits_for_its_price_and_records_it():
    e = engine()
    e.add_request("a", list(range(700)), SamplingParams(max_tokens=4, ignore_eos=True))
    e.run()
    assert [s.num_tokens for s in e.trace] == [512, 188, 1, 1, 1]   # the real scheduler's steps
    for s in e.trace:
        assert s.price_s == pytest.approx(2e-3 + 1e-5 * s.num_tokens)
        assert s.end - s.start == pytest.approx(s.price_s, abs=1e-6)   # it ends when its price says
        assert s.forward_s >= s.price_s                             # and the host woke no sooner
    assert e.memory()["kv_pool_bytes"] == 0 and e.cache.nbytes == 0


def test_requests_run_to_max_tokens_on_ids_that_are_never_their_stop_ids():
    e = engine()
    req = e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    stops = set()
    for _ in range(3):
        stops.add(emulated_token(req, LLAMA.vocab_size))
        req.token_ids.append(0)
    e2 = engine()
    r = e2.add_request("b", [1, 2, 3], SamplingParams(max_tokens=6, stop_token_ids=sorted(stops)))
    events = e2.run()
    assert [ev.finish_reason for ev in events][-1] == "length" and len(r.output_ids) == 6
    assert not set(r.output_ids) & stops


def test_the_pool_counts_blocks_and_its_kv_is_shape_alone():
    e = engine(role="prefill", blocks=100)
    e.add_request("a", list(range(40)), SamplingParams(max_tokens=8, ignore_eos=True))
    e.run()
    assert e.blocks.num_used == 3                   # 40 tokens + the first in blocks of 16, kept for the handoff
    kv = e.export_kv("a")
    assert kv.device.type == "meta" and tuple(kv.shape) == (32, 2, 40, 8, 128) and kv.dtype == torch.bfloat16
    d = engine(role="decode", blocks=100)
    d.begin_import("a", list(range(40)), SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(InvalidRequest, match="does not fit"):
        d.import_kv("a", 0, torch.empty((32, 2, 41, 8, 128), dtype=torch.bfloat16, device="meta"))
    d.import_kv("a", 0, kv)
    d.finish_import("a", 7)
    d.run()
    assert d.requests == {} and d.blocks.num_used == 0


def test_a_pool_too_small_for_a_request_refuses_it_as_the_real_engine_does():
    e = engine(blocks=4)
    with pytest.raises(InvalidRequest, match="needs 5 KV blocks but this engine's pool has 4"):
        e.add_request("a", list(range(60)), SamplingParams(max_tokens=8))


def test_an_emulated_engine_needs_its_pool_size():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Engine.emulated(LLAMA, EngineConfig(timing="emulated"), Price())


def test_link_clock_egress_first_come_first_served():
    t = [10.0]
    c = LinkClock(clock=lambda: t[0])
    assert c.egress(2.0) == 12.0           # free: leaves after its own time
    assert c.egress(1.0) == 13.0           # behind the first
    t[0] = 20.0
    assert c.egress(1.0) == 21.0           # the egress freed meanwhile


def test_link_clock_ingress_waits_only_when_busy():
    c = LinkClock(clock=lambda: 0.0)
    assert c.ingress(5.0, 2.0) == 5.0      # its time was paid leaving the sender
    assert c.ingress(5.5, 2.0) == 7.0      # read while the first held the ingress: waits it out, then its own
    assert c.ingress(30.0, 2.0) == 30.0


def test_simulated_links_follow_the_same_rule():
    """Two prefill workers send to one decode worker at once, and the first sender again right after:
    the second transfer waits at the receiver, the third leaves as soon as the first sender's egress is free."""
    m = TransferModel(0.0, 1.0)           # a byte a second
    links = Links()
    assert links.send(0, 9, 2, m, ready=0.0) == (0.0, 2.0)
    assert links.send(1, 9, 2, m, ready=0.0) == (2.0, 4.0)       # the ingress was busy until 2
    assert links.send(1, 8, 1, m, ready=0.0) == (2.0, 3.0)       # sender 1's egress freed at 2, not at 4


def _declared_pair(link):
    cfg = TransferConfig(backend="zmq", timeout_s=5.0)
    rx = ZmqTransport(cfg, "127.0.0.1", link=link)
    got, problems, arrived = [], [], []
    eng = engine(role="decode")

    def deliver(d):
        got.append(d)
        arrived.append(time.time())
    rx.start_receiving(Expect.for_engine(eng), deliver, problems.append)
    tx = ZmqTransport(cfg, "127.0.0.1", peers={1: rx.address}, link=link)
    return rx, tx, got, arrived, problems


def test_declared_kv_crosses_the_wire_in_its_link_time_with_no_bytes():
    link = Link(0.01, 1e9, "test link")          # 10 ms, then 1 GB/s
    rx, tx, got, arrived, problems = _declared_pair(link)
    try:
        p = engine(role="prefill")
        req = p.add_request("r1", list(range(100)), SamplingParams(max_tokens=4, ignore_eos=True))
        p.run()
        kv = p.export_kv("r1")
        nbytes = kv.numel() * kv.element_size()              # 100 tokens x 128 KiB, declared
        ch = tx.channel(1)
        t0 = time.time()
        ch.begin(handoff_for(req, LLAMA, torch.bfloat16))
        ch.part("r1", 0, 0, kv)
        ch.end("r1", 5, t0)
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not problems
        begin, part, end = got
        assert isinstance(begin, Begin) and isinstance(part, Part) and isinstance(end, End)
        assert part.kv.device.type == "meta" and tuple(part.kv.shape) == tuple(kv.shape)
        assert end.nbytes == nbytes == 100 * 131072
        assert arrived[1] - t0 >= link.seconds(nbytes)       # not before the link has carried its bytes
        assert rx.pending_bytes == 0                         # and none of them held
    finally:
        tx.close() if hasattr(tx, "close") else None
        rx.close()


def test_a_part_carrying_bytes_on_an_emulated_link_is_refused():
    import zmq

    from cluster.transfer.wire import PartMeta

    link = Link(0.0, 1e12)
    rx, tx, got, arrived, problems = _declared_pair(link)
    try:
        p = engine(role="prefill")
        req = p.add_request("r2", list(range(10)), SamplingParams(max_tokens=4, ignore_eos=True))
        p.run()
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(rx.address)
        sock.send_multipart([b"B", handoff_for(req, LLAMA, torch.bfloat16).encode()])
        sock.send_multipart([b"P", PartMeta("r2", 0, 32, 0, 10).encode(), b"x" * 64])
        deadline = time.monotonic() + 5
        while not problems and time.monotonic() < deadline:
            time.sleep(0.01)
        assert problems and "declare their bytes" in problems[0].reason and problems[0].request_id == "r2"
        sock.close(linger=0)
    finally:
        rx.close()


# -- an emulated cluster on the embedded Ray ---------------------------------------------------------
def _served(tmp_path, *overrides):
    """One repeat of one emulated point, served into tmp_path (the points of run.run_points)."""
    from hydra import compose, initialize_config_dir

    from experiments.serving.serve import prepare, serve_repeat
    from experiments.sim.emulated import prepare_emulation
    from tests.conftest import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["model=llama-3-8b", "hardware=h200", "hardware.costs=roofline",
                                           "engine.timing=emulated", "repeats=1", "report=false", *overrides])
    (p,) = prepare_emulation(prepare(cfg, tmp_path, ""))
    out = tmp_path / "rep0"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(p.repeat_config)
    return p, serve_repeat(p, 0, out), out


@pytest.mark.slow
def test_an_emulated_cluster_serves_llama_8b_at_h200_time_on_fake_gpus(ray_session, tmp_path):
    import json

    from experiments.serving.aggregate import read_jsonl
    from experiments.sim.backend import num_blocks

    p, metrics, out = _served(tmp_path, "cluster.gpus=4", "layout=2p2d", "workload.num_requests=12",
                              "workload.rate=20")
    rows, steps = read_jsonl(out / "requests.jsonl"), read_jsonl(out / "steps.jsonl")
    assert [r["status"] for r in rows] == ["ok"] * 12
    assert all(r["output_len"] == r["max_tokens"] for r in rows)            # to max_tokens, as simulated
    emu = metrics["emulated"]
    assert emu["num_kv_blocks"]["decode"] == num_blocks(p.spec, "decode", 2) > 40_000   # 141 GB less the weights
    assert metrics["point"]["device"] == "emulated h200"
    for s in steps:
        assert s["end_s"] - s["start_s"] == pytest.approx(s["price_s"], abs=1e-6)
        assert s["forward_s"] >= s["price_s"]
    link = emu["link"]
    for r in rows:
        assert r["transfer_bytes"] == r["prompt_len"] * 131072             # declared: 128 KiB a token
        assert r["exposed_transfer_s"] >= link["latency_s"] + r["transfer_bytes"] / link["bandwidth"]
    peaks = json.loads((out / "metrics.json").read_text())["emulated"]["worker_peak_rss_bytes"]
    assert len(peaks) == 4 and all(0 < b < 0.5e9 for b in peaks.values()), peaks   # no model, no KV bytes
