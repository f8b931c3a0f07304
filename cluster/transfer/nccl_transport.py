"""KV over torch.distributed point-to-point: NCCL between GPUs, the same code with gloo on CPU.

All transfer workers join one process group through a TCP store hosted by the driver (so losing
any worker never takes the rendezvous with it). Every prefill/decode pair gets its own two-rank
group, so each pair's stream is independent of the others. The stream is a sequence of messages,
each a preamble int64[3] = [kind, meta bytes, payload bytes], the meta (msgpack, wire.py), and for
a part its payload:

    begin   sender -> receiver: [BEGIN, n, 0], header;  receiver -> sender: reply uint8[REPLY_BYTES]
            (b"\x00" accepted, or b"\x01" + the reason, utf-8)
    part    [PART, n, bytes], part header, payload (one frame, at most max_frame_bytes)
    end     [END, n, 0], end;   cancel  [CANCEL, n, 0], cancel;   close  [CLOSE, 0, 0]

Limits are per frame: the sender splits a part into frames of at most `max_frame_bytes` (whole
layers where they fit, else runs of tokens), so a request's KV is bounded only by the receiver's
memory for KV (`max_pending_bytes`) and its pool. The receiver checks a header before it allocates
a byte and refuses what it cannot take: the refusal reaches the sender's `begin` at once. Every
message consumes exactly what its preamble announces: a part that does not fit its transfer, or
names one already dropped, has its payload drained, so the stream stays in step whatever becomes
of the transfer; a rejected message is reported against its request, and a consumer or a bug of
this thread that raises is reported the same way and the thread goes on. A preamble that breaks
the protocol (an unknown kind, a meta or payload past its limit) leaves the stream untrusted: that
receive thread stops and reports a fatal problem (its worker takes no more KV); so does the
backend failing under a receive (a dead peer), as a closed channel.

An idle receiver waits for the next preamble without a deadline (gloo would otherwise time out an
idle receive after the group's timeout and silently lose the pair). Sockets bind to the node's own
address, never all interfaces: the rendezvous store in the driver listens on a socket bound to it
(cluster/wiring.py), and gloo/NCCL use the network interface whose network holds it, or the one
transfer.socket_ifname names (cluster/transfer/netif.py). Every pair group gets the world group's
timeout (on NCCL the idle wait), not new_group's default. On a GPU each channel and
receive thread runs on its own CUDA stream, so waiting for a peer never holds up the engine; a
received part carries an event on that stream, which the import waits on (staging.py).

Workers are named by their pool ranks; the group's own ranks are their places in `members` (the
workers a group formed with: a group formed again without a lost worker renumbers, the pool's
ranks stay). Before joining, the members meet in a rendezvous of their own on the store, which the
pool can abandon when one of them is lost (cluster/wiring.py).
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from cluster.transfer import staging
from cluster.transfer.base import (Inbound, Part, RecvBuffers, TransferConfig, TransferProblem, TransferRefused, frames,
                                   hand_over, safe_report)
from cluster.transfer.netif import interface_for
from cluster.transfer.wire import (MAX_HEADER_BYTES, WIRE_DTYPES, CancelMeta, EndMeta, Expect, KVHandoff, PartMeta,
                                   WireError, decode_cancel, decode_end, decode_header, decode_part)

REPLY_BYTES = 512
IDLE_WAIT = datetime.timedelta(days=7)       # a receiver waits for the next request this long


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


ARRIVED, ABANDONED = "pdlab/arrived", "pdlab/abandoned"      # rendezvous keys in the store


def rendezvous(store, world_size: int, timeout_s: float) -> None:
    """Wait until all `world_size` members reached the store, before any joins the group: a member
    lost on the way then leaves the others here, where the pool's `abandon` frees them at once,
    not inside the backend's own wait for it (which only the store's timeout ends)."""
    deadline = time.monotonic() + timeout_s
    if not store.check([ABANDONED]):
        store.add(ARRIVED, 1)
    while not store.check([ABANDONED]) and store.add(ARRIVED, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{store.add(ARRIVED, 0)} of {world_size} members reached the rendezvous "
                               f"within {timeout_s:g} s")
        time.sleep(0.02)
    if store.check([ABANDONED]):
        raise RuntimeError(f"rendezvous abandoned: {store.get(ABANDONED).decode(errors='replace')}")


def abandon(store, world_size: int, reason: str) -> bool:
    """Tell the members waiting in `rendezvous` to give up. Returns True when every member had passed
    it (one was lost after): they then wait inside the backend, and only closing the store frees them."""
    store.set(ABANDONED, reason)
    return store.add(ARRIVED, 0) >= world_size


def leave_group() -> None:
    """Leave the process group this process joined (or half-joined), so that it can join another."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


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


