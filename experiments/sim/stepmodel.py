"""Step-time models: how long one engine step takes, from what the scheduler put into it.

A step's features (`features` reads them off a SchedulerOutput in one pass over its chunks):
  num_decode       decode sequences, one token each
  decode_context   their cached tokens, summed (the KV each decode reads)
  prefill_tokens   prompt tokens computed
  num_prefill      prompt chunks
  prefill_context  tokens cached before each chunk, summed (the KV a later chunk reads)
  prefill_pairs    the chunks' attention (query, key) pairs: n*s + n*(n+1)/2 for n tokens from s
  logit_rows       rows whose logits are computed: each decode, and each chunk that ends its prompt
  context_pairs    of those pairs, the ones against the KV cached before the chunk: n*s

Two models give a step's duration (what steps.jsonl records: start to end of the model's work) and the
host time between two steps of one worker (scheduling, post-processing, the worker loop):

- `LinearStepModel`, fitted to a profile of the device at hand (experiments/analysis/profile.py):
  t = c . [1, num_decode, decode_context, prefill_tokens, num_prefill, chunk_pairs, context_pairs],
  every coefficient >= 0, chunk_pairs = prefill_pairs - context_pairs (the causal pairs within the
  chunk; a pair against the cache costs less than one within the chunk, so they are priced apart;
  profiles with one pair price, terms ending in prefill_pairs, are still read). A calibrated profile
  adds the serving factors (docs/simulator.md): `decode` and `prefill`, how much longer a step of
  that kind takes while serving than in isolation, and `shared_host`, how much longer its work goes
  while another worker of its host has work (the simulator applies it for that share of the step).
- `RooflineStepModel`, for a datasheet GPU: t = overhead + max(flops / (peak * compute_eff),
  bytes / (mem_bw * mem_eff)), with FLOPs and bytes counted as experiments/hardware.py counts
  them (its docstring), generalised to chunks that start past token 0 (they read the KV before them).

Both give `decode_run(b, context, k)`: the durations of k decode-only steps of b sequences whose
summed context starts at `context` and grows by b per step, as a list (the simulator advances such
runs in one event).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from experiments.hardware import HARDWARE, Hardware, matmul_params
from workers.config import ModelConfig

FEATURES = ("num_decode", "decode_context", "prefill_tokens", "num_prefill", "prefill_context",
            "prefill_pairs", "logit_rows", "context_pairs")
LINEAR_TERMS = ("const", "num_decode", "decode_context", "prefill_tokens", "num_prefill", "chunk_pairs",
                "context_pairs")
ONE_PAIR_TERMS = ("const", "num_decode", "decode_context", "prefill_tokens", "num_prefill", "prefill_pairs")


def features(sched) -> tuple:
    """The FEATURES of one scheduled step (a workers.scheduler.SchedulerOutput), as a tuple of numbers."""
    num_decode = len(sched.decodes)
    decode_context = 0
    for c in sched.decodes:
        decode_context += c.request.num_computed_tokens
    tokens = context = pairs = ends = cached = 0
    for c in sched.prefills:
        n, s = c.num_tokens, c.request.num_computed_tokens
        tokens += n
        context += s
        pairs += n * s + n * (n + 1) // 2
        cached += n * s
        ends += s + n == c.request.num_tokens
    return (num_decode, decode_context, tokens, len(sched.prefills), context, pairs, num_decode + ends, cached)


def chunk_features(num_decode: int, decode_context: int, chunks: list[tuple[int, int, bool]]) -> tuple:
    """FEATURES of `num_decode` decodes at `decode_context` summed context beside prompt chunks given as
    (tokens, start, ends its prompt): what a profile measures and a test states by hand."""
    tokens = sum(n for n, _, _ in chunks)
    pairs = sum(n * s + n * (n + 1) // 2 for n, s, _ in chunks)
    return (num_decode, decode_context, tokens, len(chunks), sum(s for _, s, _ in chunks), pairs,
            num_decode + sum(1 for *_, e in chunks if e), sum(n * s for n, s, _ in chunks))


class StepPrice:
    """A step model as an emulated engine's price (workers/emulated.py's StepPrice): what the simulator
    charges a scheduled step with the same features. Only a model whose steps do not vary with the
    host (no shared_host factor, no spread) prices an emulated device: those serving factors are this
    machine's, and the emulated cluster runs on it for real."""

    def __init__(self, model):
        if getattr(model, "shared_host", None) or getattr(model, "spread", None):
            raise ValueError(f"step model {model.name}: a model with serving factors (shared_host, spread) "
                             "prices a machine's serving, not an emulated device; use its isolated steps")
        self.model = model
        self.name = model.name

    def price(self, sched) -> float:
        return self.model.time(features(sched))


