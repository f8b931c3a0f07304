"""The handoff wire: malformed messages are rejected with a reason; valid ones survive a bad neighbour."""
import threading
import time

import msgpack
import pytest
import torch
import zmq

from cluster.transfer.base import TransferConfig, TransferRefused, layer_chunks
from cluster.transfer.wire import Expect, KVHandoff, WireError, decode_header
from cluster.transfer.zmq_transport import ZmqTransport

EXPECT = Expect(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float32", vocab_size=2048, max_tokens=4096,
                max_frame_bytes=1 << 20)
PARAMS = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop_token_ids": [], "ignore_eos": True}


def handoff(n=10, rid="r#1", **over) -> KVHandoff:
    fields = dict(request_id=rid, prompt_ids=list(range(n)), first_token=7, first_token_time=1.5, params=PARAMS,
                  dtype="float32", shape=(4, 2, n, 4, 32))
    fields.update(over)
    return KVHandoff(**fields)


def raw(**over) -> bytes:
    d = msgpack.unpackb(handoff().encode())
    d.update(over)
    return msgpack.packb(d)


def test_valid_header_roundtrips():
    h = decode_header(handoff().encode(), EXPECT)
    assert h == handoff() and h.nbytes == 4 * 2 * 10 * 4 * 32 * 4
    assert h.sampling.max_tokens == 3 and h.sampling.ignore_eos


