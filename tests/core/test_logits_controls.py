"""Logits controls (penalties, bias, bans, min_tokens, grammar) against references, and the
property every strategy relies on: a row with a tentative path sees exactly what it would see
after those tokens were committed."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from ratchetlm import SamplingParams
from ratchetlm.layers.logits_processors import ControlsFactory, LogitsControls
from ratchetlm.sampling_params import StructuredOutputsParams

V = 64
EOS = 2


def controls(prompt=(5, 6, 7), bad_words=(), grammar=None, **kw) -> LogitsControls:
    return LogitsControls(SamplingParams(**kw), list(prompt), V, (EOS,), [list(w) for w in bad_words], grammar)


def logits(n=1, seed=0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_hf():
    c = controls(prompt=(5, 6, 7), repetition_penalty=1.7)
    c.accept([9, 9, 11])
    x = logits()
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[5, 6, 7, 9, 9, 11]]), x.clone())
    assert torch.allclose(c.process(x), ref)


def test_frequency_and_presence_penalties_follow_openai():
    c = controls(frequency_penalty=0.5, presence_penalty=0.25)
    c.accept([9, 9, 11, 5])  # the prompt (5, 6, 7) does not count, output 5 does
    x = logits()
    counts = torch.zeros(V)
    for t in (9, 9, 11, 5):
        counts[t] += 1
    ref = x - 0.5 * counts - 0.25 * (counts > 0).float()
    assert torch.allclose(c.process(x), ref)


def test_bias_allowed_ids_min_tokens():
    x = logits()
    out = controls(logit_bias={3: 5.0, "4": -100}).process(x)  # JSON keys arrive as strings
    assert out[0, 3] == pytest.approx(float(x[0, 3]) + 5) and out[0, 4] == pytest.approx(float(x[0, 4]) - 100)
    out = controls(allowed_token_ids=[1, 8]).process(x)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 8]
    c = controls(min_tokens=2, max_tokens=5)
    assert torch.isneginf(c.process(x)[0, EOS])
    c.accept([10])
    assert torch.isneginf(c.process(x)[0, EOS])
    c.accept([11])
    assert c.process(x)[0, EOS] == x[0, EOS]


def test_bad_words_ban_the_last_token_after_its_prefix():
    c = controls(bad_words=[(20,), (30, 31, 32)])
    x = logits()
    assert torch.isneginf(c.process(x)[0, 20])  # a one-token word is always banned
    assert c.process(x)[0, 32] == x[0, 32]
    c.accept([30, 31])
    assert torch.isneginf(c.process(x)[0, 32])
    c.accept([33])
    assert c.process(x)[0, 32] == x[0, 32]


def test_extreme_valid_penalties_stay_samplable():
    """Found by the server fuzz test: repetition_penalty 5e-324 divided a logit into inf (then NaN)."""
    from ratchetlm.layers.sampler import filtered_probs

    c = controls(prompt=(5, 6, 7), repetition_penalty=5e-324, frequency_penalty=2.0, presence_penalty=-2.0)
    c.accept([9] * 1000)
    x = c.process(logits())
    assert not torch.isnan(x).any() and not torch.isposinf(x).any()
    p = filtered_probs(x, SamplingParams(temperature=1.0))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-5


def test_a_row_with_no_allowed_token_falls_back_to_the_raw_logits():
    x = logits()
    out = controls(allowed_token_ids=[EOS], min_tokens=1, max_tokens=4).process(x)
    assert torch.equal(out, x)


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
    dict(min_tokens=3, max_tokens=9, logit_bias={1: 2.0}),
])
def test_row_with_a_path_equals_the_state_after_committing_it(kw):
    """What speculative verification relies on: row i of process(logits, paths) is the target
    of the position after committed + paths[i]."""
    paths = [[], [9], [9, 30], [30, 31], [9, 9, 9]]
    bad = [(30, 31, 32), (40,)]
    c = controls(bad_words=bad, **kw)
    c.accept([30])
    x = logits(len(paths), seed=1)
    got = c.process(x, paths)
    for i, path in enumerate(paths):
        ref = controls(bad_words=bad, **kw)
        ref.accept([30] + path)
        assert torch.equal(got[i], ref.process(x[i : i + 1])[0]), f"row {i} path {path}"


def test_grammar_rows_with_paths_equal_the_committed_state(smollm_tokenizer):
    tok = smollm_tokenizer
    f = ControlsFactory(tok, len(tok), (EOS,))
    params = SamplingParams(structured=StructuredOutputsParams(json={
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    c = f.build(params, [1], (EOS,))
    assert c is not None and c.grammar is not None
    c.accept(enc('{"'))
    paths = [[], enc('n'), enc('n":'), enc('n":1'), enc('x')]
    x = torch.zeros(len(paths), len(tok))
    got = c.process(x, paths)
    for i, path in enumerate(paths[:4]):
        ref = f.build(params, [1], (EOS,))
        ref.accept(enc('{"') + path)
        assert torch.equal(got[i], ref.process(x[i : i + 1])[0]), f"row {i}"
    assert torch.isfinite(got[3]).sum() < len(tok) // 2, "the grammar narrowed the row after a number"
    # a path the grammar rejects cannot be reached: its row is left unconstrained
    assert torch.isfinite(got[4]).all()
    assert c.valid_prefix(enc('n":1') + enc('x')) == len(enc('n":1'))


@pytest.mark.parametrize("kw, needle", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={1: 101}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(bad_words=("",)), "bad_words"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(structured={"regex": "a", "choice": ["a"]}), "exactly one"),
])
def test_invalid_controls_name_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


def test_out_of_vocabulary_ids_are_refused_at_submission(llm_fp32):
    for kw, needle in ((dict(logit_bias={10**6: 1.0}), "logit_bias"),
                       (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
                       (dict(stop_token_ids=[999999]), "stop_token_ids token id 999999"),  # no other control
                       (dict(stop_token_ids=[5, -1]), "stop_token_ids token id -1")):
        with pytest.raises(ValueError, match=needle):
            llm_fp32.engine.add_request([1, 2, 3], SamplingParams(**kw))
