"""Physical V4 cache pools and the host-side allocator that fills the block tables.

Pools are per layer; block tables are per sequence and shared by every layer of a kind
(the same block id addresses the same rows in each layer's pool). The allocator keeps the
state tables *logical* over absolute positions while mapping only the rolling compression
window onto a small physical page pool, releasing pages as the window moves on.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import torch

from ratchetlm.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from ratchetlm.models.deepseek_v4.paging import BlockTables, DecodeCapacity, physical_rows
from ratchetlm.models.deepseek_v4.reference import LayerTrace


class _FreeList:
    """Block ids ``[0, n)``; optionally handed out in a shuffled order (tests use it to get
    non-identity tables). Released ids go to the back, so they are reused ring-fashion."""

    def __init__(self, n: int, shuffle_seed: int | None) -> None:
        ids = list(range(n))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(ids)
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
    csa_cmp: dict[int, int] = field(default_factory=dict)
    idx: dict[int, int] = field(default_factory=dict)
    hca_cmp: dict[int, int] = field(default_factory=dict)
    csa_state: dict[int, int] = field(default_factory=dict)
    inner_state: dict[int, int] = field(default_factory=dict)
    hca_state: dict[int, int] = field(default_factory=dict)


class DeepseekV4PagedCache:
    """Pools for ``max_seqs`` concurrent sequences at full capacity, plus their allocator."""

    def __init__(self, cfg: DeepseekV4Config, cap: DecodeCapacity, max_seqs: int, dtype: torch.dtype,
                 shuffle_seed: int | None = None, spare_state_pages: int = 1) -> None:
        self.cfg, self.cap = cfg, cap
        bs, d, di = cap.block_size, cfg.head_dim, cfg.index_head_dim
        r4, r128 = cap.csa_ratio, cap.hca_ratio
        n_ori = max_seqs * cap.ori_max_blocks
        n_csa, n_hca = max_seqs * cap.cmp_max_blocks(r4), max_seqs * cap.cmp_max_blocks(r128)
        # Physical state pages: the rolling window of each sequence, plus a few spare pages so
        # released pages are not always handed straight back to the same logical page.
        n_state4 = max_seqs * (cap.state_live_pages(r4) + spare_state_pages)
        n_state128 = max_seqs * (cap.state_live_pages(r128) + spare_state_pages)
        self.ori = {i: torch.zeros(n_ori, bs, d, dtype=dtype) for i in range(cfg.num_layers)}
        kinds = cfg.layers_of_kind
        self.csa_cmp = {i: torch.zeros(n_csa, bs, d, dtype=dtype) for i in kinds[CSA]}
        self.idx = {i: torch.zeros(n_csa, bs, di, dtype=dtype) for i in kinds[CSA]}
        self.hca_cmp = {i: torch.zeros(n_hca, bs, d, dtype=dtype) for i in kinds[HCA]}
        # fp32 state rows [kv | score], width 2 * coff * dim.
        self.csa_state = {i: torch.zeros(n_state4 * cap.csa_state_page, 4 * d) for i in kinds[CSA]}
        self.inner_state = {i: torch.zeros(n_state4 * cap.csa_state_page, 4 * di) for i in kinds[CSA]}
        self.hca_state = {i: torch.zeros(n_state128 * cap.hca_state_page, 2 * d) for i in kinds[HCA]}
        seed = (lambda k: None) if shuffle_seed is None else (lambda k: shuffle_seed + k)
        self._free = {
            "ori": _FreeList(n_ori, seed(0)), "csa_cmp": _FreeList(n_csa, seed(1)), "idx": _FreeList(n_csa, seed(2)),
            "hca_cmp": _FreeList(n_hca, seed(3)), "csa_state": _FreeList(n_state4, seed(4)),
            "inner_state": _FreeList(n_state4, seed(5)), "hca_state": _FreeList(n_state128, seed(6)),
        }
        self._seqs: dict[int, _SeqTables] = {}
        self.page_history: list[tuple[str, int, int]] = []  # (table, logical, physical) ever mapped

    # -- allocation -------------------------------------------------------------------------
    def admit(self, seq: int) -> None:
        if seq in self._seqs:
            raise KeyError(f"sequence {seq} already admitted")
        self._seqs[seq] = _SeqTables(ori=[self._free["ori"].take() for _ in range(self.cap.ori_max_blocks)])

    def release(self, seq: int) -> None:
        t = self._seqs.pop(seq)
        for b in t.ori:
            self._free["ori"].give(b)
        for name in ("csa_cmp", "idx", "hca_cmp", "csa_state", "inner_state", "hca_state"):
            for b in getattr(t, name).values():
                self._free[name].give(b)

    def _map(self, t: _SeqTables, name: str, logical: int) -> None:
        table = getattr(t, name)
        if logical not in table:
            table[logical] = self._free[name].take()
            self.page_history.append((name, logical, table[logical]))

    def ensure(self, seq: int, pos: int) -> None:
        """Maps everything writing position ``pos`` (and every earlier compressed slot) needs,
        and releases state pages the compressors can no longer read."""
        cap, t = self.cap, self._seqs[seq]
        if pos >= cap.max_seq_len:
            raise ValueError(f"position {pos} beyond capacity {cap.max_seq_len}")
        for ratio, cmp_names, state_names in ((cap.csa_ratio, ("csa_cmp", "idx"), ("csa_state", "inner_state")),
                                              (cap.hca_ratio, ("hca_cmp",), ("hca_state",))):
            for name in cmp_names:
                for blk in range((pos // ratio) // cap.block_size + 1):
                    self._map(t, name, blk)
            page = cap.state_page(ratio)
            first = cap.state_window_start(ratio, pos) // page
            for name in state_names:
                table = getattr(t, name)
                for logical in [lp for lp in table if lp < first]:
                    self._free[name].give(table.pop(logical))
                for logical in range(first, pos // page + 1):
                    self._map(t, name, logical)

    def tables(self, seqs: list[int]) -> BlockTables:
        cap = self.cap

        def dense(name: str, width: int) -> torch.Tensor:
            out = torch.full((len(seqs), width), -1, dtype=torch.long)
            for row, s in enumerate(seqs):
                for logical, phys in getattr(self._seqs[s], name).items():
                    out[row, logical] = phys
            return out

        ori = torch.tensor([self._seqs[s].ori for s in seqs], dtype=torch.long)
        return BlockTables(
            ori=ori, csa_cmp=dense("csa_cmp", cap.cmp_max_blocks(cap.csa_ratio)),
            idx=dense("idx", cap.cmp_max_blocks(cap.csa_ratio)),
            hca_cmp=dense("hca_cmp", cap.cmp_max_blocks(cap.hca_ratio)),
            csa_state=dense("csa_state", cap.state_table_blocks(cap.csa_ratio)),
            inner_state=dense("inner_state", cap.state_table_blocks(cap.csa_ratio)),
            hca_state=dense("hca_state", cap.state_table_blocks(cap.hca_ratio)),
        )

    # -- prefill ----------------------------------------------------------------------------
    def write_prefill(self, seq: int, traces: list[LayerTrace]) -> None:
        """Stores a prompt's traces: the last ``window`` raw KVs into the ring, every complete
        window's compressed entry / indexer key, and the state rows of the open windows."""
        cap, cfg = self.cap, self.cfg
        T = traces[0].kv.shape[0]
        if T == 0:
            return
        self.ensure(seq, T) if T < cap.max_seq_len else self.ensure(seq, T - 1)
        tb = self.tables([seq])
        ring_pos = torch.arange(max(0, T - cap.window), T)[None]
        ring_rows = physical_rows(tb.ori, ring_pos % cap.window, cap.block_size)[0]
        for i, tr in enumerate(traces):
            self.ori[i].view(-1, cfg.head_dim)[ring_rows] = tr.kv[ring_pos[0]]
            kind = cfg.layer_types[i]
            if kind == SLIDING:
                continue
            parts = [(tr.main, self.csa_cmp, tb.csa_cmp, self.csa_state, tb.csa_state)] if kind == CSA else \
                [(tr.main, self.hca_cmp, tb.hca_cmp, self.hca_state, tb.hca_state)]
            if kind == CSA:
                parts.append((tr.indexer, self.idx, tb.idx, self.inner_state, tb.inner_state))
            ratio = cap.csa_ratio if kind == CSA else cap.hca_ratio
            for trace, cmp_pool, cmp_table, state_pool, state_table in parts:
                assert trace is not None, f"layer {i} ({kind}) was prefilled without its compressor trace"
                n = trace.entries.shape[0]
                slots = physical_rows(cmp_table, torch.arange(n)[None], cap.block_size)[0]
                cmp_pool[i].view(-1, cmp_pool[i].shape[-1])[slots] = trace.entries
                open_pos = torch.arange(cap.state_window_start(ratio, T), T)[None]
                rows = physical_rows(state_table, open_pos, cap.state_page(ratio))[0]
                state_pool[i][rows] = torch.cat([trace.kv_rows, trace.score_rows], -1)[open_pos[0]]
