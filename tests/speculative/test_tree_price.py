"""The tree proposers priced and judged by measured steps (draft_price.py through tree_proposers.py): the
tree rule takes a learnt price ``factor·E(n) + fixed`` and a margin; trees shrink where steps measured
drafts dear and grow where they measured them cheap; the proposer hands each step's plain cost, its trees'
curve price and drafting count to the fit; a batch size the ledger judged a loss builds no tree; a pinned
``verify_token_cost`` turns both off; in the engine the output stays plain greedy's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ratchetlm.decoding.speculative import draft_price, proposers, tree_proposers
from ratchetlm.decoding.speculative.config import SpecConfig
from ratchetlm.decoding.speculative.cost_curve import CostCurve
from ratchetlm.decoding.speculative.draft_price import Price
from ratchetlm.decoding.speculative.proposers import create_proposer
from ratchetlm.decoding.speculative.tree_select import CostTable, build
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import Sequence

from .conftest import GREEDY, make_engine, run_engine
from .tree_sources import FixedSource, calibrated


def test_the_tree_rule_takes_the_price_and_the_margin():
    """``build`` with a price and a margin keeps the reference rule's size, and its plan's ``extra`` is the
    curve's (unscaled) price of the tree it kept."""
    src = FixedSource({t: [t + 1, t + 100] for t in range(50)})
    calib = calibrated([0.85, 0.3])
    curve = CostCurve((1, 32), (1.0, 2.55), first_token=3e-4, row_token=5e-5)  # 1 + 0.05 (R - 1)
    ctx = 300
    full = build([src], {0: True}, 0, calib, CostTable(curve), 16, 8, 1, 0, False, 1, context=ctx).nodes
    probs = [n.p for n in full]
    share = 1.0 + curve.first_token * ctx
    e = [curve(n + 2) - curve(1) + n * curve.row_token * ctx for n in range(len(probs) + 1)]
    sizes = []
    for price, margin in ((Price(), 0.0), (Price(1.6), 0.0), (Price(3.0), 0.0), (Price(0.5), 0.0),
                          (Price(1.0, 0.4), 0.0), (Price(), 10.0)):
        values = [(1 + margin) / share] + [(1 + sum(probs[:n])) / (share + price.factor * e[n] + price.fixed)
                                           for n in range(1, len(probs) + 1)]
        want = max(range(len(values)), key=lambda n: (values[n], -n))
        plan = build([src], {0: True}, 0, calib, CostTable(curve), 16, 8, 1, 0, True, 1, context=ctx,
                     price=price, margin=margin)
        assert len(plan.nodes) == want, (price, margin)
        assert plan.nodes == full[:want] and plan.extra == pytest.approx(e[want] if want else 0.0)
        sizes.append(want)
    assert sizes[3] > sizes[0] > sizes[1] > sizes[2] > 0, sizes  # cheaper drafts, bigger trees
    assert sizes[4] > 0 and sizes[5] == 0  # (a fixed part favours bigger trees; a margin no tree at all)


def suffix_proposer(**options):
    """A ``suffix`` proposer on the measured path (``verify_token_cost`` unset) without a model: no runner,
    so its curve is the fixed line ``1 + 0.09·(R − 1)`` (proposers.verify_cost) and the test is the same
    on any machine."""
    return create_proposer("suffix", SpecConfig(method="suffix", **options), SimpleNamespace(runner=None))


def repeating(i: int = 0) -> Sequence:
    """A prompt that repeats itself: a 12-token suffix match with one continuation, 8 levels deep."""
    tokens = list(range(10, 40)) * 3 + list(range(10, 22))
    return Sequence(i, tokens, len(tokens), SamplingParams(max_tokens=64))


def nodes_drafted(prop, batch: int = 1) -> int:
    beams = prop.propose([repeating(i) for i in range(batch)], [8] * batch)
    return sum(len(b.tree) for b in beams if b is not None)


