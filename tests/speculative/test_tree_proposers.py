"""The training-free tree proposers' parts against brute-force references: the recycling successor
table (top-k of each token's last row), the suffix tries (longest match and continuation counts by
a naive scan, history eviction), the gain-shaped tree (best-first order, the value cut, judging),
and the engine's top-k hook (every computed row reaches the table, once per step)."""

from __future__ import annotations

import gc
import random
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm.decoding.speculative import suffix_index
from ratchetlm.decoding.speculative.cost_curve import CostCurve
from ratchetlm.decoding.speculative.draft_tree import trees_from_beams
from ratchetlm.decoding.speculative.recycling import SuccessorTable, top_k_indices
from ratchetlm.decoding.speculative.suffix_index import History, SequenceIndex, SuffixTrie
from ratchetlm.decoding.speculative.tree_select import Calibration, CostTable, build, judge, to_beam, to_tree
from ratchetlm.sampling_params import SamplingParams

from .conftest import GREEDY, make_engine, run_engine
from .tree_sources import FixedSource, calibrated

# ------------------------------------------------------------------ successor table


def test_successor_table_keeps_each_tokens_last_top_k():
    g = torch.Generator().manual_seed(0)
    vocab, k = 50, 4
    table = SuccessorTable(k)
    ref: dict[int, list[int]] = {}
    for _ in range(30):
        r = int(torch.randint(1, 12, (), generator=g))
        tokens = torch.randint(0, 15, (r,), generator=g)  # few distinct tokens: duplicates within a call
        logits = torch.randn(r, vocab, generator=g)
        table.observe(tokens, logits)
        for t, row in zip(tokens.tolist(), logits, strict=True):  # later rows overwrite earlier ones
            ref[t] = sorted(range(vocab), key=lambda j: -float(row[j]))[:k]
    for t in range(vocab):
        assert table.successors(t) == ref.get(t, []), t
    assert table.vocab == vocab and all(len(r) == k for r in table.rows.values())