CLOSE, BEGIN, PART, END, CANCEL = range(5)


class NcclChannel:
    def __init__(self, transport: "NcclTransport", dst: int):
        self.t = transport
        self.dst = dst
        self.to = transport.peer[dst]          # its group rank
        self.group = transport.groups[(transport.rank, dst)]
        staging.own_stream(transport.device)   # channels are made and used in their sender thread

    def _message(self, kind: int, meta: bytes, payload: torch.Tensor | None = None) -> None:
        dev = self.t.device
        size = 0 if payload is None else payload.numel() * payload.element_size()
        dist.send(torch.tensor([kind, len(meta), size], dtype=torch.int64, device=dev), self.to, group=self.group)
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev), self.to, group=self.group)
        if payload is not None:
            dist.send(payload.contiguous().reshape(-1).view(torch.uint8), self.to, group=self.group)

    def begin(self, handoff: KVHandoff) -> None:
        encoded = handoff.encode()
        if len(encoded) > MAX_HEADER_BYTES:
            raise TransferRefused(f"header of {len(encoded)} bytes exceeds {MAX_HEADER_BYTES}")
        self._message(BEGIN, encoded)
        reply = torch.empty(REPLY_BYTES, dtype=torch.uint8, device=self.t.device)
        dist.recv(reply, self.to, group=self.group)
        refused = _refusal(reply)
        if refused is not None:
            raise TransferRefused(f"refused by the receiver: {refused}")

    def part(self, request_id: str, first_layer: int, start: int, kv: torch.Tensor) -> None:
        if kv.device != self.t.device:
            kv = kv.to(self.t.device)
        for l0, t0, frame in frames(kv, first_layer, start, self.t.cfg.max_frame_bytes):
            meta = PartMeta(request_id, l0, l0 + frame.shape[0], t0, t0 + frame.shape[2])
            self._message(PART, meta.encode(), frame)

    def end(self, request_id: str, first_token: int, first_token_time: float) -> None:
        self._message(END, EndMeta(request_id, first_token, first_token_time).encode())
        _sync(self.t.device)

    def cancel(self, request_id: str, reason: str) -> None:
        self._message(CANCEL, CancelMeta(request_id, reason).encode())

    def close(self) -> None:
        """Tell the receiver this stream is over."""
        dist.send(torch.zeros(3, dtype=torch.int64, device=self.t.device), self.to, group=self.group)
        _sync(self.t.device)