def feed(prop, batch: int, factor: float, n: int = 300) -> None:
    """``n`` steps at ``batch`` whose drafts cost ``factor`` times the curve's price (every third plain)."""
    for i in range(n):
        plain, drafting = 1.0 + 0.01 * (i % 7), 0 if i % 3 == 0 else 1
        extra = (0.1 + 0.05 * (i % 9)) * drafting
        prop.measured.price.observe(batch, plain, extra, drafting, 0.01 * (plain + factor * extra))


def test_trees_shrink_where_steps_measured_drafts_dear_and_grow_where_cheap():
    fresh = suffix_proposer()
    assert fresh.measured is not None and fresh.measured.price.price(1) == Price(tree_proposers.TREE_PRICE)
    at_prior = nodes_drafted(fresh)
    dear, cheap = suffix_proposer(), suffix_proposer()
    feed(dear, 1, factor=3.5)
    feed(cheap, 1, factor=0.5)
    assert dear.measured.price.price(1).factor > 2.5 and cheap.measured.price.price(1).factor < 0.8
    assert 0 < nodes_drafted(dear) < at_prior < nodes_drafted(cheap), \
        (nodes_drafted(dear), at_prior, nodes_drafted(cheap))
    feed(dear, 3, factor=0.5)  # batch sizes are separate: batch 3's cheap drafts leave batch 1 dear
    assert nodes_drafted(dear) < at_prior


def test_each_step_hands_its_plain_cost_tree_price_and_drafters_to_the_fit(monkeypatch):
    prop = suffix_proposer()
    seen: list[tuple] = []
    monkeypatch.setattr(prop.measured.price, "observe", lambda *a: seen.append(a))
    seqs = [repeating(0), repeating(1)]
    seqs[0].num_cached = seqs[1].num_cached = 40
    beams = prop.propose(seqs, [8, 8])
    prop.observe_step(2, 5, 0.03)
    curve = CostCurve.linear(0.09)
    plans = [s.strategy_state[tree_proposers._PLAN] for s in seqs]
    n0, n1 = (len(p.nodes) for p in plans)
    assert n0 > 0 and beams[0] is not None
    e = (curve(2 + n0 + 1) - curve(2)) + ((curve(2 + n0 + 1 + n1 + 1) - curve(2 + n0 + 1)) if n1 else 0.0)
    assert seen == [(2, pytest.approx(curve(2) + curve.first_token * 80), pytest.approx(e), 1 + (n1 > 0), 0.03)]
    prop.observe_step(2, 5, 0.03)  # a step not proposed for (or timed twice) adds nothing
    prop.propose(seqs, [8, 8])
    prop.observe_step(3, 5, 0.03)  # nor one of another batch size
    assert len(seen) == 1


def test_a_batch_size_judged_a_loss_builds_no_tree_and_a_pinned_cost_measures_nothing(monkeypatch):
    prop = suffix_proposer()
    led = prop.measured.ledger
    for _ in range(20):
        led.observe(2, 1.0, True, 1, 1.0)
        led.observe(2, 1.0, False, 8, 1.0)
    built: list[int] = []
    real = tree_proposers.build
    monkeypatch.setattr(tree_proposers, "build", lambda *a, **k: built.append(1) or real(*a, **k))
    asked = [prop.propose([repeating(0), repeating(1)], [8, 8]) for _ in range(2 * draft_price.LEDGER_PROBE)]
    assert sum(any(b is not None for b in beams) for beams in asked) == 2  # the probes only
    assert len(built) == 2 * 2 and prop.metrics()["spec_decode_ledger_plain_steps"] == led.skipped > 0
    pinned = suffix_proposer(verify_token_cost=0.09)
    assert pinned.measured is None and not any("price" in k for k in pinned.metrics())
    constant = suffix_proposer(depth_schedule="constant")
    assert constant.measured is None


