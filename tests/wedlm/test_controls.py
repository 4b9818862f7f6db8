"""WeDLM and logits controls: they shape every mask's distribution; a grammar is refused (a window
fills positions out of order, so it could not be enforced exactly)."""

from __future__ import annotations

import pytest

from ratchetlm.sampling_params import SamplingParams, StructuredOutputsParams

from .conftest import run


def test_structured_outputs_are_refused(tiny):
    eng = tiny.engine(window_size=4)
    with pytest.raises(ValueError, match="structured outputs are not supported with decoding='wedlm'"):
        eng.add_request([5, 6, 7], SamplingParams(structured=StructuredOutputsParams(regex="[0-9]+")))
    assert not eng.has_unfinished()


def test_bans_reach_every_mask(trained):
    eng = trained.engine(window_size=8)
    prompt = trained.llm.encode("The cat sat on the")
    free, _, _ = run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    banned = sorted(set(free[0]))[:3]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={t: -100.0 for t in banned})
    out, _, _ = run(trained.engine(window_size=8), [prompt], params)
    assert not set(out[0]) & set(banned), (free[0], out[0])
