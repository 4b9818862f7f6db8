"""Every response body, stream chunk and error of the real server validates against OpenAI's
published schemas (tests/server/openai_schema.py): chat with and without logprobs, n=2, a forced
tool call (whole and streamed), json_schema, streamed chat, completions with echo and logprobs,
streamed completions, /v1/models and /v1/models/{id}, and errors (400 and 404)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.openai_schema import violations
from tests.server.test_inprocess import _sse

MSG = [{"role": "user", "content": "Name a color."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}}}

CHAT = [
    {"max_tokens": 6, "temperature": 0},
    {"max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    {"max_tokens": 4, "temperature": 0.8, "seed": 3, "n": 2},
    {"max_tokens": 40, "temperature": 0, "tools": [WEATHER],
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"max_tokens": 30, "temperature": 0, "response_format": PERSON},
]
STREAMED_CHAT = [
    {"max_tokens": 6, "temperature": 0, "stream_options": {"include_usage": True}},
    {"max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1},
    {"max_tokens": 40, "temperature": 0, "tools": [WEATHER], "tool_choice": "required"},
]
COMPLETIONS = [
    {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
    {"prompt": ["One", "Two"], "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True},
    {"prompt": "Score me", "max_tokens": 0, "echo": True, "logprobs": 1},
]
STREAMED_COMPLETIONS = [
    {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "stream_options": {"include_usage": True}},
    {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True},
]
ERRORS = [  # (method, path, body, status)
    ("post", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MSG, "temperature": "hot"}, 400),
    ("post", "/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404),
    ("post", "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "frobnicate": 1}, 400),
    ("get", "/v1/models/no-such-model", None, 404),
]


@pytest.fixture(scope="module")
def responses(server) -> list[tuple[str, str, object]]:
    """(what, shape, body) of every response and chunk the test validates."""
    out: list[tuple[str, str, object]] = []
    post = lambda path, body: httpx.post(server.v1 + path, json={"model": MODEL_NAME, **body}, timeout=300)  # noqa: E731
    for i, body in enumerate(CHAT):
        r = post("/chat/completions", {"messages": MSG, **body})
        assert r.status_code == 200, r.text
        out.append((f"chat {i}", "chat", r.json()))
    for i, body in enumerate(STREAMED_CHAT):
        r = post("/chat/completions", {"messages": MSG, "stream": True, **body})
        events = _sse(r.text)
        assert events[-1] == "[DONE]" and len(events) > 2
        out += [(f"chat stream {i} chunk {j}", "chat_chunk", e) for j, e in enumerate(events[:-1])]
    for i, body in enumerate(COMPLETIONS):
        r = post("/completions", body)
        assert r.status_code == 200, r.text
        out.append((f"completion {i}", "completion", r.json()))
    for i, body in enumerate(STREAMED_COMPLETIONS):
        r = post("/completions", {"stream": True, **body})
        events = _sse(r.text)
        assert events[-1] == "[DONE]" and len(events) > 2
        out += [(f"completion stream {i} chunk {j}", "completion_chunk", e) for j, e in enumerate(events[:-1])]
    out.append(("models", "models", httpx.get(server.v1 + "/models", timeout=60).json()))
    card = httpx.get(server.v1 + f"/models/{MODEL_NAME}", timeout=60)
    assert card.status_code == 200
    out.append(("model card", "model", card.json()))
    for method, path, body, status in ERRORS:
        r = httpx.request(method, server.base + path, json=body, timeout=60)
        assert r.status_code == status, (path, r.text)
        out.append((f"error {status} {path}", "error", r.json()))
    return out


def test_every_response_and_chunk_validates_against_openais_schema(responses):
    found = [f"{what}: {v}" for what, shape, body in responses for v in violations(shape, body)]
    assert len(responses) > 40
    assert not found, f"{len(found)} violations in {len(responses)} responses:\n" + "\n".join(found)


def test_the_validator_catches_what_a_strict_client_rejects(responses):
    """The helper is no stub: the shapes the server used to send are violations."""
    chat = next(b for _, shape, b in responses if shape == "chat")
    bad = {**chat, "choices": [{**chat["choices"][0], "message": {"role": "assistant", "content": "x"}}]}
    assert any("refusal" in v for v in violations("chat", bad))
    assert violations("error", {"error": {"message": "m", "type": "t", "param": None, "code": 400}})
    assert violations("model", {"id": "m", "object": "model", "created": 0})  # owned_by is required
    done = next(b for _, shape, b in responses if shape == "completion")
    assert not violations("completion", done)
    pending = {**done, "choices": [{**done["choices"][0], "finish_reason": None}]}
    assert violations("completion", pending) and not violations("completion_chunk", pending)  # only chunks
