"""The run's configuration, typed and validated once, before any worker starts.

Each Hydra group becomes the frozen dataclass of the room that uses it (ClusterConfig,
TransferConfig, RouterConfig, FaultConfig, WorkloadConfig, ...). Unknown keys, wrong types and bad
values raise ConfigError with one line naming the full key. Layouts ("colocated-chunked", "1p3d")
are edits of the composed config, so every point's saved config.yaml says exactly what ran.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from cluster.config import ClusterConfig
from cluster.transfer.base import TransferConfig
from experiments.hardware import HardwareSpec
from experiments.workload import WorkloadConfig
from router.config import FaultConfig, RouterConfig
from workers.config import POLICIES, CheckpointError, EngineConfig, from_hf_config, preset
from workers.weights import ModelSpec, with_checkpoint

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")    # the Hydra config tree (conf/)
BACKENDS = ("real", "sim")
CHUNKED_BUDGET = 256          # default chunk (token budget) under the chunked policy
LAYOUT_DISAGG = re.compile(r"^(\d+)p(\d+)d$")
COLOCATED_LAYOUTS = ("colocated-prefill_first", "colocated-chunked")


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the key."""


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "chunked"
    token_budget: int | None = None
    prefill_token_budget: int | None = None
    max_batch: int = 64
    block_size: int = 16
    max_model_len: int | None = None
    kv_cache_mb: int = 256
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.85

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: choose one of {list(POLICIES)}")
        for key in ("token_budget", "prefill_token_budget"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key}={value} must be a positive number of tokens (or null for the default)")

    def engine(self, role: str, max_model_len: int) -> EngineConfig:
        """Prefill workers prefill whole prompts; colocated and decode workers follow `policy`.
        prefill_first takes whole prompts, as early vLLM did: its budget is at least max_model_len."""
        if role == "prefill":
            policy, budget = "prefill_first", max(self.prefill_token_budget or 0, max_model_len)
        elif self.policy == "prefill_first":
            policy, budget = "prefill_first", max(self.token_budget or 0, max_model_len)
        else:
            policy, budget = "chunked", self.token_budget or CHUNKED_BUDGET
        return EngineConfig(policy=policy, token_budget=budget, max_batch=self.max_batch, block_size=self.block_size,
                            max_model_len=max_model_len, num_kv_blocks=self.num_kv_blocks,
                            kv_cache_bytes=self.kv_cache_mb << 20,
                            gpu_memory_utilization=self.gpu_memory_utilization, role=role)


@dataclass(frozen=True)
class EngineOptions:
    """How each engine runs its model (the `engine` group): attention backend, kernels, compilation, graphs."""

    attention: str = "auto"      # auto | cpu | flex | reference (workers/attention.py)
    compile: bool = False        # torch.compile the model
    cuda_graphs: bool = True     # GPU: replay decode-only steps from CUDA graphs
    kernels: str = "auto"        # auto | torch | cpu: the rest of a layer's math (workers/ops.py)
    cpu_gemm_rows: int | str | None = "auto"   # CPU kernels: MKL's GEMM from this many rows (null: never;
                                               # auto: measured, workers/ops.py)
    timing: str = "real"         # real: compute every step | emulated: wait for its price (workers/emulated.py)

    def __post_init__(self):
        from workers.attention import BACKENDS
        from workers.config import TIMINGS, check_gemm_rows
        from workers.ops import KERNELS
        if self.timing not in TIMINGS:
            raise ValueError(f"timing={self.timing!r}: choose one of {list(TIMINGS)}")
        if self.attention not in ("auto", *BACKENDS):
            raise ValueError(f"attention={self.attention!r}: choose auto or one of {sorted(BACKENDS)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r}: choose one of {list(KERNELS)}")
        if self.cpu_gemm_rows != "auto":
            check_gemm_rows(self.cpu_gemm_rows)


@dataclass(frozen=True)
class SLOConfig:
    ttft_ms: float = 1000.0
    tpot_ms: float = 40.0
    attainment_target: float = 0.9

    def __post_init__(self):
        for key in ("ttft_ms", "tpot_ms"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)} must be positive")
        if not 0 < self.attainment_target <= 1:
            raise ValueError(f"attainment_target={self.attainment_target} must be in (0, 1]")


@dataclass(frozen=True)
class RunSpec:
    model: ModelSpec
    cluster: ClusterConfig
    gpus: int
    scheduler: SchedulerConfig
    engine: EngineOptions
    transfer: TransferConfig
    router: RouterConfig
    fault: FaultConfig
    workload: WorkloadConfig
    slo: SLOConfig
    seed: int
    max_model_len: int
    vocab_size: int
    backend: str = "real"                  # real: serve on the cluster | sim: simulate (experiments/sim/)
    hardware: HardwareSpec = HardwareSpec("measured")   # what a simulation's costs come from

    def engines(self) -> dict[str, EngineConfig]:
        e = dataclasses.asdict(self.engine)
        return {role: self.scheduler.engine(role, self.max_model_len).replace(**e)
                for role in ("colocated", "prefill", "decode")}


