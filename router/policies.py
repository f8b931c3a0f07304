"""Which worker gets a request: small classes behind a name. Adding one touches this file only.

The router keeps each worker's load from what it has assigned (exact and never stale):
outstanding prompt tokens, running requests, and KV tokens held. A policy that picks the least of
something says what in `key(load)`, and which load fields that key reads in `fields` (all of them
unless it says fewer); `choose` is the first worker with the least key, and router/load_index.py
finds that same worker without looking at every one, re-ranking a worker when one of those fields changes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerLoad:
    name: str
    kv_capacity_tokens: int
    prompt_tokens: int = 0      # assigned prompts not yet prefilled
    running: int = 0            # requests it decodes (or serves whole) that have not finished
    kv_tokens: int = 0          # tokens of those requests' KV: prompt plus tokens so far

    @property
    def kv_fraction(self) -> float:
        return self.kv_tokens / max(self.kv_capacity_tokens, 1)

    def __setattr__(self, name, value):
        d = self.__dict__                     # (its fields are plain: set in place, read on every token)
        d[name] = value
        if name in d.get("_watched", ()):     # a LoadIndex ranks the workers by this field: it is told
            d["_watch"]()


LOAD_FIELDS = ("prompt_tokens", "running", "kv_tokens")   # what a key may read; a policy names fewer in `fields`


class RoundRobin:
    def __init__(self):
        self._next = 0

    def choose(self, loads: list[WorkerLoad], prompt_len: int) -> WorkerLoad:
        chosen = loads[self._next % len(loads)]
        self._next += 1
        return chosen


class _Least:
    """The first of the loads with the least key(load), which reads only the load's `fields`."""

    fields: tuple = LOAD_FIELDS

    @staticmethod
    def key(w: WorkerLoad) -> tuple:
        raise NotImplementedError

    def choose(self, loads: list[WorkerLoad], prompt_len: int) -> WorkerLoad:
        return min(loads, key=self.key)


class LeastPromptTokens(_Least):
    fields = ("prompt_tokens", "running")

    @staticmethod
    def key(w: WorkerLoad) -> tuple:
        return w.prompt_tokens, w.running


class LeastKV(_Least):
    @staticmethod
    def key(w: WorkerLoad) -> tuple:
        return w.kv_fraction, w.running


class FewestRunning(_Least):
    @staticmethod
    def key(w: WorkerLoad) -> tuple:
        return w.running, w.kv_fraction


PREFILL_POLICIES = {"round_robin": RoundRobin, "least_prompt_tokens": LeastPromptTokens}
DECODE_POLICIES = {"least_kv": LeastKV, "fewest_running": FewestRunning}
