"""Greedy generation equals HF transformers; batching, continuous batching and preemption
never change a request's output."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import SamplingParams
from tests.models.tiny import engine_on, run

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
def hf_next_token_logprobs(hf_smollm):
    """HF transformers' log-softmax after every prefix of ``tokens`` (row ``i``: the next token after
    ``tokens[:i + 1]``), one forward per distinct sequence, shared by both engines below."""
    done: dict[tuple[int, ...], torch.Tensor] = {}

    def rows(tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
        if tuple(tokens) not in done:
            with torch.no_grad():
                done[tuple(tokens)] = torch.log_softmax(hf_smollm(torch.tensor([tokens])).logits[0].float(), -1)
        return done[tuple(tokens)]

    return rows


# The block kernels (the default) over 64 tokens; the dense fp32 matmuls over 24: a matmul path is the same code at
# every position (the positions past 24 exercise the attention and the cache, which both engines share, and the
# kernel point covers them), so the dense point's extra 40 tokens were ~60% of its CPU for no other path.
@pytest.mark.parametrize("engine, n", [("llm_fp32", 64), ("llm_fp32_dense", 24)])
def test_greedy_matches_hf_greedy(engine, n, hf_next_token_logprobs, request):
    """Our greedy continuation (EOS, id 2, or ``n`` tokens) is HF's: every generated token is HF's
    argmax after the prompt and the tokens before it, with HF's log-prob, so HF's greedy decoding
    produces the same list and stops where we stop (EOS is HF's argmax there and nowhere before) — with
    the GGUF block kernels (the default) and with dense fp32 matmuls. (HF ``generate`` would make the
    same check one token per forward: 320 sequential HF decode steps, ~35 s of CPU; one HF forward per
    prompt reads the same distribution at every position.)"""
    llm_fp32 = request.getfixturevalue(engine)
    outs = llm_fp32.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, logprobs=1))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids, got = llm_fp32.tokenize(prompt), out.outputs[0]
        hf = hf_next_token_logprobs(ids + got.token_ids)[len(ids) - 1:-1]  # [generated, vocab]: rows before each
        assert hf.argmax(-1).tolist() == got.token_ids, prompt
        ours = torch.tensor([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)])
        torch.testing.assert_close(ours, hf[torch.arange(len(got.token_ids)), got.token_ids], atol=1e-3, rtol=0)
        assert 2 not in got.token_ids[:-1]
        assert got.finish_reason == ("stop" if got.token_ids[-1] == 2 else "length")
        assert got.finish_reason == "stop" or len(got.token_ids) == n
        visible = got.token_ids[:-1] if got.finish_reason == "stop" else got.token_ids
        assert got.text == llm_fp32.tokenizer.decode(visible)
    assert sum(len(o.outputs[0].token_ids) for o in outs) >= 5 * n * 5 // 8  # mostly full-length generations


# the most tokens a test below asks of each MIXED prompt alone (the batched test: 4 + 2i, the continuous one: 12
# of the first 4, preemption: 16 of the first 6)
ALONE_TOKENS = [16, 16, 16, 16, 16, 16, 16, 18]


@pytest.fixture(scope="module")
def alone(llm_fp32) -> dict[str, list[int]]:
    """Each MIXED prompt's greedy tokens with the request alone, run once for the module at the longest length
    a test asks for (greedy with ``ignore_eos``: the first ``n`` tokens of a longer run are the run of ``n``):
    the oracle of the three batching tests below (each ran its own alone runs before, 152 decode steps in all
    where these take 130)."""
    return {p: llm_fp32.generate(p, _greedy(n))[0].token_ids for p, n in zip(MIXED, ALONE_TOKENS, strict=True)}


def test_mixed_batch_equals_each_alone(llm_fp32, alone):
    # every request a different length (4 to 18 tokens; 8 to 29 before): the batch loses a request every 2
    # steps (every 3 before), so each request decodes beside a changing set of others
    params = [_greedy(4 + 2 * i) for i in range(len(MIXED))]
    together = llm_fp32.generate(MIXED, params)
    for prompt, p, out in zip(MIXED, params, together, strict=True):
        assert out.token_ids == alone[prompt][: p.max_tokens], prompt
        assert len(out.token_ids) == p.max_tokens
    assert llm_fp32.engine.blocks.num_free == llm_fp32.engine.blocks.num_blocks


def test_requests_added_mid_decode(llm_fp32, alone):
    """Continuous batching: requests join while others are decoding; outputs are unchanged."""
    eng = llm_fp32.engine
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
        assert got[sid] == alone[p][:12], p
        eng.release(sid)


def test_preemption_by_recompute_keeps_outputs(llm_fp32, alone):
    """A pool too small for all requests at once forces preemption; outputs stay identical."""
    prompts = MIXED[:6]
    # 16 tokens each (24 before): ~55 prompt tokens + 96 generated need ~22 blocks of 8 at the end, 12 exist
    expected = [alone[p][:16] for p in prompts]  # (each alone: the batch equals it, test_mixed_batch_...)
    # an engine of its own (12 blocks of 8 tokens) on the loaded model
    small = engine_on(llm_fp32, numerics="exact", kv_cache_blocks=12, block_size=8, max_model_len=96)
    assert run(small, [llm_fp32.tokenize(p) for p in prompts], 16) == expected
    assert small.scheduler.num_preemptions > 0
    assert small.blocks.num_free == small.blocks.num_blocks


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
