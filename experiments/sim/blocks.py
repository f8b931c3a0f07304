"""The BlockManager of a simulated worker: workers/block_manager.py's logic, with storage that grows.

A real engine's pool is a list of every block's reference count and a free list of every block. A
simulated H200 serving Llama-3-8B has about 57,000 blocks, so a thousand of them would hold 57 million
list entries before serving anything. `LazyBlockManager` inherits can_allocate, allocate and free
(as the real one decides them) and gives them storage that holds only the blocks ever handed out:
the free list is the blocks returned so far (in the order they came back) behind the blocks never
used (in id order), which is the order the real deque(range(num_blocks)) pops them in, so block ids
come out the same; reference counts are kept for handed-out blocks only. `allocate` and `free` do
what BlockManager's do with the never-used blocks taken as one range (a prompt takes a hundred blocks
at once in a large simulation).
"""
from __future__ import annotations

from collections import deque

from workers.block_manager import BlockManager


class _FreeList:
    """deque-like: popleft takes the next never-used block while there is one, then a returned one."""

    def __init__(self, owner: "LazyBlockManager", num_blocks: int):
        self.owner, self.num_blocks = owner, num_blocks
        self.fresh = 0                          # blocks [fresh, num_blocks) were never handed out
        self.returned: deque[int] = deque()

    def __len__(self) -> int:
        return self.num_blocks - self.fresh + len(self.returned)

    def popleft(self) -> int:
        if self.fresh < self.num_blocks:
            block = self.fresh
            self.fresh += 1
            self.owner.ref_counts.append(0)    # its count comes into being at 0, as in the real list
            return block
        return self.returned.popleft()

    def append(self, block: int) -> None:
        self.returned.append(block)

    def __iter__(self):
        yield from range(self.fresh, self.num_blocks)
        yield from self.returned


class LazyBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts: list[int] = []        # blocks 0 .. fresh - 1
        self._free = _FreeList(self, num_blocks)

    def can_allocate(self, block_ids: list[int], num_tokens: int) -> bool:
        """BlockManager.can_allocate in one expression: the scheduler asks it for every request every step."""
        free = self._free
        return -(-num_tokens // self.block_size) - len(block_ids) <= free.num_blocks - free.fresh + len(free.returned)

    def check(self) -> None:
        """BlockManager.check's invariant, never-used blocks counted as free."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        unreferenced = {b for b, n in enumerate(self.ref_counts) if n == 0} | set(range(self._free.fresh, self.num_blocks))
        assert set(free) == unreferenced, f"free list and ref counts disagree: {sorted(set(free) ^ unreferenced)[:8]}"

    def allocate(self, block_ids: list[int], num_tokens: int) -> None:
        """BlockManager.allocate: grow the table to cover `num_tokens`, never-used blocks first, in id order."""
        need = -(-num_tokens // self.block_size) - len(block_ids)
        if need <= 0:
            return
        free = self._free
        if need > len(free):
            raise RuntimeError(f"asked for {need} KV blocks with {len(free)} free")
        k = min(need, free.num_blocks - free.fresh)
        if k:
            block_ids.extend(range(free.fresh, free.fresh + k))
            self.ref_counts.extend([1] * k)
            free.fresh += k
        refs, returned = self.ref_counts, free.returned
        for _ in range(need - k):
            block = returned.popleft()
            assert refs[block] == 0, f"free block {block} has references"
            refs[block] = 1
            block_ids.append(block)

    def free(self, block_ids: list[int]) -> None:
        """BlockManager.free: one reference fewer to each block; blocks at zero go back to the free list."""
        refs, returned = self.ref_counts, self._free.returned
        for block in block_ids:
            n = refs[block]
            assert n > 0, f"double free of block {block}"
            refs[block] = n - 1
            if n == 1:
                returned.append(block)
