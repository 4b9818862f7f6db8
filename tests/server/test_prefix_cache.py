"""Prefix caching through ``ratchet serve``: ``usage.prompt_tokens_details.cached_tokens``, the
``cache_salt`` extra, and the /metrics counters."""

from __future__ import annotations

import uuid

import httpx

from tests.server.conftest import MODEL_NAME

BS = 16  # the server's default block size
TIMEOUT = 120  # seconds: CI and shared machines can be slow (httpx waits 5 s by default)


def _metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.base + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith("ratchet:prefix_cache"):
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            out[name] = float(value)
    return out


def test_cached_tokens_in_usage_and_metrics(server, client):
    # a system prompt no other test sends, so the first request cannot hit
    system = f"Session {uuid.uuid4().hex}. You answer in one short sentence about the weather in Oslo. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Will it rain?"}]
    before = _metrics(server)
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BS * BS > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    after = _metrics(server)
    assert after["ratchet:prefix_cache_queries_total"] - before.get("ratchet:prefix_cache_queries_total", 0) == 2 * n
    assert after["ratchet:prefix_cache_hits_total"] - before.get("ratchet:prefix_cache_hits_total", 0) == \
        (n - 1) // BS * BS
    assert 0 < after["ratchet:prefix_cache_hit_rate"] <= 1 and after["ratchet:prefix_cache_blocks"] > 0

    # streamed usage carries it too; a salted request shares only with its own salt
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // BS * BS
    salted = [client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                             extra_body={"cache_salt": "tenant-a"}) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in salted] == [0, (n - 1) // BS * BS]

    # completions: a prompt counts once however many choices; prompt logprobs skip the cache
    prompt = system + " Will it snow?"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    one = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).json()["usage"]
    hit = (one["prompt_tokens"] - 1) // BS * BS
    assert one["prompt_tokens_details"]["cached_tokens"] == 0
    both = httpx.post(server.v1 + "/completions", json={**body, "prompt": [prompt, prompt], "n": 2},
                      timeout=TIMEOUT).json()
    assert both["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * hit > 0
    echo = httpx.post(server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0,
                                                        "echo": True, "logprobs": 1}, timeout=TIMEOUT).json()
    assert echo["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_empty_cache_salt_is_a_400(server):
    r = httpx.post(server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "a", "cache_salt": ""},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_n_choices_compute_the_prompt_once(server):
    """Choices 1..n-1 of a prompt wait for choice 0's prompt K/V and take its full blocks."""
    prompt = f"Session {uuid.uuid4().hex}. Describe the harbour at dawn in three sentences. " * 3
    before = _metrics(server)
    r = httpx.post(server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": prompt, "n": 3, "max_tokens": 3,
                                                     "temperature": 0.9, "seed": 5}, timeout=300).json()
    n = r["usage"]["prompt_tokens"]
    assert len(r["choices"]) == 3 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hits = _metrics(server)["ratchet:prefix_cache_hits_total"] - before.get("ratchet:prefix_cache_hits_total", 0)
    assert hits == 2 * ((n - 1) // BS * BS) > 0
