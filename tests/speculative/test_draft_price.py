"""Drafts priced and judged by measured steps (decoding/speculative/draft_price.py): the price fit recovers
what drafts really cost from step times; the ledger refuses proposing at a batch size where proposing
steps measured a lower rate than plain ones (but for probes), never at batch 1; in the engine such steps do
no lookups and the output stays plain greedy's; the strategy hands the proposer the times of decode-only
steps only."""

from __future__ import annotations

import numpy as np
import pytest

from ratchetlm.decoding.speculative import draft_price, proposers
from ratchetlm.decoding.speculative.draft_price import DraftLedger, DraftPrice, Price
from ratchetlm.decoding.speculative.suffix_index import TokenPositions

from .conftest import GREEDY, make_engine, run_engine


def steps(price: DraftPrice, batch: int, factor: float, fixed: float, n: int, seed: int = 0) -> None:
    """``n`` steps whose time is ``α·(P + factor·E + fixed·drafting)`` (α = 10 ms a unit), every third plain."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        plain = float(rng.uniform(1.0, 3.0))
        drafting = 0 if i % 3 == 0 else int(rng.integers(1, 3))
        extra = float(drafting * rng.uniform(0.05, 0.6))
        price.observe(batch, plain, extra, drafting, 0.01 * (plain + factor * extra + fixed * drafting))


def test_the_fit_recovers_what_drafts_really_cost_per_batch_size():
    price = DraftPrice()
    assert price.price(8) == Price(1.0, 0.0)  # nothing measured: the curve as it is
    steps(price, 8, factor=2.5, fixed=0.3, n=400)
    steps(price, 1, factor=1.0, fixed=0.0, n=400, seed=1)
    at8, at1 = price.price(8), price.price(1)
    # (the priors pull a little)
    assert at8.factor == pytest.approx(2.5, rel=0.05) and at8.fixed == pytest.approx(0.3, abs=0.06)
    assert at1.factor == pytest.approx(1.0, rel=0.05) and at1.fixed == pytest.approx(0.0, abs=0.03)
    assert price.price(4) == Price()  # batch sizes are separate


def test_few_drafting_steps_leave_the_curve_s_price_and_bounds_hold():
    price = DraftPrice()
    for _ in range(50):  # plain steps only: no evidence about drafts
        price.observe(4, 2.0, 0.0, 0, 0.02)
    assert price.price(4).factor == pytest.approx(1.0) and price.price(4).fixed == pytest.approx(0.0)
    price.observe(4, 2.0, 0.2, 1, 0.05)  # one drafting step that took 2.5x: pulled towards it, not to it
    assert 1.0 < price.price(4).factor + price.price(4).fixed / 0.2 < 7.0
    huge = DraftPrice()
    steps(huge, 2, factor=40.0, fixed=5.0, n=200)
    assert huge.price(2) == Price(draft_price.HIGH, draft_price.HIGH_FIXED)


def ledger_with(batch: int, on: float, off: float, n: int = 10) -> DraftLedger:
    led = DraftLedger()
    for _ in range(n):
        led.observe(batch, 2.0, True, int(on), 1.0 * 2.0)  # rate = tokens * P / t = on
        led.observe(batch, 2.0, False, int(off), 1.0 * 2.0)
    return led


def decisions(led: DraftLedger, batch: int, n: int) -> str:
    return "".join("P" if led.allows(batch) else "." for _ in range(n))


def test_where_proposing_lost_only_probes_propose():
    led = ledger_with(8, on=7, off=8)
    assert led.loses(8) is True
    probe = draft_price.LEDGER_PROBE
    assert decisions(led, 8, 2 * probe) == ("." * (probe - 1) + "P") * 2
    assert led.skipped == 2 * (probe - 1)


def test_a_batch_size_not_judged_yet_takes_a_loss_measured_below_it():
    led = ledger_with(5, on=7, off=8)
    assert led.loses(5) is True and led.loses(7) is True and led.loses(4) is None
    led.observe(6, 2.0, True, 9, 2.0)  # batch 6 measured once: not judged, still takes batch 5's loss
    assert led.loses(6) is True
    won = ledger_with(5, on=9, off=8)  # a win is not inherited: larger batch sizes are explored
    assert won.loses(5) is False and won.loses(7) is None
    ones = ledger_with(1, on=1, off=8)  # (batch 1 is never judged, nor passed on)
    assert ones.loses(3) is None


def test_where_proposing_won_plain_steps_are_rare_and_batch_1_is_never_judged():
    ahead = ledger_with(4, on=12, off=8)  # 1.5x the plain rate: clearly ahead
    rare = draft_price.LEDGER_EXPLORE_RARE
    assert ahead.loses(4) is False and decisions(ahead, 4, rare) == "P" * (rare - 1) + "."
    close = ledger_with(4, on=9, off=8)  # ahead, not clearly: explored more often
    every = draft_price.LEDGER_EXPLORE
    assert decisions(close, 4, every) == "P" * (every - 1) + "."
    unknown = DraftLedger()  # not judged yet: explored too, so that the plain rate gets measured
    assert unknown.loses(6) is None and decisions(unknown, 6, every) == "P" * (every - 1) + "."
    one = ledger_with(1, on=1, off=8)
    assert one.loses(1) is True and decisions(one, 1, 20) == "P" * 20  # batch 1: the gain rule alone


def test_token_positions_earlier_copies_are_the_comparisons():
    """TokenPositions.earlier (positions kept per token) gives the last token's earlier copies, most recent
    first, as comparing the whole text does, while the text grows, shrinks or is replaced; the lookup
    reading them finds the same candidates."""
    import random

    import numpy as np

    rng = random.Random(3)
    held = TokenPositions()
    tokens: list[int] = []
    texts = []
    for _ in range(60):
        tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        texts.append(tokens)
    texts += [tokens[:30], tokens[:10] + [9], [5] * 7, tokens]  # shorter, changed at its end, another's
    for text in texts:
        arr = np.asarray(text)
        want = np.flatnonzero(arr[:-1] == arr[-1])[::-1].tolist()
        held.sync(text)
        assert held.tokens == text and held.earlier() == want
        for m, c in ((1, 3), (3, 2)):
            assert proposers.ngram_candidates(text, 1, 4, m, c, earlier=held.earlier()) == \
                proposers.ngram_candidates(text, 1, 4, m, c)
    assert TokenPositions().earlier() == []


def test_a_batch_size_where_proposing_lost_looks_nothing_up_and_decodes_plain_greedy(
        spec_llm, encoded, reference, monkeypatch):
    """The default (measured curve, so the ledger is on) with batch 8 judged a loss: at batch 8 only the
    ledger's probes look up matches; the tokens are plain greedy's."""
    eng = make_engine(spec_llm, "speculative", depth_schedule="gain", verify_token_cost=None)
    proposer = eng.strategy.proposer
    assert proposer.ledger is not None
    on, off = draft_price._Rate(), draft_price._Rate()
    for _ in range(200):  # a strong record: plain steps 1e6x the proposing steps' rate
        on.add(1.0)
        off.add(1e6)
    proposer.ledger.on[8], proposer.ledger.off[8] = on, off
    lookups: list[int] = []  # the batch size of every lookup
    real_propose, real_lookup = proposer.propose, proposers.ngram_candidates
    batch = [0]
    monkeypatch.setattr(proposer, "propose", lambda seqs, d: batch.__setitem__(0, len(seqs)) or real_propose(seqs, d))
    monkeypatch.setattr(proposers, "ngram_candidates", lambda *a, **k: lookups.append(batch[0]) or real_lookup(*a, **k))
    assert run_engine(eng, encoded[:8], GREEDY) == reference[:8]
    asked = proposer.ledger.steps[8]  # decode steps at batch 8
    probes = asked // draft_price.LEDGER_PROBE
    assert asked > draft_price.LEDGER_PROBE and lookups.count(8) <= 8 * probes
    assert eng.strategy.metrics()["spec_decode_ledger_plain_steps"] == asked - probes


def test_the_proposer_is_handed_the_times_of_decode_only_steps(spec_llm, encoded, reference, monkeypatch):
    """observe_step: once per step in which every sequence decoded (none in prefill) and could draft, with
    the step's batch size and the tokens it committed."""
    eng = make_engine(spec_llm, "speculative", depth_schedule="gain", verify_token_cost=None)
    seen: list[tuple[int, int, float]] = []
    monkeypatch.setattr(eng.strategy.proposer, "observe_step", lambda b, t, s: seen.append((b, t, s)))
    ids = [eng.add_request(p, GREEDY) for p in encoded[:3]]
    expect: list[tuple[int, int]] = []
    while eng.has_unfinished():
        prompt = bool(eng.scheduler.waiting) or any(eng.scheduler.prefilling(s) for s in eng.scheduler.running)
        n = len(eng.scheduler.running)
        # (a sequence with one token of room left takes the plain path: that step proposes for fewer)
        room = min((GREEDY.max_tokens - s.num_output_tokens for s in eng.scheduler.running), default=0)
        outs = eng.step()
        if not prompt and room > 1:
            expect.append((n, sum(len(o.new_token_ids) for o in outs)))
    assert [eng.seqs[i].output_ids for i in ids] == reference[:3]
    assert [(b, t) for b, t, _ in seen] == expect and all(s > 0 for _, _, s in seen)


def test_the_gain_rule_takes_the_measured_price_in_a_batch_and_the_curve_s_at_batch_1():
    from ratchetlm.decoding.speculative.cost_curve import CostCurve
    from ratchetlm.decoding.speculative.gain import GainSchedule

    curve = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.05, 1.1, 1.4, 2.3, 4.1))
    measured, bare = GainSchedule(4, 8, curve, DraftPrice()), GainSchedule(4, 8, curve)
    for b in (1, 2):
        steps(measured.price, b, factor=6.0, fixed=0.5, n=300)  # drafts measured far dearer than the curve
    rec = measured.new_record()
    for _ in range(6):  # 3-token matches whose continuations agreed for 1 token
        rec.counts.add(3, 8, 1)
    assert measured.length(rec, 3, 8, 1) == bare.length(rec, 3, 8, 1) > 0  # batch 1: the curve's price
    assert bare.length(rec, 3, 8, 2) > 0 and measured.length(rec, 3, 8, 2) == 0  # batch 2: priced out
