"""Fixed-size KV blocks: allocation, block tables and slot mapping."""

from __future__ import annotations

from collections import deque

import torch

from ratchetlm.engine.sequence import Sequence


class BlockManager:
    """Owns the free list. A sequence's block table covers at least every position it may write
    this step; blocks are only returned when the sequence finishes or is preempted, so two live
    sequences never share a block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s table cover positions ``[0, num_tokens)``. Caller checked ``can_grow``."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        assert need <= self.num_free, "grow() without can_grow()"
        for _ in range(max(0, need)):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def slots(self, seq: Sequence, start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Slots of positions ``[start, end)``: ``block_table[p // bs] * bs + p % bs``."""
        assert end <= len(seq.block_table) * self.block_size, "positions beyond the block table"
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(device)
