"""Each worker's clock read on the router's: min-RTT offset estimates, applied without jumps.

A probe: the router reads its clock (t_send), asks the worker for its clock (w) and reads its own again
when the answer is in (t_recv). Whatever the split of the round trip between request and reply, the
worker read w at a router time within [t_send, t_recv], so offset = w - (t_send + t_recv) / 2 is
wrong by at most rtt / 2. Of several probes the one with the shortest round trip bounds the error
best (Cristian's algorithm; NTP's clock filter), so a round of probes keeps only that one.

Clocks of different nodes drift apart (tens of ppm), so rounds are repeated. A sample's error bound
grows with its age at `drift` seconds per second (NTP's dispersion); the estimate in use is, at each
round, the recent sample with the smallest bound.

Converting: router time = worker time - offset(worker time). When the estimate changes, the offset
does not jump to it: it slews toward it at most `slew` seconds per second of worker time (1%), so the
gap between two tokens of one worker keeps its length to within 1%. A jump would add the whole
change to one gap, and a change can be as large as a decode step when probes are slow.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    offset: float    # worker clock - router clock, seconds
    rtt: float       # the probe's round trip, seconds
    at: float        # router time of the probe (midpoint)

    def bound(self, now: float, drift: float) -> float:
        """Largest error of `offset` at router time `now`."""
        return self.rtt / 2 + drift * max(0.0, now - self.at)


def best_probe(probes) -> Sample:
    """The sample of the shortest round trip among (t_send, worker_time, t_recv) triples."""
    probes = list(probes)
    if not probes:
        raise ValueError("no probe answered")
    t_send, w, t_recv = min(probes, key=lambda p: p[2] - p[0])
    if t_recv < t_send:
        raise ValueError(f"a probe came back before it was sent ({t_send} -> {t_recv}): the router's clock went back")
    mid = (t_send + t_recv) / 2
    return Sample(w - mid, t_recv - t_send, mid)


class WorkerClock:
    """One worker's clock on the router's. Without any sample the offset is 0 (the same clock)."""

    def __init__(self, drift: float = 1e-4, slew: float = 0.01, keep: int = 8, history: int = 100_000):
        if not 0 < slew < 0.5:
            raise ValueError(f"slew={slew} must be in (0, 0.5): one worker's gaps must keep their order and size")
        self.drift, self.slew, self.keep, self.history = drift, slew, keep, history
        self.samples: list[Sample] = []          # the best of each recent round
        self.chosen: Sample | None = None
        self.rounds = 0
        # piecewise offset over worker time: from w0 on, it moves from o0 toward target at `slew`
        self._w0: list[float] = []
        self._pieces: list[tuple[float, float]] = []   # (o0, target)

    def update(self, sample: Sample, now: float) -> Sample:
        """Take one round's best sample (at router time `now`); returns the sample now in use."""
        self.samples = (self.samples + [sample])[-self.keep:]
        self.rounds += 1
        best = min(self.samples, key=lambda s: s.bound(now, self.drift))
        self.chosen = best
        if not self._pieces:                     # the first estimate: nothing converted yet, take it
            self._w0, self._pieces = [float("-inf")], [(best.offset, best.offset)]
            return best
        # The new piece starts no earlier than the worker's clock can read now (its estimate plus the
        # error bound), so a time converted before this update converts the same after it.
        w0 = max(now + best.offset + best.bound(now, self.drift), self._w0[-1])
        here = self.offset_at(w0)                # the new piece starts where the last one is: no jump
        self._w0.append(w0)
        self._pieces.append((here, best.offset))
        if len(self._pieces) > self.history:     # days of rounds: what is older is long converted
            del self._w0[0], self._pieces[0]
        return best

    def offset_at(self, w: float) -> float:
        """The offset applied to worker time `w` (continuous in w, slope at most `slew`)."""
        if not self._pieces:
            return 0.0
        i = bisect.bisect_right(self._w0, w) - 1
        if i < 0:                                # before the oldest piece kept
            return self._pieces[0][0]
        o0, target = self._pieces[i]
        reach = self.slew * (w - self._w0[i])    # the first piece starts at -inf with o0 == target
        return o0 + max(-reach, min(reach, target - o0))

    def to_router(self, w: float) -> float:
        return w - self.offset_at(w)

    def report(self, now: float) -> dict:
        """What metrics.json keeps of it: the offset in use, its error bound, the probe round trip."""
        s = self.chosen
        if s is None:
            return {"offset_ms": 0.0, "error_ms": None, "rtt_ms": None, "rounds": 0}
        return {"offset_ms": 1e3 * s.offset, "error_ms": 1e3 * s.bound(now, self.drift), "rtt_ms": 1e3 * s.rtt,
                "rounds": self.rounds}
