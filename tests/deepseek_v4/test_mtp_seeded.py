"""Seeded MTP sampling repeats draw for draw: a seeded request's token ``n`` is drawn with a uniform
keyed by ``(seed, n)`` (layers/seeded_draw.py) and a draft is accepted exactly when it is that token,
so the output does not depend on the drafts, on how the prompt was chunked (the step-time budget
chunks by measured time) or on the batch: MTP sampling equals plain sampling token for token.

Before, a request consumed one generator in order and a verify step consumed a draft-dependent
number of draws: a prompt chunked one token short of its end (its last token then became a drafting
root) or another draft gave different tokens from then on. Equal "up to rounding": V4's call shapes
round differently (test_mtp_no_write_on_reject.py), and a token moves only when its uniform lies
within that rounding of a CDF boundary (~1e-7 per token here).
"""

from __future__ import annotations

import pytest
import torch

from ratchetlm.layers.seeded_draw import inverse_cdf, position_uniform
from ratchetlm.sampling_params import SamplingParams

from .conftest import v4_engine
from .test_mtp import _prompts, mtp_engine, steer

PROMPT_LENS = [6, 40, 130, 9]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed)


def _run_seeded(engine, prompts, seeds):
    sids = [engine.add_request(p, _params(s)) for p, s in zip(prompts, seeds, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [engine.seqs[s].output_ids for s in sids]


@pytest.fixture(scope="module")
def plain_sampled(model):
    prompts = _prompts(PROMPT_LENS, seed=5)
    seeds = [11, 12, 13, 14]
    return prompts, seeds, _run_seeded(v4_engine(model, max_num_seqs=4), prompts, seeds)


def test_seeded_mtp_sampling_is_plain_sampling_whatever_the_drafts_and_chunks(model, plain_sampled):
    prompts, seeds, want = plain_sampled
    truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    # the module's own drafts (nearly all rejected), batched
    assert _run_seeded(mtp_engine(model, 2, max_num_seqs=4), prompts, seeds) == want
    # drafts mostly right (accepted 1..3 tokens a call), batched, twice
    for _ in range(2):
        engine = mtp_engine(model, 2, max_num_seqs=4)
        steer(engine, truth)
        assert _run_seeded(engine, prompts, seeds) == want
        assert engine.strategy.metrics()["spec_decode_num_accepted_tokens"] > 10
    # prompts chunked 129 tokens at a time: the 130-token prompt's last token is then a drafting
    # root (its first output token comes from a verify step, not from the prefill's last row)
    engine = mtp_engine(model, 2, max_num_seqs=4, max_num_batched_tokens=129)
    steer(engine, truth, wrong_every=2)
    assert _run_seeded(engine, prompts, seeds) == want
    # alone, deeper chains
    for p, s, w in zip(prompts, seeds, want, strict=True):
        alone = mtp_engine(model, 3)
        steer(alone, truth, wrong_every=2)
        assert _run_seeded(alone, [p], [s]) == [w]


def test_position_uniforms_are_uniform_and_inverse_cdf_draws_the_law():
    u = torch.tensor([position_uniform(seed, n) for seed in range(4) for n in range(2500)], dtype=torch.float64)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and len(set(u.tolist())) == len(u)
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(((counts - 1000) ** 2 / 1000).sum()) < 30  # chi-square, 9 dof: p ~ 5e-4
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3])
    assert [inverse_cdf(p, x) for x in (0.0, 0.49, 0.5, 0.69, 0.7, 1.0 - 2**-53)] == [1, 1, 3, 3, 4, 4]
    drawn = torch.bincount(torch.tensor([inverse_cdf(p, float(x)) for x in u]), minlength=5).double() / len(u)
    torch.testing.assert_close(drawn, p.double(), atol=0.02, rtol=0)
