"""Local layers in their own KV pool: models that mix sliding-window and global layers (Gemma 2/3).

A global layer reads the whole context, so its K/V are kept for every position; a local layer
reads only the last ``window`` positions. Keeping both in one pool would make the local layers'
memory grow with the context like the global ones'. So the cache gives the local layers pools of
their own (``KVCache(local=...)``: ``k_local`` / ``v_local``, slot group ``kv_local``) whose blocks
follow ``Sequence.local_block_table`` and are released as the window moves past them
(``BlockManager(window=...)``), while the global layers' ``k`` / ``v`` follow ``Sequence.block_table``
and are kept. Each pool's blocks are a plain :class:`BlockManager`; this class makes the pair look
like one to the scheduler: a sequence grows, is admitted or preempted in both at once.

Everything else stays as it was: one forward, one slot tensor per forward with a row per slot group
(``[2, n]``: the same tokens' slots in each pool; ``-1`` in both for rows not written), one write
point (the sink writes each layer's rows into its pools), one staging buffer whose all-or-nothing
commit covers every pool.

**Prefix caching** works in both pools under the same block names (a name stands for a token
prefix; each pool keeps its own blocks under it). A hit of ``k`` blocks needs the global pool to hold
all ``k`` and the local pool the blocks its window reaches from block ``k`` (the ones before were
released, or evicted, and are never read again): :meth:`match_prefix` takes the longest ``k`` both
serve.

**Sizing** (:func:`split_blocks`): the local pool gets what every running sequence needs at once —
``max_num_seqs`` windows plus one step's tokens — or as many blocks as the global pool if that is
fewer; the global pool gets the rest of the byte budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ratchetlm.engine.config import EngineConfig
from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.prefix_stats import PrefixCacheStats
from ratchetlm.sequence import Sequence


class GroupedBlocks:
    """The global layers' :class:`BlockManager` (``groups[0]``, the one whose counts the server
    reports) and the local layers' (``groups[1]``, with ``window``), moved together."""

    window = None  # some layers read the whole context

    def __init__(self, full: BlockManager, local: BlockManager) -> None:
        assert full.window is None and local.window is not None and full.block_size == local.block_size
        assert full.table != local.table and full.enable_caching == local.enable_caching
        self.groups = [full, local]
        self.block_size = full.block_size
        self.enable_caching = full.enable_caching

    # --- what the scheduler, the server and tests read: the global pool's counts
    @property
    def num_blocks(self) -> int:
        return self.groups[0].num_blocks

    @property
    def num_free(self) -> int:
        return self.groups[0].num_free

    @property
    def stats(self) -> PrefixCacheStats:
        return self.groups[0].stats

    def blocks_needed(self, num_tokens: int) -> int:
        return self.groups[0].blocks_needed(num_tokens)

    def fits(self, num_tokens: int, step_tokens: int) -> str | None:
        """Why a sequence of ``num_tokens`` tokens can never fit, or None."""
        for name, g in zip(("global", "local"), self.groups, strict=True):
            need = g.blocks_held(num_tokens, step_tokens)
            if need > g.num_blocks:
                return (f"needs {need} KV blocks of the {name} layers but their cache has only {g.num_blocks} "
                        f"blocks of {g.block_size} tokens")
        return None

    # --- a sequence moves in both pools at once
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return all(g.can_grow(seq, num_tokens) for g in self.groups)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for g in self.groups:
            g.grow(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        for g in self.groups:
            g.free(seq)

    def match_prefix(self, seq: Sequence) -> int:
        """The longest prefix both pools serve (see the module docstring); returns ``seq.num_cached``."""
        assert seq.num_cached == 0, "lookup is for a sequence without KV"
        k = self.groups[0].longest_hit(seq)
        k = self.groups[1].longest_hit(seq, upto=k)
        for g in self.groups:
            seq.num_cached = g.take_hit(seq, k)
        return seq.num_cached

    def cache_full_blocks(self, seq: Sequence, num_cached_before: int) -> None:
        for g in self.groups:  # names in both; the local pool also releases what its window left
            g.cache_full_blocks(seq, num_cached_before)

    def context_start(self, seq: Sequence) -> int:
        return self.groups[0].context_start(seq)

    def slots(self, seq: Sequence, start: int, end: int, device: torch.device | str = "cpu",
              released: bool = False) -> torch.Tensor:  # [2, end - start]
        """Slots of positions ``[start, end)`` in each pool (``released``: -1 where the local pool let go)."""
        return torch.stack([g.slots(seq, start, end, device, released) for g in self.groups])

    def position_slots(self, seq: Sequence, positions: list[int]) -> torch.Tensor:  # [2, n]
        return torch.stack([g.position_slots(seq, positions) for g in self.groups])

    def metrics(self) -> dict[str, float]:
        out = self.groups[0].metrics()
        local = self.groups[1]
        out["kv_local_blocks_used"] = local.num_blocks - local.num_free
        out["kv_local_blocks_total"] = local.num_blocks
        return out

    def audit(self) -> dict[str, int]:
        """Both pools' bookkeeping checked; the counts of the local pool's states carry a ``local_`` prefix."""
        out = self.groups[0].audit()
        out.update({f"local_{k}": v for k, v in self.groups[1].audit().items()})
        return out


def split_blocks(budget: int, full_block_bytes: int, local_block_bytes: int, local_need: int) -> tuple[int, int]:
    """Blocks of (global, local) pool for a byte budget: the local pool ``local_need`` blocks if
    that leaves the global pool more blocks, else both pools the same number."""
    even = budget // (full_block_bytes + local_block_bytes)
    if even <= local_need:
        return even, even
    return (budget - local_need * local_block_bytes) // full_block_bytes, local_need


def grouped_cache(cfg: EngineConfig, model_config: Any, kv_heads: int, dtype: torch.dtype, device: torch.device,
                  max_model_len: int, local: list[int], cache_key: Mapping[str, str] | None
                  ) -> tuple[KVCache, GroupedBlocks]:
    """The two-pool cache of a model whose layers ``local`` slide and the others do not (``kv_heads``:
    this rank's). With ``kv_cache_blocks`` that many global blocks; else ``kv_cache_bytes`` (default
    ~1 GiB, at least one ``max_model_len`` sequence) split between the pools. Either way the local
    pool has ``min(global blocks, what the running sequences need)``, so a tensor-parallel worker
    given rank 0's global block count builds the same geometry."""
    window = max(model_config.layer_window(i) for i in local)  # released behind the widest
    full = [i for i in range(model_config.num_layers) if i not in local]
    bs, steps = cfg.block_size, cfg.max_num_batched_tokens
    esize = torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * bs * kv_heads * model_config.head_dim * esize  # one layer's block
    full_bytes, local_bytes = per_layer * len(full), per_layer * len(local)
    probe = BlockManager(1, bs, window=window)
    # every running sequence's window and partial blocks, plus one step's tokens
    local_need = max(cfg.max_num_seqs * (probe.blocks_needed(window - 1) + 2) + probe.blocks_needed(steps),
                     probe.blocks_held(max_model_len, steps) + 1)
    n_full = cfg.kv_cache_blocks
    if n_full is None:
        if cfg.kv_cache_bytes is not None and cfg.kv_cache_bytes < full_bytes + local_bytes:
            raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} is less than one KV block of each layer group "
                             f"({full_bytes + local_bytes} bytes)")
        n_full = split_blocks(cfg.kv_cache_bytes or 1 << 30, full_bytes, local_bytes, local_need)[0]
        if cfg.kv_cache_bytes is None:  # the default budget holds at least one whole sequence
            n_full = max(n_full, probe.blocks_needed(max_model_len) + 1)
    n_local = min(n_full, local_need)
    cache = KVCache(model_config.num_layers, n_full, bs, kv_heads, model_config.head_dim, dtype, device,
                    local=(local, n_local))
    caching = cfg.enable_prefix_caching
    blocks = GroupedBlocks(BlockManager(n_full, bs, enable_caching=caching, cache_key=cache_key),
                           BlockManager(n_local, bs, enable_caching=caching, cache_key=cache_key, window=window,
                                        table="local_block_table"))
    return cache, blocks
