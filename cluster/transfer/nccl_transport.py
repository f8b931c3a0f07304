"""KV over torch.distributed point-to-point: NCCL between GPUs, the same code with gloo on CPU.

All transfer workers join one process group through a TCP store hosted by the driver (so losing
any worker never takes the rendezvous with it). Every prefill/decode pair gets its own two-rank
group, so each pair's stream is independent of the others. Per request:

    sender -> receiver   preamble int64[2] = [header bytes, layers per frame]
    sender -> receiver   header uint8[...] (msgpack KVHandoff)
    receiver -> sender   reply uint8[REPLY_BYTES]: b"\\x00" accepted, or b"\\x01" + the reason (utf-8)
    sender -> receiver   (accepted only) frames uint8[...]: runs of `layers per frame` whole layers

Limits are per frame: each frame is at most `max_frame_bytes` (the sender makes frames that large;
it refuses, before sending anything, a KV whose single layer is larger), so a request's KV is
bounded only by the receiver's memory for KV (`max_pending_bytes`) and its pool. The receiver checks
the header and the frame layout before it allocates a byte and refuses what it cannot take; the
sender raises the refusal against its request at once, and the stream stays in step because no
payload follows a refusal. A preamble of [0, 0] ends the stream (the sender's `close`). A preamble
that breaks the protocol leaves the stream untrusted: that receive thread stops and reports a fatal
problem (its worker takes no more KV).

An idle receiver waits for the next preamble without a deadline (gloo would otherwise time out an
idle receive after the group's timeout and silently lose the pair). Sockets bind to the node's own
address, never all interfaces: the rendezvous store in the driver listens on a socket bound to it
(pool.py), and gloo/NCCL use the network interface that carries it.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from cluster.transfer.base import Arrival, RecvBuffers, TransferConfig, TransferProblem, TransferRefused, check_frame
from cluster.transfer.wire import MAX_HEADER_BYTES, WIRE_DTYPES, Expect, KVHandoff, WireError, decode_header

REPLY_BYTES = 512
IDLE_WAIT = datetime.timedelta(days=7)       # a receiver waits for the next request this long


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _own_stream(device: torch.device) -> None:
    """Give the calling thread its own CUDA stream: a recv waiting for a peer must never hold up
    the engine's kernels on the default stream."""
    if device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device))


def interface_for(address: str) -> str:
    """The name of the network interface that carries `address` (Linux), e.g. "lo" for 127.0.0.1."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue                                # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    raise ValueError(f"no network interface has the address {address!r}")


def bound_listener(host: str) -> socket.socket:
    """A listening TCP socket on host:<free port>, for a TCPStore to serve on (master_listen_fd):
    the store would otherwise listen on every interface."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def _reply(ok: bool, reason: str = "", device: torch.device = torch.device("cpu")) -> torch.Tensor:
    data = b"\x00" if ok else b"\x01" + reason.encode()[:REPLY_BYTES - 1]
    buf = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)


def _refusal(reply: torch.Tensor) -> str | None:
    data = reply.cpu().numpy().tobytes()
    return None if data[0] == 0 else data[1:].rstrip(b"\x00").decode(errors="replace")


