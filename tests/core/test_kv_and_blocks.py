"""KV write point and block bookkeeping."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.sink import DirectSink
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import Sequence


def test_slot_minus_one_writes_nothing():
    cache = KVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=3,
                    dtype=torch.float32, device="cpu")
    k = torch.randn(5, 2, 3)
    v = torch.randn(5, 2, 3)
    slots = torch.tensor([3, -1, 7, -1, 0])
    DirectSink(cache, slots).write(1, k=k, v=v)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache.k[1, s], k[i]) and torch.equal(cache.v[1, s], v[i])
    written = {3, 7, 0}
    untouched = [s for s in range(cache.num_slots) if s not in written]
    assert cache.k[1, untouched].abs().sum() == 0 and cache.v[1, untouched].abs().sum() == 0
    assert cache.k[0].abs().sum() == 0  # other layer untouched
    DirectSink(cache, torch.full((5,), -1)).write(0, k=k, v=v)
    assert cache.k[0].abs().sum() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), min_size=1, max_size=60))
def test_block_tables_never_alias(ops):
    """Random grow/free sequences: live tables are disjoint, cover their tokens, and frees return
    every block."""
    bm = BlockManager(num_blocks=32, block_size=4)
    seqs = [Sequence(i, [1], 1, SamplingParams()) for i in range(6)]
    for idx, n in ops:
        s = seqs[idx]
        if random.Random(idx * 100 + n).random() < 0.2:
            bm.free(s)
        elif bm.can_grow(s, n):
            bm.grow(s, n)
            assert len(s.block_table) * bm.block_size >= n
        live = [b for q in seqs for b in q.block_table]
        assert len(live) == len(set(live)), "two live sequences share a block"
        assert len(live) + bm.num_free == bm.num_blocks
    for s in seqs:
        bm.free(s)
    assert sorted(bm.free_blocks) == list(range(32))


def test_slot_mapping_follows_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Sequence(0, [1], 1, SamplingParams())
    s.block_table = [5, 2, 7]
    assert bm.slots(s, 2, 9).tolist() == [22, 23, 8, 9, 10, 11, 28]


def test_slots_short_and_long_ranges_follow_one_rule():
    """A few rows (list arithmetic) and many (tensor ops) give the same slots: ``table[p // bs] * bs
    + p % bs``, -1 in a released block (``released``) or past the table (``position_slots``)."""
    bs = 4
    bm = BlockManager(num_blocks=64, block_size=bs)
    s = Sequence(0, [1], 1, SamplingParams())
    s.block_table = [9, -1, 0, 3] + list(range(10, 40))  # block 1 released (a sliding window's)

    def want(p: int) -> int:
        b = s.block_table[p // bs] if p < len(s.block_table) * bs else -1
        return -1 if b < 0 else b * bs + p % bs

    for start, end in [(2, 13), (8, 80), (8, 8 + 64), (8, 8 + 65), (0, 120), (0, 64)]:
        assert bm.slots(s, start, end, released=True).tolist() == [want(p) for p in range(start, end)]
    for positions in [[0, 5, 9, 200], list(range(3, 70)), list(range(60, 140, 3))]:
        assert bm.position_slots(s, positions).tolist() == [want(p) for p in positions]


def test_long_slot_ranges_stay_right_while_the_table_changes():
    """Long ranges read a slot tensor kept per sequence (BlockManager._all_slots): after the table
    grows, loses a block to a window, is replaced in place or freed and its id reused, the slots are
    still ``table[p // bs] * bs + p % bs`` (-1 in released blocks), and what a caller got stays as it was."""
    bs = 4
    bm = BlockManager(num_blocks=64, block_size=bs)
    s = Sequence(3, [1], 1, SamplingParams())

    def want(p: int) -> int:
        b = s.block_table[p // bs]
        return -1 if b < 0 else b * bs + p % bs

    bm.grow(s, 80)
    first = bm.slots(s, 0, 80, released=True)
    kept = first.tolist()
    assert kept == [want(p) for p in range(80)]
    bm.grow(s, 100)  # a new block
    assert bm.slots(s, 0, 100, released=True).tolist() == [want(p) for p in range(100)]
    s.block_table[1] = -1  # released out of a window (in place: the same list)
    assert bm.slots(s, 0, 100, released=True).tolist() == [want(p) for p in range(100)]
    held = s.block_table[2]
    s.block_table[2] = 63  # the same list, another block
    assert bm.slots(s, 8, 100).tolist() == [want(p) for p in range(8, 100)]
    assert first.tolist() == kept  # the first answer was not written over
    s.block_table[2] = held
    bm.free(s)
    t = Sequence(3, [1], 1, SamplingParams())  # the same id, a new table
    bm.grow(t, 90)
    s = t
    assert bm.slots(t, 0, 90, released=True).tolist() == [want(p) for p in range(90)]
