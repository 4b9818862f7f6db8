"""The gain depth schedule's bookkeeping and choice, against hand-computed expectations."""

from __future__ import annotations

import numpy as np
import pytest

from ratchetlm.decoding.speculative.gain import GainSchedule, PendingContinuation


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
    assert c.tries[2].tolist() == [0, 1, 1, 1] and c.hits[2].tolist() == [0, 1, 1, 0]
    assert c.tries[4].tolist() == [0, 1, 1, 0] and c.hits[4].tolist() == [0, 1, 1, 0]
    assert c.tries[1].tolist() == [0, 1, 0, 0] and c.hits[1].tolist() == [0, 0, 0, 0]
    assert (g.totals.tries == c.tries).all() and (g.totals.hits == c.hits).all()
    g.judge(rec, [1, 2, 3, 4, 5, 6])  # now the m=1 continuation agreed entirely
    assert rec.pending == [] and c.hits[1].tolist() == [0, 1, 1, 1]


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

    assert SpecConfig().depth_schedule == "gain"  # n-gram by default
    assert SpecConfig(method="eagle").depth_schedule == "gain"
    assert SpecConfig(method="draft").depth_schedule == "constant"
    assert SpecConfig(method="ngram", depth_schedule="constant").depth_schedule == "constant"


def test_a_proposal_repeated_from_the_same_state_is_recorded_once(spec_llm):
    """Fault isolation re-runs a discarded step from the same committed state: the continuation
    it proposed is recorded once, so it is judged (and counted in the shared totals) once."""
    from types import SimpleNamespace

    from ratchetlm.decoding.speculative.proposers import _GAIN, NgramProposer
    from ratchetlm.engine.sequence import Sequence
    from ratchetlm.sampling_params import SamplingParams

    cfg = SimpleNamespace(num_candidates=1, min_n=1, max_n=4, depth=4, depth_schedule="gain", verify_token_cost=0.1)
    prop = NgramProposer(cfg, ctx=None)
    seq = Sequence(0, [5, 6, 7, 8, 5, 6], 6, SamplingParams(max_tokens=8))
    prop.propose([seq], [4])
    prop.propose([seq], [4])  # the same step again
    assert [(p.start, p.tokens) for p in seq.strategy_state[_GAIN].pending] == [(6, [7, 8, 5, 6])]
    seq.token_ids += [7, 8, 5, 6]
    prop.propose([seq], [4])
    assert prop.gain.totals.tries[2].tolist() == [0, 1, 1, 1, 1]  # one judged continuation, not two
