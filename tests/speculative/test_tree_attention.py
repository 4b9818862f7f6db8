"""pack/unpack/mask against a brute-force prefix-tree builder (hypothesis)."""

from __future__ import annotations

import pytest
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
    packed, mask, offsets, umap, indices = pack(beam)
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
    flat = beam.reshape(b, m * c)
    for i in range(b):  # packed_token_indices: where each node was taken from, first candidate holding it
        n = int(counts[i])
        assert torch.equal(flat[i][indices[i, :n]], packed[i, :n])
        assert (indices[i, n:] == -1).all()
        for node in range(n):
            holders = (umap[i] == node).nonzero()  # [(candidate, depth)], candidate-major
            assert int(indices[i, node]) == int(holders[0, 0]) * c + int(holders[0, 1])
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
    packed, mask, offsets, umap, indices = pack(beam)
    assert packed[0].tolist() == [mars, is_, a, red, reddish, when, dark, red]
    assert indices[0].tolist() == [0, 1, 2, 3, 6, 7, 10, 11]  # the seed's packed_token_indices
    assert umap[0].tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]]
    assert offsets[0].tolist() == [0, 1, 2, 3, 2, 3, 2, 3]
    # the two "red"s are different nodes: one attends "a", the other "dark"
    assert mask[0, 3, 2] and not mask[0, 3, 6]
    assert mask[0, 7, 6] and not mask[0, 7, 2]


def test_edge_shapes_m1_c1_and_fully_shared():
    packed, mask, offsets, umap, _ = pack(torch.tensor([[[7]]]))
    assert packed.tolist() == [[7]] and mask.tolist() == [[[True]]] and offsets.tolist() == [[0]]
    same = torch.tensor([[[4, 5, 6]] * 4])
    packed, mask, _, umap, _ = pack(same)
    assert packed.tolist() == [[4, 5, 6]] and umap.tolist() == [[[0, 1, 2]] * 4]
    assert torch.equal(mask[0], torch.ones(3, 3, dtype=torch.bool).tril())


def test_unpack_carries_trailing_dims():
    beam = torch.tensor([[[1, 2], [1, 3]], [[5, 6], [7, 8]]])
    packed, _, _, umap, _ = pack(beam)
    feats = torch.randn(2, packed.shape[1], 3, 4)
    out = unpack(feats, umap)
    assert out.shape == (2, 2, 2, 3, 4)
    assert torch.equal(out[1, 1, 0], feats[1, int(umap[1, 1, 0])])


def test_bad_beam_shape_raises():
    import pytest

    with pytest.raises(ValueError, match="beam"):
        pack(torch.tensor([1, 2, 3]))


# ---------------------------------------------------------------- the API the engine runs

def _random_tree_and_logits(data):
    from ratchetlm.decoding.speculative.draft_tree import trees_from_beams

    beam = data.draw(beams())
    tree = trees_from_beams([beam[0]])[0]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    logits = torch.randn(1 + len(tree), 1010, generator=g)  # beams() uses tokens up to 1004
    # steer some rows to a child's token so that paths of several nodes get accepted
    for n in range(len(tree)):
        if data.draw(st.booleans()):
            row = 0 if tree.parent[n] < 0 else 1 + tree.parent[n]
            logits[row, tree.tokens[n]] = 50.0 + n
    return beam[0], tree, logits


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_verification_through_the_verified_beam_equals_the_tree_walk(data):
    from ratchetlm.decoding.speculative.draft_tree import candidates, greedy_verify
    from ratchetlm.decoding.speculative.tree_attention import unpack_verified
    from ratchetlm.decoding.speculative.verify import greedy_accept

    _, tree, logits = _random_tree_and_logits(data)
    assert greedy_verify(tree, logits) == greedy_accept(tree, logits.argmax(dim=-1).tolist())
    # the verified beam / scores: what the target says at each candidate position (its parent's row)
    cand, umap = candidates(tree)
    vb, vs = unpack_verified(logits[None], umap[None], cand[None])
    logp = torch.log_softmax(logits, dim=-1)
    for m in range(cand.shape[0]):
        for c in range(cand.shape[1]):
            if umap[m, c] < 0:
                continue
            row = 0 if c == 0 else 1 + int(umap[m, c - 1])
            assert int(vb[0, m, c]) == int(logits[row].argmax())
            # fp32 log-probabilities near 0 (a near-certain token) differ in the last bits between
            # log_softmax and (x - max) - logsumexp: absolute, not relative, agreement
            assert float(vs[0, m, c]) == pytest.approx(float(logp[row, cand[m, c]]), rel=1e-6, abs=1e-6)
            assert tree.tokens[int(umap[m, c])] == int(cand[m, c])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 10_000)), min_size=1, max_size=5),
       st.booleans())
def test_batched_pack_of_many_sequences_equals_one_at_a_time(shapes, chains):
    """trees_from_beams packs B sequences' beams (different M, C, PAD tails; all chains or mixed)
    in one pack() call; each sequence's tree equals packing it alone and the brute-force trie."""
    from ratchetlm.decoding.speculative.draft_tree import trees_from_beams
    from ratchetlm.decoding.speculative.proposers import PAD

    beams = []
    for m, c, seed in shapes:
        m = 1 if chains else m
        g = torch.Generator().manual_seed(seed)
        b = torch.randint(0, 3, (m, c), generator=g)
        cut = torch.randint(1, c + 1, (m,), generator=g)
        for i in range(m):
            b[i, cut[i]:] = PAD
        beams.append(b)
    together = trees_from_beams(beams)
    alone = [trees_from_beams([b])[0] for b in beams]
    for t, a, b in zip(together, alone, beams, strict=True):
        assert (t.tokens, t.parent, t.depth) == (a.tokens, a.parent, a.depth)
        brute = brute_force_tree([[x for x in row if x != PAD] for row in b.tolist()])
        assert (t.tokens, t.parent, t.depth) == tuple(brute[:3])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_sampled_verification_through_the_tree_api_equals_the_tree_walk(data):
    """The engine's sampled verify (candidates + unpack_map + parent_rows) draws exactly what the
    tree walk draws with the same generator: same rows, same children in the same order."""
    from ratchetlm.decoding.speculative.draft_tree import sample_verify
    from ratchetlm.decoding.speculative.verify import sample_accept

    _, tree, logits = _random_tree_and_logits(data)
    probs = torch.softmax(logits.double() / data.draw(st.sampled_from([0.05, 1.0, 3.0])), dim=-1)
    seed = data.draw(st.integers(0, 10_000))
    for _ in range(3):
        got = sample_verify(tree, probs, torch.Generator().manual_seed(seed))
        assert got == sample_accept(tree, probs, torch.Generator().manual_seed(seed))
        seed += 1


@settings(max_examples=200, deadline=None)
@given(beams())
def test_a_chain_packs_like_a_beam_of_copies(beam):
    """pack's single-candidate path returns what the general path returns for the same chain
    (a beam of two identical candidates shares everything)."""
    chain = beam[:, :1]
    fast, general = pack(chain), pack(chain.expand(-1, 2, -1).contiguous())
    for name in ("tokens", "mask", "position_offsets", "packed_token_indices"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert torch.equal(fast.unpack_map, general.unpack_map[:, :1])