@pytest.mark.parametrize("shape", [(1, 50), (3, 128 * 9), (4, 128 * 20 + 37), (2, 5000)])
def test_two_stage_top_k_equals_torch_topk(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    x[0, -1] = x[-1, 7] = 50.0  # the best entry in the last column (past the whole blocks), in the first block
    x[-1, 3] = 49.0  # two of the best in one block
    for k in (1, 8):
        assert torch.equal(top_k_indices(x, k), torch.topk(x, k, dim=-1).indices)


def test_successor_table_empty_and_out_of_range():
    table = SuccessorTable(8)
    assert table.successors(3) == []
    table.observe(torch.tensor([], dtype=torch.long), torch.zeros(0, 20))
    assert table.vocab is None and not table.rows
    table.observe(torch.tensor([2]), torch.arange(20.0)[None])
    assert table.successors(2) == list(range(19, 11, -1))
    assert table.successors(25) == [] and table.successors(-1) == []


# ------------------------------------------------------------------ suffix tries


def naive_match(tokens: list[int], max_len: int) -> tuple[int, Counter] | None:
    """The longest suffix (<= max_len) with an earlier occurrence followed by a token, and the
    counts of the tokens that followed its earlier occurrences."""
    n = len(tokens)
    for m in range(min(max_len, n), 0, -1):
        suf = tokens[n - m:]
        nxt = Counter(tokens[e + 1] for e in range(m - 1, n - 1) if tokens[e - m + 1: e + 1] == suf)
        if nxt:
            return m, nxt
    return None


@pytest.mark.parametrize("seed", range(6))
def test_sequence_index_longest_match_equals_a_naive_scan(seed):
    rng = random.Random(seed)
    depth = 6
    tokens = [rng.randrange(3 + seed) for _ in range(120)]
    idx = SequenceIndex(depth)
    for n in range(1, len(tokens) + 1, rng.randrange(1, 4)):  # appended in uneven pieces, as committed
        idx.sync(tokens[:n])
        for max_len in (2, depth - 1, 12):
            got = idx.match(max_len)
            want = naive_match(tokens[:n], min(max_len, depth - 1))
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                node, m = got
                assert m == want[0]
                assert {t: c.count for t, c in node.kids.items()} == dict(want[1])
                assert trie_substrings(node) == naive_below(tokens[:n], m, depth)  # every level below it


def test_sequence_index_resyncs_a_text_that_is_not_an_extension():
    """The per-token positions (the match's starting point) are rebuilt when the tokens given are
    shorter than the indexed ones or end differently where those end (a request's tokens only grow,
    so that is all the index checks): it then matches as a fresh index of the text does."""
    rng = random.Random(7)
    tokens = [rng.randrange(4) for _ in range(80)]
    other = tokens[:50] + [rng.randrange(4) for _ in range(20)]
    idx = SequenceIndex(6)
    for text in (tokens, tokens[:40], tokens, other, other[:69] + [9]):
        idx.sync(text)
        fresh = SequenceIndex(6)
        fresh.sync(text)
        got, want = idx.match(5), fresh.match(5)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert got[1] == want[1] and list(got[0].starts) == list(want[0].starts)
            assert got[1] == naive_match(text, 5)[0]


def naive_below(tokens: list[int], m: int, depth: int) -> Counter:
    """Continuations of the last ``m`` tokens' earlier occurrences, as a depth-``depth`` trie counts
    them: every prefix (up to ``depth - m`` tokens) of what followed each occurrence."""
    n, suf = len(tokens), tokens[len(tokens) - m:]
    out: Counter = Counter()
    for e in range(m - 1, n - 1):
        if tokens[e - m + 1: e + 1] == suf:
            for j in range(1, min(depth - m, n - 1 - e) + 1):
                out[tuple(tokens[e + 1: e + 1 + j])] += 1
    return out


def all_substrings(texts: list[list[int]], depth: int) -> Counter:
    return Counter(tuple(t[i:j]) for t in texts for i in range(len(t))
                   for j in range(i + 1, min(len(t), i + depth) + 1))


def trie_substrings(trie: SuffixTrie | Any) -> Counter:
    """Every path below ``trie``'s root (or below a node) with its count."""
    out: Counter = Counter()
    stack = [((), trie.root if isinstance(trie, SuffixTrie) else trie)]
    while stack:
        path, node = stack.pop()
        for t, kid in node.kids.items():
            assert kid.count > 0
            out[path + (t,)] = kid.count
            stack.append((path + (t,), kid))
    return out


def test_history_counts_every_substring_and_evicts_the_oldest():
    rng = random.Random(7)
    depth = 5
    hist = History(depth, max_tokens=100)
    texts = [[rng.randrange(6) for _ in range(rng.randrange(10, 40))] for _ in range(12)]
    for i, t in enumerate(texts):
        hist.add(t)
        kept = list(hist.texts)
        assert sum(map(len, kept)) <= 100 and kept[-1] == t
        assert kept == texts[i - len(kept) + 1: i + 1]  # the newest ones, oldest evicted first
        assert trie_substrings(hist.trie) == all_substrings(kept, depth)  # evicted counts all taken out
    ctx = texts[-1][-4:] + [0]
    got = hist.trie.find(ctx, 8)
    want = None
    for m in range(min(8, depth - 1, len(ctx)), 0, -1):  # naive: the longest suffix followed in some text
        nxt = Counter(t[e + m] for t in hist.texts for e in range(len(t) - m) if t[e:e + m] == ctx[-m:])
        if nxt:
            want = m, nxt
            break
    assert got is not None and want is not None and got[1] == want[0]
    assert {t: c.count for t, c in got[0].kids.items()} == dict(want[1])


def test_history_nodes_add_nothing_for_the_garbage_collector():
    """A history's trie holds ~depth nodes per token; none may be an object the cyclic collector tracks
    (as objects they set off full collections of the whole heap, 0.1-0.2 s each, suffix_index.SuffixTrie).
    Only each kept text's token list is tracked."""
    rng = random.Random(3)
    hist = History(20, max_tokens=4000)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(40):
        hist.add([rng.randrange(300) for _ in range(100)])
    grown = len(gc.get_objects()) - before
    assert len(trie_substrings(hist.trie)) > 40 * 100  # thousands of nodes...
    assert grown <= len(hist.texts) + 20, grown  # ... and about one tracked object per text


# ------------------------------------------------------------------ gain-shaped trees



def test_tree_is_built_best_first_and_cut_where_value_peaks():
    src = FixedSource({0: [1, 2], 1: [3, 4], 2: [5], 3: [6], 4: [7]})
    calib = calibrated([0.8, 0.3])
    per_row = 0.2
    plan = build([src], {0: True}, 0, calib, CostTable(CostCurve.linear(per_row)), 10, 8, 1, 0, True, 5)
    p0, p1 = calib.p(("fixed", 0)), calib.p(("fixed", 1))
    # all candidate path probabilities, best first (ties keep discovery order)
    paths = {1: p0, 2: p1, 3: p0 * p0, 4: p0 * p1, 5: p1 * p0, 6: p0 ** 3, 7: p0 * p1 * p0}
    order = sorted(paths, key=lambda t: -paths[t])
    value = [1.0] + [(1 + sum(paths[t] for t in order[:n])) / (1 + per_row * (n + 1)) for n in range(1, 8)]
    best = max(range(8), key=lambda n: (value[n], -n))
    assert [n.token for n in plan.nodes] == order[:best]
    assert 0 < best < 7  # the cut is inside the tree: the test sees both sides of it
    assert [n.p for n in plan.nodes] == pytest.approx([paths[t] for t in order[:best]])
    for cost in (0.05, 0.1, 0.15, 0.3, 0.45):  # the cut at other prices: every one where the rule puts it
        got = build([src], {0: True}, 0, calib, CostTable(CostCurve.linear(cost)), 10, 8, 1, 0, True, 5).nodes
        assert len(got) == reference_size([paths[t] for t in order], CostCurve.linear(cost), 1, 0), cost
    for n in plan.nodes:  # every prefix of the order is a tree, and parents point at the right node
        assert n.parent < len(plan.nodes) and (n.parent == -1) == (n.token in (1, 2))
    # a static size keeps max_nodes whatever they are worth
    static = build([src], {0: True}, 0, calib, CostTable(CostCurve.linear(5.0)), 4, 8, 1, 0, False, 5)
    assert len(static.nodes) == 4
    gained = build([src], {0: True}, 0, calib, CostTable(CostCurve.linear(5.0)), 4, 8, 1, 0, True, 5)
    assert gained.nodes == []  # rows that expensive never pay
    # the tree as candidates packs back to the same nodes
    tree = trees_from_beams([to_beam(plan.nodes)])[0]
    assert sorted(tree.tokens) == sorted(n.token for n in plan.nodes)


def reference_size(probs: list[float], curve: CostCurve, batch: int, drafted: int) -> int:
    """The gain rule written out: nodes (path probabilities, best first) kept for the best value."""
    share = curve(batch) / batch
    values = [1 / share] + [(1 + sum(probs[:n])) / (share + curve(batch + drafted + n + 1) - curve(batch + drafted))
                            for n in range(1, len(probs) + 1)]
    return max(range(len(values)), key=lambda n: (values[n], -n))


def test_tree_size_follows_the_cost_curve_batch_and_earlier_drafts():
    src = FixedSource({t: [t + 1, t + 100] for t in range(50)})  # a chain of rank-0 children, rank-1 side twigs
    calib = calibrated([0.7, 0.2])
    curve = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.05, 1.2, 1.6, 2.8, 5.5))
    sizes = []
    for b, e in ((1, 0), (2, 3), (4, 0), (8, 20)):
        plan = build([src], {0: True}, 0, calib, CostTable(curve), 16, 8, b, e, True, 1)
        full = build([src], {0: True}, 0, calib, CostTable(curve), 16, 8, b, e, False, 1).nodes
        assert plan.nodes == full[:len(plan.nodes)]
        assert len(plan.nodes) == reference_size([n.p for n in full], curve, b, e), (b, e)
        sizes.append(len(plan.nodes))
    assert sizes[0] > sizes[2] >= sizes[3] and sizes[0] > 0


