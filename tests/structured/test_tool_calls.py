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
from ratchetlm.structured.tool_calls import (
    FORMATS,
    StreamingToolParser,
    ToolCall,
    functions_from,
    tool_format,
)

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


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_streamed_text_splits_into_content_and_calls(name):
    fmt = tool_format(name)
    prefix = "Checking now. " if name != "llama3_json" else ""
    text = prefix + fmt.render(CALLS)
    p = StreamingToolParser(fmt)
    released = "".join(p.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = p.finish()
    assert released + rest == prefix
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    # text that only looks like the start of a call is released at the end
    p = StreamingToolParser(fmt)
    out = p.feed("a < b and {x}") + p.finish()[0]
    assert out == "a < b and {x}"


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
