"""A property-based fuzzer of the ZeroMQ KV receiver: well-formed and malformed messages from several
senders, interleaved, and after each sequence the properties that must always hold:

- the receive thread alive, and nothing fatal reported;
- every transfer it began delivered or ended: after its deliveries an End or a Cancel, or a problem
  tied to its request; none still open once transfer.timeout_s has passed;
- every End's parts add up to exactly the bytes its header announced; nothing riding inside another
  message's frames delivered; a sender's good transfer, and a real channel's, arriving byte for byte;
- pending_bytes back to 0; every hostile message that names a request reported against it, with a
  short reason; nothing unpickled (a pickle that would set a flag is among the payloads).

PDLAB_FUZZ_EXAMPLES sets how many sequences (default 25, a few seconds); raise it for a long run.
"""
import os
import pickle
from unittest import mock

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.transfer.base import Begin, Cancel, End
from cluster.transfer.wire import PartMeta, WireError, decode_header
from tests.wire_harness import (EXPECT, PARAMS, TOKEN_BYTES, Live, begin, cancel, end, header, intact, nested, part,
                                wait_for, whole)

EXAMPLES = int(os.environ.get("PDLAB_FUZZ_EXAMPLES", "25"))
RIDS = ["t#0", "t#1", "t#2"]                             # well-formed and hostile messages name these
HOSTILE_ONLY = ["h#0", "h#1"]                            # only hostile messages name these: nothing delivered
TOKENS = {rid: 3 + i for i, rid in enumerate(RIDS + HOSTILE_ONLY)}   # each transfer's prompt length
SENDERS = 3
UNPICKLED = []


def _pwned():
    UNPICKLED.append(True)


class Evil:
    def __reduce__(self):
        return (_pwned, ())


EVIL = pickle.dumps(Evil())
HOSTILE = [4.0, True, False, float("nan"), float("inf"), -1, 1 << 63, "x", "", None, [], {}, nested(1000),
           list(range(5000)), "y" * 5000, EVIL]

rid_ = st.sampled_from(RIDS)
bad_value = st.sampled_from(HOSTILE)


def near(v: int):
    """Wrong types that compare equal to, or look like, a good integer `v`: the loose-number class."""
    return st.sampled_from([float(v), bool(v) if v in (0, 1) else True, str(v), [v], -1 - v])


def wrong(v: int):
    return st.one_of(near(v), near(v), bad_value)          # loose numbers first: they are the quiet ones


@st.composite
def well_formed(draw):
    rid = draw(rid_)
    n = TOKENS[rid]
    kind = draw(st.sampled_from(["begin", "part", "part", "part", "end", "cancel"]))
    if kind == "begin":
        return None, begin(rid, n)
    if kind == "part":
        l0 = draw(st.integers(0, 3))
        l1 = draw(st.integers(l0 + 1, 4))
        t0 = draw(st.integers(0, n - 1))
        t1 = draw(st.integers(t0 + 1, n))
        return None, part(rid, l0, l1, t0, t1, fill=draw(st.integers(0, 255)))
    if kind == "end":
        return None, end(rid)
    return None, cancel(rid)


