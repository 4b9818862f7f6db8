"""No-write-on-reject on the real model: after speculative steps the paged KV of the committed
tokens equals a plain AR run's; rejected tree rows leave no trace; exactly one token's KV is
written per committed token; a commit fault at layer k falls back with identical output."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.sampling_params import SamplingParams

from .conftest import GREEDY, make_engine, run_engine
from .prompts import CODE2, SUMMARY

PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def step_until(engine, prompt, min_tokens: int, params: SamplingParams = PARAMS):
    """Step until the request has ``min_tokens`` output tokens; fails (instead of looping forever)
    when it finished before, e.g. with an error."""
    sid = engine.add_request(prompt, params)
    seq = engine.seqs[sid]
    error = None
    while seq.num_output_tokens < min_tokens:
        assert not seq.is_finished, f"the request finished early ({seq.finish_reason}): {error}"
        error = next((o.error for o in engine.step() if o.seq_id == sid and o.error), error)
    return seq


def committed_kv(engine, seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # [layers, n, h, d] each
    slots = engine.blocks.slots(seq, 0, n)
    return engine.cache.k[:, slots], engine.cache.v[:, slots]


def unused_slots(engine, seq) -> torch.Tensor:
    """Slots of the sequence's blocks past its committed KV (written only by a leak)."""
    return engine.blocks.slots(seq, seq.num_cached, len(seq.block_table) * engine.blocks.block_size)


@pytest.mark.parametrize("opts", [dict(method="ngram", num_candidates=3, depth=4),
                                  dict(method="draft", draft_layers=4, depth=3, num_candidates=2),
                                  dict(method="hybrid"), dict(method="recycling", tree_nodes=12)])
def test_committed_kv_equals_plain_ar_and_rejects_leave_no_trace(spec_llm, opts):
    prompt = spec_llm.tokenize(CODE2)
    ar = make_engine(spec_llm, kv_cache_blocks=16)
    sp = make_engine(spec_llm, "speculative", kv_cache_blocks=16, **opts)
    a = step_until(ar, prompt, 12)
    s = step_until(sp, prompt, 12)
    n = min(a.num_cached, s.num_cached)
    assert s.token_ids[:n] == a.token_ids[:n]
    ka, va = committed_kv(ar, a, n)
    ks, vs = committed_kv(sp, s, n)
    torch.testing.assert_close(ks, ka, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vs, va, atol=1e-4, rtol=1e-4)
    # the fresh cache is all zeros: any staged-but-rejected row written to the cache would show
    rest = unused_slots(sp, s)
    assert not sp.cache.k[:, rest].any() and not sp.cache.v[:, rest].any()
    # exactly one token's K/V written per committed token (prefill included)
    assert sp.cache.bytes_written == s.num_cached * sp.cache.bytes_per_token()
    m = sp.runner.staging.metrics
    assert m.tokens_rejected > 0, "the test needs rejected tree rows to be meaningful"
    assert m.unique_tokens == m.tokens_committed + m.tokens_rejected
    assert m.stage_operations == m.unique_tokens * spec_llm.model_config.num_layers


@pytest.mark.parametrize("fault_layer", [0, 17])
def test_commit_fault_falls_back_with_identical_output(spec_llm, fault_layer):
    prompt = spec_llm.tokenize(SUMMARY)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = run_engine(make_engine(spec_llm, kv_cache_blocks=16), [prompt], params)
    eng = make_engine(spec_llm, "speculative", kv_cache_blocks=16, method="ngram", num_candidates=2, depth=4)
    eng.runner.staging.fault_layer = fault_layer
    seq = step_until(eng, prompt, 6, params)
    # every staged commit failed: nothing but direct catch-up writes reached the cache
    m = eng.runner.staging.metrics
    assert m.fallback_commit_fail > 0 and m.tokens_committed == 0
    assert not eng.cache.k[:, unused_slots(eng, seq)].any()
    # layers written before the fault were physically written, then restored
    direct = seq.num_cached * eng.cache.bytes_per_token()
    assert eng.cache.bytes_written == direct if fault_layer == 0 else eng.cache.bytes_written > direct
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == ref[0]


@pytest.mark.parametrize("capacity", [3, 8])
def test_staging_overflow_falls_back_with_identical_output(spec_llm, encoded, reference, capacity):
    """Capacity 3: no 5-row tree fits, every draft step falls back. Capacity 8: in a batch of
    three, the first sequence's tree fits and the others' do not. Either way the output is plain
    greedy's, the buffer never grows past its capacity and nothing rejected reaches the cache."""
    subset = [0, 1, 3]
    eng = make_engine(spec_llm, "speculative", staging_capacity=capacity, method="ngram", depth=4)
    assert run_engine(eng, [encoded[i] for i in subset], GREEDY) == [reference[i] for i in subset]
    m = eng.runner.staging.metrics
    assert m.fallback_overflow > 0 and m.fallback_commit_fail == m.fallback_stage_fail == 0
    assert m.unique_tokens == m.tokens_committed + m.tokens_rejected  # the unstaged trees count nowhere
    assert eng.runner.staging.max_tokens <= capacity
    assert eng.strategy.metrics()["spec_decode_num_drafts"] > 0
    if capacity == 8:
        assert m.tokens_committed > 0  # trees that fit were still staged and committed
    assert eng.metrics()["kv_staging_fallback_overflow"] == m.fallback_overflow
    # exactly one token's K/V written per committed token: the unstaged trees wrote nothing
    assert eng.cache.bytes_written == sum(s.num_cached for s in eng.seqs.values()) * eng.cache.bytes_per_token()


@pytest.mark.parametrize("fault_layer", [0, 11])
def test_stage_failure_falls_back_and_the_engine_keeps_serving(spec_llm, encoded, reference, fault_layer):
    eng = make_engine(spec_llm, "speculative", kv_cache_blocks=16, method="ngram", num_candidates=2, depth=4)
    eng.runner.staging.fault_stage_layer = fault_layer
    seq = step_until(eng, encoded[1], 6, GREEDY)
    m = eng.runner.staging.metrics
    assert m.fallback_stage_fail > 0 and m.tokens_committed == 0 and m.fallback_commit_fail == 0
    assert not eng.cache.k[:, unused_slots(eng, seq)].any()
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == reference[1]
    eng.runner.staging.fault_stage_layer = None  # the same engine serves the next request normally
    assert run_engine(eng, [encoded[3]], GREEDY) == [reference[3]]
    assert m.tokens_committed > 0 and eng.metrics()["kv_staging_fallback_stage_fail"] == m.fallback_stage_fail
    # rows staged before the fault layer were never committed or rejected: not counted as unique
    assert m.unique_tokens == m.tokens_committed + m.tokens_rejected


def test_sampling_with_seed_is_reproducible(spec_llm):
    prompt = spec_llm.tokenize(CODE2)
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=11, ignore_eos=True)
    outs = [run_engine(make_engine(spec_llm, "speculative", kv_cache_blocks=16, method="ngram", num_candidates=2,
                                   depth=4), [prompt], p)[0] for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 10
