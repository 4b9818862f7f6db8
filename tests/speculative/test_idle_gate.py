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


def test_hybrid_at_batch_8_with_no_draft_that_pays_is_plain(spec_llm, encoded, reference, monkeypatch):
    """Every verified row priced at a whole forward: no tree can pay, so after the gate's patience
    the hybrid neither builds trees nor takes the successor table's top-k, and decodes the same
    tokens as plain greedy."""
    builds: list[int] = []  # the batch size of every tree built
    real = tree_proposers.build
    monkeypatch.setattr(tree_proposers, "build", lambda *a, **k: builds.append(a[7]) or real(*a, **k))
    eng = make_engine(spec_llm, "speculative", method="hybrid", depth_schedule="gain", verify_token_cost=1.0)
    proposer = eng.strategy.proposer
    gate = proposer.gate
    events: list[str] = []  # per step, in order: the gate's answer ("open" / "gated"), then "top-k" if taken
    real_open, real_observe = gate.open, proposer.observe_logits
    monkeypatch.setattr(gate, "open",
                        lambda b: events.append("open" if real_open(b) else "gated") or events[-1] == "open")
    monkeypatch.setattr(proposer, "observe_logits", lambda t, lg: events.append("top-k") or real_observe(t, lg))
    assert run_engine(eng, encoded[:8], GREEDY) == reference[:8]
    m = eng.strategy.metrics()
    assert m["spec_decode_num_drafts"] == 0
    assert m["spec_decode_idle_plain_steps"] == gate.skipped == events.count("gated") > 0
    proposed_at_8 = gate.idle[8] - gate.skipped  # steps at batch 8 that proposed: patience, then probes
    assert proposed_at_8 == events.count("open") == gate.patience + (gate.skipped >= gate.probe - 1)
    assert builds.count(8) == 8 * proposed_at_8  # no tree built on a gated step
    assert all(b != "top-k" for a, b in zip(events, events[1:], strict=False) if a == "gated")  # nor a top-k taken
    assert events.count("top-k") >= 1 + proposed_at_8  # (prefill's step, every proposing step)


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
