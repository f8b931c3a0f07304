"""The CPU kernels of workers/csrc, built once per machine and loaded with ctypes: paged attention
(paged_attention.c) and the fused elementwise work of a decoder layer (cpu_ops.c).

The C sources are compiled with the system C compiler on first use into one library in a cache
directory (`$PDLAB_CACHE`, else `~/.cache/pdlab`), keyed by the sources, the compiler and this CPU's
flags, so several worker processes share one build. It links the OpenMP runtime torch already
loaded, so `torch.set_num_threads` sets its parallelism too. `available()` says whether it could be
had; the engine falls back to torch's own ops (with a warning) where it cannot.

Paged attention is also registered as the custom op `pdlab::paged_attention`, so `torch.compile`
treats it as one opaque call inside a compiled model.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "paged_attention.c", CSRC / "cpu_ops.c"]
HEADERS = [CSRC / "simd.h"]
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


def _signature(fn, restype, *argtypes) -> None:
    fn.restype, fn.argtypes = restype, list(argtypes)


@functools.cache
def _library() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH to build the CPU kernels")
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(text + " ".join(FLAGS + version + [_cpu_flags(), platform.machine()]).encode())
    path = _cache_dir() / f"pdlab_cpu-{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            build = subprocess.run([cc, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"], capture_output=True,
                                   text=True)
            if build.returncode != 0:
                raise KernelUnavailable(f"building {', '.join(p.name for p in SOURCES)} with {cc} failed: "
                                        f"{build.stderr.strip()[:500]}")
            os.replace(out, path)          # atomic: concurrent builders each install a whole file
        log.info("built the CPU kernels: %s", path)
    lib = ctypes.CDLL(str(path))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    _signature(lib.pdlab_paged_attention_f32, ctypes.c_int, p, i64, p, p, p, p, i32, p, p, i32, i32, i32, i32, i32, f32)
    _signature(lib.pdlab_rms_norm_f32, None, p, p, p, p, i64, i64, f32)
    _signature(lib.pdlab_silu_mul_f32, None, p, p, i64, i64)
    _signature(lib.pdlab_linear_small_f32, None, p, i64, i64, p, i64, p)
    _signature(lib.pdlab_linear_panel_width, i64)
    _signature(lib.pdlab_rope_store_kv_f32, ctypes.c_int, p, i64, i32, i32, i32, p, p, p, p, p)
    return lib


def available() -> bool:
    try:
        _library()
        return True
    except (KernelUnavailable, OSError) as e:
        log.warning("CPU kernels unavailable (%s); using torch's ops and the reference attention", e)
        return False


class Workspace:
    """Output buffers the CPU path reuses from step to step, one per name, each grown to the most
    rows a step has asked of it and then kept. A step's activations are megabytes (a 2,048-token
    step of the 29m shape writes 25 MB from its gate-up projection alone); fresh tensors that large
    come from mmap, and faulting their pages in cost a prefill step about 15% of its time here.
    A buffer's contents live until the next call that asks for the same name."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, *shape: int) -> torch.Tensor:
        """A contiguous [rows, *shape] float32 view of buffer `name`."""
        width = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * width:
            buf = self._bufs[name] = torch.empty(rows * width, dtype=torch.float32)
        return buf[:rows * width].view(rows, *shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def paged_attention_eager(q: torch.Tensor, pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
                          q_start: torch.Tensor, ctx_len: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] float32 (rows contiguous); pool [L, 2, NB, BS, KVH, D], of which layer `layer` is read;
    block_tables [S, MB] (rows may be strided), q_start [S + 1], ctx_len [S] int32. Sequence s's queries
    are rows q_start[s]..q_start[s+1] and its last query is at position ctx_len[s] - 1. -> [T, H, D],
    written into `out` (contiguous) if given."""
    T, H, D = q.shape
    k_cache, v_cache = pool[layer, 0], pool[layer, 1]
    _, BS, KVH, _ = k_cache.shape
    out = torch.empty((T, H, D), dtype=q.dtype) if out is None else out
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


def _paged_attention(q: torch.Tensor, pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
                     q_start: torch.Tensor, ctx_len: torch.Tensor, scale: float) -> torch.Tensor:
    return paged_attention_eager(q, pool, layer, block_tables, q_start, ctx_len, scale)


# The same function as a custom op, for torch.compile (eager calls skip the op's dispatch cost); it
# returns a fresh tensor, as a functional op must.
paged_attention = torch.library.custom_op("pdlab::paged_attention", _paged_attention, mutates_args=())
paged_attention.register_fake(
    lambda q, pool, layer, block_tables, q_start, ctx_len, scale: q.new_empty(q.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [T, N] (float32, contiguous). With `residual` [T, N]: residual += x in
    place first (the residual stream), and the norm is of the sum. -> [T, N]: `out` if given (contiguous,
    not x), else a new tensor."""
    out = torch.empty_like(x) if out is None else out
    _library().pdlab_rms_norm_f32(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                                  out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2F] (float32, contiguous) -> silu(gate) * up [T, F], into `out` (contiguous) if given."""
    T, F2 = gate_up.shape
    out = gate_up.new_empty(T, F2 // 2) if out is None else out
    _library().pdlab_silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), T, F2 // 2)
    return out


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> the panels `linear_small` reads: [ceil(N / NR), K, NR], columns past N zero."""
    N, K = weight.shape
    nr = _library().pdlab_linear_panel_width()
    padded = torch.zeros(-(-N // nr) * nr, K, dtype=torch.float32)
    padded[:N] = weight.detach()
    return padded.view(-1, nr, K).transpose(1, 2).contiguous()


def linear_small(x: torch.Tensor, packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32, contiguous) @ W^T for W [n, K] packed by `pack_linear` -> [M, n], into `out`
    (contiguous) if given. Made for a decode step's few rows; any M is correct."""
    M, K = x.shape
    if packed.shape[1] != K:
        raise ValueError(f"linear_small: x has {K} columns, the packed weight {packed.shape[1]}")
    out = x.new_empty(M, n) if out is None else out
    _library().pdlab_linear_small_f32(x.data_ptr(), M, K, packed.data_ptr(), n, out.data_ptr())
    return out


def rope_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                  slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Rotate the queries and keys of qkv [T, (H + 2 KVH) * D] in place (cos, signed_sin [T, D]) and
    write the keys and values at their slots (slot_mapping [T] int64) of one layer's pools."""
    T, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    if not (qkv.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous() and slot_mapping.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_store_kv needs contiguous inputs and pools")
    code = _library().pdlab_rope_store_kv_f32(qkv.data_ptr(), T, num_heads, num_kv_heads, D, cos.data_ptr(),
                                              signed_sin.data_ptr(), slot_mapping.data_ptr(), k_cache.data_ptr(),
                                              v_cache.data_ptr())
    if code != 0:
        raise ValueError(f"rope_store_kv: head_dim {D} must be even and at most 512")
