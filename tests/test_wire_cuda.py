"""The KV wires' CUDA paths up to the device, with a recording fake of torch.cuda in place of the
real one: side streams per thread, events instead of syncs, receive buffers fenced before import
and kept from reuse while it is queued, host staging in pinned memory off the loop thread, pair
groups with the long timeout, and no device-wide synchronize anywhere in cluster/ or workers/."""
import ast
import datetime
import threading

import pytest
import torch

from cluster import kv_in, kv_out
from cluster.transfer import nccl_transport, staging
from cluster.transfer.base import Inbound, Part, RecvBuffers, TransferConfig
from tests.conftest import ROOT
from tests.wire_harness import EXPECT, Live, begin, part, wait_for

CUDA = torch.device("cuda", 0)


class FakeCuda:
    """Records every stream, event and sync call, with the thread that made it."""

    def __init__(self):
        self.log: list[tuple] = []
        self.default = FakeStream(self, "default")
        self._current = threading.local()

    def _note(self, *what):
        self.log.append((threading.current_thread().name, *what))

    def Stream(self, device):
        s = FakeStream(self, f"side-{len([e for e in self.log if e[1] == 'new_stream'])}")
        self._note("new_stream", s.name)
        return s

    def set_stream(self, s):
        self._note("set_stream", s.name)
        self._current.stream = s

    def current_stream(self, device=None):
        return getattr(self._current, "stream", self.default)

    def Event(self):
        return FakeEvent(self)

    def synchronize(self, *a):
        raise AssertionError("device-wide synchronize")


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, e):
        self.cuda._note("wait_event", self.name, e.name)

    def synchronize(self):
        self.cuda._note("stream_sync", self.name)


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.name = cuda, f"event-{id(self) % 10_000}"

    def record(self, stream=None):
        self.stream = (stream or self.cuda.current_stream()).name
        self.cuda._note("record", self.name, self.stream)

    def synchronize(self):
        self.cuda._note("event_sync", self.name)


class FakeDeviceTensor:
    """A tensor "on the GPU": records the copies into it and the streams it is used on."""

    def __init__(self, cuda, shape, dtype, data=None):
        self.cuda, self.shape, self.dtype = cuda, tuple(shape), dtype
        self.device = CUDA
        self.data = torch.zeros(shape, dtype=dtype) if data is None else data

    def copy_(self, src, non_blocking=False):
        self.cuda._note("to_device", getattr(src, "pinned", False), non_blocking)
        self.data.copy_(src)
        return self

    def record_stream(self, s):
        self.cuda._note("record_stream", s.name)

    def numel(self):
        return self.data.numel()

    def dim(self):
        return self.data.dim()

    def clone(self):
        return self.data.clone()

    def element_size(self):
        return self.data.element_size()


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(staging, "cuda", fake)
    monkeypatch.setattr(staging, "_local", threading.local())

    def pinned(shape, dtype):
        t = torch.zeros(shape, dtype=dtype)
        t.pinned = True
        fake._note("pinned", tuple(shape))
        return t
    monkeypatch.setattr(staging, "pinned_empty", pinned)
    monkeypatch.setattr(staging, "device_empty", lambda shape, dtype, device: FakeDeviceTensor(fake, shape, dtype))
    return fake


def steps(fake, *kinds):
    return [e for e in fake.log if e[1] in kinds]


def test_each_thread_gets_one_side_stream_of_its_own(cuda):
    staging.own_stream(CUDA)
    staging.own_stream(CUDA)                    # once per thread
    t = threading.Thread(target=staging.own_stream, args=(CUDA,), name="other")
    t.start()
    t.join()
    staging.own_stream(torch.device("cpu"))     # a no-op off CUDA
    made = steps(cuda, "new_stream")
    assert len(made) == 2 and {e[0] for e in made} == {threading.current_thread().name, "other"}


def test_the_import_waits_for_the_receive_and_keeps_the_buffer_from_reuse(cuda):
    """Received on a receive thread's stream, imported on the engine's: the engine's stream waits on
    the receive's event, and the buffer is recorded on it before the receive thread lets it go."""
    def receive():
        staging.own_stream(CUDA)
        out["ready"] = staging.filled(CUDA)     # after the receive on this thread's stream
    out = {}
    t = threading.Thread(target=receive, name="kv-recv")
    t.start()
    t.join()
    kv = FakeDeviceTensor(cuda, (1, 2, 3, 4, 32), torch.float32)

    class Engine:
        def import_kv(self, rid, layer, t, start):
            cuda._note("import_kv", rid)
    released = []
    k = kv_in.KVIn(Engine(), emit=lambda e: None)
    k._import_part("r#1", Part("r#1", 0, 0, kv, lambda: released.append(cuda.log[-1][1]), out["ready"]))
    record = steps(cuda, "record")[0]
    assert record[0] == "kv-recv" and record[3].startswith("side-")
    main = [e[1:] for e in cuda.log if e[0] == threading.current_thread().name]
    assert main == [("wait_event", "default", record[2]), ("record_stream", "default"), ("import_kv", "r#1")]
    assert released == ["import_kv"], "released once the import copy is queued, not before"


