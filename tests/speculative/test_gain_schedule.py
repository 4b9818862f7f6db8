"""The gain depth schedule's bookkeeping and choice, against hand-computed expectations."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ratchetlm.decoding.speculative.cost_curve import CostCurve
from ratchetlm.decoding.speculative.gain import GainSchedule, PendingContinuation, draft_value
from ratchetlm.decoding.speculative.proposers import NgramProposer


def test_continuations_are_judged_once_the_output_has_passed_them():
    g = GainSchedule(max_n=4, depth=3, verify_token_cost=0.1)
    rec = g.new_record()
    rec.pending = [
        PendingContinuation(start=2, m=2, tokens=[3, 4, 9]),  # agrees for 2, then a mismatch
        PendingContinuation(start=3, m=1, tokens=[4, 5, 6]),  # agrees so far, output too short to tell
        PendingContinuation(start=1, m=4, tokens=[2, 3]),  # agrees entirely
        PendingContinuation(start=4, m=1, tokens=[7]),  # wrong at once
    ]
    g.judge(rec, [1, 2, 3, 4, 5])
    assert [p.start for p in rec.pending] == [3]  # still undecided
    c = rec.counts
    assert c.tries[2] == [0, 1, 1, 1] and c.hits[2] == [0, 1, 1, 0]
    assert c.tries[4] == [0, 1, 1, 0] and c.hits[4] == [0, 1, 1, 0]
    assert c.tries[1] == [0, 1, 0, 0] and c.hits[1] == [0, 0, 0, 0]
    assert g.totals.tries == c.tries and g.totals.hits == c.hits
    g.judge(rec, [1, 2, 3, 4, 5, 6])  # now the m=1 continuation agreed entirely
    assert rec.pending == [] and c.hits[1] == [0, 1, 1, 1]


def _record_with(g: GainSchedule, m: int, agreed: int, times: int):
    rec = g.new_record()
    for _ in range(times):
        rec.counts.add(m, g.depth, agreed)
        g.totals.add(m, g.depth, agreed)
    return rec


def test_agreement_estimate_is_the_shrunk_running_product():
    g = GainSchedule(max_n=2, depth=2, verify_token_cost=0.1)
    rec = _record_with(g, m=1, agreed=1, times=2)  # position 1: 2/2 agreed, position 2: 0/2
    glob1, glob2 = 3 / 4, 1 / 4  # Beta(1, 1) on the strategy-wide counts
    q1, q2 = (2 + 2 * glob1) / 4, (0 + 2 * glob2) / 4
    assert g.agreement(rec, 1) == pytest.approx(np.array([q1, q1 * q2]))


def test_length_follows_the_evidence_and_the_batch():
    g = GainSchedule(max_n=4, depth=6, verify_token_cost=0.1)
    never = _record_with(g, m=1, agreed=0, times=20)
    assert g.length(never, 1, 6, batch=1) == 0  # 1-token matches never agreed: plain steps
    g4 = GainSchedule(4, 6, 0.1)
    always = _record_with(g4, m=4, agreed=6, times=20)
    assert g4.length(always, 4, 6, batch=1) == 6  # 4-token matches always agreed: the whole depth
    assert g4.length(always, 4, 3, batch=1) == 3  # never past the room the strategy allows
    half = _record_with(g4, m=2, agreed=1, times=10)  # first token right half the time, second never
    for _ in range(10):
        half.counts.add(2, 6, 0)
    assert g4.length(half, 2, 6, batch=1) == 1
    assert g4.length(half, 2, 6, batch=8) == 0  # in a big batch the same draft does not pay
    free = GainSchedule(4, 6, 0.0)  # verify tokens cost nothing (a GPU): any chance is worth a draft
    assert free.length(free.new_record(), 1, 6, batch=1) == 6


def test_auto_schedule_is_gain_where_it_applies():
    from ratchetlm.decoding.speculative.config import SpecConfig

    assert SpecConfig().method == "ngram" and SpecConfig().depth_schedule == "gain"  # the default
    for method in ("hybrid", "eagle", "recycling", "suffix"):
        assert SpecConfig(method=method).depth_schedule == "gain"
    assert SpecConfig(method="draft").depth_schedule == "constant"
    assert SpecConfig(method="ngram", depth_schedule="constant").depth_schedule == "constant"


def test_a_proposal_repeated_from_the_same_state_is_recorded_once(spec_llm):
    """Fault isolation re-runs a discarded step from the same committed state: the continuation
    it proposed is recorded once, so it is judged (and counted in the shared totals) once."""
    from types import SimpleNamespace

    from ratchetlm.decoding.speculative.proposers import _GAIN
    from ratchetlm.sampling_params import SamplingParams
    from ratchetlm.sequence import Sequence

    cfg = SimpleNamespace(num_candidates=1, min_n=1, max_n=4, depth=4, depth_schedule="gain", verify_token_cost=0.1)
    prop = NgramProposer(cfg, ctx=None)
    seq = Sequence(0, [5, 6, 7, 8, 5, 6], 6, SamplingParams(max_tokens=8))
    prop.propose([seq], [4])
    prop.propose([seq], [4])  # the same step again
    assert [(p.start, p.tokens) for p in seq.strategy_state[_GAIN].pending] == [(6, [7, 8, 5, 6])]
    seq.token_ids += [7, 8, 5, 6]
    prop.propose([seq], [4])
    assert prop.gain.totals.tries[2] == [0, 1, 1, 1, 1]  # one judged continuation, not two


def test_cost_curve_interpolates_and_the_constant_model_is_a_line():
    from ratchetlm.decoding.speculative.cost_curve import CostCurve, from_times

    c = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.3, 2.1))
    assert c(1) == 1.0 and c(3) == pytest.approx(1.2) and c(6) == pytest.approx(1.7)
    assert c(12) == pytest.approx(2.9)  # past the last point: the last segment's slope (0.2 per row)
    lin = CostCurve.linear(0.09)
    assert lin(1) == 1.0 and lin(9) == pytest.approx(1.72)
    # measured times: ratios to one row, never decreasing (a noisy 4-row run must not look cheaper)
    assert from_times((1, 2, 4), [2.0, 2.4, 2.2]).cost == (1.0, 1.2, 1.2)
    assert from_times((1, 2, 4), [1.0, 5.0, 9.0]).cost == (1.0, 2.0, 4.0)  # never over R one-row forwards


def test_draft_value_prices_rows_on_the_curve():
    from ratchetlm.decoding.speculative.cost_curve import CostCurve
    from ratchetlm.decoding.speculative.gain import draft_value

    # the constant model reproduces the old formula: share = (1 + c (B - 1)) / B, a draft adds c (d + 1)
    c = 0.1
    for batch in (1, 3, 8):
        share = (1 + c * (batch - 1)) / batch
        assert draft_value(1.0, 0, c, batch) == pytest.approx(1.0 / share)
        assert draft_value(2.5, 3, c, batch) == pytest.approx(2.5 / (share + c * 4))
    curve = CostCurve((1, 2, 4, 8, 16), (1.0, 1.05, 1.1, 1.5, 2.7))
    # batch 2, 3 drafts after 4 rows drafted by earlier sequences: rows 6 -> 10 cost C(10) - C(6)
    share = curve(2) / 2
    assert draft_value(3.0, 3, curve, 2, drafted=4) == pytest.approx(3.0 / (share + curve(10) - curve(6)))
    assert draft_value(3.0, 3, curve, 2, drafted=4) < draft_value(3.0, 3, curve, 2)  # later rows cost more here


def test_gain_schedule_drafts_by_the_curve():
    from ratchetlm.decoding.speculative.cost_curve import CostCurve

    flat = GainSchedule(4, 6, CostCurve((1, 32), (1.0, 1.0)))  # rows are free (a GPU, memory bound)
    steep = GainSchedule(4, 6, CostCurve((1, 2, 32), (1.0, 1.9, 28.0)))  # every row ~ a whole forward
    for g in (flat, steep):
        rec = _record_with(g, m=3, agreed=2, times=20)  # the first two tokens always right, the third never
        g.rec = rec  # type: ignore[attr-defined]
    assert flat.length(flat.rec, 3, 6, batch=1) == 6  # type: ignore[attr-defined]
    assert steep.length(steep.rec, 3, 6, batch=1) == 0  # type: ignore[attr-defined]
    kink = GainSchedule(4, 6, CostCurve((1, 4, 5, 32), (1.0, 1.05, 2.0, 30.0)))  # cheap up to 4 rows, then dear
    rec = _record_with(kink, m=4, agreed=6, times=20)
    assert kink.length(rec, 4, 6, batch=1) == 2  # 1 + 2 drafts + 1 = 4 rows: the longest draft before the kink


def test_length_is_the_best_draft_value_over_every_length():
    """GainSchedule.length prices every length at once: the same choice as draft_value length by length
    (ties to the shorter; in a batch a draft must beat the plain step by MARGIN), on curves, batches, earlier drafts
    and evidence drawn at random."""
    from ratchetlm.decoding.speculative.cost_curve import CostCurve
    from ratchetlm.decoding.speculative.gain import MARGIN, draft_value

    rng = np.random.default_rng(0)
    for trial in range(300):
        rows = (1, 2, 4, 8, 16, 32)
        steps = rng.choice([0.0, 0.02, 0.3, 1.5], size=5)
        curve = CostCurve(rows, tuple(np.concatenate([[1.0], 1.0 + np.cumsum(steps * np.diff(rows))])))
        g = GainSchedule(4, 8, curve)
        m, agreed = int(rng.integers(1, 5)), int(rng.integers(0, 9))
        rec = _record_with(g, m=m, agreed=agreed, times=int(rng.integers(0, 12)))
        max_depth, batch, drafted = int(rng.integers(0, 9)), int(rng.integers(1, 12)), int(rng.integers(0, 40))
        gain = 1.0 + np.concatenate([[0.0], np.cumsum(g.agreement(rec, m)[:max_depth])])
        values = [draft_value(float(x), d, curve, batch, drafted) * (1.0 + MARGIN if d == 0 and batch > 1 else 1.0)
                  for d, x in enumerate(gain)]
        assert g.length(rec, m, max_depth, batch, drafted) == int(np.argmax(values)), trial


def test_long_contexts_price_every_row_s_attention():
    """Each verified row reads the sequence's cached context: ``share`` grows by ``first_token * L`` and a
    draft of d tokens by ``d * row_token * L`` (draft_value and length agree); a draft that pays after
    100 cached tokens is shortened after 1,500 and dropped after 20,000."""
    from ratchetlm.decoding.speculative.cost_curve import CostCurve
    from ratchetlm.decoding.speculative.gain import draft_value

    curve = CostCurve((1, 2, 4, 8, 16), (1.0, 1.02, 1.15, 1.5, 2.6), first_token=3e-4, row_token=2e-4)
    bare = CostCurve(curve.rows, curve.cost)
    share = 1.0 + 3e-4 * 1500
    assert draft_value(2.0, 0, curve, 1, context=1500) == pytest.approx(2.0 / share)
    assert draft_value(2.5, 3, curve, 1, context=1500) == pytest.approx(2.5 / (share + curve(5) - curve(1) + 3 * 0.3))
    assert draft_value(2.5, 3, curve, 1, context=0) == draft_value(2.5, 3, bare, 1)
    g = GainSchedule(4, 8, curve)
    rec = _record_with(g, m=2, agreed=0, times=2)  # two continuations wrong at once, two right throughout
    for _ in range(2):
        rec.counts.add(2, 8, 8)
        g.totals.add(2, 8, 8)
    lengths = [g.length(rec, 2, 8, 1, context=n) for n in (100, 1500, 20000)]
    assert lengths == [6, 3, 0], lengths  # each length the argmax below
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(g.agreement(rec, 2)[:8])])
    free = GainSchedule(4, 8, bare)
    free.totals = g.totals  # the same evidence
    for n in (100, 1500, 20000):
        best = int(np.argmax([draft_value(float(x), d, curve, 1, 0, n) for d, x in enumerate(gain)]))
        assert g.length(rec, 2, 8, 1, context=n) == best
        assert free.length(rec, 2, 8, 1, context=n) == free.length(rec, 2, 8, 1)  # no terms: context is free


def test_context_terms_are_measured_on_the_real_path(spec_llm):
    """The probe times forwards over cached context (the runner's cache): a row reading 1,024 cached
    tokens costs more than one reading none. (Each further row's term is small beside a loaded
    machine's noise, so here it is only checked to be sane; its arithmetic is the next test's.)"""
    import time

    from ratchetlm.decoding.speculative import cost_curve

    model, cache = spec_llm.engine.model, spec_llm.engine.runner.cache
    base = cost_curve.CostCurve.linear(0.1)
    c = cost_curve.context_terms(model, torch.device("cpu"), cache, base, rows=16, repeats=5,
                                   clock=time.process_time)
    assert (c.rows, c.cost) == (base.rows, base.cost)
    assert 0 < c.first_token < 0.01 and 0 <= c.row_token < 0.01, c


def test_context_terms_recover_a_known_cost_model(monkeypatch):
    """Forwards timed as 1 + 0.1 (R - 1) + L (0.002 + 0.0005 (R - 1)) one-row units (R rows over L cached
    tokens): the probe reads back 0.002 for the first row's cached token and 0.0005 for each further
    row's."""
    from ratchetlm.decoding.speculative import cost_curve

    def fake_seconds(model, device, rows, repeats=2, probe_layers=None, clock=None, cache=None, context=0):
        return 1 + 0.1 * (rows - 1) + context * (0.002 + 0.0005 * (rows - 1))

    monkeypatch.setattr(cost_curve, "seconds", fake_seconds)
    cache = SimpleNamespace(num_slots=4096)
    c = cost_curve.context_terms(None, torch.device("cpu"), cache, cost_curve.CostCurve.linear(0.1))
    assert c.first_token == pytest.approx(0.002) and c.row_token == pytest.approx(0.0005)


def test_a_step_prices_each_draft_after_the_rows_drafted_before_it():
    """Rows are cheap up to 5 here and dear beyond: at batch 2 the first sequence drafts the 2 tokens
    that still fit (2 rows + 2 drafts + 1), the second, priced after them, drafts nothing."""
    from types import SimpleNamespace

    from ratchetlm.decoding.speculative.cost_curve import CostCurve
    from ratchetlm.sampling_params import SamplingParams
    from ratchetlm.sequence import Sequence

    cfg = SimpleNamespace(num_candidates=1, min_n=1, max_n=4, depth=4, depth_schedule="gain", verify_token_cost=0.0)
    prop = NgramProposer(cfg, ctx=None)
    prop.gain = GainSchedule(4, 4, CostCurve((1, 5, 6, 32), (1.0, 1.0, 3.0, 55.0)))
    for _ in range(50):  # 4-token matches have always agreed: a fresh sequence expects ~4 right tokens
        prop.gain.totals.add(4, 4, 4)
    seqs = [Sequence(i, [5, 6, 7, 8, 9, 5, 6, 7, 8], 9, SamplingParams(max_tokens=8)) for i in range(2)]
    first, second = prop.propose(seqs, [4, 4])
    assert first is not None and first.tree is not None and first.tree.tokens == [9, 5]
    assert second is None and prop.gain_skipped == 1
    alone, = prop.propose(seqs[1:], [4])  # alone at batch 1 it fits 1 + 3 + 1 rows
    assert alone is not None and alone.tree is not None and alone.tree.tokens == [9, 5, 6]


def test_measured_curve_is_taken_once_per_model_and_thread_count(spec_llm):
    from ratchetlm.decoding.speculative import cost_curve

    model = spec_llm.engine.model
    c = cost_curve.measured(model)
    assert c.rows == cost_curve.ROWS and c.cost[0] == 1.0 and list(c.cost) == sorted(c.cost)
    assert c.cost[-1] > 1.0  # 32 rows cost more than one on a CPU
    assert cost_curve.measured(model) is c  # kept for the process

    class Other:  # not a Llama-shaped stack (DeepSeek-V4): no probe, the constant model
        tp = type("TP", (), {"size": 1})()
    assert cost_curve.measured(Other(), fallback=0.2) == cost_curve.CostCurve.linear(0.2)


def test_default_schedule_reads_the_measured_curve(spec_llm):
    from ratchetlm.decoding.speculative import cost_curve
    from ratchetlm.decoding.speculative.config import SpecConfig
    from ratchetlm.decoding.speculative.proposers import verify_cost

    assert SpecConfig().verify_token_cost is None
    ctx = type("Ctx", (), {"runner": spec_llm.engine.runner})()
    assert verify_cost(SpecConfig(), ctx) is cost_curve.measured(spec_llm.engine.model)
    assert verify_cost(SpecConfig(verify_token_cost=0.2), ctx) == cost_curve.CostCurve.linear(0.2)
    assert NgramProposer(SpecConfig(method="ngram"), ctx).gain.cost is cost_curve.measured(spec_llm.engine.model)
    from ratchetlm.decoding.speculative.tree_proposers import HybridProposer

    assert HybridProposer(SpecConfig(), ctx).costs.cost is cost_curve.measured(spec_llm.engine.model)


def test_greedy_text_is_plain_greedy_whatever_the_curve(spec_llm, encoded, reference):
    """The curve changes how much is drafted, never the text: the measured curve (the default),
    free rows (every match drafted to full depth) and a curve that turns dear after 16 rows (the
    11 prompts' batch leaves room for a few drafts) all give plain greedy's tokens, batched."""
    from ratchetlm.decoding.speculative.cost_curve import CostCurve, measured

    from .conftest import GREEDY, make_engine, run_engine

    curves = {"measured": None, "free": CostCurve((1, 32), (1.0, 1.0)),
              "kink": CostCurve((1, 16, 17, 32), (1.0, 1.05, 2.0, 17.0))}
    drafted = {}
    for name, c in curves.items():
        eng = make_engine(spec_llm, "speculative", method="ngram", depth=6, depth_schedule="gain",
                          verify_token_cost=None)
        gain = eng.strategy.proposer.gain
        assert gain.cost is measured(spec_llm.engine.model)  # the default reads the measured curve
        if c is not None:
            gain.cost = c
        assert run_engine(eng, encoded, GREEDY) == reference, name
        drafted[name] = eng.strategy.metrics()["spec_decode_num_draft_tokens"]
    assert drafted["free"] > drafted["kink"] > 0  # not vacuous: both drafted, the cheap curve more


def test_the_probe_times_the_path_the_engines_forwards_take(monkeypatch):
    """In the integer modes a forward of a few rows runs through the decode chain once every layer's
    weights are packed; the probe must time that path, not the layer-by-layer one (whose Python
    overhead made a one-row forward look dearer and every draft cheaper)."""
    from ratchetlm import LLM
    from ratchetlm.decoding.speculative import cost_curve
    from ratchetlm.models.decode_chain import DecodeChain

    llm = LLM(progress=False, numerics="int16", kv_cache_blocks=16)  # a fresh model: nothing packed yet
    probes: list[int] = []
    run = DecodeChain.run
    monkeypatch.setattr(DecodeChain, "run", lambda self, x, cs, b, n: probes.append(n) or run(self, x, cs, b, n))
    cost_curve.curve(llm.engine.model, torch.device("cpu"), rows=(1, 2), repeats=1)
    # every probe forward (a warm-up and a timed run per row count) of PROBE_LAYERS layers took the chain
    assert probes.count(cost_curve.PROBE_LAYERS) == 4


def test_a_draft_heads_own_forwards_are_priced_per_drafted_token():
    """``drafting``: what making the draft cost (an EAGLE head's forwards), added to the step's price.
    A one-token draft right 30% of the time pays when drafting is free and not at 0.2 of a step a token
    (the EAGLE proposer passes HEAD_COST per drafted token)."""
    line = CostCurve.linear(0.1)  # every row after the first costs 0.1 of a one-row forward
    # one drafted token: two more rows (the draft and a step's staging, one row's worth)
    assert draft_value(1.3, 1, line, 1) == pytest.approx(1.3 / (1 + 0.2))
    assert draft_value(1.3, 1, line, 1, drafting=0.2) == pytest.approx(1.3 / (1 + 0.2 + 0.2))
    plain = draft_value(1.0, 0, line, 1, drafting=0.2)  # a plain step makes no draft
    assert plain == pytest.approx(1.0)
    assert draft_value(1.3, 1, line, 1) > plain > draft_value(1.3, 1, line, 1, drafting=0.2)
