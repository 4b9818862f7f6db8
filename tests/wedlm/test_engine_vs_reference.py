"""The paged engine's WeDLM decoding equals the no-KV reference decoder token for token
(temperature 0), for windows 4/8/16 and τ in {0.2, 0.4, 0.8}, alone and batched, on a tiny
random WeDLM-shaped Qwen3 and on the model trained here. The reference runs on HF
transformers' forward, so the two share no attention or KV code."""

from __future__ import annotations

import itertools

import pytest

from ratchetlm.sampling_params import SamplingParams
from ratchetlm.training.corpus import held_out

from .conftest import run

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
GRID = list(itertools.product((4, 8, 16), (0.2, 0.4, 0.8)))
TINY_PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 7], [9, 10, 11, 12, 13, 14]]


@pytest.mark.parametrize("window, tau", GRID)
def test_tiny_engine_equals_reference_batched_and_alone(tiny, window, tau):
    opts = dict(window_size=window, entropy_threshold=tau)
    want = [tiny.reference(p, GREEDY, **opts) for p in TINY_PROMPTS]
    batched, reasons, _ = run(tiny.engine(**opts), TINY_PROMPTS, GREEDY)
    for i, (got, ref) in enumerate(zip(batched, want, strict=True)):
        assert got == ref.output_ids, f"prompt {i} diverged in the batch"
    assert reasons == ["length"] * len(TINY_PROMPTS)
    alone, _, _ = run(tiny.engine(**opts), [TINY_PROMPTS[1]], GREEDY)
    assert alone[0] == want[1].output_ids
    # not vacuous: at this τ some steps fill several masks and commit several tokens
    if tau >= 0.4:
        assert max(max(r.fills_per_step) for r in want) > 1
        assert max(max(r.commits_per_step) for r in want) > 1


def trained_prompts(pair, n=6):
    return [pair.llm.tokenize(ex.prompt) for ex in held_out(n)]


@pytest.mark.parametrize("window, tau", GRID)
def test_trained_engine_equals_reference(trained, window, tau):
    # three of the six held-out prompts, batched, alternating with the grid point: every prompt meets
    # every window and 4-5 of the 9 points (the reference runs HF's forward once per step per prompt:
    # ~0.3 s of CPU a prompt; the tiny model above runs every prompt at every point)
    prompts = trained_prompts(trained)[GRID.index((window, tau)) % 2::2]
    params = SamplingParams(temperature=0.0, max_tokens=40)  # stops at <eos>
    opts = dict(window_size=window, entropy_threshold=tau)
    got, reasons, _ = run(trained.engine(**opts), prompts, params)
    for i, p in enumerate(prompts):
        ref = trained.reference(p, params, **opts)
        assert got[i] == ref.output_ids, f"held-out prompt {i} diverged"
        assert reasons[i] == ref.finish_reason
    alone, _, _ = run(trained.engine(**opts), prompts[:1], params)
    assert alone[0] == got[0]


def test_seeded_sampling_matches_reference_and_reproduces(tiny):
    """Same seed → same draws in the same order (tokens are drawn for every mask, selection after).
    A high temperature because the tiny model's scaled head is very peaked."""
    params = SamplingParams(temperature=4.0, top_k=50, max_tokens=24, ignore_eos=True, seed=7)
    opts = dict(window_size=8, entropy_threshold=0.4)
    a, _, _ = run(tiny.engine(**opts), [TINY_PROMPTS[0]], params)
    b, _, _ = run(tiny.engine(**opts), [TINY_PROMPTS[0]], params)
    assert a == b
    assert a[0] == tiny.reference(TINY_PROMPTS[0], params, seed=7, **opts).output_ids
    other, _, _ = run(tiny.engine(**opts), [TINY_PROMPTS[0]], SamplingParams(
        temperature=4.0, top_k=50, max_tokens=24, ignore_eos=True, seed=8))
    assert other != a