FACTORS = ("decode", "prefill", "shared_host", "spread")   # the serving factors a calibration may fit

def describe_factors(factors: dict) -> str:
    """A calibration's factors as a reader sees them: "decode x1.12, ..., spread 0.20"."""
    return ", ".join(f"{k} {v:.2f}" if k == "spread" else f"{k} x{v:.2f}" for k, v in factors.items())


_NORMALS = np.random.default_rng(20261205).standard_normal(1 << 16)    # the jitter's draws, one table for all


def step_jitter(spread: float, stream: int, first: int, k: int | None = None):
    """Multipliers of a worker's steps `first` .. first + k - 1 (one float when k is None): exp(spread * z)
    with z drawn from a fixed table at the step's number, offset by the worker's `stream`. A step's draw
    depends on its number alone, not on the order the simulator prices steps in, so a run of steps and
    the same steps scheduled one by one vary alike."""
    start = first + stream * 40503
    if k is None:
        return math.exp(spread * _NORMALS[start & 0xFFFF])
    return np.exp(spread * _NORMALS[(start + np.arange(k)) & 0xFFFF])


@dataclass
class LinearStepModel:
    """t = factor[kind] * (c0 + c1 num_decode + c2 decode_context + c3 prefill_tokens + c4 num_prefill +
    c5 chunk_pairs + c6 context_pairs) in seconds, coef = c0..c6 (`terms`: LINEAR_TERMS; ONE_PAIR_TERMS:
    c5 prefill_pairs, an older profile's), kind "prefill" for a step with prompt tokens, else "decode";
    gap = gap_coef[0] + gap_coef[1] * sequences in the step. `factors`: a profile's serving calibration,
    {"decode": x, "prefill": y, "shared_host": z, "spread": s}; each factor left out is 1.0 (shared_host:
    not modelled); `spread`, the sigma of the lognormal that steps while serving vary by around their
    median (the simulator's step_jitter; left out: none)."""

    coef: list[float]
    gap_coef: list[float] = field(default_factory=lambda: [0.0, 0.0])
    factors: dict = field(default_factory=dict)
    name: str = "profile"
    terms: tuple | None = None             # None: LINEAR_TERMS, or ONE_PAIR_TERMS for six coefficients

    kind = "linear"

    def __post_init__(self):
        self.terms = tuple(self.terms or (ONE_PAIR_TERMS if len(self.coef) == len(ONE_PAIR_TERMS) else LINEAR_TERMS))
        if self.terms not in (LINEAR_TERMS, ONE_PAIR_TERMS):
            raise ValueError(f"terms must be {LINEAR_TERMS} (or {ONE_PAIR_TERMS}), got {self.terms}")
        if len(self.coef) != len(self.terms) or min(self.coef) < 0:
            raise ValueError(f"coef must be {len(self.terms)} non-negative numbers ({', '.join(self.terms)}), "
                             f"got {self.coef}")
        self.factors = {k: float(v) for k, v in (self.factors or {}).items() if v is not None}
        unknown = sorted(set(self.factors) - set(FACTORS))
        if unknown:
            raise ValueError(f"factors.{unknown[0]}: unknown serving factor; choose from {list(FACTORS)}")
        bad = [k for k, v in self.factors.items() if not (v > 0 and math.isfinite(v))]
        if bad:
            raise ValueError(f"factors.{bad[0]}={self.factors[bad[0]]} must be a positive number")
        self._c = list(self.coef) if len(self.coef) == 7 else list(self.coef) + [self.coef[5]]   # one pair price
        self._g0, self._g1 = self.gap_coef
        self._kd, self._kp = self.factors.get("decode", 1.0), self.factors.get("prefill", 1.0)
        self.shared_host = self.factors.get("shared_host")
        self.spread = self.factors.get("spread")

    def time(self, f: tuple) -> float:
        c = self._c
        t = c[0] + c[1] * f[0] + c[2] * f[1] + c[3] * f[2] + c[4] * f[3] + c[5] * (f[5] - f[7]) + c[6] * f[7]
        return t * (self._kp if f[2] else self._kd)

    def gap(self, num_seqs: int) -> float:
        return self._g0 + self._g1 * num_seqs

    def decode_run(self, b: int, context: int, k: int) -> list[float]:
        c, kd = self._c, self._kd
        base, c2 = c[0] + c[1] * b, c[2]
        return [kd * (base + c2 * float(context + b * i)) for i in range(k)]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "terms": list(self.terms), "coef": list(self.coef),
                "gap_coef": list(self.gap_coef), "factors": dict(self.factors)}


