"""GPUs and the roofline: datasheet peaks (`HARDWARE`, the `hardware` config group), and the FLOPs,
memory bytes and time of one engine step on them.

Pure arithmetic on a `ModelConfig`; torch is imported only inside `measured_hardware`. It sits at the
bottom of experiments/: the config, the simulator, the analysis and the lesson all read it.

Counting model (one forward step of a Llama-style decoder, weights and KV in `dtype_bytes`):

FLOPs
  * Matmuls: 2 FLOPs per weight per token row that goes through it. Per layer the weights are
    q/k/v/o (h*nh*d + 2*h*nkv*d + nh*d*h) and gate/up/down (3*h*i). Every scheduled token pays them.
  * lm_head (vocab*h weights, 2 FLOPs each) is paid only by rows whose logits are needed: every
    decode sequence, and one row per prefill chunk (its last token). The engine computes logits
    only for those rows.
  * Attention (QK^T and PV): 2 * 2 * num_heads * head_dim FLOPs per (query, attended key) pair,
    per layer. A query at 0-based position t attends t+1 keys (the cached t plus itself), so
      - a causal prefill of P tokens from an empty cache attends sum_{t<P}(t+1) = P(P+1)/2 keys;
      - a decode step with context C (C tokens already cached) is the query at position C and
        attends C+1 keys.
  * Ignored: norms, rope, SiLU, softmax, residual adds, sampling (all O(h) per token).

Bytes (HBM traffic)
  * Weights, read once per step however many tokens share it: the matmul weights above plus
    lm_head (for tied embeddings the lm_head is the embedding matrix, counted once as lm_head).
  * Embedding lookup: only the rows used, tokens * h * dtype_bytes.
  * KV read: C * kv_bytes_per_token per decode sequence; 0 for a prefill from an empty cache
    (its own K/V are used while still on chip; flash-attention style).
  * KV written: kv_bytes_per_token per new token (decode and prefill alike).
  * Ignored: norm weights (65 * h values for Llama-3-8B) and activations between kernels.

Time on hardware `hw`: max(flops / peak_flops, bytes / mem_bw), a lower bound.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from workers.config import ModelConfig


@dataclass(frozen=True)
class Hardware:
    """One GPU. Rates in FLOP/s and bytes/s; link bandwidths per direction, per GPU; 0.0 = unknown."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    mem_bw: float      # HBM bytes/s
    nvlink_bw: float   # bytes/s, one direction
    pcie_bw: float     # bytes/s, one direction
    net_bw: float      # bytes/s, one direction (inter-node NIC)

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP per byte) above which a kernel is compute-bound."""
        return self.peak_flops / self.mem_bw


_NET_BW = 400e9 / 8  # one 400 Gb/s NIC per GPU (ConnectX-7 NDR class) = 50e9 bytes/s; an assumption

HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): BF16 312 TFLOPS dense (624 sparse),
    # HBM2e 2,039 GB/s, NVLink 600 GB/s (both directions), PCIe Gen4 64 GB/s (both directions).
    "a100": Hardware("a100", peak_flops=312e12, mem_bw=2.039e12, nvlink_bw=300e9, pcie_bw=32e9,
                     net_bw=_NET_BW),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense,
    # HBM3 3.35 TB/s, NVLink 900 GB/s (both directions), PCIe Gen5 128 GB/s (both directions).
    "h100": Hardware("h100", peak_flops=989e12, mem_bw=3.35e12, nvlink_bw=450e9, pcie_bw=64e9,
                     net_bw=_NET_BW),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense,
    # HBM3e 4.8 TB/s, NVLink 900 GB/s (both directions), PCIe Gen5 128 GB/s (both directions).
    "h200": Hardware("h200", peak_flops=989e12, mem_bw=4.8e12, nvlink_bw=450e9, pcie_bw=64e9,
                     net_bw=_NET_BW),
}


@dataclass(frozen=True)
class Cost:
    """Work of one step: FLOPs and bytes of memory traffic."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOP per byte."""
        return self.flops / self.bytes

    def time(self, hw: Hardware) -> float:
        """Roofline lower bound in seconds."""
        return max(self.flops / hw.peak_flops, self.bytes / hw.mem_bw)

    def bound(self, hw: Hardware) -> str:
        return "compute" if self.flops / hw.peak_flops >= self.bytes / hw.mem_bw else "memory"


# ---- counting ------------------------------------------------------------------------------

