"""DeepSeek-V4's cache layout under the one engine: its pools, their sizing from a byte budget,
and the block allocator the scheduler admits and grows sequences with.

Pools (per layer, all flat ``[rows, width]``; block tables are per sequence and shared by every
layer of a kind, so the same block id addresses the same rows in each layer's pool):

========================  ======================  ==========================  ====================
pool                      layers                  rows per block / page       per sequence
========================  ======================  ==========================  ====================
``ori`` raw KV ring       every layer + MTP       ``block_size`` (128)        fixed: 1 block
``csa_cmp`` compressed    CSA                     128 entries = 512 tokens    grows with length
``idx`` indexer keys      CSA                     128 entries = 512 tokens    grows with length
``hca_cmp`` compressed    HCA                     128 entries = 16384 tokens  grows with length
``csa_state`` / ``inner_state``  CSA              page of 4 positions (fp32)  rolling, bounded
``hca_state``             HCA                     page of 8 positions (fp32)  rolling, bounded
========================  ======================  ==========================  ====================

The state tables stay *logical* over absolute positions while only the rolling compression
window (plus the rows a verify step may still commit) is mapped onto a small physical page pool;
pages behind the window go back to the free list as the sequence advances.

Sizing: the budget (bytes) first gives the fixed pools (ring, state pages) room for as many
sequences as fit next to one compressed block each, at most ``max_num_seqs``; the rest goes to
the growing pools (compressed KV, indexer keys). Admission and growth ask every pool for the
blocks the sequence needs at its new length, so how many sequences run at once follows their
lengths and the budget, not a fixed slot count. A V4 cache cannot share blocks between requests
(a ring and compressor state are not a function of a token prefix's blocks), so this allocator
never reuses a prefix: prefix caching is off for V4.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ratchetlm.kv.pools import Pools
from ratchetlm.kv.sink import DirectSink
from ratchetlm.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from ratchetlm.models.deepseek_v4.paging import BlockTables, DecodeCapacity, physical_rows
from ratchetlm.models.deepseek_v4.reference import LayerTrace

GROWING = ("csa_cmp", "idx", "hca_cmp")  # blocks that accumulate with the sequence length
STATE = ("csa_state", "inner_state", "hca_state")  # fp32 rows [kv | score + bias]


class _FreeList:
    """Block ids ``[0, n)``; optionally handed out in a shuffled order (tests use it to get
    non-identity tables). Released ids go to the back, so they are reused ring-fashion."""

    def __init__(self, n: int, shuffle_seed: int | None) -> None:
        ids = list(range(n))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(ids)
        self.n = n
        self.ids = deque(ids)

    def take(self) -> int:
        if not self.ids:
            raise RuntimeError("cache pool exhausted")
        return self.ids.popleft()

    def give(self, block: int) -> None:
        self.ids.append(block)


@dataclass
class _SeqTables:
    ori: list[int]
    maps: dict[str, dict[int, int]] = field(default_factory=lambda: {name: {} for name in GROWING + STATE})


@dataclass(frozen=True)
class PoolPlan:
    """Block (page) counts per pool, and the bytes one block of each takes over all its layers."""

    blocks: dict[str, int]
    block_bytes: dict[str, int]
    fixed_seqs: int  # sequences the fixed pools (ring, state) hold at once

    def nbytes(self) -> int:
        return sum(self.blocks[k] * self.block_bytes[k] for k in self.blocks)


class DeepseekV4Layout:
    """Pools + allocator for one V4 model. ``ring_layers`` are the layer keys with a raw-KV
    ring: the decoder layers ``0..L-1`` and, when an MTP module is served, ``"mtp0"``."""

    def __init__(self, cfg: DeepseekV4Config, cap: DecodeCapacity, dtype: torch.dtype, device: torch.device | str,
                 budget_bytes: int | None = None, max_num_seqs: int = 32, max_model_len: int | None = None,
                 ring_layers: tuple[Hashable, ...] | None = None, shuffle_seed: int | None = None) -> None:
        self.cfg, self.cap, self.dtype = cfg, cap, dtype
        self.max_model_len = min(max_model_len or cap.max_seq_len, cap.max_seq_len)
        self.ring_layers: tuple[Hashable, ...] = ring_layers or tuple(range(cfg.num_layers))
        kinds = cfg.layers_of_kind
        self.pool_layers: dict[str, tuple[Hashable, ...]] = {
            "ori": self.ring_layers, "csa_cmp": kinds[CSA], "idx": kinds[CSA], "hca_cmp": kinds[HCA],
            "csa_state": kinds[CSA], "inner_state": kinds[CSA], "hca_state": kinds[HCA]}
        d, di, bs = cfg.head_dim, cfg.index_head_dim, cap.block_size
        esize = torch.tensor([], dtype=dtype).element_size()
        # (rows per block, row width, element bytes)
        self.shapes: dict[str, tuple[int, int, int]] = {
            "ori": (bs, d, esize), "csa_cmp": (bs, d, esize), "idx": (bs, di, esize), "hca_cmp": (bs, d, esize),
            "csa_state": (cap.csa_state_page, 4 * d, 4), "inner_state": (cap.csa_state_page, 4 * di, 4),
            "hca_state": (cap.hca_state_page, 2 * d, 4)}
        self.plan = self.plan_pools(budget_bytes, max_num_seqs)
        self.pools = Pools()  # one pool per name, its layers stacked; each pool its own slot group
        for name, (rows, width, _) in self.shapes.items():
            if self.pool_layers[name]:
                self.pools.add(name, self.pool_layers[name], self.plan.blocks[name] * rows, (width,),
                               dtype if name not in STATE else torch.float32, device)
        self.allocator = DeepseekV4BlockAllocator(self, shuffle_seed)

    # ------------------------------------------------------------------ sizing

    def block_bytes(self, name: str) -> int:
        rows, width, esize = self.shapes[name]
        return rows * width * esize * len(self.pool_layers[name])

    def fixed_blocks_per_seq(self) -> dict[str, int]:
        cap = self.cap
        return {"ori": cap.ori_max_blocks, "csa_state": cap.state_pages_per_seq(cap.csa_ratio),
                "inner_state": cap.state_pages_per_seq(cap.csa_ratio),
                "hca_state": cap.state_pages_per_seq(cap.hca_ratio)}

    def growing_blocks(self, num_tokens: int) -> dict[str, int]:
        """Compressed/indexer blocks a sequence of ``num_tokens`` tokens maps (block 0 from the start)."""
        cap, last = self.cap, max(num_tokens - 1, 0)
        csa = (last // cap.csa_ratio) // cap.block_size + 1
        return {"csa_cmp": csa, "idx": csa, "hca_cmp": (last // cap.hca_ratio) // cap.block_size + 1}

    def bytes_per_sequence(self, num_tokens: int) -> int:
        """Cache bytes one sequence of ``num_tokens`` tokens holds (all layers, all pools)."""
        need = {**self.fixed_blocks_per_seq(), **self.growing_blocks(num_tokens)}
        return sum(n * self.block_bytes(k) for k, n in need.items() if self.pool_layers[k])

    def plan_pools(self, budget: int | None, max_num_seqs: int) -> PoolPlan:
        fixed = self.fixed_blocks_per_seq()
        fixed_bytes = sum(n * self.block_bytes(k) for k, n in fixed.items())
        one_grow = {k: 1 for k in GROWING}
        full = self.growing_blocks(self.max_model_len)
        full_bytes = sum(n * self.block_bytes(k) for k, n in full.items())
        if budget is None:  # ~1 GiB, but never more than every sequence at full length needs
            budget = min(1 << 30, max_num_seqs * (fixed_bytes + full_bytes))
        per_seq_min = fixed_bytes + sum(self.block_bytes(k) for k in one_grow)
        seqs = min(max_num_seqs, budget // per_seq_min)
        if seqs < 1 or budget - seqs * fixed_bytes < full_bytes:
            raise ValueError(
                f"DeepSeek-V4 cache budget of {budget} bytes is too small: one sequence of max_model_len "
                f"{self.max_model_len} tokens needs {fixed_bytes + full_bytes} bytes")
        blocks = {k: n * seqs for k, n in fixed.items()}
        # spare state pages per pool, so released pages are not always handed straight back
        for k in STATE:
            blocks[k] += max(1, seqs // 4)
        left = budget - sum(blocks[k] * self.block_bytes(k) for k in fixed)
        # HCA blocks are tiny and every sequence maps one from the start: enough for all of them
        # at full length; the compressed-KV + indexer-key pair takes the rest.
        blocks["hca_cmp"] = seqs * full["hca_cmp"]
        left -= blocks["hca_cmp"] * self.block_bytes("hca_cmp")
        pair = self.block_bytes("csa_cmp") + self.block_bytes("idx")
        blocks["csa_cmp"] = blocks["idx"] = max(full["csa_cmp"], left // pair) if pair else full["csa_cmp"]
        return PoolPlan(blocks, {k: self.block_bytes(k) for k in blocks}, seqs)

    # ------------------------------------------------------------------ tables

    def tables(self, seq_ids: list[int]) -> BlockTables:
        return self.allocator.tables(seq_ids)

    def restore(self, seq_id: int, traces: list[LayerTrace]) -> int:
        """Writes the cache state a prompt with these traces leaves behind into ``seq_id``'s
        (already allocated) blocks: the last ``window`` raw KVs into the ring, every complete
        window's compressed entry / indexer key, and the state rows of the open windows.
        Returns the prompt length. (Tests use it to start sequences at long positions from
        :func:`~ratchetlm.models.deepseek_v4.reference.prefix_traces` without a prefill.) Written
        through the engine's write point like any forward's rows."""
        cap, cfg = self.cap, self.cfg
        T = traces[0].kv.shape[0]
        tb = self.tables([seq_id])
        ring_pos = torch.arange(max(0, T - cap.window), T)[None]
        ring_rows = physical_rows(tb.ori, ring_pos % cap.window, cap.block_size)[0]
        for i, tr in enumerate(traces):
            DirectSink(self.pools, {"ori": ring_rows}).write(i, ori=tr.kv[ring_pos[0]])
            kind = cfg.layer_types[i]
            if kind == SLIDING:
                continue
            parts = [(tr.main, "csa_cmp" if kind == CSA else "hca_cmp", "csa_state" if kind == CSA else "hca_state")]
            if kind == CSA:
                parts.append((tr.indexer, "idx", "inner_state"))
            ratio = cap.csa_ratio if kind == CSA else cap.hca_ratio
            for trace, cmp_name, state_name in parts:
                assert trace is not None, f"layer {i} ({kind}) was prefilled without its compressor trace"
                n = trace.entries.shape[0]
                slots = physical_rows(getattr(tb, cmp_name), torch.arange(n)[None], cap.block_size)[0]
                DirectSink(self.pools, {cmp_name: slots}).write(i, **{cmp_name: trace.entries})
                open_pos = torch.arange(cap.state_window_start(ratio, T), T)[None]
                rows = physical_rows(getattr(tb, state_name), open_pos, cap.state_page(ratio))[0]
                state = torch.cat([trace.kv_rows, trace.score_rows], -1)[open_pos[0]]
                DirectSink(self.pools, {state_name: rows}).write(i, **{state_name: state})
        return T


class DeepseekV4BlockAllocator:
    """The engine's block manager for a V4 layout: one free list per pool, tables per sequence.

    Same surface as :class:`~ratchetlm.kv.block_manager.BlockManager` for the scheduler
    (``can_grow`` / ``grow`` / ``free``), so admission, growth, preemption and abort are the
    scheduler's own code. ``grow(seq, n)`` maps everything a step over positions
    ``[seq.num_cached, n)`` reads or writes and releases state pages behind the rolling window."""

    enable_caching = False  # V4 opts out of prefix caching (see the module docstring)

    def __init__(self, layout: DeepseekV4Layout, shuffle_seed: int | None = None) -> None:
        self.layout = layout
        self.cap = layout.cap
        seed = (lambda k: None) if shuffle_seed is None else (lambda k: shuffle_seed + k)
        names = ("ori",) + GROWING + STATE
        self._free = {name: _FreeList(layout.plan.blocks[name], seed(i)) for i, name in enumerate(names)}
        self._seqs: dict[int, _SeqTables] = {}
        self.page_history: list[tuple[str, int, int]] = []  # (table, logical, physical) ever mapped

    # ------------------------------------------------------------------ counts

    # The scheduler and /metrics read ``num_blocks`` / ``num_free`` (kv_cache_usage_perc); pools
    # have blocks of very different sizes, so both count KiB of cache, not blocks.
    @property
    def num_blocks(self) -> int:
        return sum(f.n * self.layout.block_bytes(k) for k, f in self._free.items()) // 1024

    @property
    def num_free(self) -> int:
        return sum(len(f.ids) * self.layout.block_bytes(k) for k, f in self._free.items()) // 1024

    def free_blocks(self, pool: str) -> int:
        return len(self._free[pool].ids)

    def mapped(self, seq_id: int) -> dict[str, int]:
        """Blocks (pages) ``seq_id`` holds per pool."""
        t = self._seqs.get(seq_id)
        if t is None:
            return {}
        return {"ori": len(t.ori), **{k: len(v) for k, v in t.maps.items()}}

    def seq_bytes(self, seq_id: int) -> int:
        """Cache bytes ``seq_id`` holds now (every mapped block/page, all layers)."""
        return sum(n * self.layout.block_bytes(k) for k, n in self.mapped(seq_id).items())

    # ------------------------------------------------------------------ the step's needs

    def _demand(self, seq_id: int, start: int, end: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """(logical blocks to map, logical pages to release) per pool for a step over ``[start, end)``."""
        cap, last = self.cap, max(end - 1, 0)
        t = self._seqs.get(seq_id)
        have: dict[str, Any] = t.maps if t is not None else {k: {} for k in GROWING + STATE}
        add: dict[str, list[int]] = {"ori": [] if t is not None else list(range(cap.ori_max_blocks))}
        drop: dict[str, list[int]] = {}
        grow = self.layout.growing_blocks(end)
        for name in GROWING:
            add[name] = [b for b in range(grow[name]) if b not in have[name]]
        for name, ratio in (("csa_state", cap.csa_ratio), ("inner_state", cap.csa_ratio), ("hca_state", cap.hca_ratio)):
            if not self.layout.pool_layers[name]:
                add[name], drop[name] = [], []
                continue
            first = cap.state_window_start(ratio, start) // cap.state_page(ratio)
            want = cap.state_pages(ratio, start, last)
            drop[name] = [p for p in have[name] if p < first]
            add[name] = [p for p in want if p not in have[name]]
        for name in GROWING:
            if not self.layout.pool_layers[name]:
                add[name] = []
        return add, drop

    def can_grow(self, seq: Any, num_tokens: int) -> bool:
        if num_tokens > self.cap.max_seq_len:
            return False
        add, drop = self._demand(seq.seq_id, seq.num_cached, num_tokens)
        return all(len(add[k]) - len(drop.get(k, ())) <= len(self._free[k].ids) for k in add)

    def grow(self, seq: Any, num_tokens: int) -> None:
        if num_tokens > self.cap.max_seq_len:
            raise ValueError(f"position {num_tokens - 1} beyond capacity {self.cap.max_seq_len}")
        add, drop = self._demand(seq.seq_id, seq.num_cached, num_tokens)
        t = self._seqs.get(seq.seq_id)
        if t is None:
            t = self._seqs[seq.seq_id] = _SeqTables(ori=[])
        for name, pages in drop.items():
            for p in pages:
                self._free[name].give(t.maps[name].pop(p))
        assert all(len(add[k]) <= len(self._free[k].ids) for k in add), "grow() without can_grow()"
        t.ori += [self._free["ori"].take() for _ in add["ori"]]
        for name in GROWING + STATE:
            for logical in add[name]:
                phys = t.maps[name][logical] = self._free[name].take()
                self.page_history.append((name, logical, phys))

    def free(self, seq: Any) -> None:
        t = self._seqs.pop(seq.seq_id, None)
        if t is None:
            return
        for b in t.ori:
            self._free["ori"].give(b)
        for name, m in t.maps.items():
            for b in m.values():
                self._free[name].give(b)

    # prefix caching: explicitly off for V4 (same surface as BlockManager)
    def match_prefix(self, seq: Any) -> int:
        return 0

    def cache_full_blocks(self, seq: Any, num_cached_before: int) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------ tables

    def tables(self, seq_ids: list[int]) -> BlockTables:
        cap = self.cap

        def dense(name: str, width: int) -> torch.Tensor:
            out = torch.full((len(seq_ids), width), -1, dtype=torch.long)
            for row, s in enumerate(seq_ids):
                m = self._seqs[s].maps[name]
                if m:
                    out[row, list(m)] = torch.tensor(list(m.values()), dtype=torch.long)
            return out

        ori = torch.tensor([self._seqs[s].ori for s in seq_ids], dtype=torch.long)
        return BlockTables(
            ori=ori, csa_cmp=dense("csa_cmp", cap.cmp_max_blocks(cap.csa_ratio)),
            idx=dense("idx", cap.cmp_max_blocks(cap.csa_ratio)),
            hca_cmp=dense("hca_cmp", cap.cmp_max_blocks(cap.hca_ratio)),
            csa_state=dense("csa_state", cap.state_table_blocks(cap.csa_ratio)),
            inner_state=dense("inner_state", cap.state_table_blocks(cap.csa_ratio)),
            hca_state=dense("hca_state", cap.state_table_blocks(cap.hca_ratio)),
        )
