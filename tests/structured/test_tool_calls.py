"""Tool-call formats: what a family writes is parsed back (whole and streamed), and the grammar for
tool_choice required / named forces calls whose arguments validate against the function's schema."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import jsonschema
import pytest

from ratchetlm import SamplingParams
from ratchetlm.sampling_params import StructuredOutputsParams
from ratchetlm.structured.tool_calls import FORMATS, ToolCall, functions_from, tool_format
from ratchetlm.structured.tool_stream import StreamingToolParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}
CALLS = [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), ToolCall("get_time", '{"zone": "CET"}')]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rendered_calls_parse_back(name):
    fmt = tool_format(name)
    text = "Let me check.\n" + fmt.render(CALLS) if name != "llama3_json" else fmt.render(CALLS)
    content, calls = fmt.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, json.loads(c.arguments)) for c in CALLS]
    assert content == ("Let me check." if name != "llama3_json" else None)
    assert fmt.parse("Just text, no calls.") == ("Just text, no calls.", [])


def _stream(parser: StreamingToolParser, text: str, step: int = 3) -> tuple[str, list[list], list]:
    """Feed ``text`` ``step`` characters at a time: (content, per-feed deltas, final deltas)."""
    content, per_feed = "", []
    for i in range(0, len(text), step):
        c, deltas = parser.feed(text[i:i + step])
        content += c
        per_feed.append(deltas)
    rest, final = parser.finish()
    return content + rest, per_feed, final


def _assemble(deltas) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"name": None, "args": ""})
        c["name"] = c["name"] or d.name
        c["args"] += d.arguments
    return [(c["name"], json.loads(c["args"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_streamed_text_splits_into_content_and_calls(name):
    fmt = tool_format(name)
    prefix = "Checking now. " if name != "llama3_json" else ""
    text = prefix + fmt.render(CALLS)
    content, per_feed, final = _stream(StreamingToolParser(fmt), text)
    assert content == prefix
    assert _assemble([d for f in per_feed for d in f] + final) == [(c.name, json.loads(c.arguments)) for c in CALLS]
    # streamed as written: each call's head before its arguments end, its arguments in several pieces
    assert not final
    first_head = next(i for i, f in enumerate(per_feed) if any(d.id for d in f))
    assert first_head < len(per_feed) // 2
    assert sum(1 for f in per_feed for d in f if d.index == 0 and d.id is None) > 3
    # text that only looks like the start of a call is released at the end
    p = StreamingToolParser(fmt)
    assert p.feed("a < b and {x}")[0] + p.finish()[0] == "a < b and {x}"


def test_streamed_arguments_are_the_grammar_forced_text_byte_for_byte():
    fmt = tool_format("smollm2")  # forced calls are written with json.dumps' separators
    tricky = ToolCall("note", json.dumps({"text": 'say " } then ] and {', "path": "C:\\", "n": [1, {"k": []}]}))
    calls = [CALLS[0], tricky, CALLS[1]]
    _, per_feed, final = _stream(StreamingToolParser(fmt, calls_only=True), fmt.render(calls), step=1)
    assert not final
    args: dict[int, str] = {}
    for d in [d for f in per_feed for d in f]:
        args[d.index] = args.get(d.index, "") + d.arguments
    assert [args[i] for i in range(3)] == [c.arguments for c in calls]


def test_streaming_keeps_one_call_without_parallel_calls_and_reads_odd_calls_at_the_end():
    fmt = tool_format("smollm2")
    _, per_feed, final = _stream(StreamingToolParser(fmt, calls_only=True, max_calls=1), fmt.render(CALLS))
    assert _assemble([d for f in per_feed for d in f] + final) == [("get_weather", {"city": "Paris",
                                                                                   "unit": "celsius"})]
    # arguments first, or as a JSON string: not streamable, read whole when the choice ends
    for text in ['<tool_call>[{"arguments": {"zone": "CET"}, "name": "get_time"}]</tool_call>',
                 '<tool_call>[{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}]</tool_call>']:
        content, per_feed, final = _stream(StreamingToolParser(fmt), text)
        assert content == "" and not any(per_feed) and _assemble(final) == [("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("name", ["smollm2", "hermes"])
def test_an_empty_call_list_means_no_call(name):
    fmt = tool_format(name)
    for text, content in [("<tool_call>[]</tool_call>", ""),
                          ("No tool fits. <tool_call>[]</tool_call>", "No tool fits.")]:
        assert fmt.parse(text) == (content, [])
        streamed, per_feed, final = _stream(StreamingToolParser(fmt), text)
        assert streamed.strip() == content and not any(per_feed) and not final


def test_malformed_calls_stay_content():
    fmt = tool_format("smollm2")
    assert fmt.parse('<tool_call>[{"name": "f", "arguments": ') == ('<tool_call>[{"name": "f", "arguments": ', [])
    assert tool_format("llama3_json").parse('{"no_name": 1}') == ('{"no_name": 1}', [])


def test_parser_names_and_template_guess():
    assert tool_format("qwen").name == "hermes" and tool_format("llama3").name == "llama3_json"
    assert tool_format(None, "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert tool_format("auto", "<|python_tag|>").name == "llama3_json"
    assert tool_format(None, None).name == "smollm2"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_format("mistral")
    with pytest.raises(ValueError, match="unique"):
        functions_from([WEATHER, WEATHER])
    with pytest.raises(ValueError, match=r"tools\[0\].function.name"):
        functions_from([{"type": "function", "function": {"name": "has space"}}])


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("many", [False, True])
def test_the_grammar_forces_valid_calls(llm_fp32, name, many):
    fmt = tool_format(name)
    funcs = functions_from([WEATHER, TIME])
    chosen = funcs if many else funcs[:1]
    prompt = llm_fp32.apply_chat_template([{"role": "user", "content": "What's the weather in Paris?"}],
                                          tools=[WEATHER, TIME], tool_parser=name)
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured=StructuredOutputsParams(grammar=fmt.grammar(chosen, many)))
    out = llm_fp32.generate(prompt, params)[0]
    # one call ends with the grammar; "one or more" may run to max_tokens (a small model repeats
    # itself), and the calls completed before the cut are the result
    assert out.finish_reason == "stop" or many, out.text
    _, calls = fmt.parse(out.text)
    assert calls and (many or len(calls) == 1)
    schemas = {f.name: f.parameters for f in chosen}
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_tools_reach_the_prompt(llm_fp32):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALLS[0].as_openai()]},
            {"role": "tool", "tool_call_id": CALLS[0].id, "content": '{"temp": 21}'}]
    text = llm_fp32.apply_chat_template(msgs, tools=[WEATHER])
    assert "get_weather" in text and '<tool_call>[{"name": "get_weather"' in text
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in text


# A Qwen-2.5-like template (written for this test) that renders tools and calls itself.
NATIVE = """{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{%- for tc in m.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_renders_tools_gets_them_and_parsed_arguments(smollm_tokenizer):
    from ratchetlm import LLM

    tok = copy.copy(smollm_tokenizer)
    tok.chat_template = NATIVE
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALLS[0].as_openai()]},
            {"role": "tool", "tool_call_id": CALLS[0].id, "content": '{"temp": 21}'}]
    text = LLM.apply_chat_template(SimpleNamespace(tokenizer=tok), msgs, tools=[WEATHER])
    assert "You can call functions" not in text  # no description of our own: the template has one
    assert json.dumps(WEATHER, ensure_ascii=False) in text  # the tools as OpenAI sent them
    # the template gets the arguments as an object (as HF templates expect), not as a JSON string
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<tool_response>{"temp": 21}</tool_response>' in text
    assert tool_format(None, NATIVE).name == "hermes"  # and its calls are read in its format
