"""What a speculative step does outside the forward, done the cheap way, against the simple way:

* a step in which no sequence drafts is AR's step: direct writes, no staging, no verify, no tree
  mask, and AR's tokens (the proposer still looks, and nothing else differs);
* the n-gram proposer's trees (verify.prefix_tree, built from lists) are ``pack``'s trees;
* greedy verification reduces only the rows on its walk, with the walk over every row's argmax's result;
* the gain rule's agreement estimate and the draft price's sums, kept in Python floats, are the numpy
  formulas they replaced, bit for bit, and its 3x3 solve is numpy's to rounding.

(Staging's slice copies and the sink's slice writes: tests/speculative/test_staging.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm.decoding.speculative.draft_price import FORGET, _Fit, solve3
from ratchetlm.decoding.speculative.draft_tree import greedy_verify, trees_from_beams
from ratchetlm.decoding.speculative.gain import PRIOR_WEIGHT, GainSchedule
from ratchetlm.decoding.speculative.proposers import PAD, DraftBeam, Proposer, register_proposer
from ratchetlm.decoding.speculative.verify import DraftTree, greedy_accept, prefix_tree

from .conftest import GREEDY, make_engine, run_engine

SOMETIMES = "_test_sometimes"


@register_proposer(SOMETIMES)
class SometimesProposer(Proposer):
    """Drafts ``[1, 2]`` (whatever the target says: mostly rejected) when the output length is odd, and
    nothing (None) when it is even or ``never``."""

    never = False

    def propose(self, seqs, depths):
        return [DraftBeam(torch.tensor([[1, 2][:d]]), torch.zeros(1, min(2, d)))
                if not self.never and s.num_output_tokens % 2 else None for s, d in zip(seqs, depths, strict=True)]


@pytest.mark.parametrize("never", [True, False])
def test_a_step_without_a_draft_is_an_ar_step(spec_llm, encoded, reference, monkeypatch, never):
    monkeypatch.setattr(SometimesProposer, "never", never)
    eng = make_engine(spec_llm, "speculative", method=SOMETIMES, depth=2)
    staging, runner = eng.runner.staging, eng.runner
    forwards = []  # per forward: (stage_index planned, staging begun, rows staged, masks given, sequences staged)
    forward, begin = runner.forward, staging.begin
    begun = []

    def spy_begin(stage_index, slots):
        begun.append(True)
        return begin(stage_index, slots)

    def spy_forward(plan):
        begun.clear()
        before = staging.metrics.stage_operations
        out = forward(plan)
        si = [] if plan.stage_index is None else plan.stage_index.tolist()
        drafting = sum(si[o] >= 0 for o in np.cumsum([0] + plan.new_lens[:-1]).tolist()) if si else 0
        forwards.append((plan.stage_index is not None, bool(begun), staging.metrics.stage_operations - before,
                         [m is not None for m in plan.masks], drafting))
        return out

    monkeypatch.setattr(runner, "forward", spy_forward)
    monkeypatch.setattr(staging, "begin", spy_begin)
    out = run_engine(eng, encoded[:3], GREEDY)
    assert out == reference[:3]
    plain = [f for f in forwards if not f[0]]
    assert plain and all(not b and ops == 0 and not any(masks) for _, b, ops, masks, _ in plain)
    m = staging.metrics
    if never:  # AR's steps only: nothing staged, committed or verified, ever
        assert len(plain) == len(forwards)
        assert (m.stage_operations, m.unique_tokens, m.commit_calls, m.tokens_rejected) == (0, 0, 0, 0)
        assert eng.strategy.totals.num_drafts == 0
    else:  # the drafting steps staged (and only they)
        staged = [f for f in forwards if f[0]]
        assert staged and all(b and ops > 0 for _, b, ops, _, _ in staged)
        assert eng.strategy.totals.num_drafts == sum(f[4] for f in staged)


def _padded(cands: list[list[int]]) -> torch.Tensor:  # [M, C] with PAD
    width = max(len(c) for c in cands)
    return torch.tensor([c + [PAD] * (width - len(c)) for c in cands], dtype=torch.long)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=5))
def test_the_ngram_proposers_tree_is_packs_tree(cands):
    """Shared prefixes, repeated candidates, a candidate that is another's prefix: the same nodes in the
    same order as packing the padded beam (tree_attention.pack through trees_from_beams)."""
    want = trees_from_beams([_padded(cands)])[0]
    got = prefix_tree(cands)
    assert (got.tokens, got.parent, got.depth) == (want.tokens, want.parent, want.depth)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_verification_reads_only_the_rows_on_its_walk(data):
    """The rows reduced are the walk's, once each, and rows off the walk may hold anything (NaN here):
    the walk equals the one over every row's argmax."""
    from ratchetlm.decoding.speculative import draft_tree

    reduced: list[int] = []  # rows each argmax call reduced
    real = draft_tree.argmax
    cands = data.draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=1, max_size=4))
    tree = prefix_tree(cands)
    vocab = 8
    logits = torch.randn(1 + len(tree), vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    for n in range(len(tree)):  # make some drafted tokens the target's choice
        if data.draw(st.booleans()):
            logits[0 if tree.parent[n] < 0 else 1 + tree.parent[n], tree.tokens[n]] = 50.0 + n
    path, nxt = greedy_accept(tree, logits.argmax(dim=-1).tolist())
    walked = [0] + [1 + n for n in path]
    hidden = logits.clone()
    hidden[[r for r in range(len(hidden)) if r not in walked]] = float("nan")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draft_tree, "argmax", lambda x: reduced.append(x.reshape(-1, vocab).shape[0]) or real(x))
        assert greedy_verify(tree, hidden) == (path, nxt)
    assert sum(reduced) == len(walked)
    assert greedy_verify(DraftTree([], [], []), logits[:1]) == ([], int(logits[0].argmax()))


