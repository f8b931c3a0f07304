"""The CPU paged-attention kernel (csrc/paged_attention.c): built once per machine, loaded with ctypes.

The C source is compiled with the system C compiler on first use into a cache directory
(`$PDLAB_CACHE`, else `~/.cache/pdlab`), keyed by the source, the compiler and this CPU's flags,
so several worker processes share one build. It links the OpenMP runtime torch already loaded,
so `torch.set_num_threads` sets its parallelism too. `available()` says whether it could be had;
the engine falls back to the reference attention (with a warning) where it cannot.

The kernel is also registered as the custom op `pdlab::paged_attention`, so `torch.compile` treats
it as one opaque call inside a compiled model.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]


class KernelUnavailable(RuntimeError):
    """No C compiler, or the build failed; the message says which."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("PDLAB_CACHE") or Path.home() / ".cache" / "pdlab") / "kernels"


@functools.cache
def _library() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH to build the CPU attention kernel")
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(source + " ".join(FLAGS + version + [_cpu_flags(), platform.machine()]).encode())
    path = _cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            build = subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE), "-lm"], capture_output=True, text=True)
            if build.returncode != 0:
                raise KernelUnavailable(f"building {SOURCE.name} with {cc} failed: {build.stderr.strip()[:500]}")
            os.replace(out, path)          # atomic: concurrent builders each install a whole file
        log.info("built the CPU attention kernel: %s", path)
    lib = ctypes.CDLL(str(path))
    fn = lib.pdlab_paged_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
    return lib


def available() -> bool:
    try:
        _library()
        return True
    except (KernelUnavailable, OSError) as e:
        log.warning("CPU attention kernel unavailable (%s); using the reference attention", e)
        return False


def paged_attention_eager(q: torch.Tensor, pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
                          q_start: torch.Tensor, ctx_len: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D] float32 (rows contiguous); pool [L, 2, NB, BS, KVH, D], of which layer `layer` is read;
    block_tables [S, MB] (rows may be strided), q_start [S + 1], ctx_len [S] int32. Sequence s's queries
    are rows q_start[s]..q_start[s+1] and its last query is at position ctx_len[s] - 1. -> [T, H, D]."""
    T, H, D = q.shape
    k_cache, v_cache = pool[layer, 0], pool[layer, 1]
    _, BS, KVH, _ = k_cache.shape
    out = torch.empty((T, H, D), dtype=q.dtype)
    if T == 0:
        return out
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    if block_tables.stride(1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention needs contiguous KV pools and block-table rows")
    code = _library().pdlab_paged_attention_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), q_start.data_ptr(), ctx_len.data_ptr(),
        ctx_len.shape[0], H, KVH, D, BS, scale)
    if code != 0:
        raise RuntimeError(f"CPU paged attention failed (code {code}) for H={H}, KVH={KVH}, D={D}, BS={BS}")
    return out


# The same function as a custom op, for torch.compile (eager calls skip the op's dispatch cost).
paged_attention = torch.library.custom_op("pdlab::paged_attention", paged_attention_eager, mutates_args=())
paged_attention.register_fake(
    lambda q, pool, layer, block_tables, q_start, ctx_len, scale: q.new_empty(q.shape))
