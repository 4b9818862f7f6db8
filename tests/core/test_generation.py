"""Greedy generation equals HF transformers; batching, continuous batching and preemption
never change a request's output."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "List three benefits of regular exercise:\n1.",
    "Translate to French: 'Good morning, how are you?'",
]
MIXED = [
    "Hi",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "The history of the Roman Empire began when",
    "import numpy as np\nx = np.arange(10)\n# compute the mean of x\n",
    "Q: What is 12 times 7?\nA:",
    "Summarize: The cat sat on the mat. It was a sunny day and the cat was happy to rest there for hours.",
    "A very long prompt " + "that keeps going and going " * 12 + "until it ends.",
]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm, llm_fp32):
    """HF ``generate``'s greedy continuation of each prompt (stops at EOS, id 2, or after 64 tokens),
    computed once for both engines below."""
    refs = []
    for prompt in PROMPTS:
        ids = torch.tensor([llm_fp32.tokenize(prompt)])
        with torch.no_grad():
            ref = hf_smollm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                     eos_token_id=2, pad_token_id=2)
        refs.append((ids[0].tolist(), ref[0, ids.shape[1]:].tolist()))
    return refs


@pytest.mark.parametrize("engine", ["llm_fp32", "llm_fp32_dense"])
def test_greedy_matches_hf_generate(engine, hf_greedy, request):
    """Both stop at EOS (id 2) or after 64 tokens; the token lists must be identical — with the
    GGUF block kernels (the default) and with dense fp32 matmuls."""
    llm_fp32 = request.getfixturevalue(engine)
    outs = llm_fp32.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0))
    for prompt, out, (ids, ref) in zip(PROMPTS, outs, hf_greedy, strict=True):
        assert llm_fp32.tokenize(prompt) == ids, prompt  # the same prompt tokens HF was given
        assert out.token_ids == ref, prompt
        assert out.finish_reason == ("stop" if out.token_ids[-1] == 2 else "length")
        visible = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        assert out.text == llm_fp32.tokenizer.decode(visible)
    assert sum(len(o.token_ids) for o in outs) >= 200  # mostly full-length generations


def test_mixed_batch_equals_each_alone(llm_fp32):
    params = [_greedy(8 + 3 * i) for i in range(len(MIXED))]
    together = llm_fp32.generate(MIXED, params)
    for prompt, p, out in zip(MIXED, params, together, strict=True):
        alone = llm_fp32.generate(prompt, p)[0]
        assert out.token_ids == alone.token_ids, prompt
        assert len(out.token_ids) == p.max_tokens
    assert llm_fp32.engine.blocks.num_free == llm_fp32.engine.blocks.num_blocks


def test_requests_added_mid_decode(llm_fp32):
    """Continuous batching: requests join while others are decoding; outputs are unchanged."""
    eng = llm_fp32.engine
    alone = {p: llm_fp32.generate(p, _greedy(12))[0].token_ids for p in MIXED[:4]}
    sids = {eng.add_request(llm_fp32.tokenize(MIXED[0]), _greedy(12)): MIXED[0]}
    got: dict[int, list[int]] = {sid: [] for sid in sids}
    pending = list(MIXED[1:4])
    steps = 0
    while eng.has_unfinished() or pending:
        if pending and steps % 3 == 2:  # a new request every 3 steps, while others are mid-decode
            p = pending.pop(0)
            sid = eng.add_request(llm_fp32.tokenize(p), _greedy(12))
            sids[sid] = p
            got[sid] = []
            assert len(eng.scheduler.running) >= 1
        for out in eng.step():
            got[out.seq_id] += out.new_token_ids
        steps += 1
    for sid, p in sids.items():
        assert got[sid] == alone[p], p
        eng.release(sid)


def test_preemption_by_recompute_keeps_outputs(llm_fp32):
    """A pool too small for all requests at once forces preemption; outputs stay identical."""
    prompts = MIXED[:6]
    expected = [o.token_ids for o in llm_fp32.generate(prompts, _greedy(24))]
    small = LLM(progress=False, numerics="exact", dtype="float32", kv_cache_blocks=12, block_size=8, max_model_len=96)
    outs = small.generate(prompts, _greedy(24))
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert small.engine.blocks.num_free == small.engine.blocks.num_blocks


def test_eos_stops_with_reason_stop(llm_fp32):
    out = llm_fp32.chat([{"role": "user", "content": "Say just the word 'yes'."}],
                        SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == 2 and "<|im_end|>" not in out.text


def test_prompt_and_sample_logprobs_match_hf_across_preemption(llm_fp32, hf_smollm):
    eng = llm_fp32.engine
    ids = llm_fp32.tokenize("Paris is the capital of")
    sid = eng.add_request(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=2))
    eng.step()  # prefill: prompt logprobs recorded
    seq = eng.seqs[sid]
    eng.scheduler._preempt(seq)  # lose the KV: the recompute must not duplicate prompt logprobs
    while eng.has_unfinished():
        eng.step()
    eng.release(sid)
    assert seq.num_preemptions == 1
    full = ids + seq.output_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm(torch.tensor([full])).logits[0].float(), -1)
    assert len(seq.prompt_logprobs) == len(ids) and seq.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry = seq.prompt_logprobs[p]
        assert entry is not None and abs(entry[ids[p]] - float(ref[p - 1, ids[p]])) < 1e-3
        assert len(entry) >= 2
    for j, tok in enumerate(seq.output_ids):
        pos = len(ids) + j - 1
        assert abs(seq.logprobs[j][tok] - float(ref[pos, tok])) < 1e-3
        assert tok == int(ref[pos].argmax())
