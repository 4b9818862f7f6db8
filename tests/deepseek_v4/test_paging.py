"""The lowering function fed by the engine's V4 block allocator: capacity, boundaries, state
paging, -1 writes.

Pure metadata, no model: uses a config with the real capacity constants. Sequences are grown
exactly as the scheduler grows them (``allocator.grow(seq, num_cached + tokens)``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ratchetlm.models.deepseek_v4.config import DeepseekV4Config, RopeSpec
from ratchetlm.models.deepseek_v4.layout import DeepseekV4Layout
from ratchetlm.models.deepseek_v4.paging import DecodeCapacity, lower_decode_step, physical_rows

W = 128


def _cfg() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=8, hidden_size=8, num_layers=4, num_heads=2, head_dim=8, rope_head_dim=4, q_lora_rank=4,
        o_groups=1, o_lora_rank=4,
        layer_types=("sliding_attention", "sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe"), csa_ratio=4, hca_ratio=128, sliding_window=W,
        index_n_heads=2, index_head_dim=4, index_topk=512, num_experts=2, experts_per_token=1,
        moe_intermediate_size=4, main_rope=RopeSpec(10000.0, 4), compress_rope=RopeSpec(160000.0, 4),
    )


def _layout(cap: DecodeCapacity, max_seqs: int, shuffle_seed: int | None = None) -> DeepseekV4Layout:
    return DeepseekV4Layout(_cfg(), cap, torch.float32, "cpu", max_num_seqs=max_seqs, shuffle_seed=shuffle_seed)


def _seq(seq_id: int, num_cached: int) -> SimpleNamespace:
    """What the allocator reads of a Sequence."""
    return SimpleNamespace(seq_id=seq_id, num_cached=num_cached)


def _lower(positions: list[int], decode_seq: int = 2, shuffle_seed: int | None = 7, max_seqs: int | None = None):
    """Each sequence has ``positions[s]`` tokens cached and commits one more this step."""
    cap = DecodeCapacity.for_model(_cfg(), decode_seq=decode_seq)
    layout = _layout(cap, max_seqs or len(positions), shuffle_seed)
    for s, p in enumerate(positions):
        layout.allocator.grow(_seq(s, p), p + 1)
    tables = layout.tables(list(range(len(positions))))
    return lower_decode_step(torch.tensor(positions), tables, cap), tables, layout


def test_capacity_constants_match_the_seed():
    cap = DecodeCapacity.for_model(_cfg())
    assert cap.max_seq_len == 16384 and cap.window == 128 and cap.block_size == 128
    assert cap.cmp_slots(4) == 4096 and cap.cmp_max_blocks(4) == 32  # CMP_MAX_BLOCKS
    assert cap.score_len == 4096 and cap.index_topk == 512  # IDX_KV_LEN = SCORE_LEN
    assert cap.cmp_max_blocks(128) == 1
    # Logical state tables span absolute positions; the physical pool per sequence is tiny.
    assert cap.state_table_blocks(4) == 4096 and cap.state_table_blocks(128) == 2048
    assert cap.state_live_pages(4) == 2 and cap.state_live_pages(128) == 16


START_POSITIONS = [0, 127, 128, 8191, 8192, 8703, 16383]


@pytest.mark.parametrize("decode_seq", [1, 2])
def test_position_capacity_lowering(decode_seq):
    meta, tables, _ = _lower(START_POSITIONS, decode_seq=decode_seq)
    pos = torch.tensor(START_POSITIONS)
    assert torch.equal(meta.position_ids[:, 0], pos)
    assert torch.equal(meta.kv_seq_lens, pos + 1)
    assert tables.csa_state.shape == (7, 4096) and tables.hca_state.shape == (7, 2048)
    assert tables.csa_cmp.shape == (7, 32) and tables.idx.shape == (7, 32)
    # Every committed token writes its ring row; the row is its ring slot through the table.
    assert torch.equal(meta.ori_slot_mapping[:, 0], physical_rows(tables.ori, (pos % W)[:, None], 128)[:, 0])
    assert (meta.ori_slot_mapping[:, 0] >= 0).all()


def test_position_beyond_capacity_is_rejected():
    with pytest.raises(ValueError):
        _lower([16384])


@pytest.mark.parametrize("positions", [[3, 127, 511, 8191],
                                       # the placeholder (at p + 1) completes a CSA window, and at 127,
                                       # 511 and 8191 an HCA window too: it must still write nothing
                                       [2, 126, 510, 8190]])
def test_placeholder_writes_nothing_and_is_invisible(positions):
    meta, _, _ = _lower(positions, decode_seq=2)
    for t in (meta.ori_slot_mapping, meta.csa.cmp_slot_mapping, meta.inner.cmp_slot_mapping,
              meta.hca.cmp_slot_mapping, meta.csa.state_slot_mapping, meta.inner.state_slot_mapping,
              meta.hca.state_slot_mapping):
        assert (t[:, 1] == -1).all()
    # The committed token never sees the placeholder's overlay index W + 1 ...
    assert not (meta.swa_indices[:, 0] == W + 1).any()
    # ... and the placeholder cannot see a compressed slot nobody wrote (clamped by kv_seq_lens).
    assert torch.equal(meta.csa.visible_len[:, 1], meta.csa.visible_len[:, 0])
    assert torch.equal(meta.hca.visible_len[:, 1], meta.hca.visible_len[:, 0])


@pytest.mark.parametrize("pos,writes", [(2, False), (3, True), (127, True), (128, False), (511, True),
                                        (4095, True), (8191, True), (8703, True), (16383, True), (8702, False)])
def test_csa_boundary_slots(pos, writes):
    meta, tables, _ = _lower([pos])
    slot = meta.csa.cmp_slot_mapping[0, 0]
    assert bool(slot >= 0) == writes
    if writes:
        logical = pos // 4
        assert slot == tables.csa_cmp[0, logical // 128] * 128 + logical % 128
        assert meta.inner.cmp_slot_mapping[0, 0] == tables.idx[0, logical // 128] * 128 + logical % 128
    assert meta.csa.visible_len[0, 0] == (pos + 1) // 4


@pytest.mark.parametrize("pos,writes", [(126, False), (127, True), (128, False), (255, True), (8191, True),
                                        (8703, True), (8702, False), (16383, True)])
def test_hca_boundary_slots(pos, writes):
    meta, tables, _ = _lower([pos])
    assert bool(meta.hca.cmp_slot_mapping[0, 0] >= 0) == writes
    vis = (pos + 1) // 128
    assert meta.hca.visible_len[0, 0] == vis
    idx = meta.hca_indices[0, 0]
    assert torch.equal(idx[:vis], W + 2 + torch.arange(vis)) and (idx[vis:] == -1).all()


def test_swa_raw_indices_ring_and_overlay():
    meta, _, _ = _lower([300], decode_seq=2)
    tok0, tok1 = meta.swa_indices[0]
    # token 0 at 300: positions 173..299 from the ring (slot pos % 128), itself from overlay W.
    assert torch.equal(tok0[:-1], torch.arange(173, 300) % W) and tok0[-1] == W
    # token 1 (placeholder) at 301: 174..299 ring, then overlay W (pos 300) and W + 1 (itself).
    assert torch.equal(tok1[:-2], torch.arange(174, 300) % W) and tok1[-2:].tolist() == [W, W + 1]
    meta, _, _ = _lower([5], decode_seq=2)
    assert (meta.swa_indices[0, 0, :-6] == -1).all() and meta.swa_indices[0, 0, -6:].tolist() == [0, 1, 2, 3, 4, W]


def test_state_tables_are_logical_and_pool_is_rolling():
    meta, tables, layout = _lower([8703, 16383, 8192])
    for row, pos in enumerate([8703, 16383, 8192]):
        mapped4 = (tables.csa_state[row] >= 0).nonzero().flatten().tolist()
        mapped128 = (tables.hca_state[row] >= 0).nonzero().flatten().tolist()
        # only the rolling window is mapped, addressed at its absolute logical page
        assert mapped4 == list(range(pos // 4 - 1, pos // 4 + 1))
        assert mapped128 == list(range((pos // 128) * 16, pos // 8 + 1))
        assert meta.csa.state_slot_mapping[row, 0] == tables.csa_state[row, pos // 4] * 4 + pos % 4
        assert meta.hca.state_slot_mapping[row, 0] == tables.hca_state[row, pos // 8] * 8 + pos % 8
    # the physical pool (pages a step may touch, per sequence, plus one spare) is far smaller
    # than the logical table (4096 / 2048 pages per sequence)
    cap = layout.cap
    assert layout.pools.get("csa_state", 2).shape[0] == (3 * cap.state_pages_per_seq(4) + 1) * 4
    assert layout.pools.get("hca_state", 3).shape[0] == (3 * cap.state_pages_per_seq(128) + 1) * 8
    assert cap.state_pages_per_seq(4) < 16 and cap.state_pages_per_seq(128) < 32


def test_state_slot_is_the_physical_row_where_the_position_is_also_a_valid_row():
    # Low positions inside the physical pool (a few hundred rows for 3 sequences): a lowering
    # that used the absolute position would still address a real row, so comparing with the
    # position can fail here (at 8k it cannot: the pool is far smaller).
    positions = [9, 21, 30]
    meta, tables, layout = _lower(positions, shuffle_seed=3)
    pools = layout.pools
    differs = 0
    for name, table, page, pool in (("csa", tables.csa_state, 4, pools.get("csa_state", 2)),
                                    ("inner", tables.inner_state, 4, pools.get("inner_state", 2)),
                                    ("hca", tables.hca_state, 8, pools.get("hca_state", 3))):
        for row, pos in enumerate(positions):
            assert pos < pool.shape[0]  # the absolute position is a valid physical row too
            phys_page = int(table[row, pos // page])
            assert phys_page >= 0
            want = phys_page * page + pos % page
            got = int(getattr(meta, name).state_slot_mapping[row, 0])
            assert got == want, (name, pos)
            if want != pos:
                differs += 1
                assert got != pos, (name, pos)
    assert differs >= 6  # most of the shuffled pages are not the identity
    # identity allocation: the physical row equals the position, and that is still correct
    meta, tables, _ = _lower([5], shuffle_seed=None)
    assert int(meta.csa.state_slot_mapping[0, 0]) == 5 == int(tables.csa_state[0, 1]) * 4 + 1


def test_state_pages_are_reused_ring_fashion():
    cap = DecodeCapacity.for_model(_cfg())
    layout = _layout(cap, 1, shuffle_seed=1)
    for p in range(0, 700):
        layout.allocator.grow(_seq(0, p), p + 1)
        tables = layout.tables([0])
        meta = lower_decode_step(torch.tensor([p]), tables, cap)
        assert meta.csa.state_slot_mapping[0, 0] >= 0 and meta.hca.state_slot_mapping[0, 0] >= 0
        assert layout.allocator.mapped(0)["csa_state"] <= cap.state_live_pages(4)  # pages behind the window went back
    by_phys: dict[tuple[str, int], set[int]] = {}
    for name, logical, phys in layout.allocator.page_history:
        by_phys.setdefault((name, phys), set()).add(logical)
    # 175 ratio-4 pages and 88 ratio-128 pages went through the sequence's few physical pages.
    assert len({p for (n, p) in by_phys if n == "csa_state"}) == layout.plan.blocks["csa_state"] < 16
    assert len({p for (n, p) in by_phys if n == "hca_state"}) == layout.plan.blocks["hca_state"] < 32
    assert max(len(v) for (n, _), v in by_phys.items() if n == "inner_state") > 10


@pytest.mark.parametrize("ratio_name,page", [("csa", 4), ("inner", 4), ("hca", 8)])
def test_state_page_boundaries(ratio_name, page):
    for pos in (page - 1, page, 2 * page - 1, 2 * page, 127, 128, 8191, 8192):
        meta, tables, _ = _lower([pos])
        cm = getattr(meta, ratio_name)
        table = {"csa": tables.csa_state, "inner": tables.inner_state, "hca": tables.hca_state}[ratio_name]
        assert cm.state_slot_mapping[0, 0] == table[0, pos // page] * page + pos % page


def test_unmapped_state_window_is_an_error():
    cap = DecodeCapacity.for_model(_cfg())
    layout = _layout(cap, 1)
    layout.allocator.grow(_seq(0, 7), 8)
    tables = layout.tables([0])
    tables.csa_state[0, 0] = -1  # drop the previous window's page: pooling at 7 must refuse
    with pytest.raises(ValueError, match="state window"):
        lower_decode_step(torch.tensor([7]), tables, cap)
    tables = layout.tables([0])
    tables.ori[0, 0] = -1
    with pytest.raises(ValueError, match="ring"):
        lower_decode_step(torch.tensor([7]), tables, cap)
