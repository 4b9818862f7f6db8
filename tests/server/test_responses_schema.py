"""Every ``/v1/responses`` body and stream event, and the request bodies the tests send, validate
against OpenAI's published schemas (tests/server/openai_schema.py): a strict client accepts them."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.openai_schema import violations

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}
REQUESTS = {
    "text": {"input": "Name a fruit.", "instructions": "Answer briefly.", "max_output_tokens": 16},
    "incomplete": {"input": "Tell me a long story.", "max_output_tokens": 16},
    "tool_required": {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
                      "max_output_tokens": 40},
    "tool_named": {"input": "Weather in Oslo?", "tools": [WEATHER], "max_output_tokens": 40,
                   "tool_choice": {"type": "function", "name": "get_weather"}},
    "json_schema": {"input": "Describe Paris.", "max_output_tokens": 40, "text": {"format": {
        "type": "json_schema", "name": "city", "strict": True, "schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "is_capital": {"type": "boolean"}},
            "required": ["name", "is_capital"], "additionalProperties": False}}}},
    "items": {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}],
              "max_output_tokens": 16, "metadata": {"k": "v"}, "store": False},
}


def _post(server, body):
    return httpx.post(server.v1 + "/responses", json=body, timeout=120)


def _stream(server, body):
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        text = r.read().decode()
    return [json.loads(block.split("data: ", 1)[1]) for block in text.strip().split("\n\n")]


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_bodies_and_events_validate(server, name):
    body = {"model": MODEL_NAME, "temperature": 0, **REQUESTS[name]}
    assert violations("CreateResponse", body) == []  # the test asks what OpenAI's API would accept
    r = _post(server, body)
    assert r.status_code == 200, r.text
    assert violations("Response", r.json()) == []
    events = _stream(server, body)
    for ev in events:
        assert violations("ResponseStreamEvent", ev) == [], ev["type"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_round_trip_and_retrieved_responses_validate(server):
    first = _post(server, {"model": MODEL_NAME, "temperature": 0, **REQUESTS["tool_required"]}).json()
    call = next(o for o in first["output"] if o["type"] == "function_call")
    body = {"model": MODEL_NAME, "temperature": 0, "previous_response_id": first["id"], "max_output_tokens": 16,
            "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]}
    assert violations("CreateResponse", body) == []
    second = _post(server, body).json()
    assert violations("Response", second) == []
    got = httpx.get(server.v1 + f"/responses/{second['id']}", timeout=30).json()
    assert got == second


def test_a_failed_stream_reports_schema_valid_events():
    """The error path's events (built without a failing engine: the shapes are what matter)."""
    from types import SimpleNamespace

    from ratchetlm.server.protocol_responses import ResponsesRequest
    from ratchetlm.server.serving_responses import ResponsesPlan

    plan = ResponsesPlan.__new__(ResponsesPlan)
    plan.req = ResponsesRequest.model_validate({"input": "hi"})
    plan.ctx = SimpleNamespace(model_name="m", sampling_defaults={})
    plan.id, plan.created = "resp_1", 0
    failed = plan.snapshot("failed", [])
    failed["error"] = {"code": "server_error", "message": "boom"}
    assert violations("ResponseStreamEvent", {"type": "response.failed", "response": failed,
                                              "sequence_number": 3}) == []
    assert violations("ResponseStreamEvent", {"type": "error", "code": "500", "message": "boom", "param": None,
                                              "sequence_number": 2}) == []
