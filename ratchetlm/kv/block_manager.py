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
(:mod:`ratchetlm.kv.block_hash`); :meth:`match_prefix` gives a new sequence the longest run of
named blocks its tokens start with; when the free list is empty, :meth:`grow` evicts the cached
block released longest ago. Nothing referenced is ever evicted.

With ``window`` set (the layers of this cache all slide, at most that many positions back: a
Mistral model's one cache, or a Gemma model's local-layer pool, engine/layer_groups.py), a sequence
also drops its references to blocks no later query can reach (:meth:`release_out_of_window`): the
table entry becomes ``-1``, so ``block_table[p // block_size]`` still indexes by position, and the
blocks a sequence holds stay bounded by its window however long it grows. A prefix hit then needs
only the blocks the window reaches from where the hit ends (:meth:`longest_hit`).

``table`` names the sequence's table this manager owns (``block_table``; a layer group's own pool
uses another, e.g. ``local_block_table``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping

import torch

from ratchetlm.kv.block_hash import BlockHash, chain_hash, root_hash
from ratchetlm.kv.prefix_stats import PrefixCacheStats
from ratchetlm.sequence import Sequence

SLOT_CACHE = 1024  # holders whose slot tensor is kept (a step holds max_num_seqs and their draft caches)


class BlockManager:
    """Owns the blocks of one paged cache. ``enable_caching=False`` (draft caches, models whose
    cache layout cannot share blocks): every released block goes straight back to the free list."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 cache_key: Mapping[str, str] | None = None, window: int | None = None,
                 table: str = "block_table") -> None:
        assert num_blocks > 0 and block_size > 0 and (window is None or window > 0)
        self.table = table
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # every layer slides, at most this far back: blocks behind it are released
        self.enable_caching = enable_caching
        self.cache_key = dict(cache_key or {})  # engine-wide inputs that change K/V (block_hash.root_hash)
        self._root = root_hash(self.cache_key)
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.high_water = 0  # 1 + the highest block ever handed out (they go in increasing order at first)
        self.ref_count = [0] * num_blocks
        # id(seq) -> (the block table it was made from, slots of every position it covers, -1 in released
        # blocks): a decode step's context slots are a view of it while the table stays the same (a new
        # block every block_size tokens), not five tensor ops each step (~0.15 ms after a forward). The
        # slots are a function of the table alone, so a reused id finds a table that differs, or is equal
        self._slot_cache: dict[int, tuple[list[int], torch.Tensor]] = {}
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

    def blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """Most blocks one sequence of ``num_tokens`` tokens holds at once, fed at most
        ``step_tokens`` per step: all of them, or with ``window`` the window behind its next query,
        one step's tokens and one partially reached block."""
        need = self.blocks_needed(num_tokens)
        if self.window is not None:
            need = min(need, self.blocks_needed(self.window - 1 + step_tokens) + 1)
        return need

    def fits(self, num_tokens: int, step_tokens: int) -> str | None:
        """Why a sequence of ``num_tokens`` tokens can never fit this cache, or None."""
        need = self.blocks_held(num_tokens, step_tokens)
        if need > self.num_blocks:
            return f"needs {need} KV blocks but the cache has only {self.num_blocks} blocks of {self.block_size} tokens"
        return None

    def _t(self, seq: Sequence) -> list[int]:
        table: list[int] = getattr(seq, self.table)
        return table

    # ------------------------------------------------------------------ allocate / release

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(self._t(seq)) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s table cover positions ``[0, num_tokens)``. Caller checked ``can_grow``."""
        table = self._t(seq)
        need = self.blocks_needed(num_tokens) - len(table)
        assert need <= self.num_free, "grow() without can_grow()"
        for _ in range(max(0, need)):
            table.append(self._allocate())

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
        self.high_water = max(self.high_water, b + 1)
        return b

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s references (finish, abort, preemption). Blocks others still hold stay;
        named blocks nobody holds become cached, tail first so that eviction takes a prompt's
        private end before the prefix others are likelier to share."""
        for b in reversed(self._t(seq)):
            if b >= 0:  # -1: already released out of the window
                self._unref(b)
        setattr(seq, self.table, [])
        self._slot_cache.pop(id(seq), None)

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
        table = self._t(seq)
        n = 0
        while n < len(table) and table[n] < 0:
            n += 1
        return n * self.block_size

    def _window_start(self, num_cached: int) -> int:
        """First block a query at ``num_cached`` or later can reach (0 without ``window``)."""
        return 0 if self.window is None else max(num_cached - self.window + 1, 0) // self.block_size

    def release_out_of_window(self, seq: Sequence) -> None:
        """Drop ``seq``'s blocks that no later query reaches (no-op without ``window``): a query at
        ``p >= num_cached`` sees keys ``> p - window``, so blocks wholly below
        ``num_cached - window + 1`` are dead. Named ones stay cached for later prefix hits."""
        if self.window is None:
            return
        table = self._t(seq)
        for j in range(self.context_start(seq) // self.block_size, min(self._window_start(seq.num_cached), len(table))):
            self._unref(table[j])
            table[j] = -1

    # ------------------------------------------------------------------ the prefix cache

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Names of ``seq``'s first ``num_blocks`` blocks, extending ``seq.block_hashes`` (tokens only
        grow, so a name once computed never changes; every layer group's manager shares them)."""
        hs = seq.block_hashes
        bs = self.block_size
        parent = hs[-1] if hs else (self._root if seq.cache_salt is None else root_hash(self.cache_key, seq.cache_salt))
        for i in range(len(hs), num_blocks):
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hs.append(parent)
        return hs

    def longest_hit(self, seq: Sequence, upto: int | None = None) -> int:
        """The most full blocks (at most ``upto``) ``seq`` can start with from the cache, leaving at
        least its last token to compute (its logits pick the next token). Every block must be
        cached, or with ``window`` only the blocks the window reaches from where the hit ends."""
        if not self.enable_caching:
            return 0
        n = (len(seq.token_ids) - 1) // self.block_size
        n = n if upto is None else min(n, upto)
        hashes = self._hashes(seq, n)
        best = run = 0  # run: cached blocks in a row ending at block k - 1
        for k in range(1, n + 1):
            run = run + 1 if hashes[k - 1] in self.cached else 0
            if run >= k - self._window_start(k * self.block_size):
                best = k
            elif self.window is None:
                break
        return best

    def take_hit(self, seq: Sequence, num_blocks: int) -> int:
        """Reference the first ``num_blocks`` cached blocks of ``seq``'s prefix (those its window
        reaches, with ``window``; the entries before are ``-1``); returns the tokens covered."""
        table = self._t(seq)
        assert not table, "lookup is for a sequence without KV"
        hashes = seq.block_hashes
        first = self._window_start(num_blocks * self.block_size)
        table += [-1] * first
        for h in hashes[first:num_blocks]:
            b = self.cached[h]
            if self.ref_count[b] == 0:
                del self.evictable[b]
            self.ref_count[b] += 1
            table.append(b)
        return num_blocks * self.block_size

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks yet the longest run of cached blocks its tokens start with
        (:meth:`longest_hit`); returns the tokens covered (now ``seq.num_cached``)."""
        assert seq.num_cached == 0, "lookup is for a sequence without KV"
        seq.num_cached = self.take_hit(seq, self.longest_hit(seq))
        return seq.num_cached

    def cache_full_blocks(self, seq: Sequence, num_cached_before: int) -> None:
        """After a commit: name the blocks that became full and committed since ``seq.num_cached``
        was ``num_cached_before`` (if another sequence committed the same tokens first, that block
        keeps the name and this one stays private: freed, not cached, when released); then, with
        ``window``, release what the window left behind (named first, so it stays cached)."""
        first, last = num_cached_before // self.block_size, seq.num_cached // self.block_size
        if self.enable_caching and last > first:
            hashes = self._hashes(seq, last)
            table = self._t(seq)
            for i in range(first, last):
                b = table[i]
                if b >= 0 and self.block_hash[b] is None and hashes[i] not in self.cached:
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

    def position_slots(self, seq: Sequence, positions: list[int]) -> torch.Tensor:  # [n] int64
        """Slot of each position (-1 past the blocks the scheduler reserved, or in a released block:
        such a row is never committed — an accepted row is always at ``num_cached + i``)."""
        table = self._t(seq)
        bs = self.block_size
        if len(positions) <= 64:  # a verify's few rows: list arithmetic beats the tensor ops below
            return torch.tensor(self.slot_list(seq, positions), dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        tab = torch.tensor(table, dtype=torch.long)
        block = tab[(pos // bs).clamp(max=max(len(table) - 1, 0))]
        held = (pos < len(table) * bs) & (block >= 0)
        return torch.where(held, block * bs + pos % bs, torch.full_like(pos, -1))

    def slot_list(self, seq: Sequence, positions: list[int] | range) -> list[int]:
        """:meth:`position_slots` as a list (a step's few rows: the runner makes one tensor of them all)."""
        table = self._t(seq)
        bs = self.block_size
        lim = len(table) * bs
        return [table[p // bs] * bs + p % bs if p < lim and table[p // bs] >= 0 else -1 for p in positions]

    def slots(self, seq: Sequence, start: int, end: int, device: torch.device | str = "cpu",
              released: bool = False) -> torch.Tensor:
        """Slots of positions ``[start, end)``: ``block_table[p // bs] * bs + p % bs``; ``released``:
        -1 for positions in blocks released out of the window (else they must not be asked for)."""
        table = self._t(seq)
        assert end <= len(table) * self.block_size, "positions beyond the block table"
        assert released or start >= end or table[start // self.block_size] >= 0, "positions in released blocks"
        if end - start <= 64:  # a decode step's or a verify's few rows: position_slots' list arithmetic
            return self.position_slots(seq, list(range(start, end))).to(device)
        return self._all_slots(seq, table)[start:end].to(device)

    def _all_slots(self, seq: Sequence, table: list[int]) -> torch.Tensor:  # [len(table) * bs] int64, read-only
        """Slot of every position ``table`` covers (-1 in released blocks), cached per sequence until
        its table changes. A view of it is handed out: callers copy, never write into it."""
        hit = self._slot_cache.get(id(seq))
        if hit is not None and hit[0] == table:
            return hit[1]
        bs = self.block_size
        blocks = torch.tensor(table, dtype=torch.long)  # [nb]
        out = (blocks[:, None] * bs + torch.arange(bs)).masked_fill_((blocks < 0)[:, None], -1).view(-1)
        if len(self._slot_cache) >= SLOT_CACHE:  # holders never freed (tests, abandoned drafts): bounded
            self._slot_cache.clear()
        self._slot_cache[id(seq)] = (list(table), out)
        return out