def test_trees_shrink_with_the_context_every_node_reads():
    """A node's row reads the sequence's cached tokens: with the curve's per-token terms the tree is the
    reference rule's size with ``share + f·L`` and ``n·r·L`` added, smaller the longer the context."""
    src = FixedSource({t: [t + 1, t + 100] for t in range(50)})
    calib = calibrated([0.7, 0.2])
    curve = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.05, 1.2, 1.6, 2.8, 5.5), first_token=3e-4, row_token=2e-4)
    sizes = []
    for ctx in (0, 1500, 4000, 50000):
        plan = build([src], {0: True}, 0, calib, CostTable(curve), 16, 8, 1, 0, True, 1, context=ctx)
        full = build([src], {0: True}, 0, calib, CostTable(curve), 16, 8, 1, 0, False, 1, context=ctx).nodes
        probs = [n.p for n in full]
        share = 1.0 + 3e-4 * ctx
        values = [1 / share] + [(1 + sum(probs[:n])) / (share + curve(n + 2) - curve(1) + n * 2e-4 * ctx)
                                for n in range(1, len(probs) + 1)]
        assert len(plan.nodes) == max(range(len(values)), key=lambda n: (values[n], -n)), ctx
        sizes.append(len(plan.nodes))
    assert sizes[0] > sizes[1] >= sizes[2] >= sizes[3], sizes
    bare = CostCurve(curve.rows, curve.cost)
    assert len(build([src], {0: True}, 0, calib, CostTable(bare), 16, 8, 1, 0, True, 1, context=4000).nodes) == sizes[0]


