"""Fixed-size KV blocks: a free list and reference counts, in pure Python (no device needed).

A request's block table holds one reference per block; a block returns to the free list when its
last reference is dropped, and a double free is caught rather than corrupting the list.
"""
from __future__ import annotations

from collections import deque

from workers.config import blocks_for


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def num_needed(self, block_ids: list[int], num_tokens: int) -> int:
        """Blocks to add to a table of `block_ids` so it covers `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_ids))

    def can_allocate(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.num_needed(block_ids, num_tokens) <= len(self._free)

    def allocate(self, block_ids: list[int], num_tokens: int) -> None:
        """Grow the table in place to cover `num_tokens`; call `can_allocate` first."""
        need = self.num_needed(block_ids, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"asked for {need} KV blocks with {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            assert self.ref_counts[block] == 0, f"free block {block} has references"
            self.ref_counts[block] = 1
            block_ids.append(block)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks at zero return to the free list."""
        for block in block_ids:
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)

    def check(self) -> None:
        """Invariant: the free list is exactly the blocks with no references, each once."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        unreferenced = {b for b, n in enumerate(self.ref_counts) if n == 0}
        assert free == unreferenced, f"free list and ref counts disagree: {sorted(free ^ unreferenced)[:8]}"
