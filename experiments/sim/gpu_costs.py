"""GPU step times from NVIDIA's measured performance database (aiconfigurator-core), roofline as fallback.

`aiconfigurator-core` (Apache-2.0; a dependency of pdlab) ships per-operation kernel times
measured on datacenter GPUs (GEMMs, attention, norms, ...) for vLLM, SGLang and TensorRT-LLM, and
composes them into the time of one engine step. pdlab asks it for three things, once per (model, GPU,
framework), on a grid of shapes, and keeps them as tables (`Tables`):

  decode_ms[b][c]     a decode-only step of b sequences, each with c tokens cached (Grid: which b, c)
                      (`decode_step_latency(b, c, 0)`: every sequence attends c + 1 keys)
  shared_ms[t]        the non-attention work of a step of t tokens (GEMMs, norms, logits), from
                      `mixed_step_breakdown(t, 0, t, 1)`: it depends on the step's token count only
  prefill_attn_ms[n]  the attention of an n-token prompt from an empty cache (the same call)
  decode_attn_ms[b][c] the attention of b decode sequences at context c (`mixed_step_breakdown`)

`MeasuredStepModel` prices a step from its features (experiments/sim/stepmodel.py):
  decode-only:  decode_ms(b, mean context)                         (interpolated along context)
  with prompt:  shared_ms(b + prompt tokens) + prefill_attn(pairs) + decode_attn_ms(b, mean context)
where prefill_attn(pairs) reads the prompt curve at the same number of attended (query, key) pairs: one
attention kernel over all chunks of the step, a pair against cached KV priced like one within the
chunk (aiconfigurator's own mixed step also splits a step this way: shared work, context attention,
decode attention). The host gap between steps is the roofline model's assumption (stepmodel.GAP_COEF):
the database times kernels, not a serving loop.

Which source prices a GPU (`choose`): hardware.costs=auto takes aiconfigurator where it is installed,
has a database for the GPU and framework and builds the model; otherwise the roofline, with the reason.
hardware.costs=aiconfigurator insists (an error names what is missing); hardware.costs=roofline skips
it. A shape beyond the tables (a batch, context or token count past the grid, which spans the engine's
limits) or a grid point the database refuses is priced by the roofline, and counted (`fallback_steps`,
`fallback_points`). Every result names its source: "aiconfigurator <system> <framework> <version>" or
"roofline <gpu> (...)". The tables are kept on disk (CACHE), named by the model's shape, the database's
framework version, aiconfigurator-core's version and the grid, so a later process skips the database.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from workers.config import ModelConfig

SYSTEMS = {"a100": "a100_sxm", "h100": "h100_sxm", "h200": "h200_sxm"}   # pdlab GPU -> aiconfigurator system
FRAMEWORKS = ("vllm", "sglang", "trtllm")
SOURCES = ("auto", "aiconfigurator", "roofline")
DTYPES = {2: "bfloat16"}             # the database's dense models are timed in bf16 (fp8 variants aside)
CACHE = Path.home() / ".cache" / "pdlab" / "aiconfigurator"   # the HF config.json handed to aiconfigurator


class SourceUnavailable(RuntimeError):
    """aiconfigurator cannot price this model on this GPU; the message says why."""


@dataclass(frozen=True)
class Grid:
    """Shapes the tables hold: batches up to max_batch (every one to 64, then every 8 to 256, every 32
    beyond; a step between two is read linearly between them), contexts and token counts up to theirs."""

    max_batch: int = 1024
    max_context: int = 8192
    max_tokens: int = 16384

    def batches(self) -> list[int]:
        pts = set(range(1, 65)) | set(range(72, 257, 8)) | set(range(288, self.max_batch + 1, 32)) | {self.max_batch}
        return sorted(p for p in pts if p <= self.max_batch)

    def contexts(self) -> list[int]:
        pts = {1, self.max_context}
        c = 16
        while c < self.max_context:
            pts.update((c, int(c * 1.5)))
            c *= 2
        return sorted(p for p in pts if p <= self.max_context)

    def tokens(self) -> list[int]:
        pts = set(range(16, min(2048, self.max_tokens) + 1, 16)) | {1, 2, 4, 8, self.max_tokens}
        pts |= set(range(2048, self.max_tokens + 1, 128))
        return sorted(p for p in pts if p <= self.max_tokens)


@dataclass
class Tables:
    """What the database said on a Grid, in ms (see the module docstring); `nan` where it refused."""

    source: str
    batches: list[int]
    contexts: list[int]
    tokens: list[int]
    decode_ms: list[list[float]]
    decode_attn_ms: list[list[float]]
    shared_ms: list[float]
    prefill_attn_ms: list[float]
    detail: dict = field(default_factory=dict)

    @property
    def fallback_points(self) -> int:
        arrays = (self.decode_ms, self.decode_attn_ms, self.shared_ms, self.prefill_attn_ms)
        return int(sum(np.isnan(np.asarray(a, dtype=float)).sum() for a in arrays))


def _ms(fn, *args) -> float:
    try:
        t = float(fn(*args))
    except (ValueError, RuntimeError):
        return math.nan
    return t if t > 0 and math.isfinite(t) else math.nan


def build_tables(handle, grid: Grid, source: str) -> Tables:
    """Tables from an engine handle with aiconfigurator's EngineHandle methods `decode_step_latency` and
    `mixed_step_breakdown` (a fake one in tests)."""
    batches, contexts, tokens = grid.batches(), grid.contexts(), grid.tokens()
    decode = [[_ms(handle.decode_step_latency, b, c, 0) for c in contexts] for b in batches]

    def part(i, *args):
        try:
            t = float(handle.mixed_step_breakdown(*args)[i])
        except (ValueError, RuntimeError):
            return math.nan
        return t if t >= 0 and math.isfinite(t) else math.nan
    # the decodes' attention beside a prompt: its context argument is isl + osl // 2, so isl = c, osl = 0
    decode_attn = [[part(3, 1, b, c, 0) for c in contexts] for b in batches]
    shared = [part(1, t, 0, t, 1) for t in tokens]
    prefill_attn = [part(2, t, 0, t, 1) for t in tokens]
    return Tables(source, batches, contexts, tokens, decode, decode_attn, shared, prefill_attn,
                  {"grid": {"max_batch": grid.max_batch, "max_context": grid.max_context, "max_tokens": grid.max_tokens}})


class MeasuredStepModel:
    """A GPU's step time from aiconfigurator's tables; the roofline model where the tables end."""

    kind = "aiconfigurator"
    after_prefill = after_prefill_by_size = contention = kv_transfer = by_place = after_prompt = None

    def __init__(self, tables: Tables, fallback):
        self.tables, self.fallback = tables, fallback
        self.name = tables.source
        self.gap_coef = tuple(fallback.gap_coef)
        self.fallback_steps = 0
        self._bl, self._b_max, self._c = list(tables.batches), tables.batches[-1], np.asarray(tables.contexts, dtype=float)
        self._t = np.asarray(tables.tokens, dtype=float)
        self._dec = np.asarray(tables.decode_ms, dtype=float) / 1e3        # [B, C] seconds
        self._datt = np.asarray(tables.decode_attn_ms, dtype=float) / 1e3  # [B, C]
        self._shared = np.asarray(tables.shared_ms, dtype=float) / 1e3     # [T]
        n = self._t
        self._pairs = n * (n + 1) / 2                                      # a prompt's attended pairs
        self._patt = np.asarray(tables.prefill_attn_ms, dtype=float) / 1e3
        # the same as plain lists: a step's time is read with bisect, which is several times faster
        # than numpy on one number (the simulator asks for millions of steps)
        self._cl, self._tl, self._pl = self._c.tolist(), self._t.tolist(), self._pairs.tolist()
        self._decl, self._dattl = self._dec.tolist(), self._datt.tolist()
        self._dec_finite = np.isfinite(self._dec).all(axis=1).tolist()     # rows a decode run reads whole
        self._sharedl, self._pattl = self._shared.tolist(), self._patt.tolist()

    def idle_factor(self, kind: str, idle_s: float = math.inf) -> float:
        return 1.0

    def gap(self, num_seqs: int, quiet: bool = False) -> float:
        return self.gap_coef[0] + self.gap_coef[1] * num_seqs

    def _rows(self, b: int) -> tuple[int, int, float]:
        """The table rows around batch b and b's weight on the upper one."""
        i = bisect.bisect_left(self._bl, b)
        if self._bl[i] == b:
            return i, i, 0.0
        lo, hi = self._bl[i - 1], self._bl[i]
        return i - 1, i, (b - lo) / (hi - lo)

    def _at(self, table: list, b: int, ctx: float) -> float:
        i, j, w = self._rows(b)
        t = _lin(self._cl, table[i], ctx)
        return t if w == 0.0 else t + w * (_lin(self._cl, table[j], ctx) - t)

    def _fall(self, f) -> float:
        self.fallback_steps += 1
        return self.fallback.time(f)

    def time(self, f: tuple) -> float:
        b, ctx_sum, p = f[0], f[1], f[2]
        mean_ctx = ctx_sum / b if b else 0.0
        if b > self._b_max or mean_ctx > self._cl[-1] or b + p > self._tl[-1] or f[5] > self._pl[-1]:
            return self._fall(f)
        if p == 0:
            t = self._at(self._decl, b, max(mean_ctx, 1.0)) if b else math.nan
        else:
            t = (_lin(self._tl, self._sharedl, b + p) + _lin(self._pl, self._pattl, f[5])
                 + (self._at(self._dattl, b, max(mean_ctx, 1.0)) if b else 0.0))
        return t if math.isfinite(t) else self._fall(f)

    def decode_run(self, b: int, context: int, k: int) -> list[float]:
        ctx = (context + b * np.arange(k, dtype=np.float64)) / b
        if b > self._b_max or ctx[-1] > self._c[-1]:
            self.fallback_steps += k
            return self.fallback.decode_run(b, context, k)
        i, j, w = self._rows(b)
        if ctx[0] < 1.0:
            ctx = np.maximum(ctx, 1.0)
        t = np.interp(ctx, self._c, self._dec[i])
        if w:
            t = t + w * (np.interp(ctx, self._c, self._dec[j]) - t)
        if not (self._dec_finite[i] and self._dec_finite[j]) and not np.isfinite(t).all():
            self.fallback_steps += k
            return self.fallback.decode_run(b, context, k)
        return t.tolist()

    def to_dict(self) -> dict:
        t = self.tables
        return {"kind": self.kind, "name": self.name, "gap_coef": list(self.gap_coef),
                "fallback": self.fallback.name, "fallback_points": t.fallback_points,
                "fallback_steps": self.fallback_steps, **t.detail,
                "source": "aiconfigurator-core's measured per-operation database (experiments/sim/gpu_costs.py)"}