def frame_layers(layer_bytes: int, max_frame_bytes: int) -> int:
    return max(1, max_frame_bytes // max(layer_bytes, 1))


class NcclChannel:
    def __init__(self, transport: "NcclTransport", dst: int):
        self.t = transport
        self.dst = dst
        self.group = transport.groups[(transport.rank, dst)]
        _own_stream(transport.device)   # channels are made and used in their sender thread

    def send(self, handoff: KVHandoff, kv: torch.Tensor) -> float:
        dev, limit = self.t.device, self.t.cfg.max_frame_bytes
        check_frame(kv, limit)
        encoded = handoff.encode()
        if len(encoded) > MAX_HEADER_BYTES:
            raise TransferRefused(f"header of {len(encoded)} bytes exceeds {MAX_HEADER_BYTES}")
        header = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(dev)
        layers = frame_layers(kv[0].numel() * kv.element_size(), limit)
        payload = kv.contiguous()
        if payload.device != dev:
            payload = payload.to(dev)
        preamble = torch.tensor([header.numel(), layers], dtype=torch.int64, device=dev)
        reply = torch.empty(REPLY_BYTES, dtype=torch.uint8, device=dev)
        start = time.perf_counter()
        dist.send(preamble, self.dst, group=self.group)
        dist.send(header, self.dst, group=self.group)
        dist.recv(reply, self.dst, group=self.group)
        refused = _refusal(reply)
        if refused is not None:
            raise TransferRefused(f"refused by the receiver: {refused}")
        for l0 in range(0, payload.shape[0], layers):
            dist.send(payload[l0:l0 + layers].reshape(-1).view(torch.uint8), self.dst, group=self.group)
        _sync(dev)
        return time.perf_counter() - start

    def close(self) -> None:
        """Tell the receiver this stream is over."""
        dist.send(torch.zeros(2, dtype=torch.int64, device=self.t.device), self.dst, group=self.group)
        _sync(self.t.device)


class NcclTransport:
    name = "nccl"

    def __init__(self, cfg: TransferConfig, rank: int, world_size: int, store_host: str, store_port: int,
                 pairs: list[tuple[int, int]], device: torch.device, bind_host: str = "127.0.0.1"):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # gloo and NCCL pick their interface by name; this node's address names it
        interface = interface_for(bind_host)
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface
        op_timeout = datetime.timedelta(seconds=max(60.0, 6 * cfg.timeout_s))
        # NCCL's watchdog would abort a receive left waiting longer than the group's timeout, and an
        # idle receiver always waits: on NCCL the group gets the idle wait as its timeout.
        timeout = IDLE_WAIT if self.backend == "nccl" else op_timeout
        store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=op_timeout)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        self.groups: dict[tuple[int, int], object] = {}
        for src, dst in pairs:                   # every rank creates every group, in the same order
            group = dist.new_group([src, dst], backend=self.backend)
            self.groups[(src, dst)] = group
            self.groups[(dst, src)] = group
        self.sources = sorted(src for src, dst in pairs if dst == rank)
        self._threads: list[threading.Thread] = []
        self._buffers = RecvBuffers(device)      # shared by this worker's receive threads
        self._warm_up(pairs)

    def _warm_up(self, pairs) -> None:
        """One tiny message each way per pair, so communicators exist before anything is timed."""
        one = torch.ones(1, device=self.device)
        for src, dst in pairs:
            group = self.groups[(src, dst)]
            if self.rank == src:
                dist.send(one, dst, group=group)
                dist.recv(one, dst, group=group)
            elif self.rank == dst:
                dist.recv(one, src, group=group)
                dist.send(one, src, group=group)
        _sync(self.device)

    @property
    def pending_bytes(self) -> int:
        return self._buffers.outstanding

    def channel(self, dst: int) -> NcclChannel:
        if (self.rank, dst) not in self.groups:
            raise KeyError(f"rank {self.rank} has no transfer group with rank {dst}")
        return NcclChannel(self, dst)

    def start_receiving(self, expect: Expect, deliver, report) -> None:
        for src in self.sources:
            t = threading.Thread(target=self._receive_loop, args=(src, expect, deliver, report),
                                 name=f"kv-recv-{self.backend}-{src}", daemon=True)
            t.start()
            self._threads.append(t)

    def _receive_loop(self, src: int, expect: Expect, deliver, report) -> None:
        _own_stream(self.device)
        where = f"{self.backend} from rank {src}"
        while True:
            try:
                if not self._receive_one(src, expect, deliver, report):
                    return
            except _Untrusted as e:
                report(TransferProblem(f"{where}: {e}; stream untrusted, receiver stopped", fatal=True))
                return
            except Exception as e:   # the backend failed under us (a dead peer): nothing more can come
                report(TransferProblem(f"{where}: channel closed: {str(e).splitlines()[0][:200]}"))
                return

    def _receive_one(self, src: int, expect: Expect, deliver, report) -> bool:
        """One request from `src`; False once the sender closed the stream."""
        group, dev = self.groups[(src, self.rank)], self.device
        preamble = torch.zeros(2, dtype=torch.int64, device=dev)
        dist.irecv(preamble, src, group=group).wait(IDLE_WAIT)
        _sync(dev)
        header_len, layers = preamble.tolist()
        if header_len == layers == 0:
            return False                                        # the sender closed the stream
        if not 0 < header_len <= MAX_HEADER_BYTES or layers < 1:
            raise _Untrusted(f"preamble announces a {header_len}-byte header and {layers} layers per frame")
        header = torch.empty(header_len, dtype=torch.uint8, device=dev)
        dist.recv(header, src, group=group)
        try:
            handoff = decode_header(header.cpu().numpy().tobytes(), expect)
            frame = layers * (handoff.nbytes // handoff.shape[0])
            if frame > expect.max_frame_bytes:
                raise WireError(f"frames of {frame} bytes exceed the frame limit {expect.max_frame_bytes}",
                                handoff.request_id)
            if self._buffers.outstanding + handoff.nbytes > self.cfg.max_pending_bytes:
                raise WireError(f"{handoff.nbytes} bytes more would pass transfer.max_pending_bytes="
                                f"{self.cfg.max_pending_bytes} ({self._buffers.outstanding} in use)",
                                handoff.request_id)
        except Exception as e:   # refused before any payload: the sender reports it against its request
            if not isinstance(e, WireError):
                e = f"{type(e).__name__}: {e}"
            dist.send(_reply(False, str(e), dev), src, group=group)
            report(TransferProblem(f"{self.backend}: refused a transfer from rank {src}: {e}"))
            return True
        dist.send(_reply(True, device=dev), src, group=group)
        payload = self._buffers.take(handoff.nbytes)
        try:
            start = time.perf_counter()
            layer_bytes = handoff.nbytes // handoff.shape[0]
            for l0 in range(0, handoff.shape[0], layers):
                l1 = min(l0 + layers, handoff.shape[0])
                dist.recv(payload[l0 * layer_bytes:l1 * layer_bytes], src, group=group)
            _sync(dev)
        except BaseException:
            self._buffers.give_back(payload)
            raise
        recv_s, arrived = time.perf_counter() - start, time.time()
        kv = payload.view(WIRE_DTYPES[handoff.dtype]).view(handoff.shape)
        deliver(Arrival(handoff, [(0, kv)], handoff.nbytes, recv_s, arrived, self._buffers.releaser(payload)))
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait for receive threads whose senders closed their streams, then leave the group."""
        for t in self._threads:
            t.join(timeout_s)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class _Untrusted(Exception):
    """The stream broke the protocol; what follows cannot be framed."""