def _layer_matmul_params(cfg: ModelConfig) -> int:
    """q/k/v/o + gate/up/down weights of one decoder layer."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_heads * d + 2 * h * cfg.num_kv_heads * d + cfg.num_heads * d * h
    return attn + 3 * h * cfg.intermediate_size


def _lm_head_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


def matmul_params(cfg: ModelConfig) -> int:
    """Weights read each step: all layers' projections and MLPs plus lm_head (norms excluded)."""
    return cfg.num_layers * _layer_matmul_params(cfg) + _lm_head_params(cfg)


def _attention_flops(cfg: ModelConfig, num_query_key_pairs: int) -> int:
    # QK^T and PV: 2 matmuls * 2 FLOPs * heads * head_dim per (query, key) pair, every layer.
    return 4 * cfg.num_heads * cfg.head_dim * num_query_key_pairs * cfg.num_layers


def _step_cost(cfg: ModelConfig, num_decode: int, context: int, num_prefill_tokens: int,
               dtype_bytes: int) -> Cost:
    """B = num_decode sequences at context C, plus one prefill chunk of P tokens from position 0."""
    if num_decode < 0 or context < 0 or num_prefill_tokens < 0:
        raise ValueError(f"batch={num_decode}, context={context}, chunk={num_prefill_tokens} "
                         "must be non-negative")
    num_tokens = num_decode + num_prefill_tokens
    if num_tokens == 0:
        raise ValueError("a step needs at least one token")
    num_logit_rows = num_decode + (1 if num_prefill_tokens else 0)
    num_pairs = num_decode * (context + 1) + num_prefill_tokens * (num_prefill_tokens + 1) // 2

    flops = (2 * cfg.num_layers * _layer_matmul_params(cfg) * num_tokens
             + 2 * _lm_head_params(cfg) * num_logit_rows
             + _attention_flops(cfg, num_pairs))

    kv_token_bytes = cfg.kv_bytes_per_token(dtype_bytes)
    weight_bytes = matmul_params(cfg) * dtype_bytes
    embed_bytes = num_tokens * cfg.hidden_size * dtype_bytes
    kv_read_bytes = num_decode * context * kv_token_bytes
    kv_write_bytes = num_tokens * kv_token_bytes
    return Cost(flops=flops, bytes=weight_bytes + embed_bytes + kv_read_bytes + kv_write_bytes)


def prefill_cost(cfg: ModelConfig, num_tokens: int, dtype_bytes: int = 2) -> Cost:
    """Prefill of `num_tokens` tokens starting from an empty cache; one logits row."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens} must be positive")
    return _step_cost(cfg, 0, 0, num_tokens, dtype_bytes)


def decode_cost(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 2) -> Cost:
    """One decode step of `batch` sequences, each with `context` tokens cached (attends context+1)."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be positive")
    return _step_cost(cfg, batch, context, 0, dtype_bytes)


def mixed_cost(cfg: ModelConfig, batch: int, context: int, chunk: int, dtype_bytes: int = 2) -> Cost:
    """One step: `batch` decodes at `context` plus a `chunk`-token prefill from position 0."""
    return _step_cost(cfg, batch, context, chunk, dtype_bytes)


def kv_transfer_time(cfg: ModelConfig, num_tokens: int, link_bw: float, dtype_bytes: int = 2) -> float:
    """Seconds to move `num_tokens` tokens of KV cache (all layers) over a link of `link_bw` bytes/s."""
    return num_tokens * cfg.kv_bytes_per_token(dtype_bytes) / link_bw


# ---- measurement ---------------------------------------------------------------------------

def _best_time_s(fn, sync, num_reps: int) -> float:
    """Fastest of `num_reps` timed calls after one untimed warm-up; `sync` waits for the device."""
    fn()
    sync()
    best_s = math.inf
    for _ in range(num_reps):
        start = time.perf_counter()
        fn()
        sync()
        best_s = min(best_s, time.perf_counter() - start)
    return best_s


