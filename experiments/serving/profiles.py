"""Where profiles live and which one a run is priced by: profiles/<machine>/<model>-<dtype>-<threads>t.json,
<machine> naming this machine (`machine_name`); `profile_for` a RunSpec's (hardware.profile, or this
machine's for its model, dtype and worker threads). Measuring one is experiments/analysis/profile.py.
"""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

from experiments.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "profiles"


def machine_name() -> str:
    """This machine as a file name: the GPU's name, or the CPU's model and core count."""
    try:
        import torch
        if torch.cuda.is_available():
            return _slug(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1]
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu-{_slug(model)}-{cores}c"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def profile_path(model: str, dtype: str, threads: int, machine: str | None = None) -> Path:
    return PROFILES / (machine or machine_name()) / f"{model}-{dtype}-{threads}t.json"


def model_config(spec):
    """The ModelConfig of a RunSpec's model (its checkpoint's config.json, or a preset)."""
    from workers.config import from_hf_config, preset

    m = spec.model
    return from_hf_config(f"{m.checkpoint}/config.json") if m.checkpoint else preset(m.model)


def worker_threads(spec) -> int:
    """Torch threads a real run's workers get here (cluster/pool.py's rule)."""
    c = spec.cluster
    return c.torch_threads or max(1, (c.num_cpus or os.cpu_count() or 1) // c.num_workers)


def profile_for(spec) -> Path:
    """The profile a run on this machine is priced by: hardware.profile, or this machine's for the model,
    dtype and worker threads (an error naming the command that makes it)."""
    if spec.hardware.profile:
        return Path(spec.hardware.profile)
    mcfg = model_config(spec)
    dtype = spec.model.dtype if spec.model.dtype != "auto" else "float32"
    path = profile_path(mcfg.name, dtype, worker_threads(spec))
    if not path.is_file():
        raise ConfigError(f"hardware=measured: no profile of this machine at {path}; make one with "
                          f"python -m experiments.profile model={mcfg.name} threads={worker_threads(spec)}, or give "
                          "hardware.profile=FILE or a datasheet GPU (hardware=h200)")
    return path