@st.composite
def hostile(draw):
    """(the request a receiver can read off it, or None; the frames)."""
    rid = draw(st.sampled_from(RIDS + HOSTILE_ONLY))
    n = TOKENS[rid]
    kind = draw(st.sampled_from(["header", "part_meta", "end", "cancel", "frames", "size", "junk"]))
    if kind == "header":
        field = draw(st.sampled_from(["prompt_ids", "params", "dtype", "shape", "shape", "extra"]))
        value = draw(bad_value)
        if field == "params":
            key = draw(st.sampled_from(sorted(PARAMS)))
            value = {**PARAMS, key: draw(near(3)) if key == "max_tokens" and draw(st.booleans()) else value}
        elif field in ("prompt_ids", "shape") and draw(st.integers(0, 3)):
            good = list(range(n)) if field == "prompt_ids" else [4, 2, n, 4, 32]
            at = draw(st.integers(0, len(good) - 1))
            good[at] = draw(wrong(good[at]))
            value = good
        msg = [b"B", header(rid, n, **{field: value})]
        if field == "params":           # some sampling values are valid after all (temperature 4.0): not hostile
            try:
                decode_header(msg[1], EXPECT)
                return None, [b"B", header(RIDS[0], TOKENS[RIDS[0]], **{field: value})]
            except WireError:
                pass
        return rid, msg
    if kind == "part_meta":
        fields = [rid, 0, 1, 0, n]
        at = draw(st.integers(1, 4))
        fields[at] = draw(wrong(fields[at]))
        return rid, [b"P", msgpack.packb(fields), b"\0" * TOKEN_BYTES * n]
    if kind == "end":
        fields = [rid, 7, 1.0]
        at = draw(st.integers(1, 2))
        fields[at] = draw(st.one_of(near(7), st.sampled_from([1 << 63, 2048, None, nested(1000), EVIL])) if at == 1 else
                          st.sampled_from([float("nan"), float("inf"), -float("inf"), True, -1, "1.0", [1.0], None,
                                           nested(1000), EVIL]))
        return rid, [b"E", msgpack.packb(fields)]
    if kind == "cancel":
        return rid, [b"X", msgpack.packb([rid, draw(st.sampled_from([4.0, True, None, [], nested(1000), EVIL,
                                                                     "y" * 1001, "z" * 5000]))])]
    if kind == "frames":            # a well-formed message with a whole transfer riding behind it, or cut short
        _, msg = draw(well_formed())
        carried = msgpack.unpackb(msg[1], raw=False)
        rid = carried["request_id"] if isinstance(carried, dict) else carried[0]
        if draw(st.booleans()):
            rider = f"rider#{draw(st.integers(0, 9))}"
            return rid, msg + [f for m in whole(rider, 2) for f in m]
        return rid, msg[:-1] if msg[0] == b"P" else msg + [EVIL]
    if kind == "size":
        return rid, [b"P", PartMeta(rid, 0, 1, 0, n).encode(), b"\0" * draw(st.sampled_from([0, 1, TOKEN_BYTES * n - 1,
                                                                                               TOKEN_BYTES * n + 4]))]
    return None, draw(st.sampled_from([[b"Q", b"junk"], [b"B", EVIL], [b"P", EVIL, EVIL], [b"", b""], [b"E"],
                                       [b"B", b"\xc1\xff"], [b"X", b"\x91" * 100_000 + b"\x01"]]))


steps = st.lists(st.tuples(st.integers(0, SENDERS - 1), st.one_of(well_formed(), hostile())), min_size=4, max_size=40)


def payload(rid: str, n: int) -> torch.Tensor:
    return torch.randn(4, 2, n, 4, 32, generator=torch.Generator().manual_seed(hash(rid) % 1000))


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps)
def test_receiver_keeps_its_properties_under_any_mix_of_messages(sequence):
    with mock.patch.object(pickle, "loads", side_effect=AssertionError("unpickled")), \
            mock.patch.object(pickle, "Unpickler", side_effect=AssertionError("unpickled")):
        live = Live(senders=SENDERS, max_pending=8)
        try:
            check(live, sequence)
        finally:
            live.close()
    assert not UNPICKLED