def _lin(xs: list, ys: list, x: float) -> float:
    """ys at x, linear between the points of increasing xs and flat beyond them (np.interp on one number)."""
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


# -- the database ----------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig) -> dict:
    """The Hugging Face config.json of a pdlab model shape, as aiconfigurator reads one."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "torch_dtype": "bfloat16"}


def _model_dir(cfg: ModelConfig) -> Path:
    text = json.dumps(hf_config(cfg), sort_keys=True)
    d = CACHE / f"{cfg.name}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "config.json").is_file() or (d / "config.json").read_text() != text:
        (d / "config.json").write_text(text)
    return d


def _check(gpu: str, framework: str, dtype_bytes: int) -> None:
    if gpu not in SYSTEMS:
        raise SourceUnavailable(f"aiconfigurator has no database for hardware={gpu} (pdlab maps {sorted(SYSTEMS)})")
    if framework not in FRAMEWORKS:
        raise SourceUnavailable(f"hardware.framework={framework!r}: choose one of {FRAMEWORKS}")
    if dtype_bytes not in DTYPES:
        raise SourceUnavailable(f"{dtype_bytes}-byte weights: the database times {sorted(DTYPES.values())} models")


def _installed() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("aiconfigurator_core") is not None
    except (ImportError, ValueError, AttributeError):     # a module entry that is None or has no spec
        return False


def open_engine(cfg: ModelConfig, gpu: str, framework: str = "vllm", dtype_bytes: int = 2):
    """(aiconfigurator EngineHandle, source string) for `cfg` on `gpu`; SourceUnavailable says why not."""
    _check(gpu, framework, dtype_bytes)
    try:
        import aiconfigurator_core
        from aiconfigurator_core.sdk.engine import EngineHandle
    except ImportError:
        raise SourceUnavailable("aiconfigurator-core is not installed (pip install \"aiconfigurator-core>=0.12,<0.13\")") from None
    system = SYSTEMS[gpu]
    quiet = logging.getLogger("aiconfigurator_core")
    level = quiet.level
    quiet.setLevel(logging.ERROR)        # it logs every low-fidelity table it loads, for models pdlab never runs
    try:
        handle = EngineHandle.compile(str(_model_dir(cfg)), system, framework)
        handle.decode_step_latency(1, 1, 0)
    except Exception as e:               # noqa: BLE001 - any refusal of the library means: not this source
        raise SourceUnavailable(f"aiconfigurator cannot build {cfg.name} on {system}/{framework}: "
                                f"{type(e).__name__}: {e}") from None
    finally:
        quiet.setLevel(level)
    version = _framework_version(system, framework)
    lib = getattr(aiconfigurator_core, "__version__", None) or _dist_version()
    return handle, f"aiconfigurator {system} {framework} {version} (aiconfigurator-core {lib})"


def _dist_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("aiconfigurator-core")
    except PackageNotFoundError:
        return "?"


def _framework_version(system: str, framework: str) -> str:
    """The newest framework version whose GEMM table the database holds for `system` (what it loads)."""
    try:
        import aiconfigurator_core
        root = Path(aiconfigurator_core.__file__).parent / "systems" / "data" / system / "gemm" / framework
        versions = sorted((p.name for p in root.iterdir() if p.is_dir()),
                          key=lambda v: [int(x) if x.isdigit() else x for x in v.replace("rc", ".").split(".")])
        return versions[-1] if versions else "?"
    except (OSError, ImportError, TypeError):
        return "?"


_TABLES: dict[tuple, Tables] = {}


def _disk_path(cfg: ModelConfig, gpu: str, framework: str, grid: Grid) -> Path:
    """Where the tables of one (model shape, database, library version, grid) are kept between processes."""
    system = SYSTEMS[gpu]
    name = (f"tables-{system}-{framework}-{_framework_version(system, framework)}-core{_dist_version()}-"
            f"b{grid.max_batch}-c{grid.max_context}-t{grid.max_tokens}.json")
    return _model_dir(cfg) / name


def measured_tables(cfg: ModelConfig, gpu: str, framework: str = "vllm", dtype_bytes: int = 2,
                    grid: Grid | None = None) -> Tables:
    """The tables of `cfg` on `gpu`, kept per process (a planner asks for the same ones many times) and
    on disk under CACHE, named by everything they depend on (opening the database takes seconds)."""
    grid = grid or Grid(max_context=cfg.max_position_embeddings)
    key = (json.dumps(hf_config(cfg), sort_keys=True), gpu, framework, dtype_bytes, grid)
    if key in _TABLES:
        return _TABLES[key]
    _check(gpu, framework, dtype_bytes)
    if not _installed():
        raise SourceUnavailable("aiconfigurator-core is not installed (pip install \"aiconfigurator-core>=0.12,<0.13\")")
    path = _disk_path(cfg, gpu, framework, grid)
    try:
        tables = Tables(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        handle, source = open_engine(cfg, gpu, framework, dtype_bytes)
        tables = build_tables(handle, grid, source)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(tables)))
        tmp.replace(path)                       # whole or not at all: another process may read it now
    _TABLES[key] = tables
    return tables


def choose(cfg: ModelConfig, gpu: str, fallback, source: str = "auto", framework: str = "vllm",
           dtype_bytes: int = 2, grid: Grid | None = None, tables=None):
    """(step model, why) for a datasheet GPU: MeasuredStepModel where the database prices `cfg` on `gpu`
    and `source` allows it, else `fallback` (the roofline model) with the reason in `why`. `tables`: what
    reads the database (default measured_tables; a fake one in tests)."""
    if source not in SOURCES:
        raise ValueError(f"hardware.costs={source!r}: choose one of {SOURCES}")
    if source == "roofline":
        return fallback, "hardware.costs=roofline"
    try:
        return MeasuredStepModel((tables or measured_tables)(cfg, gpu, framework, dtype_bytes, grid), fallback), None
    except SourceUnavailable as e:
        if source == "aiconfigurator":
            raise ValueError(f"hardware.costs=aiconfigurator: {e}") from None
        return fallback, str(e)