def test_zmq_receiver_copies_frames_to_the_gpu_on_its_own_thread(cuda):
    """Pinned staging, a non-blocking copy on the receive thread's side stream, an event after it:
    the loop thread gets a device tensor and an event, and never copies pageable memory."""
    got = []
    live = Live(device=CUDA, deliver_hook=lambda d: got.append(d) if isinstance(d, Part) else None)
    try:
        live.send(begin("gpu#1"))
        live.send(part("gpu#1", 0, 2, fill=3))
        assert wait_for(lambda: got), live.reasons()
    finally:
        live.close()
    (p,) = got
    assert isinstance(p.kv, FakeDeviceTensor) and bool((p.kv.data == torch.frombuffer(bytearray([3] * 4), dtype=torch.float32)[0]).all())
    log = [e for e in cuda.log if e[0] == "kv-recv-zmq"]
    kinds = [e[1] for e in log]
    assert kinds[:2] == ["new_stream", "set_stream"]
    assert kinds[2:5] == ["pinned", "to_device", "record"] and log[3][2:] == (True, True), log
    assert p.ready.stream == log[0][2], "the event is on the receive thread's side stream"
    assert not steps(cuda, "stream_sync", "event_sync")


def test_sender_reads_a_part_on_its_side_stream_into_pinned_memory(cuda, monkeypatch):
    """After the compute stream's event, on the sender's own stream; waits for its copy's event,
    never the compute stream nor the device."""
    class Cache:
        def export(self, block_ids, n, layers, start):
            cuda._note("export", staging.cuda.current_stream().name)
            return FakeDeviceTensor(cuda, (layers[1] - layers[0], 2, n - start, 4, 32), torch.float32)

    class Engine:
        device = CUDA
        cache = Cache()

    class Transport:
        name = "zmq"
    out = kv_out.KVOut(Engine(), emit=None, done=None, transport=lambda: Transport())
    computed = staging.cuda.Event()
    computed.record(staging.cuda.current_stream())        # the loop thread, on the compute stream
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: cuda._note(
        "to_host", getattr(self, "pinned", False), non_blocking) or self)
    result = {}

    def sender():
        staging.own_stream(CUDA)
        result["kv"] = out._read_part(kv_out.SendPart("r#1", (0, 2), (0, 5), [0], computed))
    t = threading.Thread(target=sender, name="kv-send-1")
    t.start()
    t.join()
    log = [e[1:] for e in cuda.log if e[0] == "kv-send-1"]
    side = log[0][1]
    assert [e[0] for e in log] == ["new_stream", "set_stream", "wait_event", "export", "pinned", "to_host",
                                   "record", "event_sync"], log
    assert log[2] == ("wait_event", side, computed.name) and log[3] == ("export", side)
    assert log[5] == ("to_host", True, True) and log[6][2] == side
    assert getattr(result["kv"], "pinned", False)


def test_nccl_part_carries_an_event_after_its_receive(cuda, monkeypatch):
    """A part received over NCCL is handed over with an event on the receive thread's stream (no
    host sync per part); its buffer's bytes count until the import releases it."""
    t = nccl_transport.NcclTransport.__new__(nccl_transport.NcclTransport)
    t.device, t.backend, t.rank = CUDA, "nccl", 1
    t._buffers = RecvBuffers(torch.device("cpu"))          # host memory standing in for the device's
    t.inbound = Inbound(TransferConfig(backend="nccl"), t._buffers)
    monkeypatch.setattr(t, "_recv", lambda buf, src, idle=False: cuda._note("recv", buf.numel()), raising=False)
    from cluster.transfer.wire import PartMeta, decode_header
    from tests.wire_harness import header
    t.inbound.begin(decode_header(header("n#1", 10), EXPECT), EXPECT)
    staging.own_stream(CUDA)
    size = 10 * 2 * 4 * 32 * 4
    p = t._message(0, nccl_transport.PART, PartMeta("n#1", 0, 1, 0, 10).encode(), [size], EXPECT, [None])
    kinds = [e[1] for e in cuda.log]
    assert kinds[-2:] == ["recv", "record"] and p.ready.stream.startswith("side-")
    assert t.pending_bytes == size
    p.release()
    assert t.pending_bytes == 0


def test_pair_groups_get_the_worlds_timeout(monkeypatch):
    """dist.new_group's default timeout (NCCL's 10 minutes) would let the watchdog abort an idle
    receiver's posted irecv; every pair group gets the world's."""
    calls = []

    class Dist:
        TCPStore = staticmethod(lambda *a, **k: object())

        @staticmethod
        def init_process_group(backend, **kw):
            calls.append(("world", backend, kw["timeout"]))

        @staticmethod
        def new_group(ranks, backend=None, timeout=None):
            calls.append(("pair", backend, timeout))
            return object()
    monkeypatch.setattr(nccl_transport, "dist", Dist)
    monkeypatch.setattr(nccl_transport, "interface_for", lambda host, name=None: "lo")
    monkeypatch.setattr(nccl_transport, "rendezvous", lambda store, world_size, timeout_s: None)
    monkeypatch.setattr(nccl_transport.NcclTransport, "_warm_up", lambda self, pairs: None)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    for device, backend, want in [(CUDA, "nccl", nccl_transport.IDLE_WAIT),
                                  (torch.device("cpu"), "gloo", datetime.timedelta(seconds=60))]:
        calls.clear()
        nccl_transport.NcclTransport(TransferConfig(backend="nccl"), 0, 4, "127.0.0.1", 1, [(0, 2), (0, 3), (1, 2)],
                                     device)
        assert calls[0] == ("world", backend, want)
        assert calls[1:] == [("pair", backend, want)] * 3


DEVICE_SYNCS = {"torch.cuda.synchronize", "cuda.synchronize", "staging.cuda.synchronize"}


def test_no_device_wide_synchronize_in_cluster_or_workers():
    """A transfer thread keeps a receive posted; torch.cuda.synchronize() would wait for it."""
    found = []
    for path in sorted([*(ROOT / "cluster").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node) in DEVICE_SYNCS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
    assert ast.unparse(ast.parse("torch.cuda.synchronize").body[0].value) in DEVICE_SYNCS   # the check can fire
