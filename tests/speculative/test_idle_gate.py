"""The idle gate (decoding/speculative/idle_gate.py): once the gain rule has drafted nothing at a batch
size for a few steps, steps at that batch size take the plain path (no proposing, no successor-table
top-k) but for a periodic probe; the output stays plain greedy's, token for token."""

from __future__ import annotations

import pytest

from ratchetlm.decoding.speculative import proposers, tree_proposers
from ratchetlm.decoding.speculative.idle_gate import IdleGate

from .conftest import GREEDY, make_engine, run_engine


def decisions(gate: IdleGate, batch: int, steps: int, drafts: set[int] = frozenset()) -> str:
    """'P' for a step that proposed, '.' for a gated one; ``drafts``: steps whose proposing drafted."""
    out = ""
    for i in range(steps):
        if gate.open(batch):
            gate.observe(batch, i in drafts)
            out += "P"
        else:
            out += "."
    return out


def test_idle_steps_close_the_gate_but_for_a_probe_every_probe_steps():
    gate = IdleGate(patience=3, probe=4)
    assert decisions(gate, 8, 14) == "PPP" + "...P" + "...P" + "..."
    assert gate.skipped == 9


def test_a_draft_reopens_the_gate_and_batch_sizes_are_separate():
    gate = IdleGate(patience=2, probe=3)
    # the probe at step 4 drafts: the count starts over (two more idle steps before it closes again)
    assert decisions(gate, 8, 10, drafts={4}) == "PP..P" + "PP..P"
    assert decisions(gate, 3, 3, drafts={0, 1, 2}) == "PPP"  # batch 3 drafts: never gated
    assert gate.open(8) is False and gate.open(3) is True


def test_batches_below_from_batch_always_propose():
    gate = IdleGate(patience=2, probe=3, from_batch=2)
    assert decisions(gate, 1, 8) == "PPPPPPPP" and gate.skipped == 0  # alone: never gated
    assert decisions(gate, 2, 5) == "PP..P"  # from two sequences on: as before


def test_the_default_alone_looks_up_every_step(spec_llm, encoded, reference, monkeypatch):
    """At batch 1 no draft can pay here either, but a lookup costs ~0.1 ms: the n-gram gate never closes
    alone (from_batch 2), so every decode step looks up a match; the same tokens as plain greedy."""
    lookups: list[int] = []
    real = proposers.ngram_candidates
    monkeypatch.setattr(proposers, "ngram_candidates", lambda *a, **k: lookups.append(1) or real(*a, **k))
    eng = make_engine(spec_llm, "speculative", depth_schedule="gain", verify_token_cost=1.0)
    assert run_engine(eng, encoded[:1], GREEDY) == reference[:1]
    m = eng.strategy.metrics()
    assert m["spec_decode_num_drafts"] == 0 and m["spec_decode_idle_plain_steps"] == 0
    # every decode step looked up but the last (one token of room left: nothing to draft)
    assert len(lookups) == len(reference[0]) - 2


def test_hybrid_at_batch_8_with_no_draft_that_pays_is_plain(spec_llm, encoded, reference, monkeypatch):
    """Every verified row priced at a whole forward: no draft can pay. In a batch the hybrid drafts the
    n-gram method's chains (tree_proposers.CHAINS_FROM), so at batch 8 it builds no tree and takes no
    successor-table top-k at all, and after the chains' gate's patience it stops looking up matches too;
    the same tokens as plain greedy."""
    builds: list[int] = []  # the batch size of every tree built
    real = tree_proposers.build
    monkeypatch.setattr(tree_proposers, "build", lambda *a, **k: builds.append(a[7]) or real(*a, **k))
    lookups: list[int] = []
    real_lookup = proposers.ngram_candidates
    monkeypatch.setattr(proposers, "ngram_candidates", lambda *a, **k: lookups.append(1) or real_lookup(*a, **k))
    eng = make_engine(spec_llm, "speculative", method="hybrid", depth_schedule="gain", verify_token_cost=1.0)
    proposer = eng.strategy.proposer
    assert proposer.chains is not None
    events: list[int | str] = []  # per step, in order: the batch proposed for, then "top-k" if taken
    real_propose, real_observe = proposer.propose, proposer.observe_logits
    monkeypatch.setattr(proposer, "propose", lambda seqs, d: events.append(len(seqs)) or real_propose(seqs, d))
    monkeypatch.setattr(proposer, "observe_logits", lambda t, lg: events.append("top-k") or real_observe(t, lg))
    assert run_engine(eng, encoded[:8], GREEDY) == reference[:8]
    m = eng.strategy.metrics()
    gate = proposer.chains.gate
    assert m["spec_decode_num_drafts"] == 0 and 8 in events
    assert not [b for b in builds if b >= tree_proposers.CHAINS_FROM]  # no tree in a batch
    assert all(b != "top-k" for a, b in zip(events, events[1:], strict=False)
               if isinstance(a, int) and a >= tree_proposers.CHAINS_FROM)  # nor a top-k taken
    assert m["spec_decode_chain_steps"] == sum(isinstance(e, int) and e >= tree_proposers.CHAINS_FROM for e in events)
    assert m["spec_decode_idle_plain_steps"] == gate.skipped + proposer.gate.skipped and gate.skipped > 0
    assert len(lookups) == 8 * (gate.idle[8] - gate.skipped)  # lookups only in the steps at 8 that proposed


def test_default_at_batch_8_with_no_draft_that_pays_is_plain(spec_llm, encoded, reference, monkeypatch):
    """The default (n-gram, gain schedule) likewise stops looking up matches at a batch size where
    none was worth drafting."""
    lookups: list[int] = []
    real = proposers.ngram_candidates
    monkeypatch.setattr(proposers, "ngram_candidates", lambda *a, **k: lookups.append(1) or real(*a, **k))
    eng = make_engine(spec_llm, "speculative", depth_schedule="gain", verify_token_cost=1.0)
    assert eng.strategy.cfg.method == "ngram"
    assert run_engine(eng, encoded[:8], GREEDY) == reference[:8]
    m = eng.strategy.metrics()
    gate = eng.strategy.proposer.gate
    assert m["spec_decode_num_drafts"] == 0 and m["spec_decode_idle_plain_steps"] == gate.skipped > 0
    assert len(lookups) == 8 * (gate.idle[8] - gate.skipped)


@pytest.mark.parametrize("method", ["ngram", "hybrid"])
def test_batch_8_with_the_measured_curve_equals_plain(spec_llm, encoded, reference, method):
    eng = make_engine(spec_llm, "speculative", method=method, depth_schedule="gain", verify_token_cost=None)
    assert run_engine(eng, encoded[:8], GREEDY) == reference[:8]