def _allows(hint, value) -> bool:
    if hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_allows(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if dataclasses.is_dataclass(hint):
        return isinstance(value, (dict, hint))     # nested sections arrive as dicts
    return isinstance(value, hint) if isinstance(hint, type) else True


def section(cls, raw: dict, key: str, **extra):
    """Build `cls` from one config section; any problem becomes ConfigError naming `key.field`."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown option {key}.{unknown[0]}; {key} takes {sorted(names - set(extra))}")
    hints = typing.get_type_hints(cls)
    for name, value in raw.items():
        if not _allows(hints[name], value):
            raise ConfigError(f"{key}.{name}={value!r}: expected {hints[name]}".replace("typing.", ""))
    try:
        return cls(**raw, **extra)
    except (TypeError, ValueError) as e:
        msg = str(e).splitlines()[0]
        raise ConfigError(msg if msg.startswith(f"{key}.") else f"{key}.{msg}") from None


def _plain(cfg: DictConfig, key: str) -> dict:
    node = cfg.get(key)
    if node is None:
        return {}
    try:
        value = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except Exception as e:  # a missing value (???) or a failed interpolation
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r}: expected a group of options")
    return value


def _model(raw: dict, seed: int) -> tuple[ModelSpec, int, int]:
    """-> (spec, vocab size, max position); checks the preset or checkpoint without loading weights."""
    raw = dict(raw)
    name = raw.pop("name", "tiny")
    spec = section(ModelSpec, {"model": name, **raw}, "model", seed=seed)
    if spec.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"model.dtype={spec.dtype!r}: choose auto, float32, bfloat16 or float16")
    if spec.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", spec.device):
        raise ConfigError(f"model.device={spec.device!r}: choose auto, cpu, cuda or cuda:N")
    try:
        spec = with_checkpoint(spec)        # a packaged model: its imported checkpoint (workers/gguf_import.py)
    except CheckpointError as e:
        raise ConfigError(f"model={name}: {e}") from None
    try:
        if spec.checkpoint is not None:
            mcfg = from_hf_config(f"{spec.checkpoint}/config.json")
        else:
            mcfg = preset(name)
    except (CheckpointError, ValueError) as e:
        key = "model.checkpoint" if spec.checkpoint is not None else "model"
        raise ConfigError(f"{key}: {e}") from None
    return spec, mcfg.vocab_size, mcfg.max_position_embeddings


def parse(cfg: DictConfig) -> RunSpec:
    """The composed Hydra config -> a validated RunSpec (raises ConfigError)."""
    known = {"model", "cluster", "scheduler", "engine", "transfer", "router", "workload", "slo", "fault",
             "seed", "layout", "compare", "report", "repeats", "backend", "hardware"}
    unknown = sorted(set(cfg.keys()) - known - {"hydra"})
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]}; top-level options are {sorted(known)}")
    seed = cfg.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed={seed!r}: expected an integer")
    repeats(cfg)
    backend = cfg.get("backend", "real")
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}: choose one of {list(BACKENDS)}")
    hardware = section(HardwareSpec, _plain(cfg, "hardware") or {"name": "measured"}, "hardware")
    model, vocab, max_pos = _model(_plain(cfg, "model"), seed)
    cluster_raw = _plain(cfg, "cluster")
    gpus = cluster_raw.pop("gpus", 2)
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"cluster.gpus={gpus!r} must be a positive integer")
    cluster = section(ClusterConfig, cluster_raw, "cluster")
    if cluster.num_workers > gpus:
        keys = "cluster.workers" if cluster.mode == "colocated" else "cluster.prefill_workers + cluster.decode_workers"
        raise ConfigError(f"{keys} = {cluster.num_workers} workers is more than cluster.gpus={gpus}")
    scheduler = section(SchedulerConfig, _plain(cfg, "scheduler"), "scheduler")
    max_model_len = scheduler.max_model_len or max_pos
    if max_model_len > max_pos:
        raise ConfigError(f"scheduler.max_model_len={max_model_len} exceeds the model's maximum {max_pos}")
    for role in ("colocated", "prefill", "decode"):
        try:
            scheduler.engine(role, max_model_len)
        except ValueError as e:
            raise ConfigError(f"scheduler.{e}") from None
    workload_raw = _plain(cfg, "workload")
    if workload_raw.get("length_scale") is None:
        tiny = model.checkpoint is None and model.model == "tiny"
        workload_raw["length_scale"] = 0.25 if tiny else 1.0
    return RunSpec(
        model=model, cluster=cluster, gpus=gpus, scheduler=scheduler,
        engine=section(EngineOptions, _plain(cfg, "engine"), "engine"),
        transfer=section(TransferConfig, _plain(cfg, "transfer"), "transfer"),
        router=section(RouterConfig, _plain(cfg, "router"), "router"),
        fault=section(FaultConfig, _plain(cfg, "fault"), "fault"),
        workload=section(WorkloadConfig, workload_raw, "workload"),
        slo=section(SLOConfig, _plain(cfg, "slo"), "slo"),
        seed=seed, max_model_len=max_model_len, vocab_size=vocab, backend=backend, hardware=hardware)


def repeats(cfg: DictConfig) -> int:
    """The top-level `repeats` (default 1): how many times each point is served."""
    n = cfg.get("repeats", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"repeats={n!r} must be a positive integer")
    return n


# cluster.* keys a layout writes: given on the command line, they are served as given
LAYOUT_KEYS = ("cluster.mode", "cluster.workers", "cluster.prefill_workers", "cluster.decode_workers")


def override_keys(overrides: list[str]) -> list[str]:
    """The keys of Hydra command-line overrides ("+a.b=1" -> "a.b"; "~a" -> "a")."""
    return [o.lstrip("+~").split("=", 1)[0] for o in overrides]


def yield_to_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Explicit cluster layout settings win over the default comparison: with any of LAYOUT_KEYS on the
    command line and neither `compare` nor `layout` given there, `compare` becomes null. Given together
    with a layout that would overwrite them (from the command line or a preset), they are an error, as is
    `scheduler.policy` beside a colocated layout, which sets the policy itself."""
    keys = override_keys(overrides)
    explicit = [k for k in keys if k in LAYOUT_KEYS]
    layout, compare = cfg.get("layout"), cfg.get("compare")
    given = {k: next(o.split("=", 1)[-1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == k)
             for k in set(explicit) | ({"scheduler.policy"} & set(keys))}
    if explicit:
        first = explicit[0]
        if layout is not None:
            raise ConfigError(f"{first}={given[first]} conflicts with layout={layout}, which sets it; "
                              "give one or the other (layout=null serves cluster.* as given)")
        if compare and "compare" in keys:
            raise ConfigError(f"{first}={given[first]} conflicts with compare={list(compare)}, whose layouts set it; "
                              "give one or the other (compare=null serves cluster.* as given)")
        if compare:
            cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
            cfg.compare = None
            compare = None
    if "scheduler.policy" in given:
        colocated = [x for x in ([layout] if layout is not None else list(compare or [])) if x in COLOCATED_LAYOUTS]
        if colocated:
            raise ConfigError(f"scheduler.policy={given['scheduler.policy']} conflicts with layout {colocated[0]}, "
                              "which sets the policy; give compare=null with cluster.mode=colocated to serve it")
    return cfg


def every_layout(gpus) -> str:
    """Both colocated layouts and every P:D split of `gpus`, comma-separated: the pool_ratio sweep's
    list for any cluster.gpus (conf/sweep/pool_ratio.yaml resolves it through `pdlab.layouts`)."""
    n = int(gpus)
    return ",".join(list(COLOCATED_LAYOUTS) + [f"{p}p{n - p}d" for p in range(1, n)])


def even_split(gpus) -> str:
    """The disaggregated layout of `gpus` GPUs that the default comparison serves: half of them (rounded
    down) prefill, the rest decode (1p1d on 2 GPUs, 4p4d on 8); conf/config.yaml resolves it through
    `pdlab.split`, so the comparison follows cluster.gpus."""
    n = int(gpus)
    return f"{n // 2}p{n - n // 2}d"


if not OmegaConf.has_resolver("pdlab.layouts"):
    OmegaConf.register_new_resolver("pdlab.layouts", every_layout)
if not OmegaConf.has_resolver("pdlab.split"):
    OmegaConf.register_new_resolver("pdlab.split", even_split)


def apply_layout(cfg: DictConfig, layout: str) -> DictConfig:
    """A copy of `cfg` with one layout's cluster and scheduler settings written in."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    gpus = out.cluster.get("gpus", 2)
    if layout in COLOCATED_LAYOUTS:
        out.cluster.mode, out.cluster.workers = "colocated", gpus
        out.scheduler.policy = layout.split("-", 1)[1]
    elif (m := LAYOUT_DISAGG.match(str(layout))) is not None:
        p, d = int(m.group(1)), int(m.group(2))
        if p < 1 or d < 1 or p + d != gpus:
            raise ConfigError(f"layout={layout} uses {p} + {d} GPUs; it needs P, D >= 1 with P + D = "
                              f"cluster.gpus={gpus}")
        out.cluster.mode, out.cluster.prefill_workers, out.cluster.decode_workers = "disaggregated", p, d
    else:
        raise ConfigError(f"layout={layout!r}: write colocated-prefill_first, colocated-chunked, or <P>p<D>d "
                          "such as 1p1d")
    out.layout, out.compare = layout, None
    return out


def points(cfg: DictConfig) -> list[tuple[str | None, DictConfig, RunSpec]]:
    """Every point this run serves: (sub-directory or None, its config, its spec), all validated."""
    layout, compare = cfg.get("layout"), cfg.get("compare")
    if layout is not None:
        chosen = [(None, apply_layout(cfg, layout))]
    elif compare:
        if len(set(compare)) != len(compare):
            raise ConfigError(f"compare={list(compare)} names a layout twice")
        chosen = [(str(name), apply_layout(cfg, name)) for name in compare]
    else:
        chosen = [(None, cfg)]
    return [(sub, c, parse(c)) for sub, c in chosen]
