"""WeDLM and logits controls. A filled slot is judged as the position after the committed tokens
and every window slot before it. Controls that count positions only (logit_bias,
allowed_token_ids, one-token bad words, min_tokens) hold for any slot, so the window fills out of
order as usual; controls that read the tokens before a slot (penalties, bad words of several
tokens) need those tokens known, so the window then fills in order (the first mask, then the run
of confident masks after it, each judged after the fills before it, several per step). Oracle:
the no-cache reference decoder with the same controls, judging each mask on its whole path."""

from __future__ import annotations

import pytest

from ratchetlm.sampling_params import SamplingParams, StructuredOutputsParams
from ratchetlm.training.corpus import held_out

from .conftest import run

PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)


def test_structured_outputs_are_refused(tiny):
    eng = tiny.engine(window_size=4)
    with pytest.raises(ValueError, match="structured outputs are not supported with decoding='wedlm'"):
        eng.add_request([5, 6, 7], SamplingParams(structured=StructuredOutputsParams(regex="[0-9]+")))
    assert not eng.has_unfinished()


def test_bans_reach_every_mask(trained):
    eng = trained.engine(window_size=8)
    prompt = trained.llm.tokenize("The cat sat on the")
    free, _, _ = run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    banned = sorted(set(free[0]))[:3]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={t: -100.0 for t in banned})
    out, _, _ = run(trained.engine(window_size=8), [prompt], params)
    assert not set(out[0]) & set(banned), (free[0], out[0])


def assert_engine_equals_reference(pair, params, opts, seed=None):
    """Engine (batched) == reference per prompt, both filling in order (the controls read the
    tokens before a slot: a fill past an open mask would count a placeholder); returns the
    reference results."""
    prompts = [pair.llm.tokenize(ex.prompt) for ex in held_out(6)]
    free, _, _ = run(pair.engine(**opts), prompts, SamplingParams(temperature=params.temperature,
                                                                  max_tokens=params.max_tokens, seed=seed))
    got, reasons, _ = run(pair.engine(**opts), prompts, params)
    assert got != free, "the controls changed nothing: the comparison would be vacuous"
    refs = [pair.reference(p, params, seed=seed, **opts) for p in prompts]
    for i, ref in enumerate(refs):
        assert got[i] == ref.output_ids, f"prompt {i} diverged from the reference"
        assert reasons[i] == ref.finish_reason
        assert ref.out_of_order_fills == 0, f"prompt {i}: a slot was filled past an open mask"
    return refs


@pytest.mark.parametrize("window, tau", [(8, 0.8), (16, 0.4)])
def test_penalties_and_phrase_bans_fill_in_order_like_the_reference(trained, window, tau):
    params = SamplingParams(temperature=0.0, max_tokens=32, bad_words=("old cow", "17 16"), **PENALTIES)
    refs = assert_engine_equals_reference(trained, params, dict(window_size=window, entropy_threshold=tau))
    # several masks filled in one step: each judged after the ones before it in that step
    assert max(max(r.fills_per_step) for r in refs) > 1


def test_seeded_sampling_with_penalties_equals_the_reference(trained):
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=3, **PENALTIES)
    assert_engine_equals_reference(trained, params, dict(window_size=8, entropy_threshold=0.8), seed=3)


def test_position_controls_keep_out_of_order_fills(trained):
    """min_tokens bans EOS at a slot by its position (the masks before it count), so the window
    keeps filling out of order. Each prompt's min_tokens lets exactly its free EOS through (it sits
    at index len - 1), which the window fills while masks before it are open on some prompts."""
    hat = trained.llm.tokenize("hat")
    assert len(hat) == 1
    base = dict(temperature=0.0, max_tokens=40, bad_words=("hat",), logit_bias={trained.llm.tokenize("the")[0]: -2.0})
    opts = dict(window_size=16, entropy_threshold=0.8)
    prompts = [trained.llm.tokenize(ex.prompt) for ex in held_out(6)]
    free, _, _ = run(trained.engine(**opts), prompts, SamplingParams(**base))
    eng = trained.engine(**opts)
    params = [SamplingParams(min_tokens=len(f) - 1, **base) for f in free]
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while eng.has_unfinished():
        eng.step()
    out_of_order = 0
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        ref = trained.reference(p, sp, **opts)
        assert eng.seqs[ids[i]].output_ids == ref.output_ids, f"prompt {i} diverged from the reference"
        assert len(ref.output_ids) >= sp.min_tokens and hat[0] not in ref.output_ids
        out_of_order += ref.out_of_order_fills
    assert out_of_order > 0, "no slot was filled past an open mask: the per-position counting went untested"
