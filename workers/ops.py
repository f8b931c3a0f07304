"""The math of a decoder layer other than attention, behind one small interface, so the model reads
the same whatever runs it (`EngineConfig.kernels`, "auto" picks by device, dtype and compile):

- `torch`: torch's own ops, one per operation: any device and dtype, and what `torch.compile` fuses.
  Its formulas are the reference the others are tested against.
- `cpu`: float32 on a CPU, eager: the fused kernels of workers/csrc/cpu_ops.c (RMSNorm with the
  residual add, rotary embedding with the KV-cache write, SiLU-and-multiply), each one pass over
  its data. Linear layers of a decode-sized step (under 256 rows) run cpu_ops.c's panel kernel on
  weights packed once at start: at those rows a linear streams its weights from memory, and the
  kernel keeps that stream moving (0.67x oneDNN's packed linear's time at 16 rows, 0.87x at 64,
  in docs/lab-notes/). From `gemm_rows` rows on they run MKL's GEMM on the weights as they are.
  Where MKL's GEMM is fast from 256 rows that is 256; where it is not, more or never (on some CPUs MKL takes
  2.3x the panel kernel's time at 128 to 1024 rows of the tiny model: docs/benchmarks.md), so by
  default (`engine.cpu_gemm_rows=auto`) it is measured once per process on the model's own layers
  (`measure_gemm_rows`). The packed copies double the memory the weights take; `Engine.memory()`
  reports them, and the rows chosen. A layer's outputs go into buffers
  reused from step to step (`cpu_kernels.Workspace`), so a prefill step does not fault in tens of
  fresh megabytes per layer; they grow to the largest step seen, then stay put.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from workers.attention import AttentionMetadata, store_kv
from workers.config import check_gemm_rows, gemm_route

log = logging.getLogger(__name__)
KERNELS = ("auto", "torch", "cpu")
GEMM_CANDIDATES = (256, 512, 1024)
GEMM_MARGIN = 1.15                   # the panel kernel takes rows from MKL only when this much faster
_measured: dict = {}                 # (layer shapes, torch threads) -> (gemm_rows, timings): once a process


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) (HF's convention)."""
    return x * cos.unsqueeze(1) + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin.unsqueeze(1)


class TorchOps:
    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        """norm (an RMSNorm module) of x [T, N]."""
        return norm(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream plus x, and its norm: (norm(residual + x), residual + x)."""
        residual = residual + x
        return norm(residual), residual

    def rope_store_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, meta: AttentionMetadata,
                      pool: torch.Tensor, layer: int) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) * D] -> the rotated queries [T, H, D]; the rotated keys and the values
        are written at the step's slots of layer `layer`'s pools."""
        T, H, KVH = qkv.shape[0], num_heads, num_kv_heads
        qkv = qkv.view(T, H + 2 * KVH, -1)
        qk = apply_rotary(qkv[:, :H + KVH], meta.cos, meta.sin)           # q and k rotated together
        store_kv(pool, layer, meta.slot_mapping, qk[:, H:], qkv[:, H + KVH:])
        return qk[:, :H]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2F] -> silu(gate) * up [T, F]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @property
    def packed_bytes(self) -> int:
        return 0

    @property
    def workspace_bytes(self) -> int:
        return 0


