"""KV over torch.distributed point-to-point: NCCL between GPUs, the same code with gloo on CPU.

All transfer workers join one process group through a TCP store hosted by the driver (so losing
any worker never takes the rendezvous with it). Every prefill/decode pair gets its own two-rank
group, so each pair's stream is independent of the others. Per request the sender sends:

    preamble int64[2] = [header bytes, payload bytes];  header uint8[...] (msgpack);  payload uint8[...]

A preamble of [0, 0] ends the stream (the sender's `close`), so receive threads stop cleanly.

The receiver checks the preamble against its limits before allocating, validates the header like
the zmq wire does, and drains (then drops) a payload whose header it rejects, keeping the stream
in step.
"""
from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from cluster.transfer.base import Arrival, RecvBuffers, TransferConfig
from cluster.transfer.wire import MAX_HEADER_BYTES, WIRE_DTYPES, Expect, KVHandoff, WireError, decode_header


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _own_stream(device: torch.device) -> None:
    """Give the calling thread its own CUDA stream: a recv waiting for a peer must never hold up
    the engine's kernels on the default stream."""
    if device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device))


class NcclChannel:
    def __init__(self, transport: "NcclTransport", dst: int):
        self.t = transport
        self.dst = dst
        self.group = transport.groups[(transport.rank, dst)]
        _own_stream(transport.device)   # channels are made and used in their sender thread

    def send(self, handoff: KVHandoff, kv: torch.Tensor) -> float:
        dev = self.t.device
        header = torch.frombuffer(bytearray(handoff.encode()), dtype=torch.uint8).to(dev)
        payload = kv.contiguous().view(-1).view(torch.uint8)
        if payload.device != dev:
            payload = payload.to(dev)
        preamble = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64, device=dev)
        start = time.perf_counter()
        for t in (preamble, header, payload):
            dist.send(t, self.dst, group=self.group)
        _sync(dev)
        return time.perf_counter() - start

    def close(self) -> None:
        """Tell the receiver this stream is over."""
        dist.send(torch.zeros(2, dtype=torch.int64, device=self.t.device), self.dst, group=self.group)
        _sync(self.t.device)


class NcclTransport:
    name = "nccl"

    def __init__(self, cfg: TransferConfig, rank: int, world_size: int, store_host: str, store_port: int,
                 pairs: list[tuple[int, int]], device: torch.device):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=max(60.0, 6 * cfg.timeout_s))
        store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        self.groups: dict[tuple[int, int], object] = {}
        for src, dst in pairs:                   # every rank creates every group, in the same order
            group = dist.new_group([src, dst], backend=self.backend)
            self.groups[(src, dst)] = group
            self.groups[(dst, src)] = group
        self.sources = sorted(src for src, dst in pairs if dst == rank)
        self._threads: list[threading.Thread] = []
        self._warm_up(pairs)

    def _warm_up(self, pairs) -> None:
        """One tiny message per pair, so communicators exist before anything is timed."""
        one = torch.ones(1, device=self.device)
        for src, dst in pairs:
            if self.rank == src:
                dist.send(one, dst, group=self.groups[(src, dst)])
            elif self.rank == dst:
                dist.recv(one, src, group=self.groups[(src, dst)])
        _sync(self.device)

    def channel(self, dst: int) -> NcclChannel:
        if (self.rank, dst) not in self.groups:
            raise KeyError(f"rank {self.rank} has no transfer group with rank {dst}")
        return NcclChannel(self, dst)

    def start_receiving(self, expect: Expect, deliver, report_error) -> None:
        for src in self.sources:
            t = threading.Thread(target=self._receive_loop, args=(src, expect, deliver, report_error),
                                 name=f"kv-recv-{self.backend}-{src}", daemon=True)
            t.start()
            self._threads.append(t)

    def _receive_loop(self, src: int, expect: Expect, deliver, report_error) -> None:
        group, dev = self.groups[(src, self.rank)], self.device
        _own_stream(dev)
        preamble = torch.zeros(2, dtype=torch.int64, device=dev)
        buffers = RecvBuffers(dev)
        while True:
            try:
                dist.recv(preamble, src, group=group)
                header_len, payload_len = preamble.tolist()
                if header_len == payload_len == 0:
                    return                                      # the sender closed the stream
                if not 0 < header_len <= MAX_HEADER_BYTES or not 0 < payload_len <= expect.max_frame_bytes:
                    # The stream cannot be trusted past this point: stop listening to this source.
                    report_error(f"{self.backend}: rank {src} announced a {header_len}-byte header and "
                                 f"{payload_len}-byte payload (limits {MAX_HEADER_BYTES}, {expect.max_frame_bytes});"
                                 " channel closed")
                    return
                header = torch.empty(header_len, dtype=torch.uint8, device=dev)
                dist.recv(header, src, group=group)
                payload = buffers.take(payload_len)
                start = time.perf_counter()
                dist.recv(payload, src, group=group)
                _sync(dev)
                recv_s, arrived = time.perf_counter() - start, time.time()
            except Exception as e:  # a dead peer surfaces as a runtime error from the backend
                report_error(f"{self.backend}: channel from rank {src} closed: {str(e).splitlines()[0][:200]}")
                return
            try:
                handoff = decode_header(header.cpu().numpy().tobytes(), expect)
                if handoff.nbytes != payload_len:
                    raise WireError(f"{handoff.request_id}: payload of {payload_len} bytes, header announced "
                                    f"{handoff.nbytes}")
            except WireError as e:
                report_error(f"{self.backend}: rejected message from rank {src}: {e}")
                buffers.give_back(payload)
                continue
            kv = payload.view(WIRE_DTYPES[handoff.dtype]).view(handoff.shape)
            deliver(Arrival(handoff, [(0, kv)], payload_len, recv_s, arrived, buffers.releaser(payload)))

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait for receive threads whose senders closed their streams, then leave the group."""
        for t in self._threads:
            t.join(timeout_s)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
