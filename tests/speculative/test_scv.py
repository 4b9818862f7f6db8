"""Speculative chunk verify (SCV, the NWOR/SCV design): a long draft is verified in chunks inside
one engine step — each forward carries at most ``chunk_size`` draft levels, its accepted tokens are
committed before the next chunk is verified on top of them, and the step stops at the first
rejection. An oracle drafter (the plain-greedy continuation itself, optionally with one wrong
token) makes every forward's rows and every chunk's commit exactly predictable."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.decoding.speculative.proposers import DraftBeam, Proposer, register_proposer
from ratchetlm.sampling_params import SamplingParams

from .conftest import GREEDY, make_engine

ORACLE = "_test_oracle"


@register_proposer(ORACLE)
class OracleProposer(Proposer):
    """Drafts the plain-greedy continuation (``future``: prompt -> reference output); the token at
    output index ``wrong_at`` is replaced by a wrong one."""

    future: dict[tuple[int, ...], list[int]] = {}
    wrong_at: int | None = None

    def propose(self, seqs, depths):
        out = []
        for s, d in zip(seqs, depths, strict=True):
            k = s.num_output_tokens
            draft = list(self.future[tuple(s.token_ids[: s.num_prompt_tokens])][k : k + d])
            if self.wrong_at is not None and k <= self.wrong_at < k + len(draft):
                draft[self.wrong_at - k] = draft[self.wrong_at - k] + 1
            out.append(DraftBeam(torch.tensor([draft]), torch.zeros(1, len(draft))) if draft else None)
        return out


@pytest.fixture
def oracle(encoded, reference, monkeypatch):
    monkeypatch.setattr(OracleProposer, "future", {tuple(p): r for p, r in zip(encoded, reference, strict=True)})
    monkeypatch.setattr(OracleProposer, "wrong_at", None)
    return OracleProposer


def trace(eng, prompts, params=GREEDY):
    """Run to completion. Per engine step: [(rows per sequence, tokens committed per sequence,
    num_cached per sequence before the forward)] for each forward of the step."""
    steps: list[list[tuple[list[int], list[int], list[int]]]] = []
    execute, commit = eng.runner.execute, eng.strategy.commit

    def spy_execute(seqs, props, **kw):
        steps[-1].append(([len(p.token_ids) for p in props], [], [s.num_cached for s in seqs]))
        return execute(seqs, props, **kw)

    def spy_commit(seqs, props, logits):
        out = commit(seqs, props, logits)
        steps[-1][-1][1].extend(len(c.token_ids) for c in out)
        return out

    eng.runner.execute, eng.strategy.commit = spy_execute, spy_commit
    ids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        steps.append([])
        eng.step()
    return [eng.seqs[i].output_ids for i in ids], steps


def test_long_draft_is_verified_chunk_by_chunk_in_one_step(spec_llm, encoded, reference, oracle):
    """Depth 6, chunks of 2: every drafting step runs two forwards of 1 + 2 rows; each chunk's
    commit appends 3 tokens (2 accepted + the target's next, which is the draft's own next token)
    and its K/V is committed before the next chunk runs, so a step appends 6 tokens."""
    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=2)
    out, steps = trace(eng, [encoded[3]])
    assert out == [reference[3]]
    prefill, *drafting, last = steps
    assert len(prefill) == 1 and prefill[0][1] == [1]
    assert len(drafting) == 2  # 13 tokens after the first: two 6-token steps, then a plain one
    for step in drafting:
        assert [f[0] for f in step] == [[3], [3]]  # verify rows per forward: root + one chunk
        assert [f[1] for f in step] == [[3], [3]]  # tokens committed per chunk
        assert step[1][2][0] == step[0][2][0] + 3  # chunk 1's K/V committed before chunk 2 ran
    assert last == [([1], [1], [len(encoded[3]) + 12])]  # the 13th output token is the root
    m = eng.strategy.metrics()
    assert m["spec_decode_scv_chunks"] == 4 and m["spec_decode_scv_continued_chunks"] == 2
    assert m["spec_decode_scv_chunks_accepting_3"] == 4  # 2 drafted + the next draft token, every chunk
    assert m["spec_decode_scv_mean_committed_per_chunk"] == 3
    assert m["spec_decode_num_drafts"] == 2  # a draft verified in chunks is still one draft
    assert m["spec_decode_num_draft_tokens"] == m["spec_decode_num_accepted_tokens"] == 12
    assert m["spec_decode_num_accepted_tokens_per_pos_5"] == 2
    assert eng.runner.staging.metrics.fallback_count == 0


@pytest.mark.parametrize("wrong_at, rows, committed", [
    (2, [[3]], [[2]]),  # rejected inside chunk 1: no second forward
    (4, [[3], [3]], [[3], [1]]),  # chunk 1 accepted, rejected at chunk 2's first token: stop there
    (5, [[3], [3]], [[3], [2]]),  # rejected inside chunk 2
])
def test_verification_stops_at_the_first_rejection(spec_llm, encoded, reference, oracle, wrong_at, rows, committed):
    oracle.wrong_at = wrong_at
    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=2)
    out, steps = trace(eng, [encoded[3]])
    assert out == [reference[3]]
    first = steps[1]  # the first drafting step drafts output tokens 1..6
    assert [f[0] for f in first] == rows and [f[1] for f in first] == committed


def test_chunks_of_a_batch_continue_together_and_alone(spec_llm, encoded, reference, oracle):
    """Two sequences: both continue after chunk 1 (one forward of two 3-row proposals); when one
    of them is rejected in chunk 1, the continuation forward carries only the other."""
    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=2)
    out, steps = trace(eng, [encoded[0], encoded[3]])
    assert out == [reference[0], reference[3]]
    assert [f[0] for f in steps[1]] == [[3, 3], [3, 3]]
    oracle.wrong_at = 1  # both prompts' second output token is drafted wrong
    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=2)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sid = eng.add_request(encoded[1], short)  # prefilled in step 0 too; drafts differ by prompt length
    out, steps = trace(eng, [encoded[3]])
    assert out == [reference[3]] and eng.seqs[sid].output_ids == reference[1][:4]


def test_unchunked_verifies_the_whole_draft_in_one_forward(spec_llm, encoded, reference, oracle):
    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=0)
    out, steps = trace(eng, [encoded[3]])
    assert out == [reference[3]]
    assert [[f[0] for f in s] for s in steps[1:3]] == [[[7]], [[6]]]  # the second is capped by max_tokens
    assert [[f[1] for f in s] for s in steps[1:3]] == [[[7]], [[6]]]  # 1 + 7 + 6 = 14 tokens
    assert "spec_decode_scv_chunks" not in eng.strategy.metrics()


def test_a_fault_in_a_continuation_forward_fails_only_its_request(spec_llm, encoded, reference, oracle):
    """Fault isolation covers every forward of a step: a continuation chunk that raises fails
    only the request it belongs to; the other's continuation is re-run and its output is unchanged."""
    from ratchetlm.decoding.speculative.strategy import TreeState

    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=2)
    commit = eng.strategy.commit
    ids = [eng.add_request(p, GREEDY) for p in (encoded[0], encoded[3])]
    victim = ids[1]

    def faulty(seqs, props, logits):
        if any(s.seq_id == victim and isinstance(p.state, TreeState) and not p.state.first
               for s, p in zip(seqs, props, strict=True)):
            raise RuntimeError("injected continuation fault")
        return commit(seqs, props, logits)

    eng.strategy.commit = faulty
    errors = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.error:
                errors[o.seq_id] = o.error
    assert list(errors) == [victim] and "injected continuation fault" in errors[victim]
    assert eng.seqs[ids[0]].output_ids == reference[0]
    assert eng.seqs[victim].finish_reason == "error" and eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("capacity", [2, 4])
