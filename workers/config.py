"""Model and engine configuration: frozen dataclasses are the schema, presets and config.json supply values."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from workers.errors import CheckpointError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent rope scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


_LLAMA3_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    # Small enough that a CPU step is milliseconds, large enough that a long prompt costs visibly
    # more than a decode step. GQA (8 query heads share 4 KV heads) like the real presets.
    "tiny": ModelConfig(name="tiny", vocab_size=2048, hidden_size=256, intermediate_size=768,
                        num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                        max_position_embeddings=4096, rope_theta=10000.0),
    "llama-3.2-1b": ModelConfig(name="llama-3.2-1b", vocab_size=128256, hidden_size=2048,
                                intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                                head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-3-8b": ModelConfig(name="llama-3-8b", vocab_size=128256, hidden_size=4096,
                              intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                              head_dim=128, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3-70b": ModelConfig(name="llama-3-70b", vocab_size=128256, hidden_size=8192,
                               intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                               head_dim=128, max_position_embeddings=8192, rope_theta=500000.0),
}


def preset(name: str) -> ModelConfig:
    """A preset's shape (random weights), or a packaged model's config (real weights, imported once)."""
    if name in PRESETS:
        return PRESETS[name]
    from workers.gguf_import import PACKAGED, ensure_checkpoint    # numpy and torch: only for a packaged model

    if name in PACKAGED:
        return from_hf_config(ensure_checkpoint(name) / "config.json")
    raise ValueError(f"unknown model {name!r}; choose a preset with random weights ({', '.join(sorted(PRESETS))}) "
                     f"or a packaged model with real ones ({', '.join(sorted(PACKAGED))})")


def _rope_from_hf(raw: dict, path: Path) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes "rope_parameters" (theta inside); older checkpoints write
    # "rope_theta" and "rope_scaling" (with "rope_type" or the older "type").
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope type {kind!r} is not supported (only default and llama3)")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params.get(
                "original_max_position_embeddings", raw["max_position_embeddings"])),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: llama3 rope scaling lacks {e.args[0]!r}") from None
    return theta, scaling


def from_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face Llama config.json; reject anything that is not a plain Llama."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the checkpoint directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read config: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: config is not a JSON object")
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise CheckpointError(f"{path}: model_type is {model_type!r}, not 'llama'; "
                              "only Llama-family checkpoints are supported")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise CheckpointError(f"{path}: {key}=true is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported (Llama uses silu)")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta, scaling = _rope_from_hf(raw, path)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            name=str(path.parent.name),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


POLICIES = ("prefill_first", "chunked")
ROLES = ("colocated", "prefill", "decode")
KV_STREAMS = ("off", "layer", "chunk")
TIMINGS = ("real", "emulated")
PANEL_ROWS = 256       # CPU kernels: under this many rows a linear always runs on the panel kernel (workers/ops.py)


def gemm_route(rows: int | None) -> str:
    """engine.cpu_gemm_rows (as chosen) in words."""
    return "the panel kernel at every size" if rows is None else f"MKL's GEMM from {rows} rows"


def check_gemm_rows(rows):
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < PANEL_ROWS):
        raise ValueError(f"cpu_gemm_rows={rows!r}: choose auto, null (always the panel kernel) or a number of "
                         f"rows of at least {PANEL_ROWS} (under that the panel kernel always runs)")
    return rows



@dataclass(frozen=True)
class EngineConfig:
    """How one engine spends its device: scheduling budget, KV pool size, role."""

    policy: str = "chunked"
    token_budget: int = 512          # tokens computed per step, prefill and decode together
                                     # (prefill_first never splits a prompt that fits max_model_len)
    max_batch: int = 256             # running requests at most
    block_size: int = 16             # tokens per KV block
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # explicit pool size; overrides the memory budget
    kv_cache_bytes: int = 256 << 20  # CPU pool budget
    gpu_memory_utilization: float = 0.85  # GPU pool: this share of memory, less weights and activations
    role: str = "colocated"
    attention: str = "auto"          # auto | cpu | flex | reference (workers/attention.py)
    compile: bool = False            # torch.compile the model (inductor)
    kernels: str = "auto"            # auto | torch | cpu: the rest of a layer's math (workers/ops.py)
    cpu_gemm_rows: int | str | None = "auto"   # CPU kernels: linears of this many rows on run MKL's GEMM,
                                     # fewer the panel kernel (None: always it; auto: measured, workers/ops.py)
    cuda_graphs: bool = True         # on a GPU, replay decode-only steps from CUDA graphs (workers/cuda_graphs.py)
    kv_stream: str = "off"           # prefill role: off (export after the first token) | layer | chunk
    timing: str = "real"             # real: the model computes each step | emulated: each step waits for its
                                     # price (workers/emulated.py)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler.policy={self.policy!r}: choose one of {list(POLICIES)}")
        if self.kv_stream not in KV_STREAMS:
            raise ValueError(f"kv_stream={self.kv_stream!r}: choose one of {list(KV_STREAMS)}")
        if self.timing not in TIMINGS:
            raise ValueError(f"timing={self.timing!r}: choose one of {list(TIMINGS)}")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r}: choose one of {list(ROLES)}")
        for key in ("token_budget", "max_batch", "block_size", "kv_cache_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be positive")
        if self.cpu_gemm_rows != "auto":
            check_gemm_rows(self.cpu_gemm_rows)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be at least 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


__all__ = ["CheckpointError", "RopeScaling", "ModelConfig", "PRESETS", "preset", "from_hf_config",
           "EngineConfig", "POLICIES", "ROLES", "blocks_for", "gemm_route", "check_gemm_rows"]
