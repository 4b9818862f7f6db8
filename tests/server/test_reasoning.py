"""``--reasoning-parser`` (vLLM's): the thinking between ``<think>`` and ``</think>`` goes to
``message.reasoning`` / ``reasoning_content`` (``delta.*`` when streamed, a ``reasoning`` item in the
Responses API), the rest stays ``content``, and tool calls are parsed from the content only.

The splitter is checked as a pure unit against vLLM's semantics over every way of cutting an
output into pieces; the server is checked on real engine output: a tiny GGUF (byte-level
vocabulary, so each tag arrives over several tokens) with a Qwen3-style template, the output forced
by a guided regex."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from ratchetlm import LLM
from ratchetlm.server.config import ServerConfig
from ratchetlm.structured.reasoning import REASONING_PARSERS, ReasoningSplitter, reasoning_format, split_reasoning
from tests.core.gguf_factory import write_tiny_gguf
from tests.server.openai_schema import assert_valid
from tests.server.test_inprocess import serve

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]

# (format, end of the prompt, output) -> (reasoning or None, content)
CASES = [
    (QWEN3, "", "<think>a b</think>\n\nthe answer", ("a b", "\n\nthe answer")),
    (QWEN3, "", "  <think>x</think>y", ("x", "y")),
    (QWEN3, "", "no thinking at all", (None, "no thinking at all")),
    (QWEN3, "", "<thin", (None, "<thin")),  # a tag that never completed is text
    (QWEN3, "", "x</think>y", (None, "x</think>y")),  # not opened
    (QWEN3, "<think>\n\n</think>\n\n", "x</think>y", (None, "x</think>y")),  # closed (enable_thinking false)
    (QWEN3, "assistant: <think>\n", "x</think>y", ("x", "y")),  # the prompt opened it (a thinking template)
    (QWEN3, "", "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    (QWEN3, "", "<think></think>", ("", "")),
    (QWEN3, "", "a <think>b</think>c", (None, "a <think>b</think>c")),  # only a leading tag opens it
    (R1, "", "step 1</think>the answer", ("step 1", "the answer")),  # R1's template opened the tag
    (R1, "", "<think>step 1</think>the answer", ("step 1", "the answer")),
    (R1, "", "never closed", ("never closed", "")),
    (R1, "", "a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends it
    (R1, "", "a</thi", ("a</thi", "")),
]


def _pieces(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _streamed(fmt, prompt, pieces):
    inside = fmt.starts_inside(prompt)
    sp = ReasoningSplitter(fmt, inside)
    r = c = ""
    for p in pieces:
        a, b = sp.feed(p)
        r, c = r + a, c + b
    a, b = sp.finish()
    return r + a, c + b


@pytest.mark.parametrize("fmt, prompt, text, expected", CASES)
def test_the_splitter_reads_outputs_as_vllm_does(fmt, prompt, text, expected):
    assert split_reasoning(fmt, text, fmt.starts_inside(prompt)) == expected


@pytest.mark.parametrize("fmt, prompt, text, expected", CASES)
def test_streamed_pieces_split_exactly_as_the_whole_output(fmt, prompt, text, expected):
    """Tags cut anywhere (one character per piece, every two-piece cut) are still found, and never
    leak into either side."""
    want = (expected[0] or "", expected[1])
    assert _streamed(fmt, prompt, list(text)) == want
    for i in range(len(text) + 1):
        assert _streamed(fmt, prompt, _pieces(text, (i,))) == want, i


def test_nothing_is_held_back_longer_than_a_tag_may_need():
    sp = ReasoningSplitter(QWEN3, False)
    assert sp.feed("<think>abc</") == ("abc", "")  # "</" may start the end tag: held
    assert sp.feed("b") == ("</b", "")  # it did not
    assert sp.feed("</think>ok") == ("", "ok")
    assert ReasoningSplitter(QWEN3, False).feed("Hello") == ("", "Hello")  # no tag: released at once


def test_a_model_has_think_tags_in_its_vocabulary_or_its_template():
    from tests.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    assert not QWEN3.applies_to(tok, None)  # bytes can spell "<think>", but the model was never taught it
    assert QWEN3.applies_to(tok, "{{ '<think>' }}...{{ '</think>' }}")  # its template writes the tags
    tok.add_tokens(["<think>", "</think>"])  # Qwen3 / DeepSeek-R1 vocabularies have them as tokens
    assert QWEN3.applies_to(tok, None) and R1.applies_to(tok, None)


def test_the_registry_names_its_parsers():
    assert reasoning_format("qwen3") is QWEN3
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'; known: deepseek_r1, qwen3"):
        reasoning_format("granite")
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="nope")


# ---------------------------------------------------------------------------------------------- server

THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
USER = [{"role": "user", "content": "two and two"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add numbers",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("think") / "t.gguf", "llama", ["F16"], pre="llama-bpe",
                           chat_template=THINKING_TEMPLATE)
    return LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=64)


def _forced(output: str, **kw):
    import re

    return {"model": "m", "messages": USER, "temperature": 0, "max_tokens": 200,
            "structured_outputs": {"regex": re.escape(output)}, **kw}


def _stream(base, body):
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_splits_real_engine_output(thinker):
    with serve(thinker, "m", ServerConfig(reasoning_parser="qwen3")) as base:
        # the template opened <think>: the model thinks, closes the tag, then answers
        r = httpx.post(base + "/v1/chat/completions", json=_forced("two plus two</think>four"), timeout=120)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == ("two plus two", "two plus two", "four")
        assert_valid("chat", r.json())

        chunks = _stream(base, _forced("two plus two</think>four"))
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning", "") for d in deltas) == "two plus two"
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "two plus two"
        assert "".join(d.get("content") or "" for d in deltas) == "four"
        assert len([d for d in deltas if d.get("reasoning")]) > 1  # streamed as it came, not at the end
        for c in chunks:
            assert_valid("chat_chunk", c)
        # with logprobs, every token's entry goes out exactly once, on whichever side released it
        chunks = _stream(base, _forced("two plus two</think>four", logprobs=True,
                                       stream_options={"include_usage": True}))
        entries = [e for c in chunks if c["choices"] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
        assert len(entries) == chunks[-1]["usage"]["completion_tokens"]
        assert "".join(e["token"] for e in entries).startswith("two plus two</think>four")

        # enable_thinking false: the template closed the tag, so a "</think>" is just text
        body = _forced("x</think>y", chat_template_kwargs={"enable_thinking": False})
        msg = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert msg["content"] == "x</think>y" and "reasoning" not in msg

        # a JSON grammar makes the whole output the answer, even after a template that opened <think>
        schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                  "additionalProperties": False}
        body = {"model": "m", "messages": USER, "max_tokens": 50, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        msg = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert json.loads(msg["content"])["a"] in ("x", "y") and "reasoning" not in msg

        # include_reasoning false (vLLM's request field): the thinking is dropped, the answer stays
        body = _forced("hmm</think>four", include_reasoning=False)
        msg = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert msg["content"] == "four" and "reasoning" not in msg
        deltas = [c["choices"][0]["delta"] for c in _stream(base, body) if c["choices"]]
        assert not any("reasoning" in d for d in deltas)
        assert "".join(d.get("content") or "" for d in deltas) == "four"


def test_tool_calls_are_parsed_from_the_answer_only(thinker):
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    with serve(thinker, "m", ServerConfig(reasoning_parser="qwen3", tool_call_parser="hermes")) as base:
        for stream in (False, True):
            body = _forced(f"maybe {call}?</think>fine", tools=TOOLS)  # a call written while thinking is thought
            if stream:
                deltas = [c["choices"][0]["delta"] for c in _stream(base, body) if c["choices"]]
                assert "".join(d.get("reasoning", "") for d in deltas) == f"maybe {call}?"
                assert not any(d.get("tool_calls") for d in deltas)
                assert "".join(d.get("content") or "" for d in deltas) == "fine"
            else:
                choice = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
                assert choice["message"]["reasoning"] == f"maybe {call}?" and choice["message"]["content"] == "fine"
                assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"

            body = _forced(f"I will add</think>{call}", tools=TOOLS)  # the answer's call is a call
            if stream:
                deltas = [c["choices"][0]["delta"] for c in _stream(base, body) if c["choices"]]
                assert "".join(d.get("reasoning", "") for d in deltas) == "I will add"
                calls = [t for d in deltas for t in d.get("tool_calls") or []]
                assert [t["function"]["name"] for t in calls if t.get("id")] == ["add"]
            else:
                choice = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
                assert choice["message"]["reasoning"] == "I will add"
                assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add"]
                assert choice["finish_reason"] == "tool_calls"


def test_responses_api_has_a_reasoning_item(thinker, monkeypatch):
    """The Responses API has no regex constraint of its own: the chat request it becomes gets one."""
    import re

    from ratchetlm.server import serving_responses

    as_chat = serving_responses.chat_request_body
    monkeypatch.setattr(serving_responses, "chat_request_body", lambda *a: {
        **as_chat(*a), "structured_outputs": {"regex": re.escape("two plus two</think>four")}})
    body = {"model": "m", "input": "two and two", "temperature": 0, "max_output_tokens": 200}
    with serve(thinker, "m", ServerConfig(reasoning_parser="deepseek_r1")) as base:
        r = httpx.post(base + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()["output"]
        assert [it["type"] for it in out] == ["reasoning", "message"]
        assert out[0]["content"] == [{"type": "reasoning_text", "text": "two plus two"}] and out[0]["summary"] == []
        assert out[1]["content"][0]["text"] == "four"
        assert_valid("response", r.json())

        with httpx.stream("POST", base + "/v1/responses", json={**body, "stream": True}, timeout=120) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "two plus two"
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        done = [e for e in events if e["type"] == "response.completed"][0]["response"]
        assert [it["type"] for it in done["output"]] == ["reasoning", "message"]
        assert done["output"][0]["content"][0]["text"] == "two plus two"
        assert done["output"][1]["content"][0]["text"] == "four"
        for e in events:
            assert_valid("response_event", e)


def test_a_model_without_think_tags_has_nothing_to_split(tmp_path, caplog):
    path = write_tiny_gguf(tmp_path / "plain.gguf", "llama", ["F16"], pre="llama-bpe", chat_template=PLAIN_TEMPLATE)
    plain = LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=64)
    with caplog.at_level(logging.INFO, logger="ratchetlm"), \
            serve(plain, "m", ServerConfig(reasoning_parser="deepseek_r1")) as base:
        msg = httpx.post(base + "/v1/chat/completions", json=_forced("<think>a</think>b"),
                         timeout=120).json()["choices"][0]["message"]
    assert msg["content"] == "<think>a</think>b" and "reasoning" not in msg
    lines = [r.getMessage() for r in caplog.records if "--reasoning-parser" in r.getMessage()]
    assert len(lines) == 1 and "nothing to split" in lines[0]