def test_a_chunk_that_fell_back_is_not_continued_on_uncached_tokens(spec_llm, encoded, reference, oracle, capacity):
    """SCV with a staging fallback (issue 40's seed audit): a chunk whose rows do not fit the staging
    buffer commits its tokens without K/V (the next step's catch-up computes it), so the next chunk
    must not be verified in that step: its rows would sit on positions whose K/V was never written
    (``continue_step``'s ``num_cached + 1`` guard). Capacity 2: no 3-row chunk fits, nothing
    continues. Capacity 4: in a batch of two, the first sequence's chunk fits and continues, the
    second's falls back and stops. Either way the output is plain greedy's."""
    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=2, staging_capacity=capacity)
    out, steps = trace(eng, [encoded[0], encoded[3]])
    assert out == [reference[0], reference[3]]
    m = eng.runner.staging.metrics
    assert m.fallback_overflow > 0, "no chunk fell back: the test would not exercise the guard"
    continued = eng.strategy.metrics()["spec_decode_scv_continued_chunks"]
    assert continued == 0 if capacity == 2 else continued > 0
    assert m.unique_tokens == m.tokens_committed + m.tokens_rejected  # fallbacks staged nothing


def test_a_chunk_that_exactly_fills_the_staging_buffer_is_staged(spec_llm, encoded, reference, oracle):
    """Capacity 3 = one chunk's rows (root + 2 levels): it fits (no needless fallback), so every
    drafting step verifies both chunks as with an unbounded buffer."""
    eng = make_engine(spec_llm, "speculative", method=ORACLE, depth=6, chunk_size=2, staging_capacity=3)
    out, steps = trace(eng, [encoded[3]])
    assert out == [reference[3]]
    assert [[f[0] for f in s] for s in steps[1:3]] == [[[3], [3]], [[3], [3]]]
    m = eng.runner.staging.metrics
    assert m.fallback_count == 0 and m.tokens_committed == 12 and eng.runner.staging.max_tokens == 3
    assert eng.strategy.metrics()["spec_decode_scv_continued_chunks"] == 2
