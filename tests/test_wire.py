"""The handoff wire: malformed messages are rejected with a reason; valid ones survive a bad neighbour."""
import threading
import time

import msgpack
import pytest
import torch
import zmq

from cluster.transfer.base import TransferConfig, layer_chunks
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
    (raw(prompt_ids=[]), "prompt of 0 tokens"),
    (raw(prompt_ids=list(range(4097))), "prompt of 4097 tokens"),
    (raw(prompt_ids=[1, 2, 5000]), "token ids outside"),
    (raw(params={**PARAMS, "max_tokens": "3"}), "params.max_tokens"),
    (raw(params={**PARAMS, "evil": 1}), "params"),
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


@pytest.fixture
def receiver():
    cfg = TransferConfig(chunk_bytes=2 * 10240, max_frame_bytes=1 << 20)  # two layers of a 10-token prompt
    rx = ZmqTransport(cfg, "127.0.0.1")
    address = rx.bind()
    got, errors = [], []
    arrived = threading.Event()

    def deliver(a):
        got.append(a)
        arrived.set()

    rx.start_receiving(EXPECT, deliver, errors.append)
    yield cfg, address, got, errors, arrived
    rx.close()


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_zmq_rejects_malformed_messages_and_keeps_serving(receiver):
    cfg, address, got, errors, arrived = receiver
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    kv = torch.randn(4, 2, 10, 4, 32)
    per_layer = kv[0].numel() * 4
    bad = [
        [b"X", b"junk"],                                               # unknown tag
        [b"B", raw(dtype="int8")],                                     # bad header
        [b"C", msgpack.packb(["nobody", 0, 0, 1]), b"\0" * per_layer],   # chunk without a begin
        [b"C", b"\xc1", b"\0"],                                        # chunk meta not msgpack
    ]
    for frames in bad:
        sock.send_multipart(frames)
    # a begin followed by a chunk whose size differs from what the header implies
    sock.send_multipart([b"B", handoff(rid="short#1").encode()])
    sock.send_multipart([b"C", msgpack.packb(["short#1", 0, 0, 2]), b"\0" * (per_layer * 2 - 4)])
    # a chunk that skips a layer
    sock.send_multipart([b"B", handoff(rid="skip#1").encode()])
    sock.send_multipart([b"C", msgpack.packb(["skip#1", 0, 1, 2]), b"\0" * per_layer])
    assert wait_for(lambda: len(errors) >= 6), errors
    assert any("unknown message tag" in e for e in errors)
    assert any("dtype 'int8'" in e for e in errors)
    assert any("unknown request 'nobody'" in e for e in errors)
    assert any("short#1" in e and "bytes" in e for e in errors)
    assert any("skip#1" in e and "does not follow layer 0" in e for e in errors)
    assert not got
    # a well-formed transfer still arrives intact
    channel = ZmqTransport(cfg, "127.0.0.1", {1: address}).channel(1)   # open until the end, like a worker's
    seconds = channel.send(handoff(rid="good#1"), kv)
    assert arrived.wait(5)
    (a,) = got
    assert a.handoff.request_id == "good#1" and seconds > 0 and a.nbytes == kv.numel() * 4
    assert torch.equal(torch.cat([t for _, t in a.parts]), kv)
    assert [first for first, _ in a.parts] == [0, 2], "streamed as two chunks of two layers"
    sock.close(linger=0)
    channel.close()


def test_zmq_oversized_frame_is_refused(receiver):
    """libzmq drops a message over the frame limit before Python sees its bytes."""
    cfg, address, got, errors, arrived = receiver
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    sock.send_multipart([b"C", msgpack.packb(["huge#1", 0, 0, 1]), b"\0" * (3 << 20)])
    channel = ZmqTransport(cfg, "127.0.0.1", {1: address}).channel(1)
    channel.send(handoff(n=3, rid="after#1"), torch.randn(4, 2, 3, 4, 32))
    assert arrived.wait(5)
    assert [a.handoff.request_id for a in got] == ["after#1"]
    assert not any("huge" in e for e in errors)
    sock.close(linger=0)
    channel.close()


def test_bind_all_interfaces_refused():
    with pytest.raises(ValueError, match="all interfaces"):
        TransferConfig(bind_host="0.0.0.0")