def paths(tree) -> set[tuple[int, ...]]:
    """Every node's root-to-node token path: what a tree verifies, whatever its node order."""
    out = set()
    for k in range(len(tree)):
        path = []
        while k >= 0:
            path.append(tree.tokens[k])
            k = tree.parent[k]
        out.add(tuple(reversed(path)))
    return out


def test_the_built_tree_is_the_tree_its_candidates_pack_into():
    """The tree proposers hand the strategy their tree as built (no pack() of the candidates): the same
    root-to-node paths and depths as packing ``to_beam``, in selection order (best first)."""
    src = FixedSource({0: [1, 2, 3], 1: [4, 5], 2: [6], 4: [7, 8], 6: [9], 7: [10]})
    for rates in ([0.8, 0.3, 0.1], [0.5, 0.45, 0.4], [0.95, 0.02, 0.01]):
        plan = build([src], {0: True}, 0, calibrated(rates), CostTable(CostCurve.linear(0.0)), 9, 8, 1, 0, False, 1)
        tree, packed = to_tree(plan.nodes), trees_from_beams([to_beam(plan.nodes)])[0]
        assert paths(tree) == paths(packed) and len(tree) == len(packed) == 9
        assert sorted(tree.depth) == sorted(packed.depth)
        assert [n.token for n in plan.nodes] == tree.tokens  # selection order


def test_hybrid_drafts_reach_the_verify_forward_as_built(spec_llm, encoded, reference, monkeypatch):
    """No pack() for the hybrid's trees: each staged proposal carries exactly its DraftBeam's tree,
    and the text is plain greedy's."""
    from ratchetlm.decoding.speculative import draft_tree

    monkeypatch.setattr(draft_tree, "pack", lambda beam: pytest.fail("a built tree was packed again"))
    eng = make_engine(spec_llm, "speculative", method="hybrid", depth_schedule="constant")
    trees: list[Any] = []
    real = eng.strategy.proposer.propose

    def spy(seqs, depths):
        beams = real(seqs, depths)
        trees.extend(b.tree for b in beams if b is not None)
        return beams

    eng.strategy.proposer.propose = spy
    seen: list[Any] = []
    tree_proposal = eng.strategy._tree_proposal
    monkeypatch.setattr(eng.strategy, "_tree_proposal",
                        lambda seq, draft, *a, **k: seen.append(draft) or tree_proposal(seq, draft, *a, **k))
    out = run_engine(eng, [encoded[i] for i in (0, 1)], GREEDY)
    assert out == [reference[i] for i in (0, 1)]
    # every tree drafted reached a verify forward as the same object (SCV's continuations are cut from it)
    assert trees and all(any(t is d for d in seen) for t in trees)


def test_judge_scores_the_children_of_each_accepted_node_from_the_committed_tokens():
    src = FixedSource({0: [1, 2], 1: [3, 4], 3: [5]})
    calib = calibrated([0.9, 0.5])
    plan = build([src], {0: True}, 0, calib, CostTable(CostCurve.linear(0.0)), 4, 8, 1, 0, False, 3)
    assert [n.token for n in plan.nodes] == [1, 3, 5, 2]  # 0.9^3 > 0.5
    c = Calibration()
    assert not judge(plan, [7, 7, 0], c) and not c.tries  # nothing committed after the root yet
    assert judge(plan, [7, 7, 0, 1, 4, 9], c)  # root -> 1 (rank 0 hit) -> 4 (rank 1 hit, not drafted): done
    assert (c.hits[("fixed", 0)], c.tries[("fixed", 0)]) == (1, 2)  # 1 hit; 3 missed
    assert (c.hits[("fixed", 1)], c.tries[("fixed", 1)]) == (1, 2)  # 2 missed; 4 hit
    c = Calibration()
    judge(plan, [7, 7, 0, 8], c)  # the target chose a token outside the tree
    assert c.tries == {("fixed", 0): 1, ("fixed",): 2, ("fixed", 1): 1} and not any(c.hits.values())