# Efficiency factors of the roofline model (fractions of datasheet peaks a serving engine reaches):
# - compute 0.7: Pope et al., "Efficiently Scaling Transformer Inference" (2022), report 76% model FLOPs
#   utilisation for large-batch prompt processing; FlashAttention-2 (Dao, 2023) reaches 50-73% of the
#   A100's peak in its attention forward pass. 0.7 sits between them.
# - memory 0.8: an assumption, not a measurement of pdlab: streaming kernels (copies, decode GEMVs)
#   reach roughly 80-90% of datasheet HBM bandwidth on A100/H100 class parts.
# - overhead 0.5 ms per step, 0.02 ms per sequence between steps: assumptions for a Python engine with
#   CUDA graphs; pdlab's engine has not been timed on a GPU here. Override any of them (hardware.*).
COMPUTE_EFF, MEM_EFF, STEP_OVERHEAD_S = 0.7, 0.8, 0.5e-3
GAP_COEF = (0.2e-3, 0.02e-3)


@dataclass
class RooflineStepModel:
    """A datasheet GPU's step time: overhead + max(FLOP time, memory time) at efficiency factors."""

    cfg: ModelConfig
    hw: Hardware
    dtype_bytes: int = 2
    compute_eff: float = COMPUTE_EFF
    mem_eff: float = MEM_EFF
    overhead_s: float = STEP_OVERHEAD_S
    gap_coef: tuple = GAP_COEF

    kind = "roofline"
    shared_host = None              # a datasheet GPU: no serving calibration

    def __post_init__(self):
        for key in ("compute_eff", "mem_eff"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"hardware.{key}={getattr(self, key)} must be in (0, 1]")
        cfg, d = self.cfg, self.dtype_bytes
        h, hd = cfg.hidden_size, cfg.head_dim
        layer = h * cfg.num_heads * hd + 2 * h * cfg.num_kv_heads * hd + cfg.num_heads * hd * h + 3 * h * cfg.intermediate_size
        self._flop_token = 2 * cfg.num_layers * layer                        # per token through the matmuls
        self._flop_row = 2 * cfg.vocab_size * h                              # per logits row
        self._flop_pair = 4 * cfg.num_heads * hd * cfg.num_layers           # per attended (query, key) pair
        self._bytes_fixed = matmul_params(cfg) * d                           # weights, once per step
        kv = cfg.kv_bytes_per_token(d)
        self._bytes_token = h * d + kv                                       # embedding row + KV written
        self._bytes_ctx = kv                                                 # KV read per cached token
        self._peak = self.hw.peak_flops * self.compute_eff
        self._bw = self.hw.mem_bw * self.mem_eff
        self.name = f"roofline {self.hw.name} (compute {self.compute_eff:g}, memory {self.mem_eff:g})"

    def _cost(self, f: tuple) -> tuple[float, float]:
        tokens = f[0] + f[2]
        flops = self._flop_token * tokens + self._flop_row * f[6] + self._flop_pair * (f[0] + f[1] + f[5])
        nbytes = self._bytes_fixed + self._bytes_token * tokens + self._bytes_ctx * (f[1] + f[4])
        return flops, nbytes

    def time(self, f: tuple) -> float:
        flops, nbytes = self._cost(f)
        return self.overhead_s + max(flops / self._peak, nbytes / self._bw)

    def gap(self, num_seqs: int) -> float:
        return self.gap_coef[0] + self.gap_coef[1] * num_seqs

    def decode_run(self, b: int, context: int, k: int) -> list[float]:
        flops0, nbytes0 = self._flop_token * b + self._flop_row * b, self._bytes_fixed + self._bytes_token * b
        pair, ctx_bytes, peak, bw, over = self._flop_pair, self._bytes_ctx, self._peak, self._bw, self.overhead_s
        out = []
        for i in range(k):
            ctx = float(context + b * i)
            out.append(over + max((flops0 + pair * (b + ctx)) / peak, (nbytes0 + ctx_bytes * ctx) / bw))
        return out

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "hardware": asdict(self.hw), "dtype_bytes": self.dtype_bytes,
                "compute_eff": self.compute_eff, "mem_eff": self.mem_eff, "overhead_s": self.overhead_s,
                "gap_coef": list(self.gap_coef),
                "source": "datasheet peaks (experiments/hardware.py) at the efficiency factors of "
                          "experiments/sim/stepmodel.py"}