def test_the_gain_rules_agreement_is_the_numpy_formula_bit_for_bit():
    rng = random.Random(0)
    g = GainSchedule(max_n=4, depth=8, verify_token_cost=0.1)
    rec = g.new_record()
    for _ in range(300):
        m, length = rng.randint(1, 4), rng.randint(1, 8)
        agreed = rng.randint(0, length)
        (rec.counts if rng.random() < 0.5 else g.totals).add(m, length, agreed)
        g.totals.add(m, length, agreed)
        for k in range(1, 5):
            gh, gt = np.array(g.totals.hits[k][1:]), np.array(g.totals.tries[k][1:])
            sh, st_ = np.array(rec.counts.hits[k][1:]), np.array(rec.counts.tries[k][1:])
            glob = (gh + 1.0) / (gt + 2.0)
            want = np.cumprod((sh + PRIOR_WEIGHT * glob) / (st_ + PRIOR_WEIGHT)).tolist()
            assert g.agreement(rec, k) == want
            assert g.agreement(rec, k, 3) == want[:3]


def test_the_draft_price_sums_are_numpys_outer_products_bit_for_bit():
    rng = np.random.default_rng(0)
    fit, vv, vy = _Fit(), np.zeros((3, 3)), np.zeros(3)
    for _ in range(200):
        x, z, y = (float(a) for a in rng.random(3) * [0.5, 2.0, 3.0])
        fit.add(x, z, y)
        v = np.array([1.0, x, z])
        vv, vy = FORGET * vv + np.outer(v, v), FORGET * vy + v * y
        assert fit.vv == vv.tolist() and fit.vy == vy.tolist()


def test_the_price_fits_solve_is_numpys_to_rounding_and_refuses_a_singular_system():
    rng = np.random.default_rng(1)
    for _ in range(500):
        a, b = rng.normal(size=(3, 3)) * rng.choice([1e-3, 1.0, 1e3]), rng.normal(size=3)
        assert solve3(a.tolist(), b.tolist()) == pytest.approx(np.linalg.solve(a, b).tolist(), rel=1e-9, abs=1e-12)
    assert solve3([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 2.0]], [1.0, 2.0, 4.0]) == (2.0, 1.0, 2.0)  # pivots
    assert solve3([[1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.0, 0.0, 1.0]], [1.0, 2.0, 3.0]) is None
    assert solve3([[0.0] * 3] * 3, [0.0] * 3) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=5))
def test_the_kept_verify_mask_is_the_tree_mask_with_its_root(cands):
    """strategy.rooted_mask (made once per tree shape, from lists) is ``with_root(tree_mask(tree))``,
    and a second tree of the same shape gets the same tensor, unchanged by the first one's use."""
    from ratchetlm.decoding.speculative.strategy import rooted_mask, tree_mask
    from ratchetlm.decoding.speculative.tree_attention import with_root

    tree = prefix_tree(cands)
    want = with_root(tree_mask(tree))
    got = rooted_mask(tree.parent)
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert rooted_mask(list(tree.parent)) is got and torch.equal(got, want)


@pytest.mark.parametrize("ctx, n, masked", [(0, 1, False), (37, 1, False), (37, 5, False), (37, 6, True),
                                            (300, 9, True)])