# ------------------------------------------------------------------ the engine's top-k hook


def test_every_computed_row_reaches_the_successor_table_once_per_step(spec_llm, encoded):
    eng = make_engine(spec_llm, "speculative", method="recycling", tree_nodes=6)
    prop, strat = eng.strategy.proposer, eng.strategy
    calls, steps = [], []
    real_observe, real_commit = prop.observe_logits, strat.commit

    def observe(tokens, logits):
        calls.append((list(tokens), logits.clone()))
        real_observe(tokens, logits)

    def commit(seqs, proposals, logits):
        steps.append(([p.token_ids[r] for p in proposals for r in p.logit_rows], torch.cat(logits).clone()))
        return real_commit(seqs, proposals, logits)

    prop.observe_logits, strat.commit = observe, commit
    run_engine(eng, [encoded[i] for i in (0, 4)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(calls) == len(steps) > 2  # one call per forward, with exactly its rows
    assert eng.strategy.metrics()["spec_decode_num_draft_tokens"] > 0  # tree rows (rejected ones too) among them
    for (tokens, logits), (want_tokens, want_logits) in zip(calls, steps, strict=True):
        assert tokens == want_tokens
        assert torch.equal(logits, want_logits)
    tokens, logits = calls[-1]
    for j, t in enumerate(tokens):
        if t not in tokens[j + 1:]:  # each token's last row of the last forward
            assert prop.table.successors(t) == torch.topk(logits[j], 8).indices.tolist()


def test_the_hook_is_off_for_proposers_that_do_not_want_logits(spec_llm, encoded):
    eng = make_engine(spec_llm, "speculative", method="suffix")
    assert not eng.strategy.proposer.wants_logits and eng.strategy.proposer.table is None


def _span_walk(node: Any, depth: int) -> list[tuple[int, list[int], int, int]]:
    out: list[tuple[int, list[int], int, int]] = []
    if depth:
        for t, k in node.kids.items():
            out += [(t, [int(s) for s in k.starts], k.count, k.left), *_span_walk(k, depth - 1)]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_span_node_kids_grouped_in_python_equal_the_array_grouping(seed, monkeypatch):
    """A node of a few occurrences groups its kids in Python (suffix_index.FEW): the same kids, in the
    same order, with the same positions as numpy's grouping, on texts of few distinct tokens."""
    rng = random.Random(seed)
    for _ in range(60):
        tokens = [rng.randrange(rng.randint(2, 7)) for _ in range(rng.randint(2, 200))]
        idx = SequenceIndex(6)
        idx.sync(tokens)
        found = idx.match(5)
        if found is None:
            continue
        walks = []
        for few in (suffix_index.FEW, -1):  # -1: every node through numpy
            monkeypatch.setattr(suffix_index, "FEW", few)
            node = found[0]
            walks.append(_span_walk(suffix_index.SpanNode(node.arr, node.starts, node.left), 4))
        assert walks[0] == walks[1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()), max_size=6), min_size=1,
                max_size=3))
def test_merged_children_are_the_simple_merge(proposals):
    """tree_select._children (one list per child, each key's probability read once per build) against the
    merge written out: per token the most confident source's probability, every source's key in source
    order, the states of the sources that can expand it."""
    from ratchetlm.decoding.speculative import tree_select

    class Given:
        def __init__(self, kids):
            self.kids = kids

        def expand(self, state, token):
            return [(t, ("fixed", r), state if more else None) for t, r, more in self.kids]

    sources = [Given(k) for k in proposals]
    states = {i: f"s{i}" for i in range(len(sources))}
    calib = calibrated([0.9, 0.5, 0.2, 0.05])
    want: dict = {}
    for i, st_ in states.items():
        for tok, key, child in sources[i].expand(st_, 0):
            p, keys, sts = want.get(tok, (0.0, [], {}))
            if child is not None:
                sts[i] = child
            want[tok] = (max(p, calib.p(key)), keys + [key], sts)
    memo: dict = {}
    for _ in range(2):  # the second time every probability comes from the memo
        got = tree_select._children(sources, states, 0, calib, memo)
        assert got == [(t, p, k, s) for t, (p, k, s) in want.items()]
