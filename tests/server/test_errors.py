"""Bad inputs get the documented status and the OpenAI error shape; the server stays healthy."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, path, json body or raw bytes, status, param)
    ("malformed_json", CMPL, b'{"model": "test-model", "prompt": ', 400, None),
    ("body_not_object", CMPL, b'["prompt"]', 400, None),
    ("missing_messages", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("empty_messages", CHAT, {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("missing_prompt", CMPL, {"model": MODEL_NAME}, 400, "prompt"),
    ("max_tokens_negative", CMPL, {"model": MODEL_NAME, "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens_zero_no_echo", CMPL, {"model": MODEL_NAME, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("chat_max_tokens_negative", CHAT, {"model": MODEL_NAME, "messages": MSGS, "max_tokens": -1}, 400, "max_tokens"),
    ("temperature_negative", CMPL, {"model": MODEL_NAME, "prompt": "a", "temperature": -1}, 400, "temperature"),
    ("top_p_2", CHAT, {"model": MODEL_NAME, "messages": MSGS, "top_p": 2}, 400, "top_p"),
    ("logprobs_21", CMPL, {"model": MODEL_NAME, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("unknown_model", CMPL, {"model": "gpt-17", "prompt": "a"}, 404, "model"),
    ("prompt_100k_chars", CMPL, {"model": MODEL_NAME, "prompt": "word " * 20000, "max_tokens": 1}, 400, "prompt"),
    ("chat_100k_chars", CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x y " * 25000}]},
     400, "messages"),
    ("bad_token_id", CMPL, {"model": MODEL_NAME, "prompt": [1, 2, 10**9]}, 400, None),
    ("echo_negative_token_id", CMPL, {"prompt": [[-1]], "echo": True}, 400, "prompt"),  # found by the fuzz test
    ("echo_huge_token_id", CMPL, {"prompt": [2**70], "echo": True, "max_tokens": 0}, 400, "prompt"),
    ("wrong_type_max_tokens", CMPL, {"model": MODEL_NAME, "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong_type_temperature", CMPL, {"model": MODEL_NAME, "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("wrong_type_prompt", CMPL, {"model": MODEL_NAME, "prompt": 5}, 400, "prompt"),
    ("wrong_type_messages", CHAT, {"model": MODEL_NAME, "messages": "hi"}, 400, "messages"),
    ("wrong_type_stream", CMPL, {"model": MODEL_NAME, "prompt": "a", "stream": "yes"}, 400, "stream"),
    ("n_zero", CMPL, {"model": MODEL_NAME, "prompt": "a", "n": 0}, 400, "n"),
    ("stream_options_without_stream", CMPL, {"model": MODEL_NAME, "prompt": "a",
                                             "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("queue_over_limit", CMPL, {"model": MODEL_NAME, "prompt": ["a"] * 40, "max_tokens": 1}, 400, "n"),
    # issue 40: like an out-of-vocabulary id anywhere else
    ("stop_token_ids_out_of_vocab", CMPL, {"prompt": "a", "stop_token_ids": [999999]}, 400, "stop_token_ids"),
    ("stop_token_ids_negative", CHAT, {"messages": MSGS, "stop_token_ids": [2, -1]}, 400, "stop_token_ids"),
    # OpenAI's rules: only an assistant message's content may be null; a tool message names its call
    ("user_content_null", CHAT, {"messages": [{"role": "user", "content": None}]}, 400,
     "messages.0.content"),
    ("user_content_missing", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("tool_without_tool_call_id", CHAT, {"messages": [*MSGS, {"role": "tool", "content": "21"}]}, 400,
     "messages.1.tool_call_id"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(server, path, body, status, param):
    raw = isinstance(body, bytes)
    kw = {"content": body, "headers": {"content-type": "application/json"}} if raw else {"json": body}
    r = httpx.post(server.base + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == str(status) and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] is not None and param in (err["param"], err["param"].split(".")[0]), err
    h = server.health()
    assert h.status_code == 200
    assert h.json()["kv_blocks_free"] == h.json()["kv_blocks_total"]  # a refused request holds nothing


def test_unknown_route_is_openai_shaped(server):
    r = httpx.get(server.base + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "404"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="a", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
