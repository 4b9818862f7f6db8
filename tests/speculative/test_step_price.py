"""The draft price measured from the engine's own steps (step_price.py), against hand-computed lines."""

from __future__ import annotations

import pytest

from ratchetlm.decoding.speculative.cost_curve import CostCurve
from ratchetlm.decoding.speculative.gain import GainSchedule, draft_value
from ratchetlm.decoding.speculative.step_price import MIN_STEPS, StepPrice

CURVE = CostCurve((1, 2, 4, 8, 16), (1.0, 1.0, 1.0, 1.2, 2.0))  # a probe that reads small drafts as free
PLAIN_S = 0.010


def _feed(price: StepPrice, batch: int, a: float, b: float, xs: list[int], drafting_seqs: int = 1) -> None:
    """Plain steps of PLAIN_S and drafting steps that cost exactly 1 + a + b x plain steps."""
    for _ in range(MIN_STEPS):
        price.observe(batch, batch, 0, PLAIN_S)
    for x in xs:  # x = drafted rows + one per drafting sequence
        price.observe(batch, batch + x - drafting_seqs, drafting_seqs, PLAIN_S * (1 + a + b * x))


def test_the_curve_prices_drafts_until_both_kinds_of_step_were_seen():
    price = StepPrice(CURVE, adaptive=True)
    assert price.step_cost(1, 0) == 1.0 and price.step_cost(1, 7) == pytest.approx(CURVE(8))
    for x in (2, 3, 4, 5):  # drafting steps only: no plain time to compare them with
        price.observe(1, x, 1, 0.05)
    assert price.fitted == {}
    for _ in range(MIN_STEPS - 1):
        price.observe(1, 1, 0, PLAIN_S)
    assert price.fitted == {}  # one plain step short
    price.observe(1, 1, 0, PLAIN_S)
    assert 1 in price.fitted


def test_the_fit_recovers_the_line_the_steps_cost():
    price = StepPrice(CURVE, adaptive=True)
    _feed(price, 1, a=0.15, b=0.08, xs=[2, 3, 3, 5, 9, 4])
    a, b = price.fitted[1]
    assert a == pytest.approx(0.15) and b == pytest.approx(0.08)
    assert price.step_cost(1, 3) == pytest.approx(1.39)
    # a 2-token draft at batch 1 adds D(3) - D(0) plain steps (= one-row forwards at batch 1)
    assert price.extra(1, 0, 2) == pytest.approx(0.39)
    assert draft_value(2.0, 2, price, 1) == pytest.approx(2.0 / 1.39)
    assert price.metrics() == {"spec_decode_draft_step_overhead": pytest.approx(0.15),
                               "spec_decode_draft_row_cost": pytest.approx(0.08)}
    # at batch 4 with 5 row-equivalents drafted before it: the line's slope only, in the curve's unit
    other = StepPrice(CURVE, adaptive=True)
    _feed(other, 4, a=0.2, b=0.05, xs=[2, 6, 10], drafting_seqs=2)
    assert other.extra(4, 5, 2) == pytest.approx(CURVE(4) * 0.05 * 3)
    assert other.extra(4, 0, 2) == pytest.approx(CURVE(4) * (0.2 + 0.05 * 3))  # the first draft pays a


def test_one_stalled_step_barely_moves_the_fit():
    price = StepPrice(CURVE, adaptive=True)
    _feed(price, 1, a=0.1, b=0.1, xs=[2, 2, 2, 4, 4, 4])
    price.observe(1, 4, 1, PLAIN_S * 10)  # x = 4 (3 drafted + 1), a step that stalled (another process, a GC pause)
    a, b = price.fitted[1]
    assert a == pytest.approx(0.1) and b == pytest.approx(0.1)  # the median of x = 4 is unchanged
    price.observe(1, 1, 0, PLAIN_S * 10)  # a stalled plain step does not move the plain median
    assert price.fitted[1] == pytest.approx((0.1, 0.1))


def test_drafts_of_one_length_take_the_slope_from_the_curve():
    price = StepPrice(CURVE, adaptive=True)
    _feed(price, 1, a=0.3, b=0.0, xs=[5, 5, 5, 5])  # each step 1.3 plain steps, all x = 5
    slope = (CURVE(9) - CURVE(1)) / 8
    a, b = price.fitted[1]
    assert b == pytest.approx(slope) and a == pytest.approx(0.3 - 5 * slope)


def test_a_fixed_price_measures_nothing():
    price = StepPrice(CostCurve.linear(0.2))  # verify_token_cost=0.2: draft lengths must not depend on timing
    _feed(price, 1, a=2.0, b=2.0, xs=[2, 3, 4])
    assert price.fitted == {} and price.plain == {} and price.metrics() == {}
    assert draft_value(2.0, 2, price, 3) == draft_value(2.0, 2, 0.2, 3)


def test_measured_steps_change_what_the_schedule_drafts():
    """The probe above says 2-4 rows are free; the engine's steps say a 1-token draft's step costs 1.6
    plain steps: a continuation whose first token is right half the time is drafted on the curve, not on
    the measurement."""
    def schedule(price: StepPrice) -> int:
        g = GainSchedule(4, 6, price)
        rec = g.new_record()
        for agreed in [1, 0] * 10:  # first token right half the time, never the second
            rec.counts.add(2, 6, agreed)
            g.totals.add(2, 6, agreed)
        return g.length(rec, 2, 6, batch=1)

    assert schedule(StepPrice(CURVE, adaptive=True)) >= 1  # free rows: even the second token's small chance
    measured = StepPrice(CURVE, adaptive=True)
    _feed(measured, 1, a=0.4, b=0.1, xs=[2, 3, 4, 5])
    assert schedule(measured) == 0  # 1.5 tokens expected from a 1-token draft, for 1.6 plain steps


def test_the_engine_times_its_decoding_steps(spec_llm, encoded):
    """Every step of decoding sequences is timed with its shape, none with prefill rows in it; a
    fixed verify_token_cost times nothing."""
    from .conftest import GREEDY, make_engine, run_engine

    eng = make_engine(spec_llm, "speculative", method="ngram", depth=4, depth_schedule="gain",
                      verify_token_cost=None)
    price = eng.strategy.proposer.gain.cost
    seen: list[tuple[int, int, int, float]] = []
    observe = price.observe
    price.observe = lambda *a: (seen.append(a), observe(*a))[1]  # type: ignore[method-assign]
    run_engine(eng, encoded[:2], GREEDY)
    prefills = 1  # both short prompts prefill in the first step; a step with prefill rows is not timed
    assert len(seen) == eng.stats.steps - prefills > 0
    assert all(b in (1, 2) and r >= b and s > 0 for b, r, _, s in seen)
    assert any(n == 0 for _, _, n, _ in seen)  # plain steps (after the prompts, before matches)
    fixed = make_engine(spec_llm, "speculative", method="ngram", depth=4, depth_schedule="gain",
                        verify_token_cost=0.1)
    run_engine(fixed, encoded[:1], GREEDY)
    assert fixed.strategy.proposer.gain.cost.plain == {} and fixed.strategy.proposer.gain.cost.drafting == {}