class CpuOps(TorchOps):
    """`gemm_rows`: a linear of this many rows or more runs as MKL's GEMM, fewer on the panel kernel
    (None: always the panel kernel); "auto": `measure_gemm_rows` on the model's first layer."""
    name = "cpu"

    def __init__(self, model, gemm_rows: int | str | None = "auto"):
        from workers import cpu_kernels
        self._k = cpu_kernels
        self.workspace = cpu_kernels.Workspace()
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        weights = [p for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name]
        # keyed by the parameter object: the model keeps each alive, so an id is never reused
        self._packed = {id(w): cpu_kernels.pack_linear(w) for w in [*weights, head]}
        self._bytes = sum(p.numel() * p.element_size() for p in self._packed.values())
        # Every layer's projection of a kind writes one buffer of that kind, and its norms another: a
        # layer reads each output before the next layer writes it again. The final norm and the LM
        # head are not in these maps, so what leaves the model is always a tensor of its own.
        self._out = {id(p): name for layer in model.layers for name, p in
                     (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                      ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj))}
        self._norm_out = {id(n.weight) for layer in model.layers for n in (layer.input_layernorm,
                                                                            layer.post_attention_layernorm)}
        self.gemm_timings: list = []
        if gemm_rows == "auto":
            layer = model.layers[0]
            gemm_rows, self.gemm_timings = measure_gemm_rows(
                [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj])
        self.gemm_rows = check_gemm_rows(gemm_rows)
        self._gemm_from = self.gemm_rows or float("inf")

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(id(weight))
        if packed is None or torch.is_grad_enabled():       # (out= and ctypes have no autograd)
            return F.linear(x, weight)
        rows, name = x.shape[0], self._out.get(id(weight))
        out = None if name is None else self.workspace.get(name, rows, weight.shape[0])
        if rows >= self._gemm_from:
            return torch.mm(x, weight.t(), out=out)
        return self._k.linear_small(x.contiguous(), packed, weight.shape[0], out=out)

    def _norm_buffer(self, x: torch.Tensor, norm) -> torch.Tensor | None:
        return self.workspace.get("norm", *x.shape) if id(norm.weight) in self._norm_out else None

    def norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        return self._k.rms_norm(x.contiguous(), norm.weight, norm.eps, out=self._norm_buffer(x, norm))

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        # residual is this layer's own stream (the embedding's output, then sums made here), so
        # adding into it in place changes nothing anyone else holds
        return self._k.rms_norm(x.contiguous(), norm.weight, norm.eps, residual=residual,
                                out=self._norm_buffer(x, norm)), residual

    def rope_store_kv(self, qkv, num_heads, num_kv_heads, meta, pool, layer) -> torch.Tensor:
        T = qkv.shape[0]
        self._k.rope_store_kv(qkv, num_heads, num_kv_heads, meta.cos, meta.sin, meta.slot_mapping,
                              pool[layer, 0], pool[layer, 1])
        return qkv.view(T, num_heads + 2 * num_kv_heads, -1)[:, :num_heads]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.silu_mul(gate_up, out=self.workspace.get("act", gate_up.shape[0], gate_up.shape[1] // 2))

    @property
    def packed_bytes(self) -> int:
        return self._bytes

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.nbytes


def pick_gemm_rows(timings: list[tuple[int, float, float]], margin: float = GEMM_MARGIN) -> int | None:
    """From (rows, panel kernel's time, MKL's time) in increasing rows: the first rows at which the panel
    kernel is not `margin` times faster than MKL (MKL from there on: it only gains with rows), or
    None where it is at every rows measured (the panel kernel from then on too)."""
    for rows, panel, gemm in timings:
        if panel * margin > gemm:
            return rows
    return None


def measure_gemm_rows(weights: list[torch.Tensor], candidates=GEMM_CANDIDATES, rounds: int = 3,
                      budget_s: float = 0.25) -> tuple[int | None, list]:
    """(gemm_rows, [(rows, panel s, MKL s), ...]) for these linears (one layer's, [N, K] each, at most 512
    output columns of each measured, so a large model measures in about the same time): at each
    candidate rows, both routes timed on random input, alternating, `rounds` times after a warm-up, the
    fastest of each kept, until one says MKL or `budget_s` is spent (the last measured then stands for
    the rest). Measured once per process for a given set of shapes and torch threads."""
    from workers import cpu_kernels
    key = (tuple(tuple(w.shape) for w in weights), torch.get_num_threads(), tuple(candidates))
    if key in _measured:
        return _measured[key]
    ws = [w.detach()[:512].contiguous() for w in weights]
    packed = [cpu_kernels.pack_linear(w) for w in ws]
    timings, start = [], time.perf_counter()
    with torch.no_grad():
        for rows in candidates:
            xs = [torch.randn(rows, w.shape[1]) for w in ws]
            outs = [torch.empty(rows, w.shape[0]) for w in ws]

            def panel():
                for x, p, w, o in zip(xs, packed, ws, outs):
                    cpu_kernels.linear_small(x, p, w.shape[0], out=o)

            def gemm():
                for x, w, o in zip(xs, ws, outs):
                    torch.mm(x, w.t(), out=o)

            routes, best = (panel, gemm), [float("inf"), float("inf")]
            for k in range(rounds + 1):
                for i in ((0, 1) if k % 2 else (1, 0)):
                    t0 = time.perf_counter()
                    routes[i]()
                    if k:
                        best[i] = min(best[i], time.perf_counter() - t0)
            timings.append((rows, best[0], best[1]))
            if pick_gemm_rows(timings[-1:]) is not None or time.perf_counter() - start > budget_s:
                break
    chosen = pick_gemm_rows(timings)
    log.info("CPU linears: %s (the panel kernel's time / MKL's: %s)", gemm_route(chosen),
             ", ".join(f"{p / g:.2f} at {r}" for r, p, g in timings))
    _measured[key] = (chosen, timings)
    return _measured[key]


def make_ops(name: str, model, device: torch.device, dtype: torch.dtype, compile: bool,
             gemm_rows: int | str | None = "auto"):
    """`auto`: `cpu` for an eager float32 model on a CPU whose kernels build; `torch` otherwise (a GPU, another dtype, or a compiled model, which inductor fuses)."""
    if name not in KERNELS:
        raise ValueError(f"kernels={name!r}: choose one of {list(KERNELS)}")
    fits = device.type == "cpu" and dtype == torch.float32 and not compile
    if name == "cpu" and not fits:
        raise ValueError(f"kernels=cpu runs an eager float32 model on a CPU, not {str(dtype).removeprefix('torch.')} "
                         f"on {device}{' compiled' if compile else ''}")
    if name == "torch" or not fits:
        return TorchOps()
    from workers import cpu_kernels
    if not cpu_kernels.available():
        if name == "cpu":
            raise ValueError("kernels=cpu: the CPU kernels could not be built (see the warning)")
        log.warning("no CPU kernels: the model runs on torch's own ops")
        return TorchOps()
    return CpuOps(model, gemm_rows)