def test_a_single_sequences_attention_batch_is_the_general_ones(ctx, n, masked):
    """layers/attention.build_attention_batch at batch 1 (its indices one arange, the context slots as
    given, the per-sequence metadata from one list) against the general construction of the same batch
    (the sequence padded to a second, empty-context one and cut back): the same indices, slots, metadata
    and mask, and the fixed-order kernel's inputs equal."""
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch

    g = torch.Generator().manual_seed(ctx + n)
    slots = torch.randperm(4 * ctx + 8, generator=g)[:ctx]
    mask = None
    if masked:
        from ratchetlm.decoding.speculative.strategy import rooted_mask
        tree = prefix_tree([[1, 2, 3], [1, 4], [5, 6, 7, 8]] if n == 9 else [[1, 2, 3], [1, 4], [5]])
        assert len(tree) == n - 1  # the root and the tree's nodes
        mask = rooted_mask(tree.parent)
    pos = torch.arange(ctx, ctx + n)
    one = build_attention_batch(pos, [n], [slots], [mask], NullSink(), None)
    two = build_attention_batch(torch.cat([pos, torch.arange(1)]), [n, 1], [slots, slots[:0]], [mask, None],
                                NullSink(), None)
    assert torch.equal(one.pad_index, two.pad_index[:1]) and torch.equal(one.unpad_index, two.unpad_index[:n])
    assert torch.equal(one.seq_meta, two.seq_meta[:1])
    assert one.seq_meta.is_contiguous() and one.seq_meta.dtype == torch.int32
    if ctx:
        assert one.ctx_slots is not None and two.ctx_slots is not None
        assert torch.equal(one.ctx_slots, two.ctx_slots[:, :1])
        assert one.slot_rows_ptr(0) == one.ctx_slots[0].contiguous().data_ptr()
    else:
        assert one.ctx_slots is None
    if one.mask is not None:
        assert two.mask is not None and torch.equal(one.mask, two.mask[:1, :, :n, : ctx + n])
        fixed = one.fixed_order_mask()  # (None where the kernel's causal rule is the mask)
        assert (fixed is None) == (not masked)
        assert fixed is None or fixed.is_contiguous() and torch.equal(fixed, one.mask.reshape(1, n, -1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.booleans(), st.integers(0, 4)), max_size=12))
def test_a_verify_steps_counters_update_in_place_as_the_round_trip_did(steps):
    """stats.observe_into (the request's stats dictionary updated in place) leaves the same keys, in the
    same order, with the same values as SpecCounters.from_stats, observe and as_dict."""
    from ratchetlm.decoding.speculative.stats import SpecCounters, observe_into

    got: dict = {"other": 1}
    want: dict = {"other": 1}
    for drafted, accepted, new, offset in steps:
        observe_into(got, "spec_", drafted, accepted, new_draft=new, offset=offset)
        c = SpecCounters.from_stats(want, "spec_")
        c.observe(drafted, accepted, new_draft=new, offset=offset)
        want.update(c.as_dict("spec_"))
        assert list(got.items()) == list(want.items())


def test_a_few_rows_inputs_packed_in_one_tensor_are_the_separate_tensors(spec_llm, encoded, monkeypatch):
    """ModelRunner.execute packs a step of few rows (ids, positions, slots from lists, staging rows) into one
    tensor: every forward's plan equals the one built from separate tensors (FEW_ROWS 0), on drafted trees
    (staged rows, the price pinned so both runs draft the same) and plain steps, and the output too."""
    from ratchetlm.engine import model_runner

    def plans(few_rows: int) -> tuple[list, list]:
        monkeypatch.setattr(model_runner, "FEW_ROWS", few_rows)
        seen = []
        real = model_runner.ModelRunner.forward

        def spy(self, plan):
            seen.append((plan.ids.tolist(), plan.positions.tolist(), plan.slot_mapping.tolist(),
                         None if plan.stage_index is None else plan.stage_index.tolist(), plan.new_lens,
                         plan.logit_rows, [None if m is None else m.tolist() for m in plan.masks]))
            return real(self, plan)

        monkeypatch.setattr(model_runner.ModelRunner, "forward", spy)
        eng = make_engine(spec_llm, "speculative", method="hybrid", verify_token_cost=0.02)
        out = run_engine(eng, [encoded[0], encoded[2]], GREEDY)
        monkeypatch.setattr(model_runner.ModelRunner, "forward", real)
        return seen, out

    packed, out = plans(model_runner.FEW_ROWS)
    separate, ref = plans(0)
    assert out == ref and packed == separate
    assert any(p[3] is not None and max(p[3]) >= 0 for p in packed), "no step staged a tree"
