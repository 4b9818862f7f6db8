"""A drafter's own paged KV cache (its KVCache + BlockManager) and each sequence's footprint in it.

Used by the proposers that keep K/V of their own: a separate draft model and the EAGLE head.
Per sequence, ``seq.strategy_state[key]`` holds a :class:`DraftSeqState`. Only committed tokens
ever get draft K/V; if the cache has no room for a sequence, it gives its blocks back and takes
a plain step (``alloc_fallbacks``), so a full draft cache costs speed, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.kv.cache import KVCache
from ratchetlm.sequence import Sequence


@dataclass
class DraftSeqState:
    """A sequence's footprint in a draft cache (duck-typed as a Sequence for BlockManager)."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading draft positions whose K/V are in the draft cache
    start: int = 0  # first position with K/V: attention reads positions [start, num_cached)


class DraftCache:
    def __init__(self, key: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.key = key  # strategy_state key of the per-sequence state
        self.cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.alloc_fallbacks = 0

    def state(self, seq: Sequence) -> DraftSeqState:
        st = seq.strategy_state.get(self.key)
        if st is None:
            st = seq.strategy_state[self.key] = DraftSeqState()
        return cast(DraftSeqState, st)

    def slots(self, st: DraftSeqState, start: int, end: int) -> torch.Tensor:  # [end - start] int64
        return self.blocks.slots(cast(Sequence, st), start, end)

    def release(self, seq: Sequence) -> None:
        st = seq.strategy_state.pop(self.key, None)
        if st is not None:
            self.blocks.free(cast(Sequence, st))

    def reserve(self, seq: Sequence, need: int) -> bool:
        """Make the sequence's draft table cover ``need`` positions; False (blocks released) if full."""
        st = self.state(seq)
        if not self.blocks.can_grow(cast(Sequence, st), need):
            self.release(seq)  # give the blocks back: another sequence may fit
            self.alloc_fallbacks += 1
            seq.stats["spec_draft_alloc_fallbacks"] = seq.stats.get("spec_draft_alloc_fallbacks", 0) + 1
            return False
        self.blocks.grow(cast(Sequence, st), need)
        return True

    def metrics(self) -> dict[str, float]:
        return {"spec_draft_alloc_fallbacks": self.alloc_fallbacks,
                "spec_draft_kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free}