def check(live: Live, sequence) -> None:
    named = set()
    for sender, (rid, frames) in sequence:
        live.send(frames, sender)
        if rid is not None:
            named.add(rid)
    fences = {}
    for s in range(SENDERS):            # each sender's last transfer: well-formed, must arrive byte for byte
        rid, kv = f"fence#{s}", payload(f"fence#{s}", 5)
        fences[rid] = kv
        live.send(begin(rid, 5), s)
        live.send([b"P", PartMeta(rid, 0, 4, 0, 5).encode(), kv.numpy().tobytes()], s)
        live.send(end(rid), s)
    assert wait_for(lambda: all(live.ended(r) or live.reasons(r) for r in fences)), live.reasons()[-5:]
    for rid, kv in fences.items():
        assert intact(live, rid, kv), (rid, live.reasons(rid))
    live.send_good("good#1", seed=3)
    live.clock.now += live.cfg.timeout_s + 1          # whatever is still open is now silent too long
    assert wait_for(lambda: not live.rx.inbound.open), live.rx.inbound.open

    assert live.rx.receiving and not any(p.fatal for p in live.problems)
    assert not live.violations, live.violations
    assert not any(live.of(rid) for rid in HOSTILE_ONLY), "a hostile message was delivered"
    assert live.rx.pending_bytes == 0
    assert all(isinstance(p.reason, str) and len(p.reason) <= 1100 for p in live.problems)
    reported = {p.request_id for p in live.problems}
    assert named <= reported, f"hostile messages not reported against their requests: {named - reported}"
    with live.lock:
        got = list(live.got)
    assert not any(isinstance(d, tuple) and d[1].startswith("rider") or not isinstance(d, tuple)
                   and (d.handoff.request_id if isinstance(d, Begin) else d.request_id).startswith("rider")
                   for d in got), "a message riding inside another's frames was delivered"
    for rid in RIDS:                                   # every transfer begun is delivered or ended
        mine = live.of(rid)
        open_ = None
        for d in mine:
            if isinstance(d, Begin):
                assert open_ is None or rid in reported, "a second begin delivered without the first ending"
                open_ = d.handoff
            else:
                assert open_ is not None, f"{d} delivered outside a transfer"
                if isinstance(d, End):
                    start = max(i for i, x in enumerate(mine[:mine.index(d)]) if isinstance(x, Begin))
                    nbytes = sum(x[4].numel() * 4 for x in mine[start:mine.index(d)] if isinstance(x, tuple))
                    assert nbytes == d.nbytes == open_.nbytes, "an end with other than its announced bytes"
                if isinstance(d, (End, Cancel)):
                    open_ = None
        assert open_ is None or rid in reported, f"{rid} begun, never ended, never reported"


def run_gloo_pair(*args: str) -> tuple[dict, dict]:
    """tests.gloo_peer as two processes over gloo, with a TCP store here; their JSON lines."""
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
    peers = [subprocess.Popen([sys.executable, "-m", "tests.gloo_peer", str(rank), str(port), *args], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=240) for p in peers]
    finally:
        for p in peers:
            p.kill()
        del store
    for p, (out, err) in zip(peers, outs):
        assert p.returncode == 0, err[-3000:]
    return tuple(json.loads(out.strip().splitlines()[-1]) for out, _ in outs)


def test_torch_distributed_receiver_keeps_its_properties_under_a_random_mix():
    """The same properties over gloo, within what its protocol allows (every preamble valid: one
    that is not ends the stream by design, tested in test_wire.py)."""
    from tests import gloo_fuzz

    sent, got = run_gloo_pair("fuzz", os.environ.get("PDLAB_FUZZ_SEED", "7"), str(max(8, 2 * EXAMPLES)))
    assert not got["alive"] and not any(p["fatal"] or "channel closed" in p["reason"] for p in got["problems"])
    assert not got["violations"], got["violations"][:3]
    assert got["pending_bytes"] == 0 and not got["open"]
    assert got["longest_reason"] <= 1100
    delivered = got["deliveries"]
    goods = [d for d in delivered if d["rid"].startswith("good#") and d["kind"] == "End"]
    assert [d["rid"] for d in goods] == sent["good"] and all(d["intact"] for d in goods), "good transfers byte for byte"
    assert not any(d["rid"] in gloo_fuzz.HOSTILE_ONLY for d in delivered), "a hostile message was delivered"
    assert all(d.get("sum_ok", True) for d in delivered), "an end with other than its announced bytes"
    reported = {p["rid"] for p in got["problems"]} | set(got["stale"])
    assert set(sent["named"]) <= reported, set(sent["named"]) - reported
    assert "raise#0" in reported or "raise#0" not in {d["rid"] for d in delivered}
    for rid in gloo_fuzz.RIDS:                            # every transfer begun is delivered or ended
        open_ = False
        for d in (d for d in delivered if d["rid"] == rid):
            if d["kind"] == "Begin":
                assert not open_ or rid in reported
                open_ = True
            else:
                assert open_, f"{d} delivered outside a transfer"
                if d["kind"] in ("End", "Cancel"):
                    open_ = False
        assert not open_ or rid in reported, f"{rid} begun, never ended, never reported"
