"""One side of the torch.distributed wire attack in test_wire.py, run as its own process:

    python -m tests.gloo_peer RANK STORE_PORT [fuzz SEED ROUNDS]

Rank 1 receives with the real NcclTransport (gloo on CPU). Rank 0 first breaks the protocol's rules
with raw messages, then sends through a real NcclChannel. Each prints one JSON line of what it saw.
"""
from __future__ import annotations

import json
import sys
import threading
import time

import torch
import torch.distributed as dist

from cluster.transfer.base import Begin, End, Part, TransferConfig, TransferRefused, send
from cluster.transfer.nccl_transport import BEGIN, PART, REPLY_BYTES, NcclTransport, _refusal
from cluster.transfer.wire import Expect, KVHandoff, PartMeta

CFG = TransferConfig(backend="nccl", timeout_s=5.0, max_frame_bytes=2 * 10240, max_pending_bytes=100 * 1024)
EXPECT = Expect(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float32", vocab_size=2048, max_tokens=4096,
                max_frame_bytes=CFG.max_frame_bytes)
PARAMS = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop_token_ids": [], "ignore_eos": True}


def kv_for(n: int, rid: str) -> torch.Tensor:
    """A payload both sides can recompute: [4, 2, n, 4, 32] float32."""
    return torch.arange(4 * 2 * n * 4 * 32, dtype=torch.float32).view(4, 2, n, 4, 32) + len(rid)


def handoff(rid: str, n: int, **params) -> KVHandoff:
    return KVHandoff(rid, list(range(n)), {**PARAMS, **params}, "float32", (4, 2, n, 4, 32))


def attacker(t: NcclTransport) -> dict:
    group, seen = t.groups[(0, 1)], {}

    def message(kind: int, meta: bytes, payload: int = 0) -> None:
        dist.send(torch.tensor([kind, len(meta), payload], dtype=torch.int64), 1, group=group)
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1, group=group)
        if payload:
            dist.send(torch.zeros(payload, dtype=torch.uint8), 1, group=group)

    def begin(header: bytes) -> str | None:
        message(BEGIN, header)
        reply = torch.empty(REPLY_BYTES, dtype=torch.uint8)
        dist.recv(reply, 1, group=group)
        return _refusal(reply)

    seen["garbage"] = begin(b"\xc1\xff\x00not msgpack")
    seen["poison"] = begin(handoff("cold#1", 10, temperature=1e-40).encode())
    seen["bent"] = begin(handoff("bent#1", 10).encode())                       # accepted ...
    message(PART, PartMeta("bent#1", 0, 1, 0, 10).encode(), payload=1000)     # ... then a part of the wrong size
    channel = t.channel(1)
    sent = {}
    for rid, n in [("multi#1", 10), ("huge#1", 24), ("over#1", 40), ("after#1", 3)]:
        try:
            send(channel, handoff(rid, n), kv_for(n, rid), first_token=7, first_token_time=1.0)
            sent[rid] = "sent"
        except TransferRefused as e:
            sent[rid] = f"refused: {e}"
    seen["sent"] = sent
    time.sleep(0.5)                       # let "after#1" be released before the stream breaks
    dist.send(torch.tensor([PART, 10, (1 << 20) + 1], dtype=torch.int64), 1, group=group)   # breaks the protocol
    return seen


def receiver(t: NcclTransport) -> dict:
    got, problems, parts = [], [], {}

    def deliver(d):
        if isinstance(d, Begin):
            parts[d.handoff.request_id] = (d.handoff, [])
        elif isinstance(d, Part):
            parts[d.request_id][1].append((d.first_layer, d.start, d.kv.clone()))
            d.release()
        elif isinstance(d, End):
            h, ps = parts.pop(d.request_id)
            kv = torch.full(h.shape, float("nan"))
            for l0, t0, part in ps:
                kv[l0:l0 + part.shape[0], :, t0:t0 + part.shape[2]] = part
            got.append({"rid": d.request_id, "intact": bool(torch.equal(kv, kv_for(h.shape[2], d.request_id))),
                        "nbytes": d.nbytes, "frames": len(ps)})

    t.start_receiving(EXPECT, deliver, lambda p: problems.append({"reason": p.reason, "fatal": p.fatal,
                                                                  "rid": p.request_id}))
    for thread in t._threads:
        thread.join(60)
    return {"got": got, "problems": problems, "pending_bytes": t.pending_bytes,
            "threads_alive": any(th.is_alive() for th in threading.enumerate() if th.name.startswith("kv-recv"))}


def main(rank: int, port: int, mode: str = "attack", seed: int = 0, rounds: int = 0) -> None:
    if mode == "fuzz":       # tests/gloo_fuzz.py: a seeded random mix, within the protocol
        from tests import gloo_fuzz
        from tests.wire_harness import ManualClock
        t = NcclTransport(gloo_fuzz.CFG, rank, 2, "127.0.0.1", port, [(0, 1)], torch.device("cpu"), "127.0.0.1")
        if rank == 0:
            out = gloo_fuzz.attacker(t, seed, rounds)
        else:
            t.inbound.clock = clock = ManualClock()
            out = gloo_fuzz.receiver(t, clock)
    else:
        t = NcclTransport(CFG, rank, 2, "127.0.0.1", port, [(0, 1)], torch.device("cpu"), "127.0.0.1")
        out = attacker(t) if rank == 0 else receiver(t)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4], *map(int, sys.argv[4:6]))
