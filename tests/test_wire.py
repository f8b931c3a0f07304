"""The handoff wire: malformed messages are rejected with a reason; valid ones survive a bad neighbour."""
import threading
import time

import msgpack
import pytest
import torch
import zmq

from cluster.transfer.base import Begin, Cancel, End, Part, TransferConfig, frames, send
from cluster.transfer.wire import (EndMeta, Expect, KVHandoff, PartMeta, WireError, decode_cancel, decode_end,
                                   decode_header, decode_part)
from cluster.transfer.zmq_transport import ZmqTransport

EXPECT = Expect(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float32", vocab_size=2048, max_tokens=4096,
                max_frame_bytes=1 << 20)
PARAMS = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop_token_ids": [], "ignore_eos": True}


def handoff(n=10, rid="r#1", **over) -> KVHandoff:
    fields = dict(request_id=rid, prompt_ids=list(range(n)), params=PARAMS, dtype="float32", shape=(4, 2, n, 4, 32))
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
    (raw(request_id=5), "request_id=5 is not a string"),
    (raw(shape="4"), "shape='4' is not a list"),
    (raw(dtype="int64"), "dtype 'int64'"),
    (raw(dtype="bfloat16"), "dtype 'bfloat16'; this engine holds 'float32'"),
    (raw(shape=[4, 2, 11, 4, 32]), r"shape \[4, 2, 11, 4, 32\]; expected \[4, 2, 10, 4, 32\]"),
    (raw(shape=[5, 2, 10, 4, 32]), "shape"),
    (raw(prompt_ids=[]), "empty prompt"),
    (raw(prompt_ids=list(range(4097))), "prompt of 4097 tokens"),
    (raw(prompt_ids=[1, 2, 5000]), r"prompt_ids\[2\]=5000 is not a token id in \[0, 2048\)"),
    # the sampling parameters are held to the router's rules (workers/request.py), field by field
    (raw(params={**PARAMS, "max_tokens": "3"}), "max_tokens='3'"),
    (raw(params={**PARAMS, "evil": 1}), r"unknown sampling field\(s\) \['evil'\]"),
    (raw(params={**PARAMS, "temperature": 1e-40}), "temperature=1e-40"),
    (raw(params={**PARAMS, "seed": -5}), "seed=-5"),
    (raw(params={**PARAMS, "stop_token_ids": [[1]]}), r"stop_token_ids\[0\]=<a list of 1> is not an integer"),
    (raw(params={**PARAMS, "stop_token_ids": [9999]}), r"stop_token_ids\[0\]=9999"),
    (raw(params={**PARAMS, "max_tokens": 4090}), r"prompt \(10\) \+ max_tokens \(4090\) exceeds"),
    (b"\x00" * (2 << 20), "exceeds"),
])
def test_malformed_headers_rejected(data, message):
    with pytest.raises(WireError, match=message):
        decode_header(data, EXPECT)


@pytest.mark.parametrize("decode,data,message", [
    (decode_part, b"\xc1", "part header is not valid msgpack"),
    (decode_part, msgpack.packb({"a": 1}), r"is not \[request_id, first_layer, end_layer, start, end\]"),
    (decode_part, msgpack.packb(["r#1", 0.0, 2.0, 0, 10]), r"first_layer=0.0 is not an integer"),
    (decode_part, msgpack.packb(["r#1", True, 2, 0, 10]), r"first_layer=True is not an integer"),
    (lambda d: decode_end(d, EXPECT), msgpack.packb(["r#1", 2048, 1.0]), r"first_token=2048 is not a token id"),
    (lambda d: decode_end(d, EXPECT), msgpack.packb(["r#1", "7", 1.0]), r"first_token='7' is not an integer"),
    (decode_cancel, msgpack.packb(["r#1"]), r"is not \[request_id, reason\]"),
])
def test_malformed_part_end_and_cancel_rejected_naming_their_request(decode, data, message):
    with pytest.raises(WireError, match=message) as e:
        decode(data)
    if data.startswith(b"\x95") or data.startswith(b"\x93"):
        assert e.value.request_id == "r#1", "reported against its request"


def test_a_part_outside_its_transfer_is_refused():
    with pytest.raises(WireError, match=r"part layers \[3, 5\) tokens \[0, 10\) outside the 4 layers x 10 tokens"):
        PartMeta("r#1", 3, 5, 0, 10).check(handoff())
    with pytest.raises(WireError, match="outside"):
        PartMeta("r#1", 0, 1, 8, 12).check(handoff())


