"""``LLM(model=<tiny V4 folder>)``: closed-loop generation through the public API, streamed
through the text layer like any other model."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM, SamplingParams


def test_llm_generates_with_deepseek_v4(v4_with_tokenizer, hf_model):
    llm = LLM(str(v4_with_tokenizer), progress=False, dtype="float32", max_num_seqs=2)
    prompts = ["w5 w17 w33 w2 w9", "w40 w41 w42"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = llm.tokenize(prompt)
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.token_ids == want[0, len(ids):].tolist()
        assert out.finish_reason == "length"
        assert out.text.split() == [f"w{t}" for t in out.token_ids]
    events = list(llm.stream(prompts[0], SamplingParams(max_tokens=4, temperature=0)))
    assert [t for e in events for t in e.token_ids] == outs[0].token_ids[:4]
    assert all(len(e.token_ids) == 1 for e in events)  # exactly one commit per decode call
    with pytest.raises(ValueError, match="DeepSeek-V4"):
        LLM(str(v4_with_tokenizer), progress=False, decoding="wedlm")