def test_a_measured_hybrid_engine_decodes_plain_greedy_and_learns_its_price(spec_llm, encoded, reference):
    """Its trees' price at batch 1, its chains' (tree_proposers.CHAINS_FROM) in a batch."""
    eng = make_engine(spec_llm, "speculative", method="hybrid", depth_schedule="gain", verify_token_cost=None)
    proposer = eng.strategy.proposer
    assert proposer.measured is not None and proposer.chains is not None and proposer.chains.measured is not None
    assert run_engine(eng, encoded[:6], GREEDY) == reference[:6]
    assert run_engine(eng, encoded[6:7], GREEDY) == reference[6:7]
    m = eng.strategy.metrics()
    assert set(proposer.measured.price.fits) == {1} and min(proposer.chains.measured.price.fits) >= 2
    assert {f"spec_decode_draft_price_factor_batch_{b}" for b in (1, 6)} <= set(m)


def test_a_tree_in_a_batch_must_beat_a_plain_step_by_the_margin(monkeypatch):
    """As the n-gram rule (gain.MARGIN): in a batch a tree's price is an estimate, so it must beat a plain
    step's value by the margin; at batch 1 it need not, and a pinned cost (nothing estimated) never does."""
    from ratchetlm.decoding.speculative.gain import MARGIN

    margins: list[float] = []
    real = tree_proposers.build
    monkeypatch.setattr(tree_proposers, "build", lambda *a, **k: margins.append(a[-1]) or real(*a, **k))
    suffix_proposer().propose([repeating(0), repeating(1)], [8, 8])
    suffix_proposer().propose([repeating(0)], [8])
    suffix_proposer(verify_token_cost=0.09).propose([repeating(0), repeating(1)], [8, 8])
    assert margins == [MARGIN, MARGIN, 0.0, 0.0, 0.0] and MARGIN > 0


def test_the_hybrid_drafts_trees_alone_and_chains_in_a_batch(monkeypatch):
    """Below ``CHAINS_FROM`` decoding sequences the hybrid builds trees and takes the successor table's
    top-k; from it on it drafts through its n-gram proposer (chains, their own price and ledger), builds
    no tree and asks for no logits. ``suffix`` and ``recycling`` draft trees at every batch size, and so
    does the hybrid with a schedule other than gain."""
    built: list[int] = []  # the batch size of every tree built
    real = tree_proposers.build
    monkeypatch.setattr(tree_proposers, "build", lambda *a, **k: built.append(a[7]) or real(*a, **k))
    hybrid = create_proposer("hybrid", SpecConfig(method="hybrid"), SimpleNamespace(runner=None))
    assert tree_proposers.CHAINS_FROM == 2 and hybrid.chains is not None
    one = hybrid.propose([repeating(0)], [8])
    assert built == [1] and hybrid.wants_logits and one[0] is not None and len(one[0].tree) > 1
    lookups: list[int] = []  # the n-gram lookups of the hybrid's chains
    real_lookup = proposers.ngram_candidates
    monkeypatch.setattr(proposers, "ngram_candidates", lambda *a, **k: lookups.append(1) or real_lookup(*a, **k))
    hybrid.propose([repeating(i) for i in range(4)], [8] * 4)
    assert built == [1] and not hybrid.wants_logits and len(lookups) == 4  # chains: no tree, no top-k
    assert hybrid.chains.measured._last is not None and hybrid.chains.measured._last[0] == 4  # its ledger's step
    hybrid.propose([repeating(0)], [8])
    assert built == [1, 1] and hybrid.wants_logits  # alone again: trees
    assert hybrid.metrics()["spec_decode_chain_steps"] == 1
    suffix = suffix_proposer()
    nodes_drafted(suffix, batch=4)
    assert suffix.chains is None and built[-4:] == [4] * 4  # (trees at 4 even where none pays)
    constant = create_proposer("hybrid", SpecConfig(method="hybrid", depth_schedule="constant"),
                               SimpleNamespace(runner=None))
    assert constant.chains is None