def test_frames_split_whole_layers_then_tokens():
    kv = torch.randn(4, 2, 10, 4, 32)
    layer = PER_LAYER
    assert [(l0, t0, f.shape[0], f.shape[2]) for l0, t0, f in frames(kv, 0, 0, 3 * layer)] == \
        [(0, 0, 3, 10), (3, 0, 1, 10)]
    small = frames(kv, 2, 5, layer // 2)          # a layer is two frames: runs of 5 tokens of one layer
    assert [(l0, t0, f.shape[2]) for l0, t0, f in small] == [(2 + l, 5 + t, 5) for l in range(4) for t in (0, 5)]
    assert torch.equal(torch.cat([f for _, _, f in small[:2]], dim=2), kv[:1])


class Receiver:
    """A live ZmqTransport receiving on loopback, with what it delivered and reported."""

    def __init__(self, **cfg):
        cfg = {"chunk_bytes": 2 * 10240, "max_frame_bytes": 1 << 20, **cfg}   # frames: two layers of 10 tokens
        self.cfg = TransferConfig(**cfg)
        self.rx = ZmqTransport(self.cfg, "127.0.0.1")
        self.address = self.rx.bind()
        self.got, self.problems = [], []
        self.ended = threading.Event()
        self.rx.start_receiving(EXPECT, self._deliver, self.problems.append)
        self.push = zmq.Context.instance().socket(zmq.PUSH)     # the attacker's raw socket
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(self.address)
        self.channel = ZmqTransport(self.cfg, "127.0.0.1", {1: self.address}).channel(1)  # a worker's sender

    def _deliver(self, d):
        self.got.append(d)
        if isinstance(d, (End, Cancel)):
            self.ended.set()

    def of(self, rid):
        return [d for d in self.got if (d.handoff.request_id if isinstance(d, Begin) else d.request_id) == rid]

    def reasons(self, rid=None):
        return [p.reason for p in self.problems if rid is None or p.request_id == rid]

    def send_good(self, rid="good#1", n=10):
        """A well-formed transfer through a real channel: it must arrive intact, parts then end."""
        kv = torch.randn(4, 2, n, 4, 32)
        self.ended.clear()
        send(self.channel, handoff(n=n, rid=rid), kv, first_token=7, first_token_time=1.5)
        assert self.ended.wait(10), self.problems
        got = self.of(rid)
        assert isinstance(got[0], Begin) and isinstance(got[-1], End) and got[-1].first_token == 7
        parts = [d for d in got if isinstance(d, Part)]
        back = torch.empty_like(kv)
        for part in parts:
            back[part.first_layer:part.first_layer + part.kv.shape[0], :, part.start:part.start + part.kv.shape[2]] = part.kv
            part.release()
        assert torch.equal(back, kv) and got[-1].nbytes == kv.numel() * 4
        return parts

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


def part(rid, l0, l1, t0=0, t1=10, nbytes=None):
    """A raw part message: its header and a payload of `nbytes` (default: what the header says)."""
    size = (l1 - l0) * (t1 - t0) * PER_LAYER // 10 if nbytes is None else nbytes
    return [b"P", PartMeta(rid, l0, l1, t0, t1).encode(), b"\0" * size]


def test_zmq_rejects_malformed_messages_and_keeps_serving(receiver):
    r = receiver()
    bad = [
        [b"Q", b"junk"],                                               # unknown tag
        [b"B", raw(dtype="int8")],                                     # bad header
        part("nobody", 0, 1),                                          # part without a begin
        [b"P", b"\xc1", b"\0"],                                        # part meta not msgpack
        [b"P", msgpack.packb({"a": 1}), b"\0"],                        # part meta not a list
        [b"E", EndMeta("ghost", 7, 0.0).encode()],                     # end without a begin
    ]
    for frames_ in bad:
        r.push.send_multipart(frames_)
    # a begin followed by a part whose size differs from what its header says
    r.push.send_multipart([b"B", handoff(rid="short#1").encode()])
    r.push.send_multipart(part("short#1", 0, 2, nbytes=PER_LAYER * 2 - 4))
    # a part outside its transfer
    r.push.send_multipart([b"B", handoff(rid="wide#1").encode()])
    r.push.send_multipart(part("wide#1", 3, 5))
    # the part that used to kill the receive thread silently: float layer indices
    r.push.send_multipart([b"B", handoff(rid="float#1").encode()])
    r.push.send_multipart([b"P", msgpack.packb(["float#1", 0.0, 2.0, 0, 10]), b"\0" * PER_LAYER * 2])
    # an end before its parts are all in
    r.push.send_multipart([b"B", handoff(rid="early#1").encode()])
    r.push.send_multipart(part("early#1", 0, 2))
    r.push.send_multipart([b"E", EndMeta("early#1", 7, 0.0).encode()])
    # a header with a poisoned sampling parameter (the router's rules hold on the wire)
    r.push.send_multipart([b"B", raw(params={**PARAMS, "temperature": 1e-40}, request_id="cold#1")])
    assert wait_for(lambda: len(r.problems) >= 11), r.problems
    assert any("unknown message tag" in e for e in r.reasons())
    assert any("dtype 'int8'" in e for e in r.reasons())
    assert any("part for a request with no transfer under way" in e for e in r.reasons("nobody"))
    assert any("is not [request_id, first_layer, end_layer, start, end]" in e for e in r.reasons())
    assert any("end for a request with no transfer under way" in e for e in r.reasons("ghost"))
    assert any("bytes" in e for e in r.reasons("short#1"))
    assert any("outside the 4 layers x 10 tokens" in e for e in r.reasons("wide#1"))
    assert any("first_layer=0.0 is not an integer" in e for e in r.reasons("float#1")), "reported against its request"
    assert any("end after 20480 of 40960 bytes" in e for e in r.reasons("early#1"))
    assert any("temperature=1e-40" in e for e in r.reasons("cold#1"))
    assert len(r.reasons("float#1")) == 1
    # later messages of a transfer already reported are dropped without a report each
    n = len(r.problems)
    r.push.send_multipart(part("float#1", 2, 4))
    r.push.send_multipart([b"E", EndMeta("float#1", 7, 0.0).encode()])
    r.push.send_multipart(part("cold#1", 0, 2))
    assert not any(p.fatal for p in r.problems) and not any(isinstance(d, End) for d in r.got)
    for d in r.got:
        if isinstance(d, Part):
            d.release()
    assert r.rx.pending_bytes == 0, "every rejected transfer's buffers were given back"
    # the thread is alive: a well-formed transfer still arrives intact, in frames of two layers
    parts = r.send_good()
    assert [p.first_layer for p in parts] == [0, 2]
    assert len(r.problems) == n


def test_zmq_limits_are_per_frame_not_per_request(receiver):
    r = receiver(max_frame_bytes=2 * PER_LAYER, chunk_bytes=8 << 20)
    # 4 layers of 10 tokens is twice the frame limit: it goes in frames of at most two layers, intact
    parts = r.send_good("big#1")
    assert [p.first_layer for p in parts] == [0, 2]
    # one layer of 30 tokens is over a frame: it goes in runs of tokens of one layer, intact
    parts = r.send_good("huge#1", n=30)
    assert {p.kv.shape[0] for p in parts} == {1} and max(p.kv.numel() * 4 for p in parts) <= 2 * PER_LAYER
    # a raw frame over the limit is dropped by libzmq; the transfer it belonged to is dropped on time
    r.push.send_multipart([b"B", handoff(rid="rogue#1").encode()])
    r.push.send_multipart(part("rogue#1", 0, 4, nbytes=3 << 20))
    r.send_good("after#1")
    assert not any(p.fatal for p in r.problems)
    assert [d.request_id for d in r.got if isinstance(d, End)] == ["big#1", "huge#1", "after#1"]


def test_zmq_transfers_interleave_and_a_cancel_ends_one(receiver):
    """Two transfers' parts interleaved in any order across layers and tokens, one cancelled midway:
    the other arrives whole, the cancelled one ends with a Cancel and frees what it held."""
    r = receiver()
    a, b = torch.randn(4, 2, 10, 4, 32), torch.randn(4, 2, 10, 4, 32)
    r.channel.begin(handoff(rid="a#1"))
    r.channel.begin(handoff(rid="b#1"))
    for layer in (3, 0, 2, 1):
        r.channel.part("a#1", layer, 5, a[layer:layer + 1, :, 5:])
        r.channel.part("b#1", layer, 0, b[layer:layer + 1])
        r.channel.part("a#1", layer, 0, a[layer:layer + 1, :, :5])
    r.channel.cancel("b#1", "preempted")
    r.channel.end("a#1", 9, 2.0)
    assert wait_for(lambda: any(isinstance(d, End) for d in r.got)), r.problems
    got = {rid: r.of(rid) for rid in ("a#1", "b#1")}
    assert isinstance(got["b#1"][-1], Cancel) and got["b#1"][-1].reason == "preempted"
    back = torch.empty_like(a)
    for d in got["a#1"]:
        if isinstance(d, Part):
            back[d.first_layer, :, d.start:d.start + d.kv.shape[2]] = d.kv[0]
    assert torch.equal(back, a) and got["a#1"][-1].first_token == 9
    for d in r.got:
        if isinstance(d, Part):
            d.release()
    assert r.rx.pending_bytes == 0 and not r.problems


def test_zmq_flood_of_unfinished_transfers_is_bounded_and_dropped_on_time(receiver):
    """Begun-never-finished transfers from a sender that keeps the socket busy: receive memory stays
    under the bound, begins past it are refused against their requests, the silent ones are dropped
    on time although poll never idles, and a good transfer still arrives."""
    r = receiver(timeout_s=0.5, max_pending=4, max_pending_bytes=6 * 4 * PER_LAYER)
    stop = threading.Event()
    peak = [0]

    def flood():
        junk = zmq.Context.instance().socket(zmq.PUSH)
        junk.connect(r.address)
        i = 0
        while not stop.is_set():
            junk.send_multipart([b"B", handoff(rid=f"flood#{i}").encode()])
            junk.send_multipart(part(f"flood#{i}", 0, 1))
            junk.send_multipart([b"Q", b"keep the socket busy"])
            peak[0] = max(peak[0], r.rx.pending_bytes + 4 * PER_LAYER * len(r.rx.inbound.open))
            i += 1
            time.sleep(0.002)
        junk.close(linger=0)

    def release_parts():        # a decode worker copies each part into its pool and releases it
        while not stop.is_set():
            for d in list(r.got):
                if isinstance(d, Part):
                    d.release()
            time.sleep(0.01)

    threads = [threading.Thread(target=flood), threading.Thread(target=release_parts)]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: any("silent for 0.5 s" in e for e in r.reasons())), r.reasons()[-3:]
        # a real transfer in the middle of the flood is delivered, or refused against its own request:
        # never silently lost
        try:
            send(r.channel, handoff(rid="during#1"), torch.randn(4, 2, 10, 4, 32))
        except Exception:
            pass
        assert wait_for(lambda: r.reasons("during#1") or any(isinstance(d, End) and d.request_id == "during#1"
                                                             for d in r.got))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert 0 < peak[0] <= r.cfg.max_pending_bytes + 4 * PER_LAYER, "receive memory stays near transfer.max_pending_bytes"
    refused = [p for p in r.problems if "refused" in p.reason and p.request_id != "during#1"]
    assert refused and all(p.request_id.startswith("flood#") for p in refused), "refusals name their requests"
    dropped = [p for p in r.problems if "silent for" in p.reason]
    assert all(p.request_id.startswith("flood#") for p in dropped)
    for d in r.got:
        if isinstance(d, Part):
            d.release()
    assert wait_for(lambda: r.rx.pending_bytes == 0 and not r.rx.inbound.open, 5), "the silent ones are all dropped"
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
    """Two real processes over gloo: a peer breaking the rules is refused message by message (a refused
    begin reaching the sender, a bad part reported against its request, the stream kept in step), a KV
    larger than a frame arrives in frames, and only a broken protocol stops the receiver, as a fatal
    problem."""
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
    assert sender["bent"] is None, "accepted; its bad part is refused at the receiver"
    sent = sender["sent"]
    assert sent == {"multi#1": "sent", "huge#1": "sent", "after#1": "sent", "over#1": sent["over#1"]}
    assert "refused by the receiver" in sent["over#1"] and "transfer.max_pending_bytes=102400" in sent["over#1"]
    # 40 KiB in frames of two layers; a 24-token layer (24 KiB) over the 20 KiB frame in runs of tokens
    assert recv["got"] == [{"rid": "multi#1", "intact": True, "nbytes": 40960, "frames": 2},
                           {"rid": "huge#1", "intact": True, "nbytes": 98304, "frames": 8},
                           {"rid": "after#1", "intact": True, "nbytes": 12288, "frames": 1}]
    bent = [p for p in recv["problems"] if p["rid"] == "bent#1"]
    assert len(bent) == 1 and "part of 1000 bytes; its header announces 10240" in bent[0]["reason"]
    fatal = [p for p in recv["problems"] if p["fatal"]]
    assert len(fatal) == 1 and "stream untrusted, receiver stopped" in fatal[0]["reason"]
    assert len(recv["problems"]) == 5, recv["problems"]      # three refusals, one bad part, one fatal
    assert recv["pending_bytes"] == 0 and not recv["threads_alive"]
