"""Attention over the paged KV pool: one call per layer for the whole step (decodes and prompt
chunks alike), reading keys and values through block tables.

The step is a flat batch of T new tokens from S sequences: sequence s owns rows
q_start[s]..q_start[s+1] and, after this step's K/V are written, keys at positions [0, ctx_len[s]);
each query attends causally to the keys up to its own position. Decodes come first (one row each).

Backends, chosen by name (`EngineConfig.attention`, "auto" picks by device and dtype):
- `cpu`: the C kernel of workers/csrc (float32 on CPU), reading blocks in place with OpenMP.
- `flex`: torch's flex_attention over the pool viewed as one long sequence, with a block mask built
  straight from the block tables (each query tile visits only its own sequence's blocks); the GPU
  path (compiled to Triton). It also runs on a CPU, slowly, which is how CPU tests exercise it.
- `reference`: gathers each sequence's context and runs SDPA with a causal mask. Simple and
  obviously right: the oracle the tests compare the others with, and the fallback where no other
  backend fits (a CPU without a C compiler, float16 on a CPU).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    positions: torch.Tensor      # [T] long
    slot_mapping: torch.Tensor   # [T] long: where each new token's K/V goes in the flat pool
    block_tables: torch.Tensor   # [S, max_blocks] int32, padded with 0
    q_start: torch.Tensor        # [S + 1] int32
    ctx_len: torch.Tensor        # [S] int32
    num_decodes: int             # sequences [0, num_decodes) are decodes: one row each
    q_lens: list[int]            # host copies: rows per sequence ...
    ctx_lens: list[int]          # ... and context per sequence
    cos: torch.Tensor | None = None   # [T, head_dim] rotary tables at `positions` (set once per step)
    sin: torch.Tensor | None = None   # signed: see Rotary.tables
    state: dict = field(default_factory=dict)   # what a backend prepares once per step for every layer

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def layer_kv(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pools [NB, BS, KVH, D] out of the whole pool [L, 2, NB, BS, KVH, D]."""
    return pool[layer, 0], pool[layer, 1]


def _store_kv(pool: torch.Tensor, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    k_cache, v_cache = layer_kv(pool, layer)
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


# An op of its own so that a compiled model updates the pool in place instead of copying it. It
# takes the whole pool and a layer index: a compiled op that mutates a *view* of a graph input
# under dynamic shapes lost its writes (torch 2.13), mutating the input itself does not.
_store_kv_op = torch.library.custom_op("pdlab::store_kv", _store_kv, mutates_args=("pool",))
_store_kv_op.register_fake(lambda pool, layer, slot_mapping, k, v: None)


def store_kv(pool, layer, slot_mapping, k, v) -> None:
    """Write the step's new keys and values (k, v [T, KVH, D]) at their slots of layer `layer`'s pools:
    through the custom op when compiling, directly (no dispatch cost) when eager."""
    (_store_kv_op if torch.compiler.is_compiling() else _store_kv)(pool, layer, slot_mapping, k, v)


class ReferenceAttention:
    name = "reference"
    workspace_bytes = 0

    def prepare(self, meta: AttentionMetadata, block_size: int, num_blocks: int) -> None:
        pass

    def forward(self, q, pool, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = layer_kv(pool, layer)
        out = torch.empty_like(q)                                         # [T, H, D]
        tables = meta.block_tables.long()
        row = 0
        for s, (n, ctx) in enumerate(zip(meta.q_lens, meta.ctx_lens)):
            k = k_cache[tables[s]].flatten(0, 1)[:ctx].transpose(0, 1)    # [KVH, ctx, D]
            v = v_cache[tables[s]].flatten(0, 1)[:ctx].transpose(0, 1)
            pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]   # [n, ctx]
            o = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1)[None], k[None], v[None],
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[row:row + n] = o[0].transpose(0, 1)
            row += n
        return out