def measured_hardware(device: str = "auto", nvlink_bw: float = 0.0, pcie_bw: float = 0.0,
                      net_bw: float = 0.0) -> Hardware:
    """Measure peak matmul FLOP/s and device-copy bandwidth on `device` ("auto", "cpu", "cuda[:i]").

    GPU: bf16 4096^3 matmul, 1 GiB copy. CPU: float32 1024^3 matmul, 256 MiB copy (well under 2 s).
    Copy bandwidth counts read + write (2x the buffer). Best of a few runs after a warm-up.
    Link bandwidths are not measured: pass them in; 0.0 means unknown.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if on_gpu else (lambda: None)

    n = 4096 if on_gpu else 1024
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)  # [n, n]
    b = torch.randn(n, n, device=dev, dtype=dtype)  # [n, n]
    matmul_s = _best_time_s(lambda: torch.mm(a, b), sync, num_reps=5)
    peak_flops = 2 * n**3 / matmul_s
    del a, b

    copy_bytes = (1 << 30) if on_gpu else (256 << 20)
    src = torch.ones(copy_bytes, device=dev, dtype=torch.uint8)  # ones: pages really backed
    dst = torch.empty_like(src)
    copy_s = _best_time_s(lambda: dst.copy_(src), sync, num_reps=3)
    mem_bw = 2 * copy_bytes / copy_s
    del src, dst

    name = f"measured-{torch.cuda.get_device_name(dev) if on_gpu else 'cpu'}"
    return Hardware(name, peak_flops=peak_flops, mem_bw=mem_bw, nvlink_bw=nvlink_bw,
                    pcie_bw=pcie_bw, net_bw=net_bw)


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def dtype_bytes_of(dtype: str, key: str = "dtype") -> int:
    """Bytes per element of a dtype name; a ValueError naming `key` for a name DTYPE_BYTES lacks."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{key}={dtype!r}: choose from {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class HardwareSpec:
    """The `hardware` group: a datasheet GPU (a100, h100, h200) or the device at hand (measured), with
    overrides; the simulator also reads the step-time model's settings (experiments/sim/costs.py)."""

    name: str = "h200"
    device: str = "auto"
    peak_flops: float | None = None
    mem_bw: float | None = None
    link_bw: float | None = None
    profile: str | None = None           # simulator: a profile JSON (null: this machine's, for `measured`)
    compute_eff: float | None = None     # simulator, datasheet GPUs: shares of the peaks a step reaches
    mem_eff: float | None = None         # (null: experiments/sim/stepmodel.py's documented defaults)
    step_overhead_ms: float | None = None
    hbm_gb: float | None = None          # simulator: GPU memory for weights and KV (null: the datasheet's)
    gpus_per_node: int = 8               # simulator: GPUs sharing a node's NVLink; the network between nodes
    costs: str = "auto"                  # simulator, datasheet GPUs: step times from aiconfigurator's measured
                                         # database where it has them (auto), always (aiconfigurator) or the
                                         # roofline (experiments/sim/gpu_costs.py)
    framework: str = "vllm"              # ... the serving framework whose measurements price a step

    def resolve(self) -> Hardware:
        if self.name == "measured":
            hw = measured_hardware(self.device)
        elif self.name in HARDWARE:
            hw = HARDWARE[self.name]
        else:
            raise ValueError(f"hardware.name={self.name!r}: choose one of {sorted(HARDWARE) + ['measured']}")
        changes = {k: v for k, v in (("peak_flops", self.peak_flops), ("mem_bw", self.mem_bw),
                                     ("net_bw", self.link_bw)) if v is not None}
        return replace(hw, **changes)


@dataclass
class OperatingPoint:
    step: str
    flops: float
    bytes: float
    intensity: float
    bound: str
    time_ms: float
    achieved_flops: float      # flops / predicted time: where the point sits on the roofline


def operating_point(name: str, cost: Cost, hw: Hardware) -> OperatingPoint:
    t = cost.time(hw)
    return OperatingPoint(name, cost.flops, cost.bytes, cost.intensity, cost.bound(hw), 1e3 * t, cost.flops / t)


def operating_points(cfg: ModelConfig, hw: Hardware, dtype_bytes: int, prefill_tokens, decode_batches, context: int,
                     mixed_batch: int, mixed_chunk: int) -> list[OperatingPoint]:
    pts = [operating_point(f"prefill P={p}", prefill_cost(cfg, p, dtype_bytes), hw) for p in prefill_tokens]
    pts += [operating_point(f"decode B={b} C={context}", decode_cost(cfg, b, context, dtype_bytes), hw)
            for b in decode_batches]
    pts.append(operating_point(f"mixed B={mixed_batch} C={context} + P={mixed_chunk}",
                               mixed_cost(cfg, mixed_batch, context, mixed_chunk, dtype_bytes), hw))
    return pts


__all__ = ["Hardware", "HARDWARE", "Cost", "matmul_params", "prefill_cost", "decode_cost",
           "mixed_cost", "kv_transfer_time", "measured_hardware", "DTYPE_BYTES", "HardwareSpec",
           "OperatingPoint", "operating_point", "operating_points"]

