"""pack/unpack/mask against a brute-force prefix-tree builder (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm.decoding.speculative.tree_attention import num_nodes, pack, parents, unpack


def brute_force_tree(cands: list[list[int]]) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Insert candidates into a trie one by one: (tokens, parent, depth, node index per (i, k))."""
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens, parent, depth, where = [], [], [], []
    for cand in cands:
        cur, row = -1, []
        for k, t in enumerate(cand):
            key = (cur, t)
            if key not in children:
                children[key] = len(tokens)
                tokens.append(t)
                parent.append(cur)
                depth.append(k)
            cur = children[key]
            row.append(cur)
        where.append(row)
    return tokens, parent, depth, where


def ancestors(parent: list[int], n: int) -> set[int]:
    out = set()
    while n >= 0:
        out.add(n)
        n = parent[n]
    return out


@st.composite
def beams(draw):
    b = draw(st.integers(1, 4))
    m = draw(st.integers(1, 5))
    c = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([1, 2, 3, 50]))  # tiny vocabularies force heavy sharing
    rows = []
    for _ in range(b):
        style = draw(st.sampled_from(["random", "duplicate", "shared_prefix", "distinct_first"]))
        base = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=c, max_size=c), min_size=m, max_size=m))
        if style == "duplicate":
            base = [base[0]] * m
        elif style == "shared_prefix":
            cut = draw(st.integers(0, c))
            base = [base[0][:cut] + r[cut:] for r in base]
        elif style == "distinct_first":
            base = [[1000 + i] + r[1:] for i, r in enumerate(base)]
        rows.append(base)
    return torch.tensor(rows, dtype=torch.long)


@settings(max_examples=300, deadline=None)
@given(beams())
def test_pack_matches_brute_force_prefix_tree(beam):
    packed, mask, offsets, umap = pack(beam)
    b, m, c = beam.shape
    big_l = packed.shape[1]
    assert mask.shape == (b, big_l, big_l) and offsets.shape == (b, big_l) and umap.shape == (b, m, c)
    assert big_l <= m * c
    # the seed's round trip property, per batch row and through unpack()
    assert torch.equal(unpack(packed, umap), beam)
    for i in range(b):
        assert torch.equal(packed[i][umap[i]], beam[i])
    counts = num_nodes(umap)
    par = parents(mask, offsets)
    for i in range(b):
        tokens, parent, depth, where = brute_force_tree(beam[i].tolist())
        n = len(tokens)
        assert int(counts[i]) == n  # L equals the number of distinct prefixes
        assert packed[i, :n].tolist() == tokens
        assert offsets[i, :n].tolist() == depth
        assert umap[i].tolist() == where
        assert par[i, :n].tolist() == parent
        for a in range(n):
            expect = ancestors(parent, a)
            assert set(mask[i, a, :n].nonzero().flatten().tolist()) == expect
        # padding never leaks: real rows never see padding columns; padding rows see only themselves
        assert not mask[i, :n, n:].any()
        for p in range(n, big_l):
            assert mask[i, p].nonzero().flatten().tolist() == [p]
            assert int(offsets[i, p]) == 0
    assert int(counts.max()) == big_l


def test_seed_example_mars_is_a_red():
    mars, is_, a, red, reddish, when, dark = range(7)
    beam = torch.tensor([[[mars, is_, a, red], [mars, is_, reddish, when], [mars, is_, dark, red]]])
    packed, mask, offsets, umap = pack(beam)
    assert packed[0].tolist() == [mars, is_, a, red, reddish, when, dark, red]
    assert umap[0].tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]]
    assert offsets[0].tolist() == [0, 1, 2, 3, 2, 3, 2, 3]
    # the two "red"s are different nodes: one attends "a", the other "dark"
    assert mask[0, 3, 2] and not mask[0, 3, 6]
    assert mask[0, 7, 6] and not mask[0, 7, 2]


def test_edge_shapes_m1_c1_and_fully_shared():
    packed, mask, offsets, umap = pack(torch.tensor([[[7]]]))
    assert packed.tolist() == [[7]] and mask.tolist() == [[[True]]] and offsets.tolist() == [[0]]
    same = torch.tensor([[[4, 5, 6]] * 4])
    packed, mask, _, umap = pack(same)
    assert packed.tolist() == [[4, 5, 6]] and umap.tolist() == [[[0, 1, 2]] * 4]
    assert torch.equal(mask[0], torch.ones(3, 3, dtype=torch.bool).tril())


def test_unpack_carries_trailing_dims():
    beam = torch.tensor([[[1, 2], [1, 3]], [[5, 6], [7, 8]]])
    packed, _, _, umap = pack(beam)
    feats = torch.randn(2, packed.shape[1], 3, 4)
    out = unpack(feats, umap)
    assert out.shape == (2, 2, 2, 3, 4)
    assert torch.equal(out[1, 1, 0], feats[1, int(umap[1, 1, 0])])


def test_bad_beam_shape_raises():
    import pytest

    with pytest.raises(ValueError, match="beam"):
        pack(torch.tensor([1, 2, 3]))
