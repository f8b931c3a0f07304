"""The paged KV pool: one preallocated tensor per engine, and per-request export/import.

Layout [layers, 2 (K, V), num_blocks + 1 (a scratch block), block_size, kv_heads, head_dim]: each
layer's K and V are contiguous views the attention kernel indexes by block table. An export gathers
one request's tokens (all layers, or a run of layers; all tokens, or those from a start) into a
contiguous [layers, 2, tokens, kv_heads, head_dim] tensor, which a transport sends as is; an import
scatters such a part into the request's blocks, so a request's KV can arrive in any number of
parts, layer by layer or chunk by chunk.
"""
from __future__ import annotations

import ctypes
import sys

import torch

from workers.config import EngineConfig, ModelConfig


def slots_for(block_ids: list[int], num_tokens: int, block_size: int, device) -> torch.Tensor:
    """Flat pool index of each of the first `num_tokens` token positions of a block table."""
    pos = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return (blocks * block_size + pos % block_size).to(device)


def activation_bytes(cfg: ModelConfig, token_budget: int, dtype_bytes: int) -> int:
    """Rough peak of one step's temporaries: the widest per-token buffers, twice over, plus logits."""
    per_token = (2 * cfg.intermediate_size + 4 * cfg.hidden_size
                 + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim) * dtype_bytes
    return 2 * token_budget * per_token + 256 * cfg.vocab_size * 4


def num_blocks_for(cfg: ModelConfig, ecfg: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Pool size: explicit, else the CPU budget, else this worker's share of the GPU. On a GPU the
    share is `gpu_memory_utilization` of the device's memory less what this process already holds
    (its weights) and a step's activations, and never more than is free: so two workers sharing one
    GPU (fractional GPUs in Ray) each take their own share instead of the first taking it all."""
    if ecfg.num_kv_blocks is not None:
        return ecfg.num_kv_blocks
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    block_bytes = cfg.kv_bytes_per_token(dtype_bytes) * ecfg.block_size
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        activations = activation_bytes(cfg, ecfg.token_budget, dtype_bytes)
        budget = int(min(ecfg.gpu_memory_utilization * total - held, free) - activations)
        where = (f"GPU {device}: gpu_memory_utilization={ecfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                 f"{held / 2**30:.1f} GiB held by this worker, {free / 2**30:.1f} GiB free")
    else:
        budget = ecfg.kv_cache_bytes
        where = f"kv_cache_bytes={ecfg.kv_cache_bytes}"
    num = budget // block_bytes - 1          # one block of the budget is the scratch block
    if num < 1:
        raise ValueError(f"no room for a KV cache: {where} leaves {budget} bytes, one block needs {block_bytes}")
    return int(num)


def ask_for_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back t's memory with 2 MiB pages (madvise MADV_HUGEPAGE; where transparent huge
    pages are set to `madvise`, nothing else gets them). The pool's blocks are scattered, so a
    decode step's attention touches a new 4 KiB page every few hundred bytes; with huge pages it
    misses the TLB far less (about 10% off decode attention on a CPU). True if the kernel agreed."""
    if sys.platform != "linux" or t.numel() * t.element_size() < 2 << 21:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    page = 1 << 21
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    start, end = (start + page - 1) // page * page, end // page * page
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14) == 0   # 14: MADV_HUGEPAGE


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        # One block past the managed ones takes the writes of padding rows (a CUDA graph's batch is
        # padded to its bucket): no request ever owns it. [L, 2, NB + 1, BS, KVH, D]
        self.scratch_block = num_blocks
        shape = (cfg.num_layers, 2, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        if device.type == "cpu":
            self.pool = torch.empty(shape, dtype=dtype)
            self.huge_pages = ask_for_huge_pages(self.pool)      # before the first touch
            self.pool.zero_()
        else:
            self.pool, self.huge_pages = torch.zeros(shape, dtype=dtype, device=device), False

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def _flat(self) -> torch.Tensor:
        cfg = self.cfg                                           # [L, 2, (NB + 1) * BS, KVH, D]
        return self.pool.view(cfg.num_layers, 2, -1, cfg.num_kv_heads, cfg.head_dim)

    def export(self, block_ids: list[int], num_tokens: int, layers: tuple[int, int] | None = None,
               start: int = 0) -> torch.Tensor:
        """[layers, 2, tokens, KVH, D], contiguous: tokens [start, num_tokens) of the request whose
        table is `block_ids`, for layers [first, end) (default: all), one copy."""
        first, end = layers or (0, self.cfg.num_layers)
        slots = slots_for(block_ids, num_tokens, self.block_size, self.device)[start:]
        return self._flat()[first:end].index_select(2, slots)

    def check_part(self, first_layer: int, t: torch.Tensor, start: int, num_tokens: int) -> None:
        """A part of a request's KV: layers [first_layer, first_layer + t.shape[0]) of tokens
        [start, start + t.shape[2]), all within a request of `num_tokens` tokens."""
        cfg = self.cfg
        ok = (t.dim() == 5 and t.dtype == self.dtype and t.shape[0] >= 1 and t.shape[2] >= 1
              and tuple(t.shape[1:2]) + tuple(t.shape[3:]) == (2, cfg.num_kv_heads, cfg.head_dim)
              and 0 <= first_layer and first_layer + t.shape[0] <= cfg.num_layers
              and 0 <= start and start + t.shape[2] <= num_tokens)
        if not ok:
            raise ValueError(f"KV part of shape {tuple(t.shape)} {t.dtype} at layer {first_layer}, token {start} "
                             f"does not fit: this engine holds {cfg.num_layers} layers of (2, tokens, "
                             f"{cfg.num_kv_heads}, {cfg.head_dim}) {self.dtype}, {num_tokens} tokens")

    def import_part(self, block_ids: list[int], num_tokens: int, first_layer: int, t: torch.Tensor,
                    start: int = 0) -> None:
        """Scatter one part (see check_part) into the request's blocks."""
        self.check_part(first_layer, t, start, num_tokens)
        slots = slots_for(block_ids, num_tokens, self.block_size, self.device)[start:start + t.shape[2]]
        self._flat()[first_layer:first_layer + t.shape[0]].index_copy_(2, slots, t.to(self.device))
