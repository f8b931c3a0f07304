"""The math of a decoder layer other than attention, behind one small interface, so the model reads
the same whatever runs it (`EngineConfig.kernels`, "auto" picks by device, dtype and compile):

- `torch`: torch's own ops, one per operation: any device and dtype, and what `torch.compile` fuses.
  Its formulas are the reference the others are tested against.
- `cpu`: float32 on a CPU, eager: the fused kernels of workers/csrc/cpu_ops.c (RMSNorm with the
  residual add, rotary embedding with the KV-cache write, SiLU-and-multiply), each one pass over
  its data. Linear layers of a decode-sized step (under 256 rows) run cpu_ops.c's panel kernel on
  weights packed once at start: at those rows a linear streams its weights from memory, and the
  kernel keeps that stream moving (measured here: 0.67x oneDNN's packed linear at 16 rows, 0.87x
  at 64). Larger steps run MKL's GEMM on the weights as they are. The packed copies double the
  memory the weights take; `Engine.memory()` reports them. A layer's outputs go into buffers
  reused from step to step (`cpu_kernels.Workspace`), so a prefill step does not fault in tens of
  fresh megabytes per layer; they grow to the largest step seen, then stay put.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from workers.attention import AttentionMetadata, store_kv

log = logging.getLogger(__name__)
KERNELS = ("auto", "torch", "cpu")


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
    name = "cpu"
    # From this many rows on, a linear runs as MKL's GEMM (compute-bound: MKL's blocking wins);
    # below it, as cpu_ops.c's panel kernel, which streams its packed weights at memory speed.
    BUFFERED_ROWS = 256

    def __init__(self, model):
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

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(id(weight))
        if packed is None or torch.is_grad_enabled():       # (out= and ctypes have no autograd)
            return F.linear(x, weight)
        rows, name = x.shape[0], self._out.get(id(weight))
        out = None if name is None else self.workspace.get(name, rows, weight.shape[0])
        if rows >= self.BUFFERED_ROWS:
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


def make_ops(name: str, model, device: torch.device, dtype: torch.dtype, compile: bool):
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
    return CpuOps(model)
