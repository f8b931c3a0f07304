"""The controlled chunked-prefill experiment and the stall timeline: N decodes running at a steady pace,
one long prompt injected at a known moment, repeated.

Every setup (prefill_first, chunked at each chunk size, disaggregated) has its own engine holding the
same N decode requests, prefilled to `context` and left decoding. An episode runs `lead` steady steps,
injects a fresh `prompt_len`-token prompt at that step boundary (the known moment), steps until the
prompt has its first token (disaggregated: until the decode worker has made its second), runs `tail`
more steps and aborts the prompt. prefill_first's token budget is the prompt, so the prompt's step
carries no decode (the original vLLM and Orca-style schedule); chunked's is the decodes plus the chunk.
Episodes run in rounds, one per setup per round in an order rotated from round to round after a
warm-up round, so that drift of the machine hits every setup alike. Where every round's decode tokens
together would outgrow the model's positions, the decodes are renewed at `context` between episodes.

Time is each engine's own: the sum of its measured step durations (plus, disaggregated, the measured
KV import on the decode worker), so a gap between episodes or another setup's steps never counts.
`clock="wall"` times steps as a user waits for them; `clock="cpu"` by this process's CPU time (every
thread's), which leaves out waiting for a CPU that other processes hold: on a shared machine it keeps
the setups comparable, though it counts work, not latency (two threads busy for 1 ms count 2 ms).
Disaggregated: the prompt is prefilled on a separate prefill-role engine as if on its own device (the
time of that step is measured and placed on the same axis from the injection); its KV is exported and
imported (both copies measured) and it joins the decode worker at the first step boundary after the
prefill, the export and the link's transfer time (`link_bw`; 0 means the measured copy only) have
passed. The running decodes therefore see only the import.

Per episode: `stall_ms`, the decodes' largest inter-token gap that overlaps the prompt's time in (from
the injection to its first token; disaggregated, to its first step on the decode worker);
`itl_p99_ms` over the same gaps; `ttft_ms`, from the injection to the prompt's first token;
`steady_ms`, the median gap before the injection. Reported per setup as median [95% interval] over the rounds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from experiments.serving.stats import median_ci
from workers.config import EngineConfig
from workers.engine import Engine
from workers.events import TokenEvent
from workers.request import SamplingParams

WHOLE = "whole"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}   # cpu: this process's CPU time, all threads


@dataclass(frozen=True)
class Setup:
    label: str
    policy: str                 # prefill_first | chunked | disaggregated
    chunk: int | str | None     # chunked: prompt tokens per step (or WHOLE)


@dataclass
class Episode:
    setup: str
    inject_s: float                                  # on the setup's own clock
    first_token_s: float                             # the prompt's first token
    decode_times: dict = field(default_factory=dict)   # decode id -> [token times]
    joined_s: float | None = None                    # disaggregated: the prompt joined the decode worker
    prefill_ms: float | None = None                  # disaggregated: the prefill worker's step
    handoff_ms: float | None = None                  # disaggregated: export + link + import
    window_end_s: float | None = None                # disaggregated: the decode worker's first step with the prompt

    @property
    def end_s(self) -> float:
        """Where "while the prompt is in" ends: its first token, or its first step on the decode worker."""
        return self.first_token_s if self.window_end_s is None else self.window_end_s

    def gaps(self) -> tuple[list[float], list[float]]:
        """(gaps while the prompt was in, gaps before the injection), in seconds (module docstring)."""
        inside, before = [], []
        for times in self.decode_times.values():
            for a, b in zip(times, times[1:]):
                if b <= self.inject_s:
                    before.append(b - a)
                elif a < self.end_s - 1e-12:        # the gap overlaps the prompt's time in
                    inside.append(b - a)
        return inside, before

    def metrics(self) -> dict:
        inside, before = self.gaps()
        return {"stall_ms": 1e3 * max(inside) if inside else None,
                "itl_p99_ms": 1e3 * float(np.percentile(inside, 99)) if inside else None,
                "ttft_ms": 1e3 * (self.first_token_s - self.inject_s),
                "steady_ms": 1e3 * float(np.median(before)) if before else None}

    def to_dict(self, t0: float | None = None) -> dict:
        """Times relative to the injection (ms), for the timeline figure."""
        base = self.inject_s if t0 is None else t0
        ms = lambda t: None if t is None else 1e3 * (t - base)   # noqa: E731
        return {"setup": self.setup, "first_token_ms": ms(self.first_token_s), "joined_ms": ms(self.joined_s),
                "window_end_ms": ms(self.end_s),
                "prefill_ms": self.prefill_ms, "handoff_ms": self.handoff_ms,
                "decodes": {k: [ms(t) for t in v] for k, v in self.decode_times.items()}}


def setups(chunks: list, disaggregated: bool = True) -> list[Setup]:
    out = [Setup("prefill_first", "prefill_first", None)]
    out += [Setup(f"chunk {c}", "chunked", c) for c in chunks]
    if disaggregated:
        out.append(Setup("disaggregated", "disaggregated", None))
    return out


class Bench:
    """One setup's engine(s) and clock, its decodes kept running from episode to episode."""

    def __init__(self, model, setup: Setup, num_decodes: int, context: int, prompt_len: int, max_tokens: int,
                 link_bw: float, gen: torch.Generator, clock: str = "wall", per_episode: int | None = None):
        """`max_tokens`: what the decodes may make in all; where that outgrows the model's positions beside
        the context and the prompt, they make what fits and are renewed at `context` before an episode
        that could outrun them (`per_episode`: the most tokens one episode takes)."""
        self.model, self.setup, self.prompt_len, self.link_bw, self.gen = model, setup, prompt_len, link_bw, gen
        self.clock = CLOCKS[clock]
        cfg = model.cfg
        block = 16
        room = cfg.max_position_embeddings - context - prompt_len - 8
        per_episode = per_episode or max_tokens
        if room < per_episode:
            raise ValueError(f"controlled chunking: context {context} + prompt_len {prompt_len} + the decodes' "
                             f"{per_episode} tokens of one episode exceed {cfg.name}'s "
                             f"{cfg.max_position_embeddings} positions; lower chunking_controlled.prompt_len or context")
        max_tokens = min(max_tokens, room)
        self.context, self.max_tokens, self.per_episode, self.renewed = context, max_tokens, per_episode, 0
        max_len = context + max_tokens + prompt_len + 8
        blocks = num_decodes * -(-(context + max_tokens + 1) // block) + 2 * -(-(prompt_len + 2) // block) + 8
        chunk = setup.chunk
        if setup.policy == "chunked":
            size = prompt_len if chunk == WHOLE else int(chunk)
            policy, budget = "chunked", num_decodes + size
        elif setup.policy == "prefill_first":        # the prompt fills the step's budget: no decode beside it
            policy, budget = "prefill_first", prompt_len
        else:                                       # the decode worker never sees a prompt chunk but the import
            policy, budget = "chunked", num_decodes + context
        self.engine = Engine(model, EngineConfig(policy=policy, token_budget=budget,
                                                 max_batch=num_decodes + 2, block_size=block, num_kv_blocks=blocks,
                                                 max_model_len=max_len))
        self.prefill = None
        if setup.policy == "disaggregated":
            self.prefill = Engine(model, EngineConfig(policy="chunked", token_budget=prompt_len, max_batch=2,
                                                      block_size=block, num_kv_blocks=-(-(prompt_len + 2) // block) + 4,
                                                      max_model_len=prompt_len + 8, role="prefill"))
        self.num_decodes = num_decodes
        self._start_decodes()
        self.now = 0.0
        self.count = 0

    def _start_decodes(self) -> None:
        """N fresh decodes at `context`, prefilled off the clock."""
        self.ids = [f"d{i}" + (f".{self.renewed}" if self.renewed else "") for i in range(self.num_decodes)]
        for rid in self.ids:
            self.engine.add_request(rid, self._prompt(self.context),
                                    SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))
        while any(r.is_prefill for r in self.engine.requests.values()):
            self.engine.step()

    def _renew_if_short(self) -> None:
        """Before an episode: decodes with fewer tokens left than an episode takes (or already finished)
        are aborted and replaced by fresh ones at `context`."""
        reqs = self.engine.requests
        left = min(self.max_tokens - reqs[rid].num_output_tokens if rid in reqs else 0 for rid in self.ids)
        if left >= self.per_episode:
            return
        for rid in self.ids:
            if rid in reqs:
                self.engine.abort(rid)
        self.renewed += 1
        self._start_decodes()

    def _prompt(self, n: int) -> list[int]:
        return torch.randint(self.model.cfg.vocab_size, (n,), generator=self.gen).tolist()

    def _step(self, times: dict) -> list:
        start = self.clock()
        events = self.engine.step()
        self.now += self.clock() - start
        for e in events:
            if isinstance(e, TokenEvent) and e.request_id in times:
                times[e.request_id].append(self.now)
        return events

    def episode(self, lead: int, tail: int) -> Episode:
        self._renew_if_short()
        self.count += 1
        pid = f"prompt{self.count}"
        times = {rid: [] for rid in self.ids}
        for _ in range(lead):
            self._step(times)
        inject = self.now
        prompt = self._prompt(self.prompt_len)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        ep = Episode(self.setup.label, inject, inject, times)
        if self.prefill is None:
            self.engine.add_request(pid, prompt, params)
            while True:
                events = self._step(times)
                if any(isinstance(e, TokenEvent) and e.request_id == pid for e in events):
                    ep.first_token_s = self.now
                    break
        else:
            self._disaggregated(ep, pid, prompt, params, times)
        for _ in range(tail):
            self._step(times)
        if pid in self.engine.requests:
            self.engine.abort(pid)
        return ep

    def _disaggregated(self, ep: Episode, pid: str, prompt: list[int], params: SamplingParams, times: dict) -> None:
        start = self.clock()
        self.prefill.add_request(pid, prompt, params)
        first = None
        while first is None:
            first = next((e.token for e in self.prefill.step() if isinstance(e, TokenEvent) and e.request_id == pid),
                         None)
        prefilled = self.clock()
        kv = self.prefill.export_kv(pid)
        exported = self.clock()
        self.prefill.release(pid)
        link = kv.numel() * kv.element_size() / self.link_bw if self.link_bw else 0.0
        ep.prefill_ms = 1e3 * (prefilled - start)
        ep.first_token_s = ep.inject_s + (prefilled - start)
        due = ep.first_token_s + (exported - prefilled) + link
        while self.now < due:                       # the decodes go on while the prompt is elsewhere
            self._step(times)
        t = self.clock()
        self.engine.import_request(pid, prompt, first, params, kv)
        self.now += self.clock() - t           # the import is the decode worker's time
        ep.joined_s = self.now
        ep.handoff_ms = 1e3 * (ep.joined_s - ep.first_token_s)
        while True:                                   # the prompt's second token: its first step here
            events = self._step(times)
            if any(isinstance(e, TokenEvent) and e.request_id == pid for e in events):
                break
        ep.window_end_s = self.now


def run(model, chunks: list, num_decodes: int, context: int, prompt_len: int, repeats: int, lead: int = 3,
        tail: int = 2, link_bw: float = 0.0, seed: int = 0, disaggregated: bool = True, clock: str = "wall",
        max_extra: int = 0) -> dict:
    """The experiment of the module docstring: {"rows": [per setup: chunk, stall_ms, ttft_ms, itl_p99_ms,
    steady_ms as [median, low, high], samples], "timeline": the median round's episodes, "extra_rounds",
    "renewed": per setup, how often its decodes were renewed at `context`}.
    After `repeats` rounds, up to `max_extra` more while the smallest chunk's and the largest chunk's stall
    or TTFT intervals still overlap (a noisy machine; every setup gets each extra round)."""
    if clock not in CLOCKS:
        raise ValueError(f"chunking_controlled.clock={clock!r}: choose {' or '.join(CLOCKS)}")
    if repeats < 2:
        raise ValueError(f"chunking_controlled.repeats={repeats}: at least 2 rounds are needed for an interval")
    bad = [c for c in chunks if c != WHOLE and (not isinstance(c, int) or c < 1 or c > prompt_len)]
    if bad:
        raise ValueError(f"chunking_controlled.chunks: {bad} must be token counts in [1, prompt_len={prompt_len}] "
                         f"or {WHOLE!r}")
    gen = torch.Generator().manual_seed(seed)
    plan = setups(chunks, disaggregated)
    steps = {s.label: lead + tail + 4 + (-(-prompt_len // (prompt_len if s.chunk in (None, WHOLE) else s.chunk)))
             for s in plan}
    per = max(steps.values()) * 2 + 16                 # the decodes' tokens in one episode, with room to spare
    most = per * (repeats + max_extra + 1)              # ... and over every episode
    benches = {s.label: Bench(model, s, num_decodes, context, prompt_len, most, link_bw, gen, clock, per)
               for s in plan}
    episodes: dict[str, list[Episode]] = {s.label: [] for s in plan}

    def one_round(k: int) -> None:
        shift = k % len(plan)
        for s in plan[shift:] + plan[:shift]:
            ep = benches[s.label].episode(lead, tail)
            if k:                                   # round 0 warms up
                episodes[s.label].append(ep)

    for k in range(repeats + 1):
        one_round(k)
    ends = [s.label for s in plan if s.policy == "chunked"]
    extra = 0
    while extra < max_extra and len(ends) > 1 and not _separated(episodes[ends[0]], episodes[ends[-1]], seed):
        extra += 1
        one_round(repeats + extra)
    rows = []
    for s in plan:
        per = [ep.metrics() for ep in episodes[s.label]]
        row = {"setup": s.label, "policy": s.policy, "chunk": s.chunk}
        for key in ("stall_ms", "ttft_ms", "itl_p99_ms", "steady_ms"):
            ci = median_ci([m[key] for m in per if m[key] is not None], seed=seed)
            row[key] = [ci["median"], ci["lo"], ci["hi"]]
        row["samples"] = per
        rows.append(row)
    median_round = repeats // 2
    timeline = {s.label: episodes[s.label][median_round].to_dict() for s in plan}
    return {"num_decodes": num_decodes, "context": context, "prompt_len": prompt_len, "repeats": repeats,
            "lead": lead, "tail": tail, "link_bw": link_bw, "clock": clock, "max_extra": max_extra,
            "extra_rounds": extra, "rows": rows, "timeline": timeline,
            "renewed": {label: b.renewed for label, b in benches.items()}}


def _separated(a: list[Episode], b: list[Episode], seed: int) -> bool:
    """Whether both the stall and the TTFT of two setups differ as compare.py would state it."""
    from experiments.serving.compare import Estimate, differs

    for key in ("stall_ms", "ttft_ms"):
        e = []
        for eps in (a, b):
            ci = median_ci([m[key] for m in (ep.metrics() for ep in eps) if m[key] is not None], seed=seed)
            e.append(Estimate(key, ci["median"], None if ci["lo"] is None else (ci["lo"], ci["hi"])))
        if differs(*e) == 0:
            return False
    return True