@pytest.mark.parametrize("data,message", [
    (b"\xc1\xff\x00", "not valid msgpack"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (raw(extra=1), "fields"),
    (raw(request_id=5), "'request_id' has type int"),
    (raw(first_token="7"), "'first_token' has type str"),
    (raw(first_token=True), "'first_token' has type bool"),
    (raw(dtype="int64"), "dtype 'int64'"),
    (raw(dtype="bfloat16"), "dtype 'bfloat16'; this engine holds 'float32'"),
    (raw(shape=[4, 2, 11, 4, 32]), r"shape \[4, 2, 11, 4, 32\]; expected \[4, 2, 10, 4, 32\]"),
    (raw(shape=[5, 2, 10, 4, 32]), "shape"),
    (raw(prompt_ids=[]), "empty prompt"),
    (raw(prompt_ids=list(range(4097))), "prompt of 4097 tokens"),
    (raw(prompt_ids=[1, 2, 5000]), r"prompt_ids\[2\]=5000 is not a token id in \[0, 2048\)"),
    (raw(first_token=2048), r"first_token=2048 is not a token id"),
    # the sampling parameters are held to the router's rules (workers/request.py), field by field
    (raw(params={**PARAMS, "max_tokens": "3"}), "max_tokens='3'"),
    (raw(params={**PARAMS, "evil": 1}), r"unknown sampling field\(s\) \['evil'\]"),
    (raw(params={**PARAMS, "temperature": 1e-40}), "temperature=1e-40"),
    (raw(params={**PARAMS, "seed": -5}), "seed=-5"),
    (raw(params={**PARAMS, "stop_token_ids": [[1]]}), r"stop_token_ids\[0\]=\[1\]"),
    (raw(params={**PARAMS, "stop_token_ids": [9999]}), r"stop_token_ids\[0\]=9999"),
    (raw(params={**PARAMS, "max_tokens": 4090}), r"prompt \(10\) \+ max_tokens \(4090\) exceeds"),
    (b"\x00" * (2 << 20), "exceeds"),
])
def test_malformed_headers_rejected(data, message):
    with pytest.raises(WireError, match=message):
        decode_header(data, EXPECT)


def test_layer_chunks_cover_all_layers():
    kv = torch.zeros(7, 2, 5, 4, 32)
    per_layer = kv[0].numel() * 4
    assert layer_chunks(kv, per_layer * 3) == [(0, 3), (3, 6), (6, 7)]
    assert layer_chunks(kv, 1) == [(l, l + 1) for l in range(7)], "a layer larger than a chunk goes alone"


class Receiver:
    """A live ZmqTransport receiving on loopback, with what it delivered and reported."""

    def __init__(self, **cfg):
        cfg = {"chunk_bytes": 2 * 10240, "max_frame_bytes": 1 << 20, **cfg}   # chunks: two layers of 10 tokens
        self.cfg = TransferConfig(**cfg)
        self.rx = ZmqTransport(self.cfg, "127.0.0.1")
        self.address = self.rx.bind()
        self.got, self.problems = [], []
        self.arrived = threading.Event()
        self.rx.start_receiving(EXPECT, self._deliver, self.problems.append)
        self.push = zmq.Context.instance().socket(zmq.PUSH)     # the attacker's raw socket
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(self.address)
        self.channel = ZmqTransport(self.cfg, "127.0.0.1", {1: self.address}).channel(1)  # a worker's sender

    def _deliver(self, a):
        self.got.append(a)
        self.arrived.set()

    def reasons(self, rid=None):
        return [p.reason for p in self.problems if rid is None or p.request_id == rid]

    def send_good(self, rid="good#1", n=10):
        """A well-formed transfer through a real channel: it must arrive intact."""
        kv = torch.randn(4, 2, n, 4, 32)
        self.arrived.clear()
        self.channel.send(handoff(n=n, rid=rid), kv)
        assert self.arrived.wait(10), self.problems
        a = self.got[-1]
        assert a.handoff.request_id == rid and torch.equal(torch.cat([t for _, t in a.parts]), kv)
        a.release()
        return a

    def close(self):
        self.push.close(linger=0)
        self.channel.close()
        self.rx.close()


@pytest.fixture
def receiver():
    made = []

    def make(**cfg):
        made.append(Receiver(**cfg))
        return made[-1]
    yield make
    for r in made:
        r.close()


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


PER_LAYER = 10 * 2 * 4 * 32 * 4          # one layer of a 10-token prompt


def test_zmq_rejects_malformed_messages_and_keeps_serving(receiver):
    r = receiver()
    bad = [
        [b"X", b"junk"],                                               # unknown tag
        [b"B", raw(dtype="int8")],                                     # bad header
        [b"C", msgpack.packb(["nobody", 0, 0, 1]), b"\0" * PER_LAYER],  # chunk without a begin
        [b"C", b"\xc1", b"\0"],                                        # chunk meta not msgpack
        [b"C", msgpack.packb({"a": 1}), b"\0"],                        # chunk meta not a list
    ]
    for frames in bad:
        r.push.send_multipart(frames)
    # a begin followed by a chunk whose size differs from what the header implies
    r.push.send_multipart([b"B", handoff(rid="short#1").encode()])
    r.push.send_multipart([b"C", msgpack.packb(["short#1", 0, 0, 2]), b"\0" * (PER_LAYER * 2 - 4)])
    # a chunk that skips a layer
    r.push.send_multipart([b"B", handoff(rid="skip#1").encode()])
    r.push.send_multipart([b"C", msgpack.packb(["skip#1", 0, 1, 2]), b"\0" * PER_LAYER])
    # the chunk that used to kill the receive thread silently: float layer indices
    r.push.send_multipart([b"B", handoff(rid="float#1").encode()])
    r.push.send_multipart([b"C", msgpack.packb(["float#1", 0, 0.0, 2.0]), b"\0" * PER_LAYER * 2])
    # a header with a poisoned sampling parameter (the router's rules hold on the wire)
    r.push.send_multipart([b"B", raw(params={**PARAMS, "temperature": 1e-40}, request_id="cold#1")])
    assert wait_for(lambda: len(r.problems) >= 9), r.problems
    assert any("unknown message tag" in e for e in r.reasons())
    assert any("dtype 'int8'" in e for e in r.reasons())
    assert any("unknown request 'nobody'" in e for e in r.reasons(None))
    assert any("is not [request_id, index, first_layer, end_layer]" in e for e in r.reasons())
    assert any("bytes" in e for e in r.reasons("short#1"))
    assert any("does not follow layer 0" in e for e in r.reasons("skip#1"))
    assert any("are not integers" in e for e in r.reasons("float#1")), "reported against its request"
    assert any("temperature=1e-40" in e for e in r.reasons("cold#1"))
    assert len(r.reasons("float#1")) == 1
    # later chunks of a transfer already reported are dropped without a report each
    n = len(r.problems)
    r.push.send_multipart([b"C", msgpack.packb(["float#1", 1, 2, 4]), b"\0" * PER_LAYER * 2])
    r.push.send_multipart([b"C", msgpack.packb(["cold#1", 0, 0, 2]), b"\0" * PER_LAYER * 2])
    assert not any(p.fatal for p in r.problems) and not r.got
    assert r.rx.pending_bytes == 0, "every rejected transfer's buffer was given back"
    # the thread is alive: a well-formed transfer still arrives intact, streamed as two chunks of two layers
    a = r.send_good()
    assert [first for first, _ in a.parts] == [0, 2]
    assert len(r.problems) == n


def test_zmq_limits_are_per_frame_not_per_request(receiver):
    r = receiver(max_frame_bytes=2 * PER_LAYER, chunk_bytes=8 << 20)
    # 4 layers of 10 tokens is twice the frame limit: it goes in frames of at most two layers, intact
    a = r.send_good("big#1")
    assert a.nbytes == 4 * PER_LAYER and [first for first, _ in a.parts] == [0, 2]
    # one layer of 30 tokens is over a frame: refused by the sender at once, nothing sent
    with pytest.raises(TransferRefused, match="one layer of this KV is 30720 bytes, more than transfer.max_frame_bytes"):
        r.channel.send(handoff(n=30, rid="huge#1"), torch.randn(4, 2, 30, 4, 32))
    # a raw frame over the limit is dropped by libzmq; the transfer it belonged to is dropped on time
    r.push.send_multipart([b"B", handoff(rid="rogue#1").encode()])
    r.push.send_multipart([b"C", msgpack.packb(["rogue#1", 0, 0, 4]), b"\0" * (3 << 20)])
    r.send_good("after#1")
    assert not r.reasons("huge#1") and not any(p.fatal for p in r.problems)
    assert [a.handoff.request_id for a in r.got] == ["big#1", "after#1"]


def test_zmq_flood_of_unfinished_transfers_is_bounded_and_dropped_on_time(receiver):
    """Begun-never-finished transfers from a sender that keeps the socket busy: receive memory stays
    under the bound, begins past it are refused against their requests, the stale ones are dropped on
    time although poll never idles, and a good transfer still arrives."""
    r = receiver(timeout_s=0.5, max_pending=4, max_pending_bytes=6 * 4 * PER_LAYER)
    stop = threading.Event()
    peak = [0]

    def flood():
        junk = zmq.Context.instance().socket(zmq.PUSH)
        junk.connect(r.address)
        i = 0
        while not stop.is_set():
            junk.send_multipart([b"B", handoff(rid=f"flood#{i}").encode()])
            junk.send_multipart([b"X", b"keep the socket busy"])
            peak[0] = max(peak[0], r.rx.pending_bytes)
            i += 1
            time.sleep(0.002)
        junk.close(linger=0)

    t = threading.Thread(target=flood)
    t.start()
    try:
        assert wait_for(lambda: any("incomplete after 0.5 s" in e for e in r.reasons())), r.reasons()[-3:]
        # a real transfer in the middle of the flood is delivered, or refused against its own request:
        # never silently lost
        r.channel.send(handoff(rid="during#1"), torch.randn(4, 2, 10, 4, 32))
        assert wait_for(lambda: r.reasons("during#1") or any(a.handoff.request_id == "during#1" for a in r.got))
    finally:
        stop.set()
        t.join()
    assert 0 < peak[0] <= r.cfg.max_pending_bytes, "receive memory stays under transfer.max_pending_bytes"
    refused = [p for p in r.problems if "refused" in p.reason and p.request_id != "during#1"]
    assert refused and all(p.request_id.startswith("flood#") for p in refused), "refusals name their requests"
    dropped = [p for p in r.problems if "incomplete after" in p.reason]
    assert all(p.request_id.startswith("flood#") for p in dropped)
    for a in r.got:
        a.release()
    assert wait_for(lambda: r.rx.pending_bytes == 0, 5), "the stale ones are all dropped once the flood ends"
    r.send_good("good#1")
    assert not any(p.fatal for p in r.problems)


def test_zmq_receiver_that_cannot_continue_says_so(receiver):
    r = receiver()
    r.rx._pull.close(linger=0)          # the socket fails under the thread
    assert wait_for(lambda: any(p.fatal for p in r.problems)), r.problems
    (p,) = r.problems
    assert "receiver stopped" in p.reason and p.request_id is None


def test_bind_all_interfaces_refused():
    with pytest.raises(ValueError, match="all interfaces"):
        TransferConfig(bind_host="0.0.0.0")


def test_torch_distributed_wire_refuses_bad_frames_and_keeps_serving():
    """Two real processes over gloo: a peer breaking the rules is refused message by message (each
    refusal reaching the sender, the stream kept in step), a KV larger than a frame arrives in frames,
    and only a broken protocol stops the receiver, as a fatal problem."""
    import json
    import subprocess
    import sys

    import torch.distributed as dist

    from cluster.transfer.nccl_transport import bound_listener
    from tests.conftest import ROOT

    listener = bound_listener("127.0.0.1")
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach())
    peers = [subprocess.Popen([sys.executable, "-m", "tests.gloo_peer", str(rank), str(port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in peers]
    finally:
        for p in peers:
            p.kill()
        del store
    for p, (out, err) in zip(peers, outs):
        assert p.returncode == 0, err[-2000:]
    sender, recv = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert "header is not valid msgpack" in sender["garbage"]
    assert "temperature=1e-40" in sender["poison"]
    assert "frames of 40960 bytes exceed the frame limit 20480" in sender["frame"]
    sent = sender["sent"]
    assert sent["multi#1"] == "sent" and sent["after#1"] == "sent"
    assert sent["huge#1"].startswith("refused: one layer of this KV is 30720 bytes")
    assert "refused by the receiver" in sent["over#1"] and "transfer.max_pending_bytes=61440" in sent["over#1"]
    assert recv["got"] == [{"rid": "multi#1", "intact": True, "nbytes": 40960},
                           {"rid": "after#1", "intact": True, "nbytes": 12288}]
    fatal = [p for p in recv["problems"] if p["fatal"]]
    assert len(fatal) == 1 and "stream untrusted, receiver stopped" in fatal[0]["reason"]
    assert len(recv["problems"]) == 5, recv["problems"]      # four refusals, one fatal
    assert recv["pending_bytes"] == 0 and not recv["threads_alive"]