class NcclTransport:
    name = "nccl"

    def __init__(self, cfg: TransferConfig, rank: int, world_size: int, store_host: str, store_port: int,
                 pairs: list[tuple[int, int]], device: torch.device, bind_host: str = "127.0.0.1",
                 members: list[int] | None = None):
        """`rank`, `pairs`: pool ranks; `members`: the pool ranks in the group, in group-rank order
        (None: 0..world_size-1)."""
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        members = list(range(world_size)) if members is None else list(members)
        if len(members) != world_size or rank not in members:
            raise ValueError(f"rank {rank} joins a group of {world_size} with members {members}")
        self.peer = {r: i for i, r in enumerate(members)}      # pool rank -> group rank
        # gloo and NCCL pick their interface by name: the one whose network holds this node's address
        interface = interface_for(bind_host, cfg.socket_ifname)
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface
        op_timeout = datetime.timedelta(seconds=max(60.0, 6 * cfg.timeout_s))
        # NCCL's watchdog would abort a receive left waiting longer than the group's timeout, and an
        # idle receiver always waits: on NCCL the group gets the idle wait as its timeout.
        timeout = IDLE_WAIT if self.backend == "nccl" else op_timeout
        store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=op_timeout)
        rendezvous(store, world_size, op_timeout.total_seconds())
        dist.init_process_group(self.backend, store=store, rank=self.peer[rank], world_size=world_size, timeout=timeout)
        self.groups: dict[tuple[int, int], object] = {}
        self.timeout = timeout
        for src, dst in pairs:                   # every rank creates every group, in the same order; each
            # gets the world's timeout (new_group's default is NCCL's 10 minutes: an idle receiver's
            # posted irecv would be aborted by the watchdog, and its worker with it)
            group = dist.new_group([self.peer[src], self.peer[dst]], backend=self.backend, timeout=timeout)
            self.groups[(src, dst)] = group
            self.groups[(dst, src)] = group
        self.sources = sorted(src for src, dst in pairs if dst == rank)
        self._threads: list[threading.Thread] = []
        self._buffers = RecvBuffers(device)      # shared by this worker's receive threads
        self.inbound = Inbound(cfg, self._buffers)
        self._warm_up(pairs)

    def _warm_up(self, pairs) -> None:
        """One tiny message each way per pair, so communicators exist before anything is timed."""
        one = torch.ones(1, device=self.device)
        for src, dst in pairs:
            group = self.groups[(src, dst)]
            if self.rank == src:
                dist.send(one, self.peer[dst], group=group)
                dist.recv(one, self.peer[dst], group=group)
            elif self.rank == dst:
                dist.recv(one, self.peer[src], group=group)
                dist.send(one, self.peer[src], group=group)
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
        if self.sources:
            threading.Thread(target=self._sweep, args=(report,), name=f"kv-sweep-{self.backend}", daemon=True).start()

    def _sweep(self, report) -> None:
        """Transfers silent for timeout_s (a sender that died mid-transfer) are dropped and reported;
        the receive threads themselves wait in their receives."""
        while any(t.is_alive() for t in self._threads):
            time.sleep(0.1)
            try:
                for rid in self.inbound.stale():
                    safe_report(report, TransferProblem(f"{self.backend}: transfer silent for {self.cfg.timeout_s:g} s "
                                                        "(transfer.timeout_s), dropped", rid))
            except Exception as e:   # a bug of its own: said, and the sweep goes on
                safe_report(report, TransferProblem(f"{self.backend}: sweep: {type(e).__name__}: {str(e)[:300]}"))

    def _receive_loop(self, src: int, expect: Expect, deliver, report) -> None:
        staging.own_stream(self.device)
        where = f"{self.backend} from rank {src}"
        while True:
            try:
                if not self._receive_one(src, expect, deliver, report):
                    return
            except _Untrusted as e:
                safe_report(report, TransferProblem(f"{where}: {e}; stream untrusted, receiver stopped", fatal=True))
                return
            except _Backend as e:   # the backend failed under us (a dead peer): nothing more can come
                safe_report(report, TransferProblem(f"{where}: channel closed: {str(e.__cause__).splitlines()[0][:200]}"))
                return
            except Exception as e:   # a bug of this loop's own, the stream still in step: said, and on
                safe_report(report, TransferProblem(f"{where}: receive loop: {type(e).__name__}: {str(e)[:300]}"))

    def _recv(self, t: torch.Tensor, src: int, idle: bool = False) -> None:
        """One receive from `src`; a failure of the backend is _Backend (the stream is over)."""
        try:
            work = dist.irecv(t, self.peer[src], group=self.groups[(src, self.rank)])
            work.wait(IDLE_WAIT) if idle else work.wait()
        except Exception as e:
            raise _Backend() from e

    def _receive_one(self, src: int, expect: Expect, deliver, report) -> bool:
        """One message from `src`, all of it: preamble, meta, and for a part its payload, whatever
        becomes of the transfer it names; False once the sender closed the stream."""
        dev = self.device
        preamble = torch.zeros(3, dtype=torch.int64, device=dev)
        self._recv(preamble, src, idle=True)
        kind, meta_len, payload_len = preamble.tolist()          # waits for this thread's stream only
        if kind == CLOSE and meta_len == payload_len == 0:
            return False                                        # the sender closed the stream
        if (kind not in (BEGIN, PART, END, CANCEL) or not 0 < meta_len <= MAX_HEADER_BYTES
                or not 0 <= payload_len <= expect.max_frame_bytes or (payload_len > 0) != (kind == PART)):
            raise _Untrusted(f"preamble {[kind, meta_len, payload_len]} breaks the protocol")
        meta = torch.empty(meta_len, dtype=torch.uint8, device=dev)
        self._recv(meta, src)
        data = meta.cpu().numpy().tobytes()
        if kind == BEGIN:
            return self._begin(src, data, expect, deliver, report)
        left, named = [payload_len], [None]           # payload bytes still on the stream; its request
        try:
            delivery = self._message(src, kind, data, left, expect, named)
        except _Backend:
            raise
        except Exception as e:   # this message does not fit: its transfer is dropped, the stream stays in step
            self._drain(src, left[0])
            rid = getattr(e, "request_id", None) or named[0]
            self.inbound.drop(rid)
            what = str(e) if isinstance(e, WireError) else f"{type(e).__name__}: {str(e)[:300]}"
            safe_report(report, TransferProblem(f"{self.backend}: rejected a message from rank {src}: {what}", rid))
            return True
        self._drain(src, left[0])                                 # a part of a transfer already dropped
        if delivery is not None:
            hand_over(delivery, deliver, report, self.inbound, self.backend)
        return True

    def _message(self, src: int, kind: int, data: bytes, left: list[int], expect: Expect, named: list):
        """A part, end or cancel -> what to deliver; a part's payload is received here (left[0] set
        to 0) unless its transfer was dropped, and its bytes released on every failure."""
        if kind == END:
            end = decode_end(data, expect)
            named[0] = end.request_id
            return None if self.inbound.quiet(end.request_id) else self.inbound.end(end)
        if kind == CANCEL:
            return self.inbound.cancel(decode_cancel(data))
        part = decode_part(data)
        rid = named[0] = part.request_id
        if self.inbound.quiet(rid):
            return None
        handoff, size = self.inbound.part(part, expect.max_frame_bytes)
        if size != left[0]:
            raise WireError(f"part of {left[0]} bytes; its header announces {size}", rid)
        buf = self._buffers.take(size)                # from here the part's bytes count, until release()
        release = self._buffers.releaser(buf)
        try:
            left[0] = 0
            self._recv(buf, src)
            self.inbound.received(rid, size)
            shape = (part.end_layer - part.first_layer, 2, part.end - part.start, *handoff.shape[3:])
            kv = buf.view(WIRE_DTYPES[handoff.dtype]).view(shape)
            return Part(rid, part.first_layer, part.start, kv, release, staging.filled(self.device))
        except BaseException:
            release()
            raise

    def _begin(self, src: int, data: bytes, expect: Expect, deliver, report) -> bool:
        dev = self.device
        try:
            begin = self.inbound.begin(decode_header(data, expect), expect)
        except Exception as e:   # refused before any payload: the sender reports it against its request
            reason = str(e) if isinstance(e, WireError) else f"{type(e).__name__}: {str(e)[:300]}"
            self._send(_reply(False, reason, dev), src)
            safe_report(report, TransferProblem(f"{self.backend}: refused a transfer from rank {src}: {reason}",
                                                getattr(e, "request_id", None)))
            return True
        try:
            self._send(_reply(True, device=dev), src)
        except _Backend:
            self.inbound.drop(begin.handoff.request_id)
            raise
        hand_over(begin, deliver, report, self.inbound, self.backend)
        return True

    def _send(self, t: torch.Tensor, dst: int) -> None:
        try:
            dist.send(t, self.peer[dst], group=self.groups[(dst, self.rank)])
        except Exception as e:
            raise _Backend() from e

    def _drain(self, src: int, nbytes: int) -> None:
        """Receive and drop a payload that will not be used, keeping the stream in step."""
        if nbytes:
            self._recv(torch.empty(nbytes, dtype=torch.uint8, device=self.device), src)

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


class _Backend(Exception):
    """torch.distributed failed under a receive or send (its cause): the stream is over."""
