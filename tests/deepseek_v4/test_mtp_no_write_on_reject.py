"""MTP speculative decoding on DeepSeek-V4 never lets a rejected draft reach the cache: the ring,
compressed KV, indexer keys and compressor state after a verify step hold what plain decoding
leaves; a failed commit rolls every pool back; a chain over the staging capacity falls back to
the plain path. All through the engine's one write point (kv/sink.py) and staging (kv/staging.py)."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.sampling_params import SamplingParams

from .conftest import pool_bytes, v4_engine
from .test_mtp import GREEDY, _prompts, mtp_engine, run, steer


def test_rejected_drafts_leave_the_cache_exactly_as_plain_decoding(model):
    """Every draft wrong: after each S = 2 verify call ([root, rejected draft]), the ring, the
    compressed KV, the indexer keys and the compressor state are byte for byte what plain S = 2
    decoding ([token, placeholder]) leaves after its call — the draft's rows were staged and
    dropped. Compared after every step: a later token overwrites a leaked ring / state row."""
    prompts = _prompts([250], seed=2)  # crosses 255/256: CSA and HCA entries, state pages, ring
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = run(v4_engine(model, shuffle_seed=4), prompts, params)
    plain = v4_engine(model, shuffle_seed=4)
    engine = mtp_engine(model, 1, shuffle_seed=4)
    steer(engine, {tuple(prompts[0]): want[0]}, wrong_every=1)
    a_id, b_id = plain.add_request(prompts[0], params), engine.add_request(prompts[0], params)
    steps = 0
    while engine.has_unfinished():
        plain.step()
        engine.step()
        steps += 1
        assert plain.seqs[a_id].num_cached == engine.seqs[b_id].num_cached  # one token per call, both
        a, b = pool_bytes(plain), pool_bytes(engine)
        for key in a:
            assert torch.equal(a[key], b[key]), (steps, key)
    assert not plain.has_unfinished() and engine.seqs[b_id].output_ids == want[0]
    m = engine.metrics()
    assert m["spec_decode_num_drafts"] >= 10 and m["spec_decode_num_accepted_tokens"] == 0
    assert m["kv_staging_tokens_committed"] >= 10  # the roots' rows did go through staging
    assert set(pool_bytes(engine)) - set(pool_bytes(plain)) == {("ori", "mtp0")}  # the module's own ring


def test_long_chains_commit_any_prefix(model):
    # depth 8: a verify step spans more than one CSA state window, so the state rows of every
    # position a shorter accepted prefix may still pool must be kept (DecodeCapacity.state_span)
    prompts = _prompts([130], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = run(v4_engine(model), prompts, params)
    engine = mtp_engine(model, 8)
    steer(engine, {tuple(prompts[0]): want[0]}, wrong_every=1)  # one wrong draft per chain, anywhere
    assert run(engine, prompts, params) == want
    assert engine.strategy.metrics()["spec_decode_num_accepted_tokens"] > 10


def test_accepted_drafts_leave_the_cache_plain_decoding_leaves(model):
    # Deeper chains, right and wrong: a different call shape rounds differently, but the same
    # rows are written with the same values (to fp32 rounding) and nothing else.
    prompts = _prompts([250], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = v4_engine(model, shuffle_seed=5)
    want = run(plain, prompts, params)
    engine = mtp_engine(model, 3, shuffle_seed=5)
    steer(engine, {tuple(prompts[0]): want[0]}, wrong_every=2)
    assert run(engine, prompts, params) == want
    a, b = pool_bytes(plain), pool_bytes(engine)
    for key in a:
        assert torch.equal(a[key] != 0, b[key] != 0), key
        torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=0, msg=str(key))


def test_failed_commit_falls_back_to_plain_and_keeps_the_output(model):
    prompts = _prompts([130, 60], seed=4)
    want = run(v4_engine(model, max_num_seqs=2), prompts, GREEDY)
    engine = mtp_engine(model, 2, max_num_seqs=2)
    steer(engine, {tuple(p): w for p, w in zip(prompts, want, strict=True)})
    staging = engine.runner.staging
    real = staging.commit
    calls, written = [0], []

    def flaky(rows):  # every third commit fails at the compressor state, after the ring (every layer) was written
        calls[0] += 1
        fail = calls[0] % 3 == 0
        staging.fault_layer, staging.fault_pool = (0, "csa_state") if fail else (None, None)
        before = engine.runner.layout.pools.bytes_written
        try:
            return real(rows)
        finally:
            written.append(fail and engine.runner.layout.pools.bytes_written > before)

    staging.commit = flaky
    assert run(engine, prompts, GREEDY) == want
    assert staging.metrics.fallback_commit_fail > 0 and any(written)  # pools were written, then rolled back


OVERFLOW_PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def overflow_plain(model) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, plain greedy outputs) of the overflow cases: the reference of both capacities, computed once."""
    prompts = _prompts([120, 250, 60], seed=6)
    return prompts, run(v4_engine(model, max_num_seqs=3), prompts, OVERFLOW_PARAMS)


@pytest.mark.parametrize("capacity", [1, 3])
def test_staging_overflow_falls_back_with_identical_output(model, overflow_plain, capacity):
    """Capacity 1: no [root, draft] chain fits, every verify step computes without writing anything
    and the next step's catch-up writes the committed tokens directly. Capacity 3: in a batch of
    three, the first chain fits and the others do not. Output is plain greedy's and the buffer never
    grows past its capacity."""
    prompts, want = overflow_plain
    params = OVERFLOW_PARAMS
    engine = mtp_engine(model, 1, max_num_seqs=3, staging_capacity=capacity)
    steer(engine, {tuple(p): w for p, w in zip(prompts, want, strict=True)})
    silent = []  # per forward whose every proposal overflowed: it wrote no pool row
    execute, pools = engine.runner.execute, engine.runner.layout.pools

    def spy(seqs, props, **kw):
        before = pools.bytes_written
        out = execute(seqs, props, **kw)
        if not any(p.direct_write for p in props) and all(b < 0 for b in out.stage_base):
            silent.append(pools.bytes_written == before)
        return out

    engine.runner.execute = spy
    assert run(engine, prompts, params) == want
    m = engine.runner.staging.metrics
    assert m.fallback_overflow > 0 and m.fallback_stage_fail == m.fallback_commit_fail == 0
    assert engine.runner.staging.max_tokens <= capacity
    assert (m.tokens_committed > 0) == (capacity == 3)  # chains that fit were still staged and committed
    assert engine.metrics()["kv_staging_fallback_overflow"] == m.fallback_overflow
    assert engine.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0
    assert all(silent) and (len(silent) > 0) == (capacity == 1)


