"""One try of a request on the real workers: its journey (router/journey.py), its id on the workers
("<router>:<n>"), and the decode worker's tokens that came in before the prefill worker's first.

Times in it are on the router's clock. The router keeps the attempts in flight in its Journeys
(router/router.py) and the worker events move them on (router/worker_events.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from router.journey import Journey


@dataclass(eq=False)
class Attempt(Journey):
    aid: str = field(default="", kw_only=True)
    early: list = field(default_factory=list, kw_only=True)   # decode-worker tokens that overtook the first token
