"""Limits, auth, content types, connection deadlines and the OpenAPI schema of a real ``ratchet serve``
(issue 12, defects 3, 4, 6, 7). ``hardened`` runs with every limit small and an API key."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def _post(srv, path: str, body: Any, headers: dict | None = None, **kw) -> httpx.Response:
    """``body``: a dict (sent as JSON), raw bytes, or an iterator of byte chunks (sent chunked)."""
    h = {**srv.headers, **(headers or {})}
    if not isinstance(body, dict):
        return httpx.post(srv.base + path, content=body, headers={"content-type": "application/json", **h},
                          timeout=120, **kw)
    return httpx.post(srv.base + path, json=body, headers=h, timeout=120, **kw)


def _error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == str(status) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


# ---------------------------------------------------------------------- defect 3: lone surrogates

@pytest.mark.parametrize("path,raw,param", [
    (CMPL, b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    (CMPL, b'{"prompt": ["ok", "x\\udfffy"], "max_tokens": 1}', "prompt.1"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}', "messages.0.content"),
    (CMPL, b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 1}', "stop.0"),
], ids=["prompt", "prompt_list", "chat_content", "stop"])
def test_lone_surrogate_is_a_400_naming_the_field(server, path, raw, param):
    _error(_post(server, path, raw), 400, param)
    assert server.health().status_code == 200


# ---------------------------------------------------------------------- defect 4: limits

def test_limits_answer_400_or_413_in_openai_shape(hardened):
    base = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    assert "at most 4" in _error(_post(hardened, CMPL, {**base, "stop": ["a"] * 5}), 400, "stop")
    assert "at most 32" in _error(_post(hardened, CMPL, {**base, "stop": ["x" * 33]}), 400, "stop")
    assert "at most 8" in _error(_post(hardened, CMPL, {**base, "prompt": ["a", "b", "c"], "n": 3}), 400, "n")
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 9}
    _error(_post(hardened, CHAT, chat), 400, "n")
    for name, value in (("temperature", 1e308), ("temperature", -0.5), ("top_p", 0.0), ("min_p", 1.5),
                        ("seed", 2**64), ("max_tokens", 10**30)):
        _error(_post(hardened, CMPL, {**base, name: value}), 400, name)
    for literal in (b"Infinity", b"-Infinity", b"NaN"):
        _error(_post(hardened, CMPL, b'{"prompt": "hi", "temperature": ' + literal + b"}"), 400, "temperature")
    # body size: refused by its Content-Length before it is read, and as it streams in (chunked)
    big = b'{"prompt": "' + b"x" * 70_000 + b'"}'
    assert "65536" in _error(_post(hardened, CMPL, big), 413)
    _error(_post(hardened, CMPL, iter([big[:40_000], big[40_000:]])), 413)
    assert hardened.health().status_code == 200


def test_choices_that_can_never_fit_the_queue_are_a_400_not_a_503(server):
    # the shared server queues at most 36 requests; 40 choices could never be accepted
    msg = _error(_post(server, CMPL, {"model": MODEL_NAME, "prompt": ["a"] * 40, "max_tokens": 1}), 400, "n")
    assert "can never be accepted" in msg


def test_max_tokens_is_clamped_to_the_context(hardened):
    r = _post(hardened, CMPL, {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 10**12,
                               "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 96 and r.json()["choices"][0]["finish_reason"] == "length"


def test_a_huge_prompt_is_refused_by_its_length_while_health_answers(server):
    """A multi-megabyte prompt (about a second to tokenize whole) is refused on its length alone,
    without tokenizing it (server/prepare.py: encode_bounded), naming max_model_len, and /health
    answers meanwhile. That preparation never blocks other requests is
    tests/server/test_preparation.py's (with a tokenizer slow on purpose)."""
    prompt = "lorem ipsum dolor sit amet " * 100_000  # 2.7 MB
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", _post(server, CMPL, {"prompt": prompt})))
    t.start()
    while t.is_alive():
        assert server.health().status_code == 200
        time.sleep(0.05)
    t.join()
    msg = _error(result["r"], 400, "prompt")
    assert "max_model_len is 1024" in msg and "2700000 characters" in msg, msg


# ---------------------------------------------------------------------- defect 6: auth, 415, deadlines

def test_api_key_is_required_on_v1(hardened):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="}):
        r = httpx.post(hardened.base + CMPL, json=body, headers=headers, timeout=30)
        assert "API key" in _error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(hardened.base + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(hardened.base + "/v1/models", headers=hardened.headers, timeout=30).status_code == 200
    assert _post(hardened, CMPL, body).status_code == 200
    key = hardened.headers["Authorization"][len("Bearer "):]
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110, 11.1)
        r = httpx.get(hardened.base + "/v1/models", headers={"Authorization": f"{scheme} {key}"}, timeout=30)
        assert r.status_code == 200, (scheme, r.text)
    assert hardened.health().status_code == 200  # probes need no key
    assert httpx.get(hardened.base + "/metrics", timeout=30).status_code == 200


def test_openai_client_sends_the_key(hardened):
    import openai

    ok = openai.OpenAI(base_url=hardened.v1, api_key=hardened.headers["Authorization"][7:], max_retries=0)
    assert ok.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1).choices[0].text is not None
    bad = openai.OpenAI(base_url=hardened.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_post_bodies_must_be_json(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(server.base + CMPL, content=b'{"prompt": "hi", "max_tokens": 1}', headers=headers, timeout=30)
    assert "application/json" in _error(r, 415)
    r = httpx.post(server.base + CMPL, content=b'{"prompt": "hi", "max_tokens": 1}', timeout=30,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_idle_and_half_open_connections_are_closed(hardened):
    """--idle-timeout 2: connections that send nothing, half a request head, or a head and half a
    body, are closed by the server; a kept-alive connection closes after its response."""
    socks = []
    for i in range(30):
        s = socket.create_connection(("127.0.0.1", int(hardened.base.rsplit(":", 1)[1])))
        if i % 3 == 1:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        elif i % 3 == 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: " + hardened.headers["Authorization"].encode() +
                      b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        s.settimeout(15)
        socks.append(s)
    t0 = time.monotonic()
    for i, s in enumerate(socks):
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        if i % 3 == 2:
            assert b"408" in data.split(b"\r\n", 1)[0], data[:200]  # the handler timed out the body
        s.close()
    assert time.monotonic() - t0 < 8, "every connection was closed within the idle timeout (plus slack)"
    assert hardened.health().status_code == 200


# ---------------------------------------------------------------------- defect 7: OpenAPI

def test_openapi_declares_the_request_bodies(server):
    schema = httpx.get(server.base + "/openapi.json", timeout=30).json()
    comps = schema["components"]["schemas"]
    for path, model, fields in ((CMPL, "CompletionRequest", {"prompt", "max_tokens", "echo", "logprobs"}),
                                (CHAT, "ChatCompletionRequest", {"messages", "max_completion_tokens", "top_logprobs"})):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}"
        props = comps[model]["properties"]
        assert fields | {"temperature", "top_p", "n", "stop", "stream", "seed"} <= set(props)
        assert model == "CompletionRequest" or "ChatMessage" in comps
    assert comps["CompletionRequest"]["required"] == ["prompt"]
