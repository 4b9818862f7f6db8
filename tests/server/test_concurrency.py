"""32 concurrent streaming clients, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from ratchetlm import SamplingParams
from tests.server.conftest import MODEL_NAME, wait_idle

PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(32)]


async def _stream_one(client: httpx.AsyncClient, base: str, prompt: str) -> tuple[str, str, int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, reason, tokens, done = [], None, None, False
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
                reason = chunk["choices"][0]["finish_reason"] or reason
            else:
                tokens = chunk["usage"]["completion_tokens"]
    assert done
    return "".join(text), reason, tokens


def test_32_concurrent_streams_are_correct_and_independent(server, oracle):
    refs = oracle.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(_stream_one(c, server.base, p) for p in PROMPTS))

    results = asyncio.run(run())
    for (text, reason, ntok), ref in zip(results, refs, strict=True):
        assert text == ref.text
        assert reason == ref.finish_reason
        assert ntok == len(ref.token_ids)
    h = wait_idle(server, within=2.0)
    assert h["requests_running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"], h


def test_disconnect_aborts_request_and_frees_blocks(server, client):
    body = {"model": MODEL_NAME, "prompt": "Write a very long story about a dragon.", "max_tokens": 500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", server.base + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got >= 3:
                break
        h = server.health().json()
        assert h["requests_running"] == 1 and h["kv_blocks_free"] < h["kv_blocks_total"]
        closed_at = time.monotonic()
    # leaving the with-block closed the connection mid-stream
    h = wait_idle(server, within=1.0)
    elapsed = time.monotonic() - closed_at
    assert h["requests_running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"], (h, elapsed)
    metrics = httpx.get(server.base + "/metrics").text
    assert 'ratchet:request_success_total{finished_reason="abort",model_name="test-model"}' in metrics
    # the server keeps serving
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_nonstream_client_timeout_aborts_request(server):
    # 1000 tokens (the server's max_model_len allows ~1018 here) take ~4 s at the bundled model's
    # 250 tok/s on 2 cores: well past the 1 s read timeout (500 tokens in 3 s was a race once decode sped up)
    body = {"model": MODEL_NAME, "prompt": "List every prime number.", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    h = wait_idle(server, within=1.0)  # the client gave up and closed: the server aborts the request
    assert h["requests_running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"], h


def _metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_metrics_after_traffic(server):
    text = httpx.get(server.base + "/metrics").text
    for name in ("ratchet:prompt_tokens_total", "ratchet:generation_tokens_total",
                 "ratchet:time_to_first_token_seconds_count", "ratchet:inter_token_latency_seconds_count",
                 "ratchet:e2e_request_latency_seconds_count"):
        assert _metric(text, name) > 0, name
    assert _metric(text, "ratchet:num_requests_running") == 0
    assert _metric(text, "ratchet:kv_cache_usage_perc") == 0.0
    assert _metric(text, "ratchet:kv_cache_blocks_total") == 384


def test_nonstream_disconnects_end_their_handlers(server):
    """Non-streaming clients that go away: their handlers return (counted as aborted) instead of
    waiting forever for deltas of a request the engine already freed."""
    before = _abort_count(httpx.get(server.base + "/metrics").text)
    body = {"model": MODEL_NAME, "prompt": "Count to one thousand:", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}

    async def one():
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=1.5)) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(server.base + "/v1/completions", json=body)

    async def run():
        await asyncio.gather(*(one() for _ in range(5)))

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while _abort_count(httpx.get(server.base + "/metrics").text) < before + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort_count(httpx.get(server.base + "/metrics").text) == before + 5, "every handler ended"
    h = wait_idle(server, within=2.0)
    assert h["kv_blocks_free"] == h["kv_blocks_total"], h


def _abort_count(text: str) -> float:
    name = 'ratchet:request_success_total{finished_reason="abort",model_name="test-model"}'
    return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name)), 0.0)
