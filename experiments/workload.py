"""Open-loop workloads: which requests arrive when. Seeded and reproducible; no clock, no model.

Arrivals: the first request at 0.0, request i after i gaps: exponential (`poisson`, mean 1/rate),
gamma with shape=burstiness, scale=1/(rate*burstiness) (`gamma`, as `vllm bench serve`: 1 is
Poisson, smaller is burstier), or exactly 1/rate (`fixed`).

Lengths: a `LengthSpec` draws (fixed `value`; uniform integer in [min, max]; lognormal with mean
`mean` tokens, mu = ln(mean) - sigma**2/2), multiplies by `length_scale`, rounds, and clips to
[min, max] scaled alike (at least 1): `length_scale` shrinks the whole distribution, bounds
included, so a scaled preset keeps its shape. Each request is then fitted to `max_model_len`:
max_tokens is capped at max_model_len - 1, then the prompt at max_model_len - max_tokens (at least
one token each); where even the shortest lengths asked for cannot fit, so every request is cut, it
warns once, naming the keys (`cut_note`). `SeedSequence(seed).spawn` gives independent streams for
arrivals, prompt lengths, output lengths and token ids: changing the rate changes no length or token.

Traces: `trace` names a JSONL file, one request a line: `arrival_s` (>= 0), `output_len` (>= 1),
`prompt_len` (>= 1) or `prompt_ids`, optional `id`. Lines are sorted by arrival and replayed as
recorded (no shift; `rate`/`arrival` ignored); the first `num_requests` are used. `length_scale`
applies to trace lengths too, never to given `prompt_ids` (used as they are, only cut from the end
to fit max_model_len); missing ids come from the token stream. A config with a trace is named "trace".

Errors name the key, not the group: `LengthSpec`: `sigma=-1 must be >= 0`; `WorkloadConfig`: `rate=0
must be positive`, `prompt_len.sigma=-1 must be >= 0`; the caller prefixes `workload.`. Trace errors
(`WorkloadError`) are one line naming the file and line.

Recommended presets (conf/workload/*.yaml), shaped like public traces (ShareGPT chat, document
summarization, code completion), not fitted to them:
  chat           prompt lognormal mean 300,  sigma 1.0, [4, 4096];   output lognormal mean 250, sigma 0.8, [4, 1024]
  summarization  prompt lognormal mean 2000, sigma 0.5, [256, 8192]; output lognormal mean 100, sigma 0.5, [8, 512]
  code           prompt lognormal mean 1500, sigma 0.4, [128, 4096]; output lognormal mean 60,  sigma 0.5, [4, 256]
  fixed          prompt fixed 512; output fixed 128
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DISTS = ("fixed", "uniform", "lognormal")
ARRIVALS = ("poisson", "gamma", "fixed")
log = logging.getLogger(__name__)
_warned: set[str] = set()             # each cut_note once a process (a planner builds a workload per probe)


class WorkloadError(ValueError):
    """A trace that cannot be replayed; the message is one line naming the file and line."""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class LengthSpec:
    """A distribution of token counts. Messages name the field alone (`sigma=-1 must be >= 0`)."""

    dist: str = "fixed"    # "fixed" | "uniform" | "lognormal"
    value: int = 128       # fixed
    min: int = 1           # bounds for every kind; uniform draws integers in [min, max]
    max: int | None = None # None: no bound but the model's context (build_workload fits every request to it)
    mean: float = 128.0    # lognormal: mean of the distribution, in tokens
    sigma: float = 1.0     # lognormal: sigma of the underlying normal

    def __post_init__(self):
        if self.dist not in DISTS:
            raise ValueError(f"dist={self.dist!r}: choose one of {list(DISTS)}")
        for key, value in (("value", self.value), ("min", self.min), ("max", self.max)):
            if value is None and key == "max":
                continue
            if not _is_int(value) or value < 1:
                raise ValueError(f"{key}={value!r} must be a positive integer")
        if self.dist == "uniform" and self.max is None:
            raise ValueError("max=None: a uniform distribution needs an upper bound")
        hi = math.inf if self.max is None else self.max
        if hi < self.min:
            raise ValueError(f"max={self.max} must be >= min={self.min}")
        if self.dist == "fixed" and not self.min <= self.value <= hi:
            raise ValueError(f"value={self.value} is outside [min={self.min}, max={self.max}]")
        if not _is_number(self.mean) or self.mean <= 0:
            raise ValueError(f"mean={self.mean!r} must be positive")
        if not _is_number(self.sigma) or self.sigma < 0:
            raise ValueError(f"sigma={self.sigma!r} must be >= 0")

    def sample(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        """n lengths: drawn, times `scale`, rounded, clipped to the scaled [min, max]."""
        if self.dist == "fixed":
            raw = np.full(n, float(self.value))
        elif self.dist == "uniform":
            raw = rng.integers(self.min, self.max, size=n, endpoint=True).astype(float)
        else:
            raw = rng.lognormal(math.log(self.mean) - self.sigma ** 2 / 2, self.sigma, size=n)
        lo, hi = self._bounds(scale)
        return np.clip(np.rint(raw * scale), lo, hi).astype(np.int64)

    def shortest(self, scale: float = 1.0) -> tuple[str, int]:
        """The shortest length `sample` can give, and the key that sets it (`value`, else `min`)."""
        lo, hi = self._bounds(scale)
        if self.dist == "fixed":
            return "value", int(np.clip(np.rint(self.value * scale), lo, hi))
        return "min", lo

    def _bounds(self, scale: float) -> tuple[int, float]:
        lo = max(1, round(self.min * scale))
        return lo, np.inf if self.max is None else max(lo, round(self.max * scale))


def _length_spec(key: str, spec) -> LengthSpec:
    if isinstance(spec, LengthSpec):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"{key}={spec!r} must be a mapping of LengthSpec fields")
    known = {f.name for f in dataclasses.fields(LengthSpec)}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown key; choose from {sorted(known)}")
    try:
        return LengthSpec(**dict(spec))
    except ValueError as e:
        raise ValueError(f"{key}.{e}") from None


@dataclass(frozen=True)
class WorkloadConfig:
    """What arrives when. Messages name the key (`rate=0 must be positive`); the caller adds `workload.`."""

    name: str = "chat"
    num_requests: int = 64
    rate: float = 4.0              # requests/s
    arrival: str = "poisson"       # "poisson" | "gamma" | "fixed"
    burstiness: float = 1.0        # gamma shape; 1 = Poisson, smaller = burstier
    prompt_len: LengthSpec = field(default_factory=lambda: LengthSpec(value=512))
    output_len: LengthSpec = field(default_factory=LengthSpec)
    trace: str | None = None       # JSONL trace; when set, arrivals and lengths come from it
    length_scale: float = 1.0      # multiplies every length (and length bound) before clipping

    def __post_init__(self):
        for key in ("prompt_len", "output_len"):
            object.__setattr__(self, key, _length_spec(key, getattr(self, key)))
        if self.trace is not None:
            object.__setattr__(self, "name", "trace")
        if not _is_int(self.num_requests) or self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests!r} must be a positive integer")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival={self.arrival!r}: choose one of {list(ARRIVALS)}")
        for key in ("rate", "burstiness", "length_scale"):
            value = getattr(self, key)
            if not _is_number(value) or value <= 0:
                raise ValueError(f"{key}={value!r} must be positive")


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    arrival_s: float       # offset from the start of the workload
    prompt_ids: list[int]  # empty when built with token_ids=False (a simulation needs lengths only)
    max_tokens: int
    num_prompt_tokens: int = 0   # the prompt's length, given either way


def _arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    n = cfg.num_requests
    if cfg.arrival == "fixed":
        return np.arange(n) / cfg.rate
    if cfg.arrival == "poisson":
        gaps = rng.exponential(1.0 / cfg.rate, size=n - 1)
    else:
        gaps = rng.gamma(cfg.burstiness, 1.0 / (cfg.rate * cfg.burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


@contextmanager
def many_objects():
    """While a million requests' objects are made and kept: the cycle collector runs every 100,000
    allocations instead of every 700, for at that rate its full collections rescan them over and over
    (docs/benchmarks.md, Simulator speed)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def _fit(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """Keep prompt + output <= max_model_len: cap the output first, then the prompt; both >= 1."""
    output_len = max(1, min(output_len, max_model_len - 1))
    return max(1, min(prompt_len, max_model_len - output_len)), output_len


def cut_note(cfg: WorkloadConfig, max_model_len: int) -> str | None:
    """Why every request of `cfg` is cut to fit `max_model_len`, when even its shortest prompt and output
    (fixed values, else the bounds' minimums, after length_scale) do not fit together; None otherwise
    (a distribution whose tail is cut is the fitting the module docstring describes)."""
    if cfg.trace is not None:
        return None
    (p_field, p), (o_field, o) = cfg.prompt_len.shortest(cfg.length_scale), cfg.output_len.shortest(cfg.length_scale)
    if p + o <= max_model_len:
        return None
    prompt, output = _fit(p, o, max_model_len)
    scaled = f" (x length_scale {cfg.length_scale:g})" if cfg.length_scale != 1 else ""
    return (f"prompt_len.{p_field}={getattr(cfg.prompt_len, p_field)} and output_len.{o_field}="
            f"{getattr(cfg.output_len, o_field)}{scaled} need at least {p + o} tokens a request, more than "
            f"max_model_len={max_model_len}: every request is cut to fit ({p} + {o} tokens become {prompt} + {output})")


def build_workload(cfg: WorkloadConfig, vocab_size: int, max_model_len: int, seed: int,
                   token_ids: bool = True) -> list[WorkloadRequest]:
    """The requests of `cfg`, sorted by arrival; same seed, same list. `token_ids=False` draws the same
    arrivals and lengths and leaves the prompts' ids out (the token stream is drawn last, per request).
    Warns (once a process) when every request must be cut to fit max_model_len (`cut_note`)."""
    if vocab_size < 1 or max_model_len < 2:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1 and max_model_len={max_model_len} >= 2")
    note = cut_note(cfg, max_model_len)
    if note is not None and note not in _warned:
        _warned.add(note)
        log.warning("workload: %s", note)
    arrival_rng, prompt_rng, output_rng, token_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
    if cfg.trace is not None:
        return _replay(cfg, vocab_size, max_model_len, token_rng, token_ids)
    arrivals = _arrivals(cfg, arrival_rng)
    prompt_lens = cfg.prompt_len.sample(prompt_rng, cfg.num_requests, cfg.length_scale)
    output_lens = cfg.output_len.sample(output_rng, cfg.num_requests, cfg.length_scale)
    requests = []
    with many_objects():
        for i, (t, n, out) in enumerate(zip(arrivals.tolist(), prompt_lens.tolist(), output_lens.tolist())):
            prompt_len, max_tokens = _fit(n, out, max_model_len)
            ids = token_rng.integers(0, vocab_size, size=prompt_len).tolist() if token_ids else []
            requests.append(WorkloadRequest(f"r{i}", t, ids, max_tokens, prompt_len))
    return requests


def _replay(cfg: WorkloadConfig, vocab_size: int, max_model_len: int, token_rng,
            token_ids: bool = True) -> list[WorkloadRequest]:
    requests, seen = [], set()
    for i, entry in enumerate(load_trace(cfg.trace)[:cfg.num_requests]):
        where = f"{cfg.trace} line {entry['line']}"
        ids = entry["prompt_ids"]
        if ids is not None and max(ids) >= vocab_size:
            raise WorkloadError(f"{where}: prompt id {max(ids)} is not a token id in [0, {vocab_size})")
        prompt_len = len(ids) if ids is not None else max(1, round(entry["prompt_len"] * cfg.length_scale))
        output_len = max(1, round(entry["output_len"] * cfg.length_scale))
        prompt_len, max_tokens = _fit(prompt_len, output_len, max_model_len)
        if ids is not None:
            ids = ids[:prompt_len]
        else:
            ids = token_rng.integers(0, vocab_size, size=prompt_len).tolist() if token_ids else []
        rid = entry["id"] if entry["id"] is not None else f"r{i}"
        if rid in seen:
            raise WorkloadError(f"{where}: id {rid!r} is used twice")
        seen.add(rid)
        requests.append(WorkloadRequest(rid, entry["arrival_s"], ids, max_tokens, prompt_len))
    return requests


def load_trace(path) -> list[dict]:
    """Lines as {id (str|None), arrival_s, prompt_len, prompt_ids (list|None), output_len, line}, by arrival."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"trace file {path} does not exist")
    entries = []
    with open(p, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if text.strip():
                entries.append(_parse_line(text, path, n))
    if not entries:
        raise WorkloadError(f"trace file {path} has no requests")
    return sorted(entries, key=lambda e: e["arrival_s"])


def _parse_line(text: str, path, line: int) -> dict:
    where = f"{path} line {line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise WorkloadError(f"{where}: not valid JSON") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: not a JSON object")
    for key in ("arrival_s", "output_len"):
        if key not in obj:
            raise WorkloadError(f"{where}: missing field {key!r}")
    if "prompt_len" not in obj and obj.get("prompt_ids") is None:
        raise WorkloadError(f"{where}: missing field 'prompt_len' (or 'prompt_ids')")
    arrival = obj["arrival_s"]
    if not _is_number(arrival) or arrival < 0:
        raise WorkloadError(f"{where}: arrival_s must be a number >= 0, not {arrival!r}")
    for key in ("output_len", "prompt_len"):
        if key in obj and (not _is_int(obj[key]) or obj[key] < 1):
            raise WorkloadError(f"{where}: {key} must be a positive integer, not {obj[key]!r}")
    ids = obj.get("prompt_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(_is_int(x) and x >= 0 for x in ids):
            raise WorkloadError(f"{where}: prompt_ids must be a non-empty list of token ids >= 0")
        if "prompt_len" in obj and obj["prompt_len"] != len(ids):
            raise WorkloadError(f"{where}: prompt_len={obj['prompt_len']} but prompt_ids has {len(ids)} ids")
    rid = obj.get("id")
    if rid is not None and not (isinstance(rid, str) or _is_int(rid)):
        raise WorkloadError(f"{where}: id must be a string, not {rid!r}")
    return {"id": None if rid is None else str(rid), "arrival_s": float(arrival),
            "prompt_len": len(ids) if ids is not None else obj["prompt_len"], "prompt_ids": ids,
            "output_len": obj["output_len"], "line": line}
