"""The worker-clock offset estimator (router/clock.py) against fake clocks: a known offset, drift, and
round trips with jitter that is neither small nor symmetric."""
import random

import pytest

from router.clock import Sample, WorkerClock, best_probe


def probe_round(rnd: random.Random, router_now: float, worker_clock, n: int = 8):
    """n probes starting at router time `router_now`: request and reply each take 0.2 ms plus an
    exponential jitter of mean 2 ms drawn separately (so the two legs differ)."""
    out, t = [], router_now
    for _ in range(n):
        up, down = 2e-4 + rnd.expovariate(1 / 2e-3), 2e-4 + rnd.expovariate(1 / 2e-3)
        out.append((t, worker_clock(t + up), t + up + down))
        t += up + down + 1e-4
    return out


def test_min_rtt_probe_bounds_the_offset_error_by_half_its_round_trip():
    rnd = random.Random(7)
    offset = 123.456789                               # the worker's clock is ahead by this much
    for _ in range(200):
        probes = probe_round(rnd, rnd.uniform(0, 1e6), lambda t: t + offset)
        s = best_probe(probes)
        assert s.rtt == min(r - t for t, _, r in probes)
        assert abs(s.offset - offset) <= s.rtt / 2 + 1e-9
    # the shortest of 8 round trips is far better than a typical one: the estimate is sub-millisecond
    errors = [abs(best_probe(probe_round(rnd, 0.0, lambda t: t + offset)).offset - offset) for _ in range(200)]
    assert sorted(errors)[len(errors) // 2] < 1e-3
    with pytest.raises(ValueError, match="no probe answered"):
        best_probe([])
    with pytest.raises(ValueError, match="before it was sent"):
        best_probe([(2.0, 5.0, 1.0)])


def test_no_estimate_is_the_same_clock():
    c = WorkerClock()
    assert c.to_router(1234.5) == 1234.5 and c.report(0.0)["rounds"] == 0


def test_tracks_a_drifting_clock_across_rounds():
    """Worker clock 50 ppm fast with a 3 s offset, re-estimated every 2 s: converted times stay within the
    estimate's error bound (plus the slew still catching up) of the truth."""
    rnd = random.Random(3)
    worker = lambda t: 3.0 + t * (1 + 50e-6)          # noqa: E731
    clock = WorkerClock()
    for k in range(60):
        now = 1000.0 + 2.0 * k
        clock.update(best_probe(probe_round(rnd, now, worker)), now + 0.05)
        t = now + 1.0                                  # a token made between rounds
        err = abs(clock.to_router(worker(t)) - t)
        assert err <= clock.chosen.bound(t, clock.drift) + 2e-3, (k, err)
    assert abs(clock.to_router(worker(1121.0)) - 1121.0) < 1.5e-3
    assert clock.report(1121.0)["rounds"] == 60


def test_a_changed_estimate_is_slewed_so_one_workers_gaps_keep_their_length():
    """Estimates jump by up to 5 ms between rounds; a gap between two of the worker's times, before,
    across or after a change, maps to a gap within 1% (the slew) of its length, never shorter by half."""
    rnd = random.Random(11)
    clock = WorkerClock(slew=0.01)
    now = 0.0
    clock.update(Sample(offset=0.0, rtt=1e-4, at=now), now)
    for _ in range(40):
        now += 2.0
        # a fresh sample with a better bound than the aged one: it is chosen, and it moved by up to 5 ms
        clock.update(Sample(offset=rnd.uniform(-5e-3, 5e-3), rtt=1e-5, at=now), now)
        for _ in range(50):
            w = now + rnd.uniform(-3.0, 3.0)
            gap = rnd.choice([1e-3, 4e-3, 20e-3, 0.5])
            mapped = clock.to_router(w + gap) - clock.to_router(w)
            assert gap * (1 - 0.01) - 1e-12 <= mapped <= gap * (1 + 0.01) + 1e-12, (w, gap, mapped)
    # and it does converge on the estimate: 5 ms at 1% takes 0.5 s of worker time
    target = clock.chosen.offset
    assert clock.offset_at(now + target + 2.0) == pytest.approx(target, abs=1e-12)


def test_the_sample_with_the_smallest_bound_now_is_used():
    clock = WorkerClock(drift=1e-4)
    clock.update(Sample(offset=0.010, rtt=0.2e-3, at=0.0), 0.0)
    # a worse round trip 2 s later loses to the fresh-enough good one (0.1 + 0.2 ms < 1 ms)
    assert clock.update(Sample(offset=0.013, rtt=2e-3, at=2.0), 2.0).offset == 0.010
    # 20 s on, the good one has aged to 0.1 + 2 ms; a 2 ms round trip (1 ms) now wins
    assert clock.update(Sample(offset=0.011, rtt=2e-3, at=20.0), 20.0).offset == 0.011
    with pytest.raises(ValueError, match="slew"):
        WorkerClock(slew=0.6)


def test_a_time_already_converted_converts_the_same_after_a_new_estimate():
    """steps.jsonl is converted at the end of a point, each token when it came in: both must agree, so
    an update never reaches back over worker times that could already have been read."""
    rnd = random.Random(5)
    offset = 0.75
    worker = lambda t: t + offset                     # noqa: E731
    clock = WorkerClock()
    clock.update(best_probe(probe_round(rnd, 0.0, worker)), 0.05)
    seen = {}
    for k in range(1, 50):
        now = 2.0 * k
        for w in (worker(now - 1.9), worker(now), worker(now + 0.05)):  # made up to the update itself
            seen[w] = clock.to_router(w)
        clock.update(best_probe(probe_round(rnd, now, worker)), now + 0.05)
        assert all(clock.to_router(w) == t for w, t in seen.items()), k