def roofline_model(cfg: ModelConfig, hardware: str | Hardware, dtype_bytes: int = 2, **overrides) -> RooflineStepModel:
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    return RooflineStepModel(cfg, hw, dtype_bytes, **{k: v for k, v in overrides.items() if v is not None})


def fit_linear(rows: list[tuple], times_s: list[float]) -> tuple[list[float], dict]:
    """Non-negative least squares of step times on LINEAR_TERMS, weighted so that every row counts by
    its relative error. `rows`: FEATURES tuples. Returns (coef, fit error: relative errors of the fitted
    times, |predicted - measured| / measured, as median, p90 and max, and their signed mean)."""
    if len(rows) < len(LINEAR_TERMS):
        raise ValueError(f"need at least {len(LINEAR_TERMS)} measured steps to fit, got {len(rows)}")
    x = np.array([[1.0, f[0], f[1], f[2], f[3], f[5] - f[7], f[7]] for f in rows], dtype=float)
    y = np.asarray(times_s, dtype=float)
    norm = x.max(axis=0)
    norm[norm == 0] = 1.0
    w = 1.0 / y
    coef, _ = nnls((x / norm) * w[:, None], y * w)
    coef = coef / norm
    return [float(c) for c in coef], relative_errors(x @ coef, y)


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method, "Solving Least Squares
    Problems", 1974, ch. 23): move the variable whose gradient most wants to grow into the passive set,
    solve least squares on that set, and step back toward the last feasible point while a passive
    variable would go negative. Returns (x, residual norm)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        w = a.T @ (b - a @ x)                      # minus the gradient
        if passive.all() or w[~passive].max() <= tol * max(1.0, np.abs(w).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x, float(np.linalg.norm(a @ x - b))


def relative_errors(predicted, measured) -> dict:
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    rel = (p - m) / m
    a = np.abs(rel)
    return {"median_abs": float(np.median(a)), "p90_abs": float(np.percentile(a, 90)), "max_abs": float(a.max()),
            "mean": float(rel.mean()), "num": int(a.size)}


def model_from_dict(d: dict, cfg: ModelConfig | None = None):
    """A step model from its to_dict() (a profile's "step_model" section)."""
    if d.get("kind") == "linear":
        return LinearStepModel(list(d["coef"]), list(d.get("gap_coef", [0.0, 0.0])), d.get("factors") or {},
                               d.get("name", "profile"), d.get("terms"))
    if d.get("kind") == "roofline":
        if cfg is None:
            raise ValueError("a roofline step model needs the model config")
        hw = Hardware(**d["hardware"])
        return RooflineStepModel(cfg, hw, d["dtype_bytes"], d["compute_eff"], d["mem_eff"], d["overhead_s"],
                                 tuple(d["gap_coef"]))
    raise ValueError(f"unknown step model kind {d.get('kind')!r}")


def check_finite(model) -> None:
    """Refuse a model whose step times are not positive and finite (a fit gone wrong)."""
    t = model.time(chunk_features(1, 1, []))
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"step model {model.name} predicts {t} s for one decode: not usable")
