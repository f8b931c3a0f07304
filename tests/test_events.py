"""Worker events: every kind survives the wire (a tagged dict) unchanged, and a malformed one is refused
with its kind and field named, in the one place the router checks them."""
import dataclasses

import msgpack
import pytest

from cluster import events as E
from router.router import Router
from tests.test_routing import fake_pool, greedy, submitted

ONE_OF_EACH = [
    E.Step(1.5, [("r:1", 7, None), ("r:2", 3, "length")], {"r:1": 1.25}),
    E.Rejected("r:1", "temperature=1e-40"),
    E.Failed("r:1", "boom"),
    E.Sent("r:1", 1, 640, 0.002, 1.0),
    E.SendFailed("r:1", 1, "refused"),
    E.Imported("r:1", 640, 0.002, 2.0, 2.1, prefill_end=1.9),
    E.ImportFailed("r:1", "no blocks"),
    E.TransportError("socket closed"),
    E.OutOfService("receiver stopped"),
    E.Fatal("Traceback ...\nRuntimeError: boom"),
]


def test_every_kind_is_described_once_and_round_trips_through_msgpack():
    assert sorted(type(e).kind for e in ONE_OF_EACH) == sorted(E.KINDS)
    for ev in ONE_OF_EACH:
        wire = E.to_wire(ev)
        assert wire["kind"] == ev.kind
        packed = msgpack.unpackb(msgpack.packb(wire))          # tuples come back as lists
        assert E.from_wire(packed) == ev


def test_optional_fields_may_be_left_out_and_ints_pass_as_times():
    ev = E.from_wire({"kind": "imported", "rid": "a", "bytes": 1, "recv_s": 0, "arrived": 2, "time": 3})
    assert ev.prefill_end is None and isinstance(ev.arrived, float) and ev.arrived == 2.0
    assert E.from_wire({"kind": "step", "end": 1, "tokens": []}).first_scheduled == {}


@pytest.mark.parametrize("raw, said", [
    ({"kind": "nope"}, "unknown event kind 'nope'"),
    ({"rid": "a"}, "unknown event kind None"),
    ("step", "a dict with a 'kind', not str"),
    ({"kind": "failed", "rid": "a"}, "failed event: missing field 'reason'"),
    ({"kind": "failed", "rid": "a", "reason": "x", "why": 1}, "failed event: unexpected field(s) ['why']"),
    ({"kind": "failed", "rid": 3, "reason": "x"}, "failed.rid=3: expected str"),
    ({"kind": "sent", "rid": "a", "dst": True, "bytes": 1, "seconds": 0.1, "start": 0.0},
     "sent.dst=True: expected int"),
    ({"kind": "step", "end": "soon", "tokens": []}, "step.end='soon': expected float"),
    ({"kind": "step", "end": 1.0, "tokens": [["a", 1]]}, "step.tokens[0]=['a', 1]: expected"),
    ({"kind": "step", "end": 1.0, "tokens": [["a", 1, 5]]}, "step.tokens[0][2]=5: expected str"),
    ({"kind": "step", "end": 1.0, "tokens": [], "first_scheduled": {"a": None}}, "step.first_scheduled['a']=None"),
])
def test_a_malformed_event_names_its_kind_and_field(raw, said):
    with pytest.raises(E.BadEvent) as err:
        E.from_wire(raw)
    assert said in str(err.value)


def test_events_are_frozen_records():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ONE_OF_EACH[1].reason = "other"


def test_the_router_checks_each_event_before_it_acts_and_a_bad_one_changes_nothing():
    pool = fake_pool({"colocated:0": "A"})
    router = Router(pool)
    rec = router.submit("a", [1, 2, 3], greedy(2))
    aid = submitted(pool)[-1][0]
    w = pool.find("colocated:0")
    with router._lock:
        with pytest.raises(E.BadEvent, match="step.tokens"):
            router._on_event(w, {"kind": "step", "end": 1.0, "tokens": [[aid, "x", None]]}, 1.0)
        assert rec.output_ids == [] and not rec.done
        router._on_event(w, E.to_wire(E.Step(1.0, [(aid, 5, None)], {aid: 0.5})), 1.0)
        router._on_event(w, E.to_wire(E.Step(1.1, [(aid, 6, "length")])), 1.1)
    assert rec.status == "ok" and rec.output_ids == [5, 6]


def test_the_router_handles_every_kind_once():
    from router.worker_events import RouterEvents
    worker, request = set(RouterEvents._ON_WORKER_EVENT), set(RouterEvents._ON_REQUEST_EVENT)
    assert not worker & request and worker | request == set(E.KINDS.values())
    assert all("rid" in {f.name for f in dataclasses.fields(cls)} for cls in request)
