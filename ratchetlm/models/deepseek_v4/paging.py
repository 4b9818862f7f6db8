"""The V4 decode cache contract: static capacities, block tables, and the one lowering
function that turns (committed lengths, block tables) into a step's metadata.

Storage kinds and their addressing (``-1`` everywhere means "unmapped" / "no write"):

* raw KV ``ori``: a sliding-window *ring* of ``window`` rows per sequence, ring slot
  ``pos % window`` through ``ori_block_table``; raw KV is never kept for the full context.
* compressed KV ``cmp`` (CSA ratio 4, HCA ratio 128) and indexer keys ``idx``: compressed
  slot ``pos // ratio`` through ``cmp_block_table`` / ``idx_block_table`` (block 128).
* compressor state: one fp32 row ``[kv | score]`` per source token. The *logical* state
  tables cover the whole absolute position space (``ceil(max_seq_len / page)`` entries),
  but only the pages of the rolling compression window are mapped, onto a small *physical*
  pool that is reused as the window moves.

Sparse-attention raw indices per query token: ``[0, W)`` ring slot, ``[W, W+S)`` this
step's token ``raw - W`` (overlay; its KV is not in the ring yet), ``[W+S, ...)``
compressed slot ``raw - W - S``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from ratchetlm.models.deepseek_v4.config import DeepseekV4Config


@dataclass(frozen=True)
class DecodeCapacity:
    """Static shapes of the decode path. Real V4 values by default."""

    max_seq_len: int = 16384
    window: int = 128
    block_size: int = 128  # rows per ring / compressed / indexer block
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_topk: int = 512
    decode_seq: int = 2  # S: tokens per call; only the first one commits
    csa_state_page: int = 4  # positions per state page, CSA main and inner compressors
    hca_state_page: int = 8

    def __post_init__(self) -> None:
        if self.decode_seq not in (1, 2):
            raise ValueError("decode_seq must be 1 or 2 (one committed token, optional placeholder)")
        if self.window % self.block_size and self.block_size % self.window:
            raise ValueError("window and block_size must divide one another")
        for ratio, page in ((self.csa_ratio, self.csa_state_page), (self.hca_ratio, self.hca_state_page)):
            if self.max_seq_len % ratio or ratio % page:
                raise ValueError("ratios must divide max_seq_len and be multiples of their state page")
        if self.index_topk > self.score_len:
            raise ValueError("index_topk exceeds the indexer score length")

    @classmethod
    def for_model(cls, cfg: DeepseekV4Config, **overrides: int) -> DecodeCapacity:
        kw = dict(max_seq_len=cfg.max_position_embeddings, window=cfg.sliding_window, csa_ratio=cfg.csa_ratio,
                  hca_ratio=cfg.hca_ratio, index_topk=cfg.index_topk)
        kw.update(overrides)
        return cls(**kw)

    @cached_property
    def ori_max_blocks(self) -> int:
        return math.ceil(self.window / self.block_size)

    def cmp_slots(self, ratio: int) -> int:
        return self.max_seq_len // ratio

    def cmp_max_blocks(self, ratio: int) -> int:
        return math.ceil(self.cmp_slots(ratio) / self.block_size)

    @cached_property
    def score_len(self) -> int:
        """Indexer score width = IDX_KV_LEN = max_seq_len / 4 (4096 at 16k)."""
        return self.cmp_slots(self.csa_ratio)

    def state_page(self, ratio: int) -> int:
        return self.csa_state_page if ratio == self.csa_ratio else self.hca_state_page

    def state_table_blocks(self, ratio: int) -> int:
        """Logical state-table width: covers every absolute position."""
        return math.ceil(self.max_seq_len / self.state_page(ratio))

    def state_window_start(self, ratio: int, pos: int) -> int:
        """First position a compressor may still read once ``pos`` is written: the current
        window, plus the previous one for overlapping (ratio-4) compressors."""
        coff = 2 if ratio == self.csa_ratio else 1
        return max(0, (pos // ratio - (coff - 1)) * ratio)

    def state_live_pages(self, ratio: int) -> int:
        """Most physical state pages one sequence holds at once."""
        coff = 2 if ratio == self.csa_ratio else 1
        return coff * ratio // self.state_page(ratio)


@dataclass
class BlockTables:
    """Per-sequence logical -> physical maps, ``[B, width]`` int64, ``-1`` = unmapped."""

    ori: torch.Tensor  # [B, ori_max_blocks]
    csa_cmp: torch.Tensor  # [B, cmp_max_blocks(4)]  (32 at 16k)
    idx: torch.Tensor  # [B, cmp_max_blocks(4)]
    hca_cmp: torch.Tensor  # [B, cmp_max_blocks(128)]
    csa_state: torch.Tensor  # [B, state_table_blocks(4)]  compress_state_block_table (CSA)
    inner_state: torch.Tensor  # [B, state_table_blocks(4)]  inner_compress_state_block_table
    hca_state: torch.Tensor  # [B, state_table_blocks(128)]  compress_state_block_table (HCA)


@dataclass
class CompressorMeta:
    """Paging metadata of one compressor kind for one step (shared by all its layers)."""

    ratio: int
    state_page: int
    cmp_slot_mapping: torch.Tensor  # [B, S] physical compressed row written by the token, or -1
    cmp_block_table: torch.Tensor  # [B, cmp_max_blocks]
    state_slot_mapping: torch.Tensor  # [B, S] physical state row written by the token, or -1
    state_block_table: torch.Tensor  # [B, state_table_blocks]
    visible_len: torch.Tensor  # [B, S] compressed slots [0, visible_len) are readable


@dataclass
class DecodeMetadata:
    position_ids: torch.Tensor  # [B, S] absolute positions
    kv_seq_lens: torch.Tensor  # [B] committed length after this step
    ori_slot_mapping: torch.Tensor  # [B, S] physical ring row, -1 for the placeholder
    ori_block_table: torch.Tensor  # [B, ori_max_blocks]
    swa_indices: torch.Tensor  # [B, S, window] raw indices of the window keys, -1 invalid
    csa: CompressorMeta
    inner: CompressorMeta  # indexer compressor: cmp_* are the idx_* cache
    hca: CompressorMeta
    hca_indices: torch.Tensor  # [B, S, cmp_slots(128)] raw indices of visible HCA entries
    window: int
    decode_seq: int


def physical_rows(table: torch.Tensor, logical: torch.Tensor, block: int) -> torch.Tensor:
    """Maps logical rows ``[B, ...]`` through ``table [B, n_blocks]``; unmapped or negative -> -1."""
    b = logical.shape[0]
    blk_idx = (logical.clamp(min=0) // block).clamp(max=table.shape[1] - 1)
    blk = table.gather(1, blk_idx.reshape(b, -1)).view_as(logical)
    ok = (blk >= 0) & (logical >= 0) & (logical // block < table.shape[1])
    return torch.where(ok, blk * block + logical % block, torch.full_like(logical, -1))


def _compressor_meta(cap: DecodeCapacity, ratio: int, cmp_table: torch.Tensor, state_table: torch.Tensor,
                     pos: torch.Tensor, commit: torch.Tensor, kv_seq_lens: torch.Tensor) -> CompressorMeta:
    page = cap.state_page(ratio)
    no = torch.full_like(pos, -1)
    state_slot = torch.where(commit, physical_rows(state_table, pos, page), no)
    boundary = commit & ((pos + 1) % ratio == 0)
    cmp_slot = torch.where(boundary, physical_rows(cmp_table, pos // ratio, cap.block_size), no)
    if bool((commit & (state_slot < 0)).any()):
        raise ValueError(f"ratio-{ratio} state page of a committed token is not mapped")
    if bool((boundary & (cmp_slot < 0)).any()):
        raise ValueError(f"ratio-{ratio} compressed block of a completed window is not mapped")
    # A completing token pools rows [start, pos]; every one of them must still be addressable.
    for b, s in boundary.nonzero().tolist():
        p = int(pos[b, s])
        rows = torch.arange(cap.state_window_start(ratio, p), p + 1)
        if bool((physical_rows(state_table[b : b + 1], rows[None], page) < 0).any()):
            raise ValueError(f"ratio-{ratio} state window for position {p} is not fully mapped")
    # Never expose a slot this step did not (or will not) write: clamp by committed length.
    visible = torch.minimum((pos + 1) // ratio, (kv_seq_lens // ratio)[:, None])
    return CompressorMeta(ratio, page, cmp_slot, cmp_table, state_slot, state_table, visible)


def lower_decode_step(committed_lens: torch.Tensor, tables: BlockTables, cap: DecodeCapacity) -> DecodeMetadata:
    """Builds one decode call's metadata. ``committed_lens [B]``: tokens already cached.

    Token 0 of each sequence sits at ``committed_lens[b]`` and is the one token this call
    commits; with ``decode_seq == 2`` token 1 (at ``+1``) is a placeholder whose every slot
    mapping is -1 and which no committed token can see.
    """
    S, W = cap.decode_seq, cap.window
    if bool((committed_lens >= cap.max_seq_len).any()) or bool((committed_lens < 0).any()):
        raise ValueError(f"committed token position outside [0, {cap.max_seq_len})")
    pos = committed_lens[:, None] + torch.arange(S)  # [B, S]
    commit = (torch.arange(S) == 0).expand_as(pos)
    kv_seq_lens = committed_lens + 1
    ori = torch.where(commit, physical_rows(tables.ori, pos % W, cap.block_size), torch.full_like(pos, -1))
    if bool((commit & (ori < 0)).any()):
        raise ValueError("ring block of a committed token is not mapped")

    # Window keys of token s: positions (pos_s - W, pos_s]. Those before this step's first
    # token are in the ring; in-step ones come from the overlay, because the ring row they
    # will occupy may still hold a key another in-step token reads.
    key_pos = pos[..., None] - (W - 1) + torch.arange(W)  # [B, S, W]
    step_start = pos[:, :1, None]
    swa = torch.where(key_pos >= step_start, W + key_pos - step_start, key_pos % W)
    swa = torch.where(key_pos >= 0, swa, torch.full_like(swa, -1))

    csa = _compressor_meta(cap, cap.csa_ratio, tables.csa_cmp, tables.csa_state, pos, commit, kv_seq_lens)
    inner = _compressor_meta(cap, cap.csa_ratio, tables.idx, tables.inner_state, pos, commit, kv_seq_lens)
    hca = _compressor_meta(cap, cap.hca_ratio, tables.hca_cmp, tables.hca_state, pos, commit, kv_seq_lens)
    slots = torch.arange(cap.cmp_slots(cap.hca_ratio))
    hca_idx = torch.where(slots < hca.visible_len[..., None], W + S + slots, torch.full_like(slots, -1))
    return DecodeMetadata(pos, kv_seq_lens, ori, tables.ori, swa, csa, inner, hca, hca_idx, W, S)
