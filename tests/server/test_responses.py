"""``POST /v1/responses`` through the official openai client against a real ``ratchet serve``:
the text equals ``LLM.chat`` on the same conversation (greedy), streams are well-formed Responses
event sequences whose deltas add up to the non-streamed output, function calls make a round trip
through ``previous_response_id``, and unsupported fields are 400s naming them."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from ratchetlm import SamplingParams
from ratchetlm.server.config import ServerConfig
from ratchetlm.server.responses_store import ResponseStore, StoredResponse
from tests.server.conftest import MODEL_NAME

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY = dict(model=MODEL_NAME, temperature=0)


def _greedy(oracle, messages, n):
    """(the choice, the prompt's token ids) of ``LLM.chat``, greedy."""
    out = oracle.chat(messages, SamplingParams(max_tokens=n, temperature=0))[0]
    return out.outputs[0], out.prompt_token_ids


def _events(server, body):
    """The raw SSE stream: (event line, data) pairs."""
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        text = r.read().decode()
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_create_equals_chat(client, oracle):
    ref, prompt = _greedy(oracle, [{"role": "system", "content": "Answer in one word."},
                                   {"role": "user", "content": "Name a fruit."}], 12)
    r = client.responses.create(input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=12,
                                **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.output_text == ref.text
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == len(prompt)
    assert r.usage.output_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    assert r.instructions == "Answer in one word." and r.temperature == 0


def test_input_items_equal_chat_messages(client, oracle):
    conv = [{"role": "user", "content": "Hi, I am Ann."}, {"role": "assistant", "content": "Hello Ann!"},
            {"role": "user", "content": "What is my name?"}]
    ref, _ = _greedy(oracle, conv, 10)
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi, I am Ann."}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello Ann!", "annotations": []}]},
             {"role": "user", "content": "What is my name?"}]
    r = client.responses.create(input=items, max_output_tokens=10, **GREEDY)
    assert r.output_text == ref.text


def test_stream_events_add_up_to_the_response(client, server):
    body = dict(model=MODEL_NAME, input="Name a fruit.", max_output_tokens=40, temperature=0)
    whole = client.responses.create(**body)
    events = _events(server, body)
    assert [e for e, _ in events] == [d["type"] for _, d in events]  # the SSE event: line names the type
    data = [d for _, d in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    types = [d["type"] for d in data]
    assert whole.status == "completed"  # (the client's stream helper wants response.completed)
    last = "response.completed"
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          last]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert deltas == whole.output_text
    assert data[-4]["text"] == deltas and data[-2]["item"]["content"][0]["text"] == deltas
    assert data[-1]["response"]["output"][0]["content"][0]["text"] == deltas
    assert data[-1]["response"]["usage"]["output_tokens"] == whole.usage.output_tokens
    assert all(d["response"]["id"] == data[0]["response"]["id"] for d in data if "response" in d)

    with client.responses.stream(**body) as s:  # the client's own accumulation agrees
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status


def test_max_output_tokens_is_incomplete(client, server):
    r = client.responses.create(model=MODEL_NAME, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    data = [d for _, d in _events(server, dict(model=MODEL_NAME, input="Tell me a long story.", max_output_tokens=3,
                                               temperature=0))]
    assert data[-1]["type"] == "response.incomplete"


def test_function_call_round_trip_with_previous_response_id(client, oracle):
    q = "What is the weather in Paris?"
    first = client.responses.create(input=q, tools=[WEATHER], tool_choice="required", max_output_tokens=40, **GREEDY)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"

    second = client.responses.create(previous_response_id=first.id, max_output_tokens=20, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 22 C"}], **GREEDY)
    conv = [{"role": "user", "content": q},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 22 C"}]
    ref, prompt = _greedy(oracle, conv, 20)
    assert second.output_text == ref.text and second.previous_response_id == first.id
    assert second.usage.input_tokens == len(prompt)

    # the same conversation sent whole (no stored state) is the same request
    third = client.responses.create(max_output_tokens=20, input=[
        {"role": "user", "content": q},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 22 C"}], **GREEDY)
    assert third.output_text == second.output_text

    stored = client.responses.retrieve(second.id)
    assert stored.id == second.id and stored.output_text == second.output_text


def test_streamed_function_call_equals_the_whole_one(client):
    body = dict(input="What is the weather in Rome?", tools=[WEATHER], tool_choice="required", max_output_tokens=40,
                **GREEDY)
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.output_text.delta" not in types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args and done[0].name == "get_weather"
    [call] = [o for o in final.output if o.type == "function_call"]
    [ref] = [o for o in whole.output if o.type == "function_call"]
    assert call.arguments == args == ref.arguments  # grammar-forced: byte for byte


def test_named_tool_choice_and_json_schema(client):
    r = client.responses.create(input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    assert [o.name for o in r.output if o.type == "function_call"] == ["get_weather"]

    class City(BaseModel):
        name: str
        is_capital: bool

    parsed = client.responses.parse(input="Describe Paris as JSON.", text_format=City, max_output_tokens=60, **GREEDY)
    assert isinstance(parsed.output_parsed, City)
    r = client.responses.create(input="Give me a JSON object.", max_output_tokens=30,
                                text={"format": {"type": "json_object"}}, **GREEDY)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Give me a JSON object."}],
                                          max_completion_tokens=30, response_format={"type": "json_object"}, **GREEDY)
    assert r.output_text == chat.choices[0].message.content and r.output_text.startswith("{")


@pytest.mark.parametrize("extra, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_unsupported_fields_are_400_naming_them(server, extra, param):
    r = httpx.post(server.v1 + "/responses", json={"model": MODEL_NAME, "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0].split("[")[0] in err["message"]


def test_unknown_previous_response_and_store_false(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="hi", previous_response_id="resp_nope", max_output_tokens=2, **GREEDY)
    r = client.responses.create(input="hi", store=False, max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="hi", previous_response_id=r.id, max_output_tokens=2, **GREEDY)


def test_store_is_a_bounded_lru():
    store = ResponseStore(2)
    item = StoredResponse({}, [])
    store.put("a", item)
    store.put("b", item)
    assert store.get("a") is item  # a is now the most recent
    store.put("c", item)
    assert store.get("b") is None and store.get("a") is item and store.get("c") is item and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    none = ResponseStore(0)
    none.put("a", item)
    assert none.get("a") is None
    with pytest.raises(ValueError, match="responses_store_size"):
        ServerConfig(responses_store_size=-1)


def test_langchain_use_responses_api(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL_NAME, base_url=server.v1, api_key="unused", use_responses_api=True,
                        temperature=0, max_tokens=40)
    msg = llm.bind_tools([{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                    "parameters")}}],
                         tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)

    class City(BaseModel):
        name: str
        is_capital: bool

    city = llm.with_structured_output(City, method="json_schema").invoke("Describe Paris.")
    assert isinstance(city, City)
