"""The paged KV pool: one preallocated tensor per engine, and per-request export/import.

Layout [layers, 2 (K, V), num_blocks + 1 (a scratch block), block_size, kv_heads, head_dim]: each layer's K and V are
contiguous views the attention kernel indexes by block table. An export gathers one request's
tokens into a single contiguous [layers, 2, tokens, kv_heads, head_dim] tensor, which a transport
sends as is; an import scatters such a tensor into freshly allocated blocks.
"""
from __future__ import annotations

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
    """Pool size: explicit, else the CPU budget, else GPU free memory after weights and activations."""
    if ecfg.num_kv_blocks is not None:
        return ecfg.num_kv_blocks
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    block_bytes = cfg.kv_bytes_per_token(dtype_bytes) * ecfg.block_size
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = (1 - ecfg.gpu_memory_utilization) * total + activation_bytes(cfg, ecfg.token_budget, dtype_bytes)
        budget = int(free - reserve)
        where = f"GPU {device} ({free / 2**30:.1f} GiB free after weights)"
    else:
        budget = ecfg.kv_cache_bytes
        where = f"kv_cache_bytes={ecfg.kv_cache_bytes}"
    num = budget // block_bytes - 1          # one block of the budget is the scratch block
    if num < 1:
        raise ValueError(f"no room for a KV cache: {where} leaves {budget} bytes, one block needs {block_bytes}")
    return int(num)


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
        self.pool = torch.zeros(cfg.num_layers, 2, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def _flat(self) -> torch.Tensor:
        cfg = self.cfg                                           # [L, 2, (NB + 1) * BS, KVH, D]
        return self.pool.view(cfg.num_layers, 2, -1, cfg.num_kv_heads, cfg.head_dim)

    def export(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """[L, 2, num_tokens, KVH, D], contiguous: exactly the request's tokens, one copy."""
        slots = slots_for(block_ids, num_tokens, self.block_size, self.device)
        return self._flat().index_select(2, slots)

    def check_importable(self, parts: list[tuple[int, torch.Tensor]], num_tokens: int) -> None:
        """`parts` are (first layer, [layers, 2, num_tokens, KVH, D]) runs covering every layer in order."""
        cfg, layer = self.cfg, 0
        for first, t in parts:
            expected = (t.shape[0] if t.dim() else 0, 2, num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if first != layer or t.dim() != 5 or tuple(t.shape) != expected or t.shape[0] < 1 or t.dtype != self.dtype:
                raise ValueError(f"imported KV part at layer {first} has shape {tuple(t.shape)} {t.dtype}; this "
                                 f"engine expects layers from {layer}, each (2, {num_tokens}, {cfg.num_kv_heads}, "
                                 f"{cfg.head_dim}) {self.dtype}")
            layer += t.shape[0]
        if layer != cfg.num_layers:
            raise ValueError(f"imported KV covers {layer} layers; this engine expects {cfg.num_layers}")

    def import_(self, block_ids: list[int], parts: list[tuple[int, torch.Tensor]], num_tokens: int) -> None:
        self.check_importable(parts, num_tokens)
        slots = slots_for(block_ids, num_tokens, self.block_size, self.device)
        flat = self._flat()
        for first, t in parts:
            flat[first:first + t.shape[0]].index_copy_(2, slots, t.to(self.device))