class CpuPagedAttention:
    name = "cpu"

    def __init__(self):
        from workers import cpu_kernels   # registers torch.ops.pdlab.paged_attention
        self._kernel = cpu_kernels
        self.workspace = cpu_kernels.Workspace()    # eager: every layer's output in one reused buffer

    def prepare(self, meta: AttentionMetadata, block_size: int, num_blocks: int) -> None:
        pass

    def forward(self, q, pool, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        args = (q, pool, layer, meta.block_tables, meta.q_start, meta.ctx_len, scale)
        if torch.compiler.is_compiling():
            return self._kernel.paged_attention(*args)
        return self._kernel.paged_attention_eager(*args, out=self.workspace.get("attention", *q.shape))

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.nbytes


class FlexPagedAttention:
    """Queries of each sequence are padded to whole tiles of Q_TILE rows, so a tile belongs to one
    sequence and visits exactly its blocks: the block mask's KV indices for a tile are that
    sequence's block table, and the KV block size is the pool's block size."""

    name = "flex"
    workspace_bytes = 0
    Q_TILE = 16

    def __init__(self):
        from torch.nn.attention.flex_attention import flex_attention
        self._flex = flex_attention
        self._compiled = None

    def prepare(self, meta: AttentionMetadata, block_size: int, num_blocks: int) -> None:
        from torch.nn.attention.flex_attention import BlockMask
        dev, tile, S = meta.positions.device, self.Q_TILE, meta.ctx_len.shape[0]
        ctx = meta.ctx_len.long()
        if meta.num_decodes == S:
            # decode-only: one tile per sequence, derived from S alone, so no host data is read and
            # the whole preparation can be captured in a CUDA graph (workers/cuda_graphs.py)
            tiles = torch.ones(S, dtype=torch.long, device=dev)
            q_lens = tiles
        else:
            q_lens = torch.tensor(meta.q_lens, device=dev)
            tiles = (q_lens + tile - 1) // tile
        num_tiles = S if meta.num_decodes == S else sum(-(-n // tile) for n in meta.q_lens)
        seq_of_tile = torch.repeat_interleave(torch.arange(S, device=dev), tiles, output_size=num_tiles)
        padded_start = (torch.cumsum(tiles, 0) - tiles) * tile                            # [S]
        seq_of_row = torch.repeat_interleave(seq_of_tile, tile)                           # [num_tiles * tile]
        offset = torch.arange(num_tiles * tile, device=dev) - padded_start[seq_of_row]
        q_pos = ctx[seq_of_row] - q_lens[seq_of_row] + offset            # padded rows: beyond the context
        real = offset < q_lens[seq_of_row]
        q_start = meta.q_start.long()
        rows = (torch.repeat_interleave(padded_start - q_start[:-1], q_lens, output_size=meta.num_tokens)
                + torch.arange(meta.num_tokens, device=dev))                  # each real token's padded row
        tables = meta.block_tables.long()
        kv_blocks = (ctx + block_size - 1) // block_size                      # [S]
        index = torch.arange(tables.shape[1], device=dev).expand_as(tables)
        # physical block -> its index in its sequence's table, and that sequence; unused table entries
        # go to a spare slot past the pool, so every shape here is static
        target = torch.where(index < kv_blocks[:, None], tables, num_blocks).flatten()
        logical = torch.zeros(num_blocks + 1, dtype=torch.long, device=dev).scatter_(0, target, index.flatten())
        owner = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=dev).scatter_(
            0, target, torch.arange(S, device=dev).repeat_interleave(tables.shape[1]))

        def causal(b, h, q_idx, kv_idx):     # complete on its own: eager flex applies it to every pair
            blk = kv_idx // block_size
            key_pos = logical[blk] * block_size + kv_idx % block_size
            return real[q_idx] & (owner[blk] == seq_of_row[q_idx]) & (key_pos <= q_pos[q_idx])

        mask = BlockMask.from_kv_blocks(kv_blocks[seq_of_tile].int()[None, None], meta.block_tables[seq_of_tile][None, None],
                                        BLOCK_SIZE=(tile, block_size), mask_mod=causal,
                                        seq_lengths=(num_tiles * tile, num_blocks * block_size), compute_q_blocks=False)
        meta.state["flex"] = (mask, rows, num_tiles * tile)

    def forward(self, q, pool, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = layer_kv(pool, layer)
        mask, rows, padded = meta.state["flex"]
        T, H, D = q.shape
        qp = q.new_zeros(padded, H, D)
        qp[rows] = q
        k = k_cache.flatten(0, 1).transpose(0, 1)[None]        # [1, KVH, NB * BS, D]
        v = v_cache.flatten(0, 1).transpose(0, 1)[None]
        fn = self._flex
        if q.device.type == "cuda":
            if self._compiled is None:
                self._compiled = torch.compile(self._flex, dynamic=True)
            fn = self._compiled
        out = fn(qp.transpose(0, 1)[None], k, v, block_mask=mask, scale=scale, enable_gqa=True)  # [1, H, P, D]
        return out[0].transpose(0, 1)[rows]


BACKENDS = {"reference": ReferenceAttention, "cpu": CpuPagedAttention, "flex": FlexPagedAttention}


def make_backend(name: str, device: torch.device, dtype: torch.dtype):
    """`auto`: the C kernel for float32 on a CPU (if it builds), flex on a GPU, else the reference."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"attention={name!r}: choose auto or one of {sorted(BACKENDS)}")
    if name == "auto":
        if device.type == "cuda":
            name = "flex"
        elif dtype == torch.float32 and _cpu_kernel_available():
            name = "cpu"
        else:
            name = "reference"
    if name == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"attention=cpu runs float32 on a CPU, not {str(dtype).removeprefix('torch.')} "
                             f"on {device}")
        if not _cpu_kernel_available():
            raise ValueError("attention=cpu: the CPU kernel could not be built (see the warning above)")
    return BACKENDS[name]()


def _cpu_kernel_available() -> bool:
    from workers import cpu_kernels
    return cpu_kernels.available()
