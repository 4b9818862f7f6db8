"""The official openai client against a real ``ratchet serve``: greedy stream == non-stream ==
``LLM.generate``, usage counts, n>1 with seeds, logprobs, echo / prompt scoring."""

from __future__ import annotations

import math

import httpx

from ratchetlm import SamplingParams
from tests.server.conftest import MODEL_NAME

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit."}]


def test_health_and_models(server):
    h = server.health()
    assert h.status_code == 200 and h.json()["status"] == "ok"
    models = httpx.get(server.v1 + "/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]


def test_completion_stream_equals_nonstream_equals_generate(client, oracle):
    ref = oracle.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0))[0]
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)

    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    usage_chunk, text_chunks = chunks[-1], chunks[:-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(ref.token_ids)
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert text_chunks[0].choices[0].text != ""  # no empty chunk before the first real token
    reasons = [c.choices[0].finish_reason for c in text_chunks]
    assert reasons[-1] == ref.finish_reason and all(r is None for r in reasons[:-1])
    assert all(c.usage is None for c in text_chunks)


def test_chat_stream_equals_nonstream_equals_generate(client, oracle):
    ref = oracle.chat(CHAT, SamplingParams(max_tokens=10, temperature=0))[0]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content  # role rides on the first real token
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == ref.finish_reason and all(r is None for r in reasons[:-1])


def test_n2_with_seed_uses_seed_plus_choice(client, oracle):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    both = client.completions.create(n=2, seed=7, **kw)
    assert [c.index for c in both.choices] == [0, 1]
    again = client.completions.create(n=2, seed=7, **kw)
    assert [c.text for c in again.choices] == [c.text for c in both.choices]  # reproducible
    for i, seed in enumerate((7, 8)):
        ref = oracle.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=1.0, seed=seed))[0]
        assert both.choices[i].text == ref.text
    assert both.choices[0].text != both.choices[1].text
    assert both.usage.completion_tokens == sum(
        len(oracle.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=1.0, seed=s))[0].token_ids)
        for s in (7, 8))


def test_completion_logprobs_match_engine(client, oracle):
    ref = oracle.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=2))[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for tid, got, top, want in zip(ref.token_ids, lp.token_logprobs, lp.top_logprobs, ref.logprobs, strict=True):
        assert math.isclose(got, want[tid], abs_tol=1e-4)
        assert max(top.values()) == got  # greedy: the sampled token is the most likely one
        assert 2 <= len(top) <= 3
    assert "".join(lp.tokens) == out.choices[0].text


def test_echo_prompt_scoring_max_tokens_0(client, oracle):
    """lm-eval loglikelihood: echo=True, max_tokens=0 returns the prompt's token logprobs only."""
    ids = oracle.tokenize(PROMPT)
    ref = oracle.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    ch = out.choices[0]
    assert ch.text == PROMPT
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert len(ch.logprobs.tokens) == len(ids) and ch.logprobs.token_logprobs[0] is None
    for i in range(1, len(ids)):
        assert math.isclose(ch.logprobs.token_logprobs[i], ref.prompt_logprobs[i][ids[i]], abs_tol=1e-4)
    # lm-eval's other form: echo with max_tokens=1 returns prompt + one generated token
    one = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert len(one.choices[0].logprobs.tokens) == len(ids) + 1
    assert one.choices[0].logprobs.token_logprobs[:-1] == ch.logprobs.token_logprobs
    assert one.choices[0].text == PROMPT + ref.text


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy picks the top token


def test_batched_prompts_and_token_ids(client, oracle):
    prompts = ["Water is", "The sun is"]
    refs = oracle.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r.text for r in refs]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[oracle.tokenize(p) for p in prompts], max_tokens=5,
                                       temperature=0)
    assert [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)] == [r.text for r in refs]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


def test_echo_streamed_equals_nonstreamed(client):
    """Streamed echo: the prompt (and its logprobs) ride on the first chunk; the joined stream
    equals the non-streamed echo, text and logprobs alike, also for prompt scoring."""
    for max_tokens in (0, 5):
        kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
        whole = client.completions.create(**kw).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
        assert chunks[0].text.startswith(PROMPT)
        assert "".join(c.text for c in chunks) == whole.text
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        lps = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
        offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        assert tokens == whole.logprobs.tokens
        assert lps == whole.logprobs.token_logprobs
        assert offsets == whole.logprobs.text_offset
        assert [c.finish_reason for c in chunks][-1] == whole.finish_reason
