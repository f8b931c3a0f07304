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
    graph_safe = False       # reads host-side lengths: a captured graph would replay the capture's
    static_shapes = False

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
    graph_safe = False
    static_shapes = False

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


def size_bucket(n: int) -> int:
    """The smallest of 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x them) >= n: the
    padded sizes a compiled kernel or a CUDA graph sees, so a few shapes cover every step."""
    if n <= 16:
        return 1 << max(0, n - 1).bit_length()
    p = 1 << (n - 1).bit_length()            # the power of two at or above n
    return p * 3 // 4 if n <= p * 3 // 4 else p


class FlexPagedAttention:
    """torch's flex_attention over the pool viewed as one long sequence [1, KVH, (NB + 1) * BS, D], with
    block masks built on the device from the block tables; two calls per layer:
    - the step's decodes as a batch of one-row queries [B, H, 1, D] (batch = sequence): each batch
      entry's KV blocks are its block table, so the short-query decoding kernel splits the context;
    - its prompt chunks as one flat query sequence, each chunk padded to whole tiles of `q_tile`
      rows so that a tile belongs to one sequence and visits exactly that sequence's blocks.
    The mask's KV block is the pool's page. On a GPU the kernels take pages of a power of two from
    16 tokens (their BLOCK_N is set to divide the page), tiles of 128 rows (a multiple of every
    BLOCK_M the Triton templates choose), and every shape is padded to a `size_bucket`, so a
    server compiles a few kernels at start and none while serving."""

    name = "flex"
    workspace_bytes = 0
    graph_safe = True        # a decode-only step prepares from device tensors alone (workers/cuda_graphs.py)
    static_shapes = True     # wants the block tables at full width

    def __init__(self, device: torch.device | None = None, block_size: int = 16, q_tile: int | None = None,
                 compile: str | None = None):
        from torch.nn.attention.flex_attention import flex_attention
        cuda = device is not None and device.type == "cuda"
        if cuda:
            check_gpu_block_size(block_size)
        self.q_tile = q_tile or (128 if cuda else 16)
        self.kernel_options = {"BLOCK_N": min(block_size, 64)} if cuda else None
        # eager flex materializes scores over the whole pool; a GPU always runs the compiled kernels
        compile = compile or ("inductor" if cuda else None)
        self.compiled = compile          # the torch.compile backend, or None: eager flex
        self._flex = flex_attention if compile is None else _compiled_flex(compile)
        self._compiles_before = COMPILES[compile] if compile else 0

    @property
    def num_compiles(self) -> int:
        """Shapes compiled since this backend was made (compiled kernels are shared by every backend
        of the process: a second engine reuses the first one's)."""
        return COMPILES[self.compiled] - self._compiles_before if self.compiled else 0

    def prepare(self, meta: AttentionMetadata, block_size: int, num_blocks: int) -> None:
        dev, S, nd = meta.positions.device, meta.ctx_len.shape[0], meta.num_decodes
        ctx = meta.ctx_len.long()
        tables = meta.block_tables.long()
        kv_blocks = (ctx + block_size - 1) // block_size                      # [S]
        index = torch.arange(tables.shape[1], device=dev).expand_as(tables)
        # physical block -> its index in its sequence's table, and that sequence; unused table entries
        # go to a spare slot past the pool, so every shape here is static
        target = torch.where(index < kv_blocks[:, None], tables, num_blocks).flatten()
        logical = torch.zeros(num_blocks + 1, dtype=torch.long, device=dev).scatter_(0, target, index.flatten())
        owner = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=dev).scatter_(
            0, target, torch.arange(S, device=dev).repeat_interleave(tables.shape[1]))
        state = {}
        if nd:
            state["decode"] = self._decode_mask(nd, ctx[:nd], kv_blocks[:nd], meta.block_tables[:nd],
                                                logical, owner, block_size, num_blocks)
        if nd < S:
            state["prefill"] = self._prefill_mask(meta, ctx, kv_blocks, logical, owner, block_size, num_blocks)
        meta.state["flex"] = state

    def _decode_mask(self, nd, ctx, kv_blocks, tables, logical, owner, block_size, num_blocks):
        from torch.nn.attention.flex_attention import BlockMask
        B = size_bucket(nd)                  # padded entries have no KV blocks: their rows are dropped
        dev = ctx.device
        pad = B - nd
        counts = torch.nn.functional.pad(kv_blocks, (0, pad))
        indices = torch.nn.functional.pad(tables, (0, 0, 0, pad))
        ctx = torch.nn.functional.pad(ctx, (0, pad))

        def in_context(b, h, q_idx, kv_idx):   # complete on its own: eager flex applies it to every pair
            blk = kv_idx // block_size
            return (owner[blk] == b) & (logical[blk] * block_size + kv_idx % block_size < ctx[b])

        mask = BlockMask.from_kv_blocks(counts.int()[:, None, None], indices[:, None, None],
                                        BLOCK_SIZE=(self.q_tile, block_size), mask_mod=in_context,
                                        seq_lengths=(1, num_blocks * block_size), compute_q_blocks=False)
        return mask, B

    def _prefill_mask(self, meta, ctx, kv_blocks, logical, owner, block_size, num_blocks):
        from torch.nn.attention.flex_attention import BlockMask
        dev, tile, nd, S = ctx.device, self.q_tile, meta.num_decodes, ctx.shape[0]
        q_lens_host = meta.q_lens[nd:]
        q_lens = torch.tensor(q_lens_host, device=dev)
        tiles = (q_lens + tile - 1) // tile
        num_tiles = sum(-(-n // tile) for n in q_lens_host)
        padded_tiles = size_bucket(num_tiles)
        # tiles past the real ones belong to no sequence (index S: no KV blocks, every row masked)
        seq_of_tile = torch.repeat_interleave(torch.arange(nd, S, device=dev), tiles, output_size=num_tiles)
        seq_of_tile = torch.nn.functional.pad(seq_of_tile, (0, padded_tiles - num_tiles), value=S)
        ctx_x = torch.nn.functional.pad(ctx, (0, 1))
        none = torch.zeros(nd, dtype=torch.long, device=dev)                  # decodes: no prompt rows
        qlen_x = torch.cat([none, q_lens, none[:0].new_zeros(1)])            # [S + 1], by sequence
        tiles_x = torch.cat([none, tiles, none[:0].new_zeros(1)])
        padded_start = (torch.cumsum(tiles_x, 0) - tiles_x) * tile                     # [S + 1]
        seq_of_row = torch.repeat_interleave(seq_of_tile, tile)                           # [padded_tiles * tile]
        offset = torch.arange(padded_tiles * tile, device=dev) - padded_start[seq_of_row]
        q_pos = ctx_x[seq_of_row] - qlen_x[seq_of_row] + offset          # padded rows: beyond the context
        real = offset < qlen_x[seq_of_row]
        first = meta.q_start[nd:S].long() - meta.q_start[nd].long()      # each chunk's first row, prompt rows only
        num_rows = meta.num_tokens - nd
        rows = (torch.repeat_interleave(padded_start[nd:S] - first, q_lens, output_size=num_rows)
                + torch.arange(num_rows, device=dev))                     # each real row's padded row

        def causal(b, h, q_idx, kv_idx):     # complete on its own: eager flex applies it to every pair
            blk = kv_idx // block_size
            key_pos = logical[blk] * block_size + kv_idx % block_size
            return real[q_idx] & (owner[blk] == seq_of_row[q_idx]) & (key_pos <= q_pos[q_idx])

        counts = torch.cat([kv_blocks, kv_blocks.new_zeros(1)])[seq_of_tile]
        tables_x = torch.nn.functional.pad(meta.block_tables, (0, 0, 0, 1))
        mask = BlockMask.from_kv_blocks(counts.int()[None, None], tables_x[seq_of_tile][None, None],
                                        BLOCK_SIZE=(tile, block_size), mask_mod=causal,
                                        seq_lengths=(padded_tiles * tile, num_blocks * block_size),
                                        compute_q_blocks=False)
        return mask, rows, padded_tiles * tile

    def forward(self, q, pool, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = layer_kv(pool, layer)
        state, nd = meta.state["flex"], meta.num_decodes
        T, H, D = q.shape
        k = k_cache.flatten(0, 1).transpose(0, 1)[None]        # [1, KVH, (NB + 1) * BS, D]
        v = v_cache.flatten(0, 1).transpose(0, 1)[None]
        out = torch.empty_like(q)                               # [T, H, D]
        if "decode" in state:
            mask, B = state["decode"]
            qd = q.new_zeros(B, H, 1, D)
            qd[:nd, :, 0] = q[:nd]
            o = self._flex(qd, k, v, block_mask=mask, scale=scale, enable_gqa=True,
                           kernel_options=self.kernel_options)   # [B, H, 1, D]
            out[:nd] = o[:nd, :, 0]
        if "prefill" in state:
            mask, rows, padded = state["prefill"]
            qp = q.new_zeros(padded, H, D)
            qp[rows] = q[nd:]
            o = self._flex(qp.transpose(0, 1)[None], k, v, block_mask=mask, scale=scale, enable_gqa=True,
                           kernel_options=self.kernel_options)   # [1, H, padded, D]
            out[nd:] = o[0].transpose(0, 1)[rows]
        return out


COMPILES: dict[str, int] = {}        # shapes compiled, per torch.compile backend, in this process
_FLEX: dict = {}
_SERVING = False                      # an engine of this process finished its warm-up


def set_serving(serving: bool) -> None:
    """Say whether this process is serving (a compile then is worth a warning) or warming up."""
    global _SERVING
    _SERVING = serving


def _compiled_flex(backend: str):
    """flex_attention compiled once per process and backend, with static shapes, counting compiles.
    Every bucket compiles once; past dynamo's recompile limit it would fall back to eager flex
    silently (scores over the whole pool), so the limit is raised well above the buckets and
    hitting it is made an error."""
    if backend not in _FLEX:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 128)
        dynamo_config.fail_on_recompile_limit_hit = True
        COMPILES[backend] = 0

        def compile_counted(gm, example_inputs):
            COMPILES[backend] += 1
            if _SERVING:
                log.warning("flex attention compiled a new shape while serving (%s): a step with more prompt "
                            "chunks than the warm-up covered; its time includes the compile",
                            [tuple(t.shape) for t in example_inputs[:1] if hasattr(t, "shape")])
            if backend == "eager":
                return gm.forward
            from torch._dynamo.backends.registry import lookup_backend
            return lookup_backend(backend)(gm, example_inputs)
        _FLEX[backend] = torch.compile(flex_attention, dynamic=False, backend=compile_counted)
    return _FLEX[backend]


def check_gpu_block_size(block_size: int) -> None:
    """The Triton flex kernels read KV in blocks of a power of two of at least 16 tokens."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"engine.block_size={block_size}: on a GPU the flex attention kernels need a power "
                         f"of two of at least 16 tokens per KV block (16, 32, 64, 128)")


BACKENDS = {"reference": ReferenceAttention, "cpu": CpuPagedAttention, "flex": FlexPagedAttention}


def make_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int = 16):
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
    if name == "flex":
        return FlexPagedAttention(device, block_size)
    return BACKENDS[name]()


def _cpu_kernel_available() -> bool:
    from workers import cpu_kernels
    return cpu_kernels.available()
