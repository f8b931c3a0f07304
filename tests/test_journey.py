"""The request-journey state machine the router and the simulator share: phases, the load an attempt
puts on its workers (back to zero however it ends), its durations, and which failures take it down."""
from dataclasses import dataclass, field

import pytest

from router.journey import MAX_CRASHES, Journey, Journeys, why_not_retry
from router.policies import WorkerLoad


@dataclass(eq=False)
class W:
    rank: int


@dataclass
class Rec:
    attempts: int = 1
    crashes: int = 0
    retried_for: list = field(default_factory=list)
    queue_s: float | None = None
    prefill_s: float | None = None
    handoff_s: float | None = None
    decode_s: float | None = None


P, D = W(0), W(1)


def book():
    loads = {0: WorkerLoad("prefill:0", 1000), 1: WorkerLoad("decode:0", 1000)}
    return Journeys(loads), loads


def zero(loads):
    return all(ld.prompt_tokens == 0 and ld.running == 0 and ld.kv_tokens == 0 for ld in loads.values())


def test_a_handoff_goes_prefill_transfer_decode_and_times_each_part():
    j, loads = book()
    att = Journey(Rec(), "handoff", P, D, 100, submitted_at=10.0)
    j.open("a", att)
    assert att.phase == "prefill" and loads[0].prompt_tokens == 100
    assert (loads[1].running, loads[1].kv_tokens) == (1, 100)
    assert not j.token(att, made=10.5, arrived=10.6, started=10.2, finish="handoff")
    assert att.phase == "transfer" and loads[0].prompt_tokens == 0 and loads[1].kv_tokens == 101
    assert att.record.queue_s == pytest.approx(0.2) and att.record.prefill_s == pytest.approx(0.3)
    att.imported = True
    assert att.phase == "decode"
    assert not j.token(att, made=11.0, arrived=11.1, started=10.8, finish=None)     # the decode worker's first
    assert not j.token(att, made=11.5, arrived=11.6, started=None, finish=None, count=4)   # a run of 4 steps
    assert att.decode_start == 10.8 and att.record.handoff_s == pytest.approx(0.3)
    assert j.token(att, made=12.0, arrived=12.1, started=None, finish="length")
    assert att.record.decode_s == pytest.approx(1.2) and att.num_tokens == 7
    assert j.close("a") is att and zero(loads)
    assert j.close("a") is None and zero(loads), "closing twice releases nothing twice"


def test_a_colocated_attempt_decodes_from_its_first_token():
    j, loads = book()
    att = Journey(Rec(), "colocated", D, D, 8, submitted_at=0.0)
    j.open("c", att)
    j.token(att, made=1.0, arrived=1.1, started=0.5, finish=None)
    assert att.phase == "decode" and att.decode_start == 1.0 and att.record.handoff_s is None
    assert j.token(att, made=2.0, arrived=2.1, started=None, finish="stop") and att.record.decode_s == 1.0
    j.close("c")
    assert zero(loads)


@pytest.mark.parametrize("seen", ["nothing", "first token", "first token and sent", "imported"])
def test_an_attempt_closed_in_any_phase_leaves_no_load(seen):
    j, loads = book()
    att = Journey(Rec(), "handoff", P, D, 50, submitted_at=0.0)
    j.open("x", att)
    if seen != "nothing":
        j.token(att, 1.0, 1.0, 0.5, "handoff")
    att.sent = "sent" in seen
    att.imported = seen == "imported"
    j.close("x")
    assert zero(loads) and j.live == {}


def test_which_failures_take_an_attempt_down():
    j, _ = book()
    att = Journey(Rec(), "handoff", P, D, 50, submitted_at=0.0)
    j.open("x", att)
    assert j.lost_with(P) == [att] and j.lost_with(D) == [att], "prefilling: either worker's death"
    j.token(att, 1.0, 1.0, 0.5, "handoff")
    assert j.lost_with(P) == [att], "prefilled, KV not yet on the wire: only the prefill worker has it"
    assert j.overdue(now=1.0 + 5.0, timeout_s=10.0) == [] and j.overdue(now=1.0 + 10.5, timeout_s=10.0) == [att]
    att.sent = True
    assert j.lost_with(P) == [] and j.lost_with(D) == [att] and j.overdue(100.0, 10.0) == []
    assert j.stranded_by(D) == [att] and j.stranded_by(P) == []
    att.imported = True
    assert j.stranded_by(D) == [], "a receiver that stops keeps what it has imported"
    assert j.of(att.record) == [att] and j.of(Rec()) == []


def test_retries_end_after_two_crashes_or_max_retries():
    rec = Rec()
    assert why_not_retry(rec, "worker died", crashed=True, max_retries=3) is None and rec.retried_for == ["worker died"]
    rec.attempts = 2
    said = why_not_retry(rec, "worker died again", crashed=True, max_retries=3)
    assert rec.crashes == MAX_CRASHES and "not retried: it was on 2 workers that died" in said
    rec = Rec(attempts=4)
    assert "gave up after 4 attempts (router.max_retries=3)" in why_not_retry(rec, "lost", False, 3)


def test_the_router_and_the_simulator_keep_the_same_journey_in_their_records():
    import dataclasses

    from experiments.sim.records import Record
    from router.journey import JourneyRecord
    from router.records import RequestRecord

    shared = {f.name for f in dataclasses.fields(JourneyRecord)}
    for cls in (RequestRecord, Record):
        assert issubclass(cls, JourneyRecord) and shared <= {f.name for f in dataclasses.fields(cls)}
    real, sim = RequestRecord("a", [1, 2], 4, 0.0), Record("a", 2, 4, 0.0)      # positional as their owners build them
    for rec in (real, sim):
        assert not rec.done
        rec.finish("length", 3.0)
        assert rec.done and (rec.status, rec.finish_reason, rec.end_time) == ("ok", "length", 3.0)
    sim.fail("worker died", 4.0)
    assert (sim.status, sim.reason, sim.end_time) == ("failed", "worker died", 4.0)
