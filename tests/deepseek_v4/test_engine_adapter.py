"""DeepseekV4Engine: the LLMEngine surface LLM drives, on the tiny V4 folder."""

from __future__ import annotations

import torch

from ratchetlm.models.deepseek_v4.engine_adapter import DeepseekV4Engine
from ratchetlm.sampling_params import SamplingParams


def _drain(engine):
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.seq_id] = out.finish_reason
    return tokens, finished


def test_engine_streams_greedy_tokens_like_hf(hf_model, tiny_v4_dir):
    g = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (60, 125, 9)]
    engine = DeepseekV4Engine(tiny_v4_dir, max_num_seqs=2)
    sids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10)) for p in prompts]
    tokens, finished = _drain(engine)
    for sid, p in zip(sids, prompts, strict=False):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert tokens[sid] == want[0, len(p):].tolist()
        assert finished[sid] == "length"
        assert engine.release(sid).output_ids == tokens[sid]
    assert engine.runner.lengths == {}  # all caches released


def test_engine_stop_token_and_abort(tiny_v4_dir):
    engine = DeepseekV4Engine(tiny_v4_dir, max_num_seqs=2)
    a = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()  # prefill a -> first token
    first = engine.seqs[a].output_ids[0]
    b = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=(first,)))
    engine.abort(a)
    tokens, finished = _drain(engine)
    assert finished[b] == "stop" and tokens[b] == [first]
    assert engine.seqs[a].finish_reason == "abort"
