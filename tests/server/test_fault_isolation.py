"""One request must never fail another (issue 12, defect 1), against a real ``ratchet serve``."""

from __future__ import annotations

import asyncio
import json

import httpx

from ratchetlm import SamplingParams
from tests.server.conftest import MODEL_NAME, wait_idle
from tests.server.fault_launcher import POISON_TOP_K

PROMPTS = [f"Question {i}: what is {i} times three? Answer:" for i in range(8)]
MAX_TOKENS = 12


async def _stream(c: httpx.AsyncClient, base: str, path: str, body: dict) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, error event) of one streamed request; asserts it ends with [DONE]."""
    text, reason, error, done = [], None, None, False
    async with c.stream("POST", base + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                continue
            ch = chunk["choices"][0]
            text.append(ch.get("text") or ch.get("delta", {}).get("content") or "")
            reason = ch["finish_reason"] or reason
    assert done, "every stream ends with [DONE]"
    return "".join(text), reason, error


def _cmpl(prompt: str, **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def test_extreme_sampling_values_are_served_and_harm_no_one(server, oracle):
    """temperature 1e-38 / top_p 1e-46 used to NaN the sampler and fail every request in flight."""
    greedy = [o.text for o in oracle.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
    chat_msgs = [{"role": "user", "content": "Name a fruit."}]
    chat_ref = oracle.chat(chat_msgs, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].text

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            streams = [asyncio.ensure_future(_stream(c, server.base, "/v1/completions", _cmpl(p)))
                       for p in PROMPTS[:3]]
            extreme = await asyncio.gather(
                c.post(server.base + "/v1/completions", json=_cmpl(PROMPTS[0], temperature=1e-38, seed=3)),
                c.post(server.base + "/v1/completions", json=_cmpl(PROMPTS[1], temperature=1.0, top_p=1e-46)),
                c.post(server.base + "/v1/chat/completions",
                       json={"model": MODEL_NAME, "messages": chat_msgs, "max_tokens": MAX_TOKENS,
                             "temperature": 1e-38}),
            )
            return await asyncio.gather(*streams), extreme

    streams, (tiny_t, tiny_p, chat) = asyncio.run(run())
    for (text, _reason, error), ref in zip(streams, greedy, strict=True):
        assert error is None and text == ref
    assert tiny_t.status_code == 200 and tiny_t.json()["choices"][0]["text"] == greedy[0]  # the greedy limit
    assert tiny_p.status_code == 200 and tiny_p.json()["choices"][0]["text"] == greedy[1]  # only the top token
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == chat_ref


def test_a_request_that_makes_the_step_raise_fails_alone(hardened, oracle):
    """Fault injection: the sampler raises for one request's parameters. That request fails with
    a clear error (in-stream, and as a 500 when not streamed); 8 concurrent requests finish
    exactly as in a clean run; every KV block comes back; the server keeps serving."""
    refs = [o.text for o in oracle.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
    poison = {"temperature": 1.0, "top_k": POISON_TOP_K}
    base = hardened.base

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32),
                                     headers=hardened.headers) as c:
            good = [asyncio.ensure_future(_stream(c, base, "/v1/completions", _cmpl(p))) for p in PROMPTS]
            bad_stream = asyncio.ensure_future(_stream(c, base, "/v1/completions", _cmpl("Poison", **poison)))
            bad_chat = asyncio.ensure_future(c.post(base + "/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "Poison"}], "max_tokens": 4, **poison}))
            return await asyncio.gather(*good), await bad_stream, await bad_chat

    good, (_, _, err), bad_chat = asyncio.run(run())
    assert [g[0] for g in good] == refs
    assert all(g[2] is None for g in good)
    assert err is not None and "injected sampler fault" in err["message"] and err["code"] == "500"
    assert bad_chat.status_code == 500, bad_chat.text
    assert "injected sampler fault" in bad_chat.json()["error"]["message"]
    h = wait_idle(hardened, within=5.0)
    assert h["kv_blocks_free"] == h["kv_blocks_total"], h
    metrics = httpx.get(base + "/metrics").text
    assert 'ratchet:request_success_total{finished_reason="error",model_name="test-model"} 2.0' in metrics
    assert httpx.get(base + "/health").json()["http_requests_active"] == 0
    again = httpx.post(base + "/v1/completions", json=_cmpl(PROMPTS[0]), timeout=120, headers=hardened.headers)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == refs[0]
