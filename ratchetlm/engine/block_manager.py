"""Fixed-size KV blocks: allocation, reference counts, block tables, slot mapping and the prefix cache.

Every block is in exactly one of three states:

* **free** — holds nothing anyone will read (``free_blocks``);
* **referenced** — in the block table of ``ref_count > 0`` live sequences;
* **cached** — unreferenced, but full of committed K/V under a known name (``evictable``, oldest
  release first): a later request whose prompt starts with the same tokens takes it back.

A block becomes shareable only when it is *full and committed*: all its positions are below its
sequence's ``num_cached``. The ratchet never moves ``num_cached`` back (preemption drops the whole
table), so such a block's K/V are final. A sequence only ever writes at positions ``>= num_cached``,
i.e. into blocks past its shared prefix, so a shared block is never written and copy-on-write is
never needed. Tentative tokens (draft trees, WeDLM windows) live in the staging buffer, not in
blocks, and cannot reach a shared block.

With caching on, :meth:`cache_full_blocks` names each newly committed full block
(:mod:`ratchetlm.engine.block_hash`); :meth:`match_prefix` gives a new sequence the longest run of
named blocks its tokens start with; when the free list is empty, :meth:`grow` evicts the cached
block released longest ago. Nothing referenced is ever evicted.

With ``window`` set (a model whose every layer has a sliding window of at most that many
positions), a sequence also drops its references to blocks no later query can reach
(:meth:`release_out_of_window`): the table entry becomes ``-1``, so ``block_table[p // block_size]``
still indexes by position, and the blocks a sequence holds stay bounded by its window however long
it grows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ratchetlm.engine.block_hash import BlockHash, chain_hash, root_hash
from ratchetlm.engine.sequence import Sequence


@dataclass
class PrefixCacheStats:
    """Token counts of prefix lookups. A request's first admission is a query; re-admissions after
    preemption (which usually re-hit the sequence's own blocks) are counted apart so they do not
    inflate the hit rate users read."""

    queries: int = 0  # tokens looked up (whole sequence at admission)
    hits: int = 0  # of those, tokens found cached
    requests: int = 0
    requests_hit: int = 0  # requests with at least one cached block
    recompute_queries: int = 0  # the same, for re-admissions after preemption
    recompute_hits: int = 0
    evictions: int = 0  # cached blocks dropped to make room

    def observe(self, num_tokens: int, hit_tokens: int, recompute: bool) -> None:
        if recompute:
            self.recompute_queries += num_tokens
            self.recompute_hits += hit_tokens
            return
        self.queries += num_tokens
        self.hits += hit_tokens
        self.requests += 1
        self.requests_hit += hit_tokens > 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Owns the blocks of one paged cache. ``enable_caching=False`` (draft caches, models whose
    cache layout cannot share blocks): every released block goes straight back to the free list."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 cache_key: Mapping[str, str] | None = None, window: int | None = None) -> None:
        assert num_blocks > 0 and block_size > 0 and (window is None or window > 0)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # every layer slides, at most this far back: blocks behind it are released
        self.enable_caching = enable_caching
        self.cache_key = dict(cache_key or {})  # engine-wide inputs that change K/V (block_hash.root_hash)
        self._root = root_hash(self.cache_key)
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # name -> the one block holding it (referenced or not)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest release first
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones plus cached-unreferenced ones (evicted on demand)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a named committed prefix, referenced or not."""
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocate / release

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s table cover positions ``[0, num_tokens)``. Caller checked ``can_grow``."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        assert need <= self.num_free, "grow() without can_grow()"
        for _ in range(max(0, need)):
            seq.block_table.append(self._allocate())

    def _allocate(self) -> int:
        if self.free_blocks:
            b = self.free_blocks.popleft()
        else:  # evict the least recently released cached block
            b, _ = self.evictable.popitem(last=False)
            h = self.block_hash[b]
            assert h is not None and self.cached[h] == b
            del self.cached[h]
            self.block_hash[b] = None
            self.stats.evictions += 1
        assert self.ref_count[b] == 0
        self.ref_count[b] = 1
        return b

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s references (finish, abort, preemption). Blocks others still hold stay;
        named blocks nobody holds become cached, tail first so that eviction takes a prompt's
        private end before the prefix others are likelier to share."""
        for b in reversed(seq.block_table):
            if b >= 0:  # -1: already released out of the window
                self._unref(b)
        seq.block_table = []

    def _unref(self, b: int) -> None:
        assert self.ref_count[b] > 0, f"block {b} released more often than referenced"
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            if self.block_hash[b] is not None:
                self.evictable[b] = None
            else:
                self.free_blocks.append(b)

    def context_start(self, seq: Sequence) -> int:
        """First position whose K/V ``seq`` still holds (0 unless blocks were released out of the window)."""
        n = 0
        while n < len(seq.block_table) and seq.block_table[n] < 0:
            n += 1
        return n * self.block_size

    def release_out_of_window(self, seq: Sequence) -> None:
        """Drop ``seq``'s blocks that no later query reaches (no-op without ``window``): a query at
        ``p >= num_cached`` sees keys ``> p - window``, so blocks wholly below
        ``num_cached - window + 1`` are dead. Named ones stay cached for later prefix hits."""
        if self.window is None:
            return
        end = min(max(seq.num_cached - self.window + 1, 0) // self.block_size, len(seq.block_table))
        for j in range(self.context_start(seq) // self.block_size, end):
            self._unref(seq.block_table[j])
            seq.block_table[j] = -1

    # ------------------------------------------------------------------ the prefix cache

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Names of ``seq``'s first ``num_blocks`` blocks, extending ``seq.block_hashes`` (tokens only
        grow, so a name once computed never changes)."""
        hs = seq.block_hashes
        bs = self.block_size
        parent = hs[-1] if hs else (self._root if seq.cache_salt is None else root_hash(self.cache_key, seq.cache_salt))
        for i in range(len(hs), num_blocks):
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hs.append(parent)
        return hs

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks yet the longest run of cached blocks its tokens start with;
        returns the tokens covered (now ``seq.num_cached``). At least the last token is left to
        compute: its logits pick the next token."""
        assert not seq.block_table and seq.num_cached == 0, "lookup is for a sequence without KV"
        if not self.enable_caching:
            return 0
        hashes = self._hashes(seq, (len(seq.token_ids) - 1) // self.block_size)
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            if self.ref_count[b] == 0:
                del self.evictable[b]
            self.ref_count[b] += 1
            seq.block_table.append(b)
        seq.num_cached = len(seq.block_table) * self.block_size
        self.release_out_of_window(seq)  # a long cached prefix is not held past its window
        return seq.num_cached

    def cache_full_blocks(self, seq: Sequence, num_cached_before: int) -> None:
        """After a commit: name the blocks that became full and committed since ``seq.num_cached``
        was ``num_cached_before`` (if another sequence committed the same tokens first, that block
        keeps the name and this one stays private: freed, not cached, when released); then, with
        ``window``, release what the window left behind (named first, so it stays cached)."""
        first, last = num_cached_before // self.block_size, seq.num_cached // self.block_size
        if self.enable_caching and last > first:
            hashes = self._hashes(seq, last)
            for i in range(first, last):
                b = seq.block_table[i]
                if self.block_hash[b] is None and hashes[i] not in self.cached:
                    self.block_hash[b] = hashes[i]
                    self.cached[hashes[i]] = b
        self.release_out_of_window(seq)

    def metrics(self) -> dict[str, float]:
        """Prefix-cache counters for /metrics (empty when caching is off)."""
        if not self.enable_caching:
            return {}
        s = self.stats
        return {"prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_cache_hit_rate": s.hit_rate,
                "prefix_cache_requests": s.requests, "prefix_cache_requests_hit": s.requests_hit,
                "prefix_cache_recompute_queries": s.recompute_queries,
                "prefix_cache_recompute_hits": s.recompute_hits, "prefix_cache_evictions": s.evictions,
                "prefix_cache_blocks": len(self.cached), "prefix_cache_blocks_unreferenced": len(self.evictable)}

    def audit(self) -> dict[str, int]:
        """Check the bookkeeping (tests, debugging): every block is in exactly one state, names and
        blocks agree, and nothing referenced is evictable. Returns the count per state."""
        free, evictable = set(self.free_blocks), set(self.evictable)
        referenced = {b for b in range(self.num_blocks) if self.ref_count[b] > 0}
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert not (free & evictable) and not (free & referenced) and not (evictable & referenced)
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, "a block is lost"
        assert all(self.block_hash[b] is None for b in free), "a free block still has a name"
        assert all(self.block_hash[b] is not None for b in evictable), "an unnamed block is cached"
        assert all(self.block_hash[b] == h for h, b in self.cached.items())
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
        return {"free": len(free), "cached_unreferenced": len(evictable), "referenced": len(referenced)}

    # ------------------------------------------------------------------ slots

    def slots(self, seq: Sequence, start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Slots of positions ``[start, end)``: ``block_table[p // bs] * bs + p % bs``."""
        assert end <= len(seq.block_table) * self.block_size, "positions beyond the block table"
        assert start >= end or seq.block_table[start // self.block_size] >= 0, "positions in released blocks"
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(device)
