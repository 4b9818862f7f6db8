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
    decode_seq: int = 2  # S: smallest static tokens-per-call shape; short steps pad with placeholders
    csa_state_page: int = 4  # positions per state page, CSA main and inner compressors
    hca_state_page: int = 8
    # A step keeps the state rows of its first ``state_span`` positions (plus those of the final
    # open windows), so a verify step of up to this many tokens can commit any prefix of them.
    state_span: int = 16

    def __post_init__(self) -> None:
        if self.decode_seq not in (1, 2):
            raise ValueError("decode_seq must be 1 or 2 (one committed token, optional placeholder)")
        if not 0 < self.state_span <= self.window:
            raise ValueError("state_span must be in [1, window]")
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
        """State pages of the rolling window alone (one committed token per step)."""
        coff = 2 if ratio == self.csa_ratio else 1
        return coff * ratio // self.state_page(ratio)

    def state_pages_per_seq(self, ratio: int) -> int:
        """Most state pages one sequence maps at once, for any step: the rolling window of the
        step's start, the ``state_span`` rows after it, and the open windows at its end."""
        page = self.state_page(ratio)
        return self.state_live_pages(ratio) + 2 * (-(-self.state_span // page) + 1)

    def state_kept(self, ratio: int, pos: int, start: int, last: int) -> bool:
        """Whether the state row of position ``pos`` (in a step writing ``[start, last]``) is
        stored: rows read later are those of the windows open at the end (``last``), or at the
        end of any shorter accepted prefix within ``state_span`` of the start."""
        return start <= pos <= last and (pos < start + self.state_span or pos >= self.state_window_start(ratio, last))

    def state_pages(self, ratio: int, start: int, last: int) -> list[int]:
        """Logical state pages a step over ``[start, last]`` touches: the rows it pools from
        before ``start`` and the rows it stores."""
        page = self.state_page(ratio)
        ranges = [(self.state_window_start(ratio, start), min(last, start + self.state_span - 1)),
                  (max(start, self.state_window_start(ratio, last)), last)]
        return sorted({p for lo, hi in ranges for p in range(lo // page, hi // page + 1) if lo <= hi})


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
    # [B] compressed slots completed before the step (read from the pool); slots from here on
    # were completed by this step's own tokens and are read from the step (overlay)
    history_len: torch.Tensor


@dataclass(kw_only=True)
class WindowMeta:
    """The sliding-window part of a step's metadata (all an SWA-only layer reads; the MTP
    module's own ring is lowered to just this)."""

    position_ids: torch.Tensor  # [B, S] absolute positions
    ori_slot_mapping: torch.Tensor  # [B, S] physical ring row, -1 = no write (placeholder, overwritten)
    ori_block_table: torch.Tensor  # [B, ori_max_blocks]
    swa_indices: torch.Tensor  # [B, S, window] raw indices of the window keys, -1 invalid
    window: int
    decode_seq: int  # S of this call
    step_start: torch.Tensor  # [B] position of token 0 (= tokens cached before the step)


@dataclass(kw_only=True)
class DecodeMetadata(WindowMeta):
    kv_seq_lens: torch.Tensor  # [B] committed length after this step (if every kept token commits)
    csa: CompressorMeta
    inner: CompressorMeta  # indexer compressor: cmp_* are the idx_* cache
    hca: CompressorMeta
    hca_indices: torch.Tensor  # [B, S, cmp_slots(128)] raw indices of visible HCA entries
    num_tokens: torch.Tensor  # [B] real tokens per sequence; the rest of the S rows are placeholders


def physical_rows(table: torch.Tensor, logical: torch.Tensor, block: int) -> torch.Tensor:
    """Maps logical rows ``[B, ...]`` through ``table [B, n_blocks]``; unmapped or negative -> -1."""
    b = logical.shape[0]
    if block & (block - 1) == 0:  # a power of two (every V4 block and page): shifts and masks, not int64 division
        shift = block.bit_length() - 1  # (x >> shift, x & (block - 1)) == (x // block, x % block), also for x < 0
        blk_of, in_blk = logical >> shift, logical & (block - 1)
    else:
        blk_of, in_blk = logical // block, logical % block
    blk_idx = blk_of.clamp(min=0, max=table.shape[1] - 1)
    blk = table.gather(1, blk_idx.reshape(b, -1)).view_as(logical)
    ok = (blk >= 0) & (logical >= 0) & (blk_of < table.shape[1])
    return torch.where(ok, blk * block + in_blk, torch.full_like(logical, -1))


def _compressor_meta(cap: DecodeCapacity, ratio: int, cmp_table: torch.Tensor, state_table: torch.Tensor,
                     pos: torch.Tensor, keep: torch.Tensor, start: torch.Tensor,
                     kv_seq_lens: torch.Tensor) -> CompressorMeta:
    page = cap.state_page(ratio)
    no = torch.full_like(pos, -1)
    last = kv_seq_lens - 1
    stored = keep & ((pos < (start + cap.state_span)[:, None])
                     | (pos >= torch.tensor([cap.state_window_start(ratio, int(x)) for x in last])[:, None]))
    state_slot = torch.where(stored, physical_rows(state_table, pos, page), no)
    boundary = keep & ((pos + 1) % ratio == 0)
    cmp_slot = torch.where(boundary, physical_rows(cmp_table, pos // ratio, cap.block_size), no)
    if bool((stored & (state_slot < 0)).any()):
        raise ValueError(f"ratio-{ratio} state page of a committed token is not mapped")
    if bool((boundary & (cmp_slot < 0)).any()):
        raise ValueError(f"ratio-{ratio} compressed block of a completed window is not mapped")
    # A completing token pools rows [pos - window_rows + 1, pos]; those before the step come
    # from the state pool and must still be addressable (in-step ones come from the step).
    R = (2 if ratio == cap.csa_ratio else 1) * ratio
    reads_pool = boundary & (pos - R + 1 < start[:, None])
    for b, s in reads_pool.nonzero().tolist():
        p, s0 = int(pos[b, s]), int(start[b])
        rows = torch.arange(max(0, p - R + 1), s0)
        if rows.numel() and bool((physical_rows(state_table[b : b + 1], rows[None], page) < 0).any()):
            raise ValueError(f"ratio-{ratio} state window for position {p} is not fully mapped")
    # Never expose a slot this step does not (or will not) write: clamp by the kept length.
    visible = torch.minimum((pos + 1) // ratio, (kv_seq_lens // ratio)[:, None])
    return CompressorMeta(ratio, page, cmp_slot, cmp_table, state_slot, state_table, visible, start // ratio)


def lower_window(step_start: torch.Tensor, S: int, keep: torch.Tensor, ori_table: torch.Tensor,
                 window: int, block: int, first_valid: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sliding-window part of a step (shared with the MTP module's own ring):
    -> (positions ``[B, S]``, ring slot mapping ``[B, S]``, window raw indices ``[B, S, W]``).

    Kept tokens write their ring row, except those a later kept token of the same step
    overwrites (a step longer than the window keeps only its last ``window`` rows).
    ``first_valid [B]``: positions before it have no ring row (default 0)."""
    W = window
    pos = step_start[:, None] + torch.arange(S)  # [B, S]
    kept = torch.arange(S) < keep[:, None]
    last = (step_start + keep - 1)[:, None]
    writes = kept & (pos > last - W)
    ori = torch.where(writes, physical_rows(ori_table, pos % W, block), torch.full_like(pos, -1))
    if bool((writes & (ori < 0)).any()):
        raise ValueError("ring block of a committed token is not mapped")
    # Window keys of token s: positions (pos_s - W, pos_s]. Those before this step's first
    # token are in the ring; in-step ones come from the overlay, because the ring row they
    # will occupy may still hold a key another in-step token reads.
    key_pos = pos[..., None] - (W - 1) + torch.arange(W)  # [B, S, W]
    start = step_start[:, None, None]
    swa = torch.where(key_pos >= start, W + key_pos - start, key_pos % W)
    lo = 0 if first_valid is None else first_valid[:, None, None]
    swa = torch.where(key_pos >= lo, swa, torch.full_like(swa, -1))
    return pos, ori, swa


def lower_decode_step(committed_lens: torch.Tensor, tables: BlockTables, cap: DecodeCapacity,
                      num_tokens: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> DecodeMetadata:
    """Builds one step's metadata. ``committed_lens [B]``: tokens already cached; the step's
    tokens sit at ``committed_lens[b] + s``.

    ``num_tokens [B]`` (default 1): real tokens per sequence; ``keep [B]`` (default
    ``num_tokens``): how many leading tokens may be written (directly or staged). The call has
    ``S = max(decode_seq, max(num_tokens))`` rows; rows past ``keep`` are placeholders whose
    every slot mapping is -1 and which no kept token can see. With the defaults and
    ``decode_seq == 2`` this is the seed's call: token 0 commits, token 1 is a placeholder.
    """
    B = committed_lens.shape[0]
    n = torch.ones(B, dtype=torch.long) if num_tokens is None else num_tokens.long()
    keep = n.clone() if keep is None else keep.long()
    if bool((keep < 1).any()) or bool((keep > n).any()):
        raise ValueError("keep must be in [1, num_tokens]")
    S, W = max(cap.decode_seq, int(n.max())), cap.window
    last = committed_lens + keep - 1
    if bool((last >= cap.max_seq_len).any()) or bool((committed_lens < 0).any()):
        raise ValueError(f"committed token position outside [0, {cap.max_seq_len})")
    pos, ori, swa = lower_window(committed_lens, S, keep, tables.ori, W, cap.block_size)
    # placeholder rows past the last position stay inside the RoPE table (their values are unused)
    pos = torch.where(torch.arange(S) < n[:, None], pos, pos.clamp(max=cap.max_seq_len))
    kept = torch.arange(S) < keep[:, None]
    kv_seq_lens = committed_lens + keep
    args = (kept, committed_lens, kv_seq_lens)
    csa = _compressor_meta(cap, cap.csa_ratio, tables.csa_cmp, tables.csa_state, pos, *args)
    inner = _compressor_meta(cap, cap.csa_ratio, tables.idx, tables.inner_state, pos, *args)
    hca = _compressor_meta(cap, cap.hca_ratio, tables.hca_cmp, tables.hca_state, pos, *args)
    slots = torch.arange(cap.cmp_slots(cap.hca_ratio))
    hca_idx = torch.where(slots < hca.visible_len[..., None], W + S + slots, torch.full_like(slots, -1))
    return DecodeMetadata(position_ids=pos, kv_seq_lens=kv_seq_lens, ori_slot_mapping=ori, ori_block_table=tables.ori,
                          swa_indices=swa, csa=csa, inner=inner, hca=hca, hca_indices=hca_idx, window=W,
                          decode_seq=S, step_start=committed_lens, num_tokens=n)
