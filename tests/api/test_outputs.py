"""The result objects: vLLM's RequestOutput / CompletionOutput / Logprob, the deprecated
single-choice aliases, and vLLM's prompt and parameter spellings."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest

from ratchetlm import CompletionOutput, Logprob, RequestOutput, SamplingParams, StructuredOutputsParams
from ratchetlm import outputs as outputs_mod
from ratchetlm.sampling_params import UNTIL_MAX_MODEL_LEN


def _out() -> RequestOutput:
    c = CompletionOutput(0, "hi", [5, 6], -1.5, [{5: Logprob(-0.5, 1, "h")}, {6: Logprob(-1.0, 2, "i")}], "stop", None)
    return RequestOutput("0", "p", [1, 2], None, [c, CompletionOutput(1, "yo", [7], None, None, "length")])


def test_old_single_choice_fields_are_deprecated_aliases(monkeypatch):
    monkeypatch.setattr(outputs_mod, "_warned", set())
    out = _out()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (out.text, out.token_ids, out.finish_reason) == ("hi", [5, 6], "stop")
        assert out.logprobs is out.outputs[0].logprobs
        assert out.text == "hi"  # a second read does not warn again
    assert [w.category for w in caught] == [DeprecationWarning] * 4
    assert "outputs[0].text" in str(caught[0].message)


def test_logprob_is_its_float_with_vllm_fields():
    lp = Logprob(-0.25, rank=3, decoded_token=" the")
    assert lp == -0.25 and lp.logprob == -0.25 and isinstance(lp, float)
    assert (lp.rank, lp.decoded_token) == (3, " the")
    back = pickle.loads(pickle.dumps(lp))
    assert (back, back.rank, back.decoded_token) == (-0.25, 3, " the")
    assert json.loads(json.dumps({"x": lp})) == {"x": -0.25}


def test_vllm_spellings_of_defaults():
    sp = SamplingParams(stop=None, stop_token_ids=None, bad_words=None, seed=-1, logprobs=True, top_k=0,
                        max_tokens=None)
    assert (sp.stop, sp.stop_token_ids, sp.bad_words, sp.seed, sp.logprobs, sp.max_tokens) == \
        ((), (), (), None, 1, UNTIL_MAX_MODEL_LEN)
    so = StructuredOutputsParams(choice=["yes", "no"])
    assert SamplingParams(structured_outputs=so).structured == so
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=so, structured=StructuredOutputsParams(regex="a+"))


def test_prompt_dicts_and_lists(llm_fp32):
    ids = llm_fp32.tokenize("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    outs = llm_fp32.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], greedy)
    assert outs[0].prompt == "The capital of France is" and outs[1].prompt is None
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].prompt_token_ids == ids and outs[0].finished
    with pytest.raises(ValueError, match="exactly one of"):
        llm_fp32.generate([{"prompt": "a", "prompt_token_ids": [1]}], greedy)


def test_params_keyword_is_a_deprecated_alias(llm_fp32):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with pytest.warns(DeprecationWarning, match="sampling_params"):
        old = llm_fp32.generate("The capital of France is", params=greedy)
    assert old[0].outputs[0].token_ids == llm_fp32.generate("The capital of France is", greedy)[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="not both"):
        llm_fp32.generate("x", greedy, params=greedy)
