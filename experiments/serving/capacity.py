"""Will the model fit? Checked before any worker starts, so a preset too big for this machine fails at once.

Each worker holds the weights (parameters x dtype bytes) and a KV cache: on a CPU the configured pool
(`scheduler.kv_cache_mb` or `num_kv_blocks`), on a GPU at least one `max_model_len`-token sequence.
With the embedded local Ray every CPU worker lives in this machine's memory and each GPU worker on one
GPU; on an existing cluster (`cluster.address`) the nodes are not known here and nothing is checked.
"""
from __future__ import annotations

from pathlib import Path

from experiments.config import ConfigError, RunSpec
from workers.config import from_hf_config, preset

GiB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (MemAvailable), None where /proc/meminfo is missing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _device_and_dtype(spec: RunSpec) -> tuple[str, str]:
    import torch

    device = spec.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = spec.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def need(spec: RunSpec) -> dict:
    """Per worker: {device, dtype, weights, kv, kv_what, total} in bytes."""
    mcfg = from_hf_config(f"{spec.model.checkpoint}/config.json") if spec.model.checkpoint else preset(spec.model.model)
    device, dtype = _device_and_dtype(spec)
    nbytes = DTYPE_BYTES[dtype]
    per_token = mcfg.kv_bytes_per_token(nbytes)
    s = spec.scheduler
    if device.startswith("cuda"):
        block = per_token * s.block_size
        kv = -(-spec.max_model_len // s.block_size) * block
        kv_what = f"KV for one {spec.max_model_len}-token sequence"
    elif s.num_kv_blocks is not None:
        kv, kv_what = s.num_kv_blocks * per_token * s.block_size, f"KV pool of scheduler.num_kv_blocks={s.num_kv_blocks}"
    else:
        kv, kv_what = s.kv_cache_mb << 20, f"KV pool of scheduler.kv_cache_mb={s.kv_cache_mb}"
    weights = mcfg.num_params() * nbytes
    return {"device": device, "dtype": dtype, "weights": weights, "kv": kv, "kv_what": kv_what, "total": weights + kv}


def check_memory(spec: RunSpec, available: int | None = None, gpu_memory: list[int] | None = None) -> None:
    """Raise ConfigError naming what the model needs and what this machine has, when it cannot fit."""
    if spec.cluster.address is not None:
        return
    n = need(spec)
    workers = spec.cluster.num_workers
    name = f"model={spec.model.checkpoint or spec.model.model}"
    each = (f"{n['total'] / GiB:.1f} GiB per worker ({n['dtype']} weights {n['weights'] / GiB:.1f} GiB + "
            f"{n['kv_what']} {n['kv'] / GiB:.2f} GiB)")
    if n["device"].startswith("cuda"):
        if gpu_memory is None:
            import torch
            gpu_memory = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        usable = [int(spec.scheduler.gpu_memory_utilization * m) for m in gpu_memory]
        if usable and min(usable) < n["total"]:
            raise ConfigError(f"{name} needs {each}; the smallest GPU here offers {min(usable) / GiB:.1f} GiB "
                              f"(scheduler.gpu_memory_utilization={spec.scheduler.gpu_memory_utilization:g})")
        return
    available = available if available is not None else available_memory()
    if available is not None and workers * n["total"] > available:
        import torch
        gpus = "no GPU" if not torch.cuda.is_available() else f"{torch.cuda.device_count()} GPU(s), unused on cpu"
        raise ConfigError(f"{name} on cpu needs {each}, {workers * n['total'] / GiB:.1f} GiB for {workers} workers; "
                          f"this machine has {available / GiB:.1f} GiB available and {gpus}")
