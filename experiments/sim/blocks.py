"""The BlockManager of a simulated worker: workers/block_manager.py's decisions, over counts.

Which KV blocks a request holds changes no simulated step's time; only how many it holds and how
many are free decide what the scheduler admits, preempts and runs. So `CountingBlockManager` answers
can_allocate, allocate and free as BlockManager does, from the number of free blocks alone: a
request's table holds one placeholder a block (the scheduler reads its length), and a prompt's
hundred blocks cost one addition, not a hundred list operations. A simulated H200 serving Llama-3-8B
has about 57,000 blocks a worker; a thousand of them hold nothing but a count each.
"""
from __future__ import annotations

from itertools import repeat


class CountingBlockManager:
    __slots__ = ("num_blocks", "block_size", "num_free")

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free = num_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, block_ids: list, num_tokens: int) -> bool:
        """BlockManager.can_allocate in one expression: the scheduler asks it for every request every step."""
        return -(-num_tokens // self.block_size) - len(block_ids) <= self.num_free

    def allocate(self, block_ids: list, num_tokens: int) -> None:
        """BlockManager.allocate: grow the table to cover `num_tokens`."""
        need = -(-num_tokens // self.block_size) - len(block_ids)
        if need <= 0:
            return
        if need > self.num_free:
            raise RuntimeError(f"asked for {need} KV blocks with {self.num_free} free")
        self.num_free -= need
        block_ids.extend(repeat(0, need))

    def free(self, block_ids: list) -> None:
        """BlockManager.free: the table's blocks go back (the caller empties the table)."""
        self.num_free += len(block_ids)
        if self.num_free > self.num_blocks:
            raise RuntimeError(f"{self.num_free} KV blocks free of {self.num_blocks}: a table was freed twice")

    def check(self) -> None:
        """BlockManager.check's invariant, as counts: no more blocks free than the pool has, none fewer than none."""
        assert 0 <= self.num_free <= self.num_blocks, f"{self.num_free} KV blocks free of {self.num_blocks}"
