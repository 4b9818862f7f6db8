"""The prefix cache's bookkeeping, without a model: names, hits, reference counts, eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import Sequence

BS = 4


def seq(i: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(i, list(tokens), len(tokens), SamplingParams(), cache_salt=salt)


def run(bm: BlockManager, s: Sequence, upto: int | None = None) -> None:
    """What the engine does for a sequence: look up its prefix, allocate the rest, commit K/V for
    ``upto`` tokens (default all) and name the blocks that became full."""
    bm.match_prefix(s)
    n = len(s.token_ids) if upto is None else upto
    bm.grow(s, n)
    before, s.num_cached = s.num_cached, n
    bm.cache_full_blocks(s, before)


def test_hits_cover_full_committed_blocks_and_leave_the_last_token():
    bm = BlockManager(16, BS, enable_caching=True)
    a = seq(0, list(range(100, 114)))  # 14 tokens: 3 full blocks + 2
    run(bm, a)
    assert bm.num_cached_blocks == 3
    a_table = a.block_table
    bm.free(a)
    assert bm.audit() == {"free": 13, "cached_unreferenced": 3, "referenced": 0}
    # same 14 tokens: all 3 full blocks hit (the last token stays uncached anyway)
    b = seq(1, list(range(100, 114)))
    assert bm.match_prefix(b) == 12 and b.num_cached == 12 and b.block_table == a_table[:3]
    # exactly 12 tokens: the third block would cover the last token, whose logits are needed
    c = seq(2, list(range(100, 112)))
    assert bm.match_prefix(c) == 8
    # differs inside the second block: only the first block hits
    d = seq(3, list(range(100, 105)) + [7] + list(range(106, 114)))
    assert bm.match_prefix(d) == 4
    assert bm.ref_count[b.block_table[0]] == 3  # b, c and d share block 0
    for s in (b, c, d):
        bm.free(s)
    assert bm.audit() == {"free": 13, "cached_unreferenced": 3, "referenced": 0}


def test_partial_and_uncommitted_blocks_are_never_named():
    bm = BlockManager(16, BS, enable_caching=True)
    a = seq(0, list(range(10)))
    run(bm, a, upto=7)  # blocks cover 7 positions; only block 0 is full and committed
    assert bm.num_cached_blocks == 1
    b = seq(1, list(range(10)))
    assert bm.match_prefix(b) == 4


def test_a_duplicate_block_stays_private():
    """Two sequences that commit the same tokens in the same step (a race): the first names its
    block, the second's copy stays private and goes to the free list when released."""
    bm = BlockManager(16, BS, enable_caching=True)
    a, b = seq(0, list(range(9))), seq(1, list(range(9)))
    for s in (a, b):
        bm.match_prefix(s)
        bm.grow(s, 9)
    for s in (a, b):
        s.num_cached = 9
        bm.cache_full_blocks(s, 0)
    assert bm.num_cached_blocks == 2 and set(bm.cached.values()) == set(a.block_table[:2])
    bm.free(a)
    bm.free(b)
    assert bm.audit() == {"free": 14, "cached_unreferenced": 2, "referenced": 0}


def test_salts_and_cache_keys_isolate():
    bm = BlockManager(16, BS, enable_caching=True)
    run(bm, seq(0, list(range(9)), salt="alice"))
    assert bm.match_prefix(seq(1, list(range(9)), salt="bob")) == 0
    assert bm.match_prefix(seq(2, list(range(9)))) == 0
    assert bm.match_prefix(seq(3, list(range(9)), salt="alice")) == 8
    other = BlockManager(16, BS, enable_caching=True, cache_key={"model": "x"})
    assert other._hashes(seq(4, list(range(9))), 2) != bm._hashes(seq(5, list(range(9))), 2)


def test_caching_off_never_hits():
    bm = BlockManager(16, BS)
    a = seq(0, list(range(9)))
    run(bm, a)
    bm.free(a)
    assert bm.match_prefix(seq(1, list(range(9)))) == 0
    assert bm.audit() == {"free": 16, "cached_unreferenced": 0, "referenced": 0}


def test_eviction_takes_the_oldest_release_and_tail_blocks_first():
    bm = BlockManager(6, BS, enable_caching=True)
    a, b = seq(0, list(range(9))), seq(1, list(range(50, 59)))
    run(bm, a)  # 3 blocks, 2 named
    run(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.audit() == {"free": 2, "cached_unreferenced": 4, "referenced": 0}
    c = seq(2, list(range(90, 102)))
    bm.match_prefix(c)
    bm.grow(c, 12)  # two free blocks + one eviction: a's tail block (released first, tail first)
    assert bm.stats.evictions == 1
    assert bm.match_prefix(seq(3, list(range(9)))) == 4  # a lost its second block only
    assert bm.match_prefix(seq(4, list(range(50, 59)))) == 8


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2), st.integers(1, 30)), min_size=1, max_size=80))
def test_random_traffic_never_evicts_a_referenced_block(ops):
    """Random admissions (from three prompt families), commits and releases on a small pool: a block
    some live sequence holds is never handed to another sequence or evicted, every live table
    covers its K/V, and at the end every block is free or cached-unreferenced."""
    bm = BlockManager(12, BS, enable_caching=True)
    live: dict[int, Sequence] = {}
    owner: dict[int, set[int]] = {}
    families = [list(range(40)), list(range(40))[:10] + list(range(500, 530)), list(range(900, 940))]
    for n, (slot, fam, length) in enumerate(ops):
        if slot in live:
            s = live.pop(slot)
            for b in s.block_table:
                owner[b].discard(s.seq_id)
            bm.free(s)
        else:
            s = seq(n, families[fam][:length])
            bm.match_prefix(s)
            if not bm.can_grow(s, length):
                bm.free(s)
                s.num_cached = 0
                continue
            taken_before = {b for b, o in owner.items() if o}
            bm.grow(s, length)
            fresh = s.block_table[s.num_cached // BS:]
            assert not set(fresh) & taken_before, "a referenced block was handed out again"
            before, s.num_cached = s.num_cached, length
            bm.cache_full_blocks(s, before)
            for b in s.block_table:
                owner.setdefault(b, set()).add(s.seq_id)
            live[slot] = s
        assert bm.audit()["referenced"] == sum(1 for o in owner.values() if o)
    for s in live.values():
        bm.free(s)
    counts = bm.audit()
    assert counts["referenced"] == 0 and counts["free"] + counts["cached_unreferenced"] == bm.num_blocks
