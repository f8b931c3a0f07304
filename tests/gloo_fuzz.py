"""The wire fuzzer's torch.distributed side (run by tests/gloo_peer.py in `fuzz` mode, gloo on CPU).

Within what this protocol allows (a preamble that breaks it ends the stream by design, so every
preamble here is valid and every payload is the length its preamble says), rank 0 sends a seeded
random mix of well-formed and hostile begins, parts, ends and cancels, reading the reply to every
begin, then a good transfer per round through a real channel, then closes the stream. Rank 1
receives with the real NcclTransport; its consumer raises on some deliveries. Rank 1 reports what
the properties need.
"""
from __future__ import annotations

import pickle
import random
import time

import msgpack
import torch
import torch.distributed as dist

from cluster.transfer.base import Begin, End, Part, TransferConfig, send
from cluster.transfer.nccl_transport import BEGIN, CANCEL, END, PART, REPLY_BYTES, _refusal
from cluster.transfer.wire import EndMeta, Expect, KVHandoff, PartMeta

CFG = TransferConfig(backend="nccl", timeout_s=5.0, max_frame_bytes=64 << 10, max_pending_bytes=4 << 20)
EXPECT = Expect(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float32", vocab_size=2048, max_tokens=4096,
                max_frame_bytes=CFG.max_frame_bytes)

PARAMS = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop_token_ids": [], "ignore_eos": True}
TOKEN_BYTES = 2 * 4 * 32 * 4
RIDS = ["t#0", "t#1", "t#2", "raise#0"]          # the consumer raises on raise#0's begin
HOSTILE_ONLY = ["h#0", "h#1"]
TOKENS = {rid: 3 + i for i, rid in enumerate(RIDS + HOSTILE_ONLY)}


def _nested(depth):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


def _pwned():
    raise SystemExit("unpickled")


class _Evil:
    def __reduce__(self):
        return (_pwned, ())


EVIL = pickle.dumps(_Evil())
BAD = [4.0, True, False, float("nan"), float("inf"), -1, 1 << 63, "x", None, [], {}, _nested(1000),
       list(range(3000)), EVIL]


def _header(rid, n, **over) -> bytes:
    d = {"request_id": rid, "prompt_ids": list(range(n)), "params": dict(PARAMS), "dtype": "float32",
         "shape": [4, 2, n, 4, 32]}
    d.update(over)
    return msgpack.packb(d)


def _near(rnd, v):
    return rnd.choice([float(v), float(v), bool(v) if v in (0, 1) else True, str(v), [v], -1 - v])


def _hostile(rnd) -> tuple[str, int, bytes, int]:
    """(rid named, kind, meta, payload bytes)."""
    rid = rnd.choice(RIDS + HOSTILE_ONLY)
    n = TOKENS[rid]
    what = rnd.choice(["header", "header", "part", "part", "end", "cancel", "size", "junk"])
    if what == "header":
        field = rnd.choice(["shape", "shape", "prompt_ids", "dtype", "extra"])
        if field in ("shape", "prompt_ids"):
            good = [4, 2, n, 4, 32] if field == "shape" else list(range(n))
            at = rnd.randrange(len(good))
            good[at] = _near(rnd, good[at]) if rnd.random() < 0.6 else rnd.choice(BAD)
            return rid, BEGIN, _header(rid, n, **{field: good}), 0
        return rid, BEGIN, _header(rid, n, **{field: rnd.choice(BAD)}), 0
    if what == "part":
        fields = [rid, 0, 1, 0, n]
        at = rnd.randint(1, 4)
        fields[at] = _near(rnd, fields[at]) if rnd.random() < 0.6 else rnd.choice(BAD)
        return rid, PART, msgpack.packb(fields), n * TOKEN_BYTES
    if what == "end":
        fields = [rid, 7, 1.0]
        if rnd.random() < 0.5:
            fields[1] = _near(rnd, 7)
        else:
            fields[2] = rnd.choice([float("nan"), float("inf"), True, -1.0, "1.0", [1.0], _nested(1000)])
        return rid, END, msgpack.packb(fields), 0
    if what == "cancel":
        return rid, CANCEL, msgpack.packb([rid, rnd.choice([4.0, None, [], _nested(1000), "y" * 1001])]), 0
    if what == "size":       # the part header announces other than the payload its preamble carries
        return rid, PART, PartMeta(rid, 0, 1, 0, n).encode(), n * TOKEN_BYTES + rnd.choice([-1, 4, 64])
    kind = rnd.choice([BEGIN, PART, END, CANCEL])
    return None, kind, rnd.choice([EVIL, b"\xc1\xff", b"\x91" * 5000]), 16 if kind == PART else 0


