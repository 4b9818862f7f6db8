"""Seed conformance: the defaults (the seed's and, for λ, the public code's), the
no-write-on-reject fallbacks under WeDLM (staging overflow, a failure inside staging: same tokens,
nothing uncommitted in the cache, the engine keeps serving) and the efficiency / staging metrics
WeDLM exports."""

from __future__ import annotations

import pytest

from ratchetlm.decoding.wedlm_window import WeDLMConfig
from ratchetlm.sampling_params import SamplingParams

from .conftest import run
from .test_engine_vs_reference import TINY_PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
OPTS = dict(window_size=8, entropy_threshold=0.8)


def test_defaults_are_the_seeds_and_the_public_codes(tiny):
    """Window 16 and τ 0.4 are seed 000's defaults. The seed has no distance penalty: λ 0.02 is the
    default of WeDLM's public code (wedlm/sampling_params.py; the paper's Eq. 11; docs/wedlm.md)."""
    cfg = WeDLMConfig()
    assert (cfg.window_size, cfg.entropy_threshold) == (16, 0.4)  # seed 000
    assert cfg.position_penalty == 0.02  # WeDLM's public code, not the seed
    assert tiny.engine().strategy.cfg == cfg  # an engine given no options runs with them


def bytes_per_committed_token_written_once(eng) -> bool:
    return eng.cache.bytes_written == sum(s.num_cached for s in eng.seqs.values()) * eng.cache.bytes_per_token()


@pytest.mark.parametrize("capacity", [4, 12])
def test_staging_overflow_falls_back_with_identical_output(tiny, capacity):
    """Capacity 4: no 8-slot window fits, every window forward falls back to recompute.
    Capacity 12: in a batch, the first window fits and the next ones do not."""
    want = [tiny.reference(p, GREEDY, **OPTS).output_ids for p in TINY_PROMPTS]
    eng = tiny.engine(staging_capacity=capacity, **OPTS)
    out, _, _ = run(eng, TINY_PROMPTS, GREEDY)
    assert out == want
    m = eng.runner.staging.metrics
    assert m.fallback_overflow > 0 and m.fallback_stage_fail == m.fallback_commit_fail == 0
    assert eng.runner.staging.max_tokens <= capacity
    assert (m.tokens_committed > 0) == (capacity == 12)
    assert m.unique_tokens == m.tokens_committed + m.tokens_rejected  # unstaged windows count nowhere
    assert bytes_per_committed_token_written_once(eng)  # unstaged windows wrote nothing


@pytest.mark.parametrize("fault_layer", [0, 1])
def test_stage_failure_falls_back_and_the_engine_keeps_serving(tiny, fault_layer):
    want = [tiny.reference(p, GREEDY, **OPTS).output_ids for p in TINY_PROMPTS[:2]]
    eng = tiny.engine(**OPTS)
    eng.runner.staging.fault_stage_layer = fault_layer
    out, _, _ = run(eng, TINY_PROMPTS[:1], GREEDY)
    m = eng.runner.staging.metrics
    assert out == want[:1]
    assert m.fallback_stage_fail > 0 and m.tokens_committed == 0
    assert bytes_per_committed_token_written_once(eng)
    eng.runner.staging.fault_stage_layer = None
    out, _, _ = run(eng, TINY_PROMPTS[1:2], GREEDY)
    assert out == want[1:] and m.tokens_committed > 0
    assert eng.metrics()["kv_staging_fallback_stage_fail"] == m.fallback_stage_fail
    # rows staged before the fault layer are never committed or rejected: not counted as unique
    assert m.unique_tokens == m.tokens_committed + m.tokens_rejected


def test_efficiency_and_staging_metrics_are_exported(tiny):
    eng = tiny.engine(**OPTS)
    out, _, _ = run(eng, TINY_PROMPTS, GREEDY)
    m = eng.metrics()  # what /metrics publishes
    forwards, fills, commits = m["wedlm_forwards"], m["wedlm_fills"], m["wedlm_commits"]
    assert commits == sum(map(len, out)) and forwards > 0 and fills >= commits
    assert m["wedlm_tokens_per_forward"] == pytest.approx(commits / forwards)  # committed tokens per forward
    assert m["wedlm_fills_per_forward"] == pytest.approx(fills / forwards)  # masks filled per step
    assert m["wedlm_efficiency"] == pytest.approx(commits / fills)  # the seed's prefix pruned / masks filled
    assert m["wedlm_tokens_per_forward"] > 1  # parallel decoding actually happened
    # no-write-on-reject: every staged window row is either committed or rejected
    assert m["kv_staging_unique_tokens"] == m["kv_staging_tokens_committed"] + m["kv_staging_tokens_rejected"]
    assert m["kv_staging_tokens_committed"] == commits
    assert m["kv_staging_tokens_rejected"] > 0
    assert m["kv_staging_bytes_avoided"] == m["kv_staging_tokens_rejected"] * eng.cache.bytes_per_token()
    assert m["kv_staging_efficiency"] == pytest.approx(1 / eng.model_config.num_layers)
    assert m["kv_staging_fallbacks"] == 0
