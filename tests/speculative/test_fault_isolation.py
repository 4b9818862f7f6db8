"""Fault isolation under speculative decoding (issue 12): a request whose step raises mid-decoding
fails alone, and every other request — greedy or seeded sampling — commits exactly what it commits
in a clean run. A discarded step must leave no trace in the strategy's per-sequence state (draft
depth, gain records, leftover chains): with seeded sampling a different draft draws differently."""

from __future__ import annotations

import pytest

from ratchetlm.sampling_params import SamplingParams

from .conftest import make_engine

POISON_SEED = 9191
# The fault fires once the poisoned request has 6 tokens; the others then decode ~10 more after the
# discarded step, where any trace it left (another draft depth, a gain record, a leftover chain, an
# unrewound generator) changes a seeded draw at once.
MAX_TOKENS = 16


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=300 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _run(eng, encoded, poison: bool) -> dict[int, list[int]]:
    ids = {eng.add_request(p, _params(i)): i for i, p in enumerate(encoded)}
    bad = None
    if poison:
        bad = eng.add_request(encoded[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, seed=POISON_SEED))
    while eng.has_unfinished():
        eng.step()
    if bad is not None:
        assert eng.seqs[bad].finish_reason == "error"
    return {i: eng.seqs[sid].output_ids for sid, i in ids.items()}


SCHEDULES = [dict(method="ngram", depth_schedule="adaptive"), dict(method="ngram", depth_schedule="auto"),
             dict(method="ngram", num_candidates=3, depth_schedule="adaptive"), dict(method="hybrid")]


@pytest.mark.parametrize("options", SCHEDULES, ids=["adaptive", "auto", "tree", "hybrid"])
def test_a_mid_decoding_fault_leaves_the_others_unchanged(spec_llm, encoded, monkeypatch, options):
    prompts = encoded[:4]
    clean = _run(make_engine(spec_llm, "speculative", **options), prompts, poison=False)
    eng = make_engine(spec_llm, "speculative", **options)
    real_execute = eng.runner.execute
    faults = 0

    def execute(seqs, proposals, *a, **kw):
        nonlocal faults
        if any(s.params.seed == POISON_SEED and s.num_output_tokens >= 6 for s in seqs):
            faults += 1
            raise RuntimeError("injected forward fault")
        return real_execute(seqs, proposals, *a, **kw)

    monkeypatch.setattr(eng.runner, "execute", execute)
    got = _run(eng, prompts, poison=True)
    assert faults > 0, "the fault never fired: the test would be vacuous"
    if options.get("depth_schedule", "auto") == "auto":
        # The auto schedule sizes drafts by the batch (docs/speculative.md), and the hybrid's
        # recycling table and suffix history are shared by every request, so a seeded sampled
        # request's draws depend on its neighbours even in a clean run: only greedy is comparable.
        got, clean = {i: v for i, v in got.items() if i % 2 == 0}, {i: v for i, v in clean.items() if i % 2 == 0}
    assert got == clean