def _well_formed(rnd) -> tuple[None, int, bytes, int]:
    rid = rnd.choice(RIDS)
    n = TOKENS[rid]
    what = rnd.choice(["begin", "part", "part", "end", "cancel"])
    if what == "begin":
        return None, BEGIN, _header(rid, n), 0
    if what == "part":
        l0 = rnd.randrange(4)
        l1 = rnd.randint(l0 + 1, 4)
        t0 = rnd.randrange(n)
        t1 = rnd.randint(t0 + 1, n)
        return None, PART, PartMeta(rid, l0, l1, t0, t1).encode(), (l1 - l0) * (t1 - t0) * TOKEN_BYTES
    if what == "end":
        return None, END, EndMeta(rid, 7, 1.0).encode(), 0
    return None, CANCEL, msgpack.packb([rid, "gave up"]), 0


def good_kv(rid: str, n: int = 5) -> torch.Tensor:
    return torch.arange(4 * 2 * n * 4 * 32, dtype=torch.float32).view(4, 2, n, 4, 32) * 0.5 + len(rid)


def attacker(t, seed: int, rounds: int) -> dict:
    group, rnd, named = t.groups[(0, 1)], random.Random(seed), set()

    def message(kind, meta, payload):
        dist.send(torch.tensor([kind, len(meta), payload], dtype=torch.int64), 1, group=group)
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1, group=group)
        if payload:
            dist.send(torch.full((payload,), rnd.randrange(256), dtype=torch.uint8), 1, group=group)
        if kind == BEGIN:
            reply = torch.empty(REPLY_BYTES, dtype=torch.uint8)
            dist.recv(reply, 1, group=group)
            return _refusal(reply)

    channel, good = t.channel(1), []
    for r in range(rounds):
        for _ in range(rnd.randint(2, 12)):
            rid, kind, meta, payload = _hostile(rnd) if rnd.random() < 0.5 else _well_formed(rnd)
            message(kind, meta, payload)
            if rid is not None:
                named.add(rid)
        rid = f"good#{r}"
        send(channel, KVHandoff(rid, list(range(5)), PARAMS, "float32", (4, 2, 5, 4, 32)), good_kv(rid),
             first_token=7, first_token_time=1.0)
        good.append(rid)
    channel.close()
    return {"named": sorted(named), "good": good}


def receiver(t, clock) -> dict:
    """Receives until the stream closes; then steps the clock past transfer.timeout_s and drops what
    is still open, as the sweep would."""
    from tests.wire_harness import typed_wrong

    deliveries, problems, violations, parts = [], [], [], {}

    def deliver(d):
        bad = typed_wrong(d)
        if bad:
            violations.append(bad)
        rid = d.handoff.request_id if isinstance(d, Begin) else d.request_id
        if isinstance(d, Begin) and rid == "raise#0":
            raise RuntimeError("consumer failed")
        if isinstance(d, Part):
            parts.setdefault(rid, []).append((d.first_layer, d.start, d.kv.clone()))
            d.release()
        if isinstance(d, Begin):
            parts[rid] = []
        if isinstance(d, End) and rid.startswith("good#"):
            kv = torch.full((4, 2, 5, 4, 32), float("nan"))
            for l0, t0, p in parts.get(rid, []):
                kv[l0:l0 + p.shape[0], :, t0:t0 + p.shape[2]] = p
            deliveries.append({"rid": rid, "kind": "End", "intact": bool(torch.equal(kv, good_kv(rid)))})
            return
        if isinstance(d, End):
            nbytes = sum(p.numel() * 4 for _, _, p in parts.get(rid, []))
            deliveries.append({"rid": rid, "kind": "End", "sum_ok": nbytes == d.nbytes})
            return
        deliveries.append({"rid": rid, "kind": type(d).__name__})

    t.start_receiving(EXPECT, deliver, lambda p: problems.append({"reason": p.reason, "fatal": p.fatal,
                                                                     "rid": p.request_id}))
    for th in t._threads:
        th.join(120)
    time.sleep(0.3)                                  # the sweep thread's last look, before the clock moves
    clock.now += t.cfg.timeout_s + 1
    stale = t.inbound.stale()
    return {"deliveries": deliveries, "problems": problems, "violations": violations, "stale": stale,
            "open": sorted(t.inbound.open), "pending_bytes": t.pending_bytes,
            "alive": any(th.is_alive() for th in t._threads),
            "longest_reason": max((len(p["reason"]) for p in problems), default=0)}
