"""Tool calls in a model family's own format: described in the prompt, parsed from the output,
forced by a grammar.

A :class:`ToolFormat` (``--tool-call-parser``) knows how one family writes calls:

* ``smollm2``: ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>`` (a JSON list in
  tags; SmolLM2's function-calling format);
* ``hermes`` (Qwen 2.5 / Qwen 3, Hermes): one ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  block per call;
* ``llama3_json`` (Llama 3.1+): a bare ``{"name": ..., "parameters": ...}`` object (after an optional
  ``<|python_tag|>``), several separated by ``; ``.

``tool_choice="required"`` or a named function is enforced with a Lark grammar in which each call
is an inline JSON schema (llguidance's ``%json``): the name is a constant and the arguments
validate against the function's parameters. The output stays in the family's format, so the
same parser reads it back whichever way it was produced.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Separators the forced JSON uses (json.dumps' defaults; free whitespace would let a small model ramble).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Function:
    """One tool of a request (OpenAI ``{"type": "function", "function": {...}}``)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolFormat(ABC):
    name: ClassVar[str]
    args_key: ClassVar[str] = "arguments"

    # ------------------------------------------------------------------ prompt side

    def call_object(self, call: ToolCall) -> dict[str, Any]:
        return {"name": call.name, self.args_key: json.loads(call.arguments or "{}")}

    @abstractmethod
    def render(self, calls: list[ToolCall]) -> str:
        """An assistant turn's calls as the model writes them (for templates that cannot)."""

    def system_prompt(self, tools: list[Function]) -> str:
        """Describes the tools and the call format, for chat templates that ignore ``tools``."""
        listing = json.dumps([t.as_openai()["function"] for t in tools], ensure_ascii=False)
        example = self.render([ToolCall("function_name", '{"argument": "value"}')])
        return ("You can call functions. The available functions, as JSON schemas:\n<tools>" + listing + "</tools>\n"
                "To call one or more of them, answer with exactly this format and nothing else:\n" + example +
                "\nIf no function fits, answer normally.")

    # ------------------------------------------------------------------ output side

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Split generated text into (content or None, calls). Unparseable calls stay content."""

    @abstractmethod
    def stream_start(self) -> str:
        """The text that opens the calls (streams hold back text from here)."""

    # ------------------------------------------------------------------ grammar side

    def call_schema(self, tools: list[Function]) -> dict[str, Any]:
        options = [{"type": "object", "properties": {"name": {"const": t.name}, self.args_key: t.parameters},
                    "required": ["name", self.args_key], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": _COMPACT}

    def grammar(self, tools: list[Function], many: bool) -> str:
        """Lark grammar forcing one call (``many=False``) or one or more calls of ``tools``."""
        call = "%json " + json.dumps(self.call_schema(tools), ensure_ascii=False)
        return self._grammar(call, many)

    @abstractmethod
    def _grammar(self, call: str, many: bool) -> str: ...


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _json_values(body: str) -> tuple[list[Any], bool]:
    """The JSON values of a call body (one object, or a list of them) and whether the body was
    complete; a body cut short (max_tokens) yields the values before the cut."""
    dec = json.JSONDecoder()
    s = body.strip()
    if not s.startswith("["):
        try:
            obj, end = dec.raw_decode(s)
        except ValueError:
            return [], False
        return [obj], not s[end:].strip()
    items: list[Any] = []
    pos = 1
    while True:
        while pos < len(s) and s[pos].isspace():
            pos += 1
        if pos < len(s) and s[pos] == "]" and not items:
            return items, not s[pos + 1:].strip()
        try:
            obj, pos = dec.raw_decode(s, pos)
        except ValueError:
            return items, False
        items.append(obj)
        while pos < len(s) and s[pos].isspace():
            pos += 1
        if pos < len(s) and s[pos] == ",":
            pos += 1
            continue
        return items, pos < len(s) and s[pos] == "]" and not s[pos + 1:].strip()


class _Tagged(ToolFormat):
    """Formats that wrap calls in ``<tool_call>...</tool_call>``."""

    def stream_start(self) -> str:
        return "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "<tool_call>" not in text:
            return (text or None), []
        calls: list[ToolCall] = []
        empty = True  # every block an empty list: SmolLM2's way of saying no call is needed
        for body in _BLOCK.findall(text):
            items, complete = _json_values(body)
            empty = empty and complete and not items
            for item in items:
                call = _call_from(item, self.args_key)
                if call is None:  # not a call after all: the whole text is content
                    return (text or None), []
                calls.append(call)
            if not complete:
                break  # cut short: the calls before the cut stand
        if not calls:
            return (_BLOCK.sub("", text).strip() if empty else text or None), []
        content = _BLOCK.sub("", text).strip()
        return (content or None), calls


class SmolLM2Format(_Tagged):
    name = "smollm2"

    def render(self, calls: list[ToolCall]) -> str:
        return "<tool_call>" + json.dumps([self.call_object(c) for c in calls], ensure_ascii=False) + "</tool_call>"

    def _grammar(self, call: str, many: bool) -> str:
        more = ' (", " call)*' if many else ""
        return f'start: "<tool_call>[" call{more} "]</tool_call>"\ncall: {call}\n'


class HermesFormat(_Tagged):
    name = "hermes"

    def render(self, calls: list[ToolCall]) -> str:
        return "\n".join("<tool_call>\n" + json.dumps(self.call_object(c), ensure_ascii=False) + "\n</tool_call>"
                         for c in calls)

    def _grammar(self, call: str, many: bool) -> str:
        more = ' ("\\n" block)*' if many else ""
        return f'start: block{more}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}\n'


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    args_key = "parameters"

    def stream_start(self) -> str:
        return "{"

    def render(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps(self.call_object(c), ensure_ascii=False) for c in calls)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return (text or None), []
        calls: list[ToolCall] = []
        dec = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, pos = dec.raw_decode(body, pos)
            except ValueError:
                break  # cut short (or not JSON): the calls before stand
            call = _call_from(obj, self.args_key)
            if call is None:
                return (text or None), []
            calls.append(call)
            rest = body[pos:].lstrip()
            if not rest.startswith(";"):
                break
            pos = len(body) - len(rest) + 1
            while pos < len(body) and body[pos].isspace():
                pos += 1
        return (None, calls) if calls else ((text or None), [])

    def _grammar(self, call: str, many: bool) -> str:
        more = ' ("; " call)*' if many else ""
        return f"start: call{more}\ncall: {call}\n"


FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (SmolLM2Format, HermesFormat, Llama3JsonFormat)}
ALIASES = {"qwen": "hermes", "qwen2": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
           "llama3.1": "llama3_json", "llama": "llama3_json"}


def tool_format(name: str | None, chat_template: str | None = None) -> ToolFormat:
    """The format named by ``--tool-call-parser`` (``None``/``"auto"``: guessed from the template)."""
    if name in (None, "auto"):
        t = chat_template or ""
        if "<|python_tag|>" in t or "ipython" in t:
            name = "llama3_json"
        elif "<tool_call>" in t:
            name = "hermes"
        else:
            name = "smollm2"
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        choices = ", ".join(sorted(FORMATS) + sorted(ALIASES))
        raise ValueError(f"unknown tool call parser {name!r}; choose one of: auto, {choices}")
    return FORMATS[key]()


def functions_from(tools: list[dict[str, Any]]) -> list[Function]:
    """OpenAI ``tools`` -> :class:`Function` list; raises ValueError naming the problem."""
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"),
                                                                                                 dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append(Function(name, str(f.get("description") or ""), params))
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    return out


def template_handles_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def chat_messages(messages: list[dict[str, Any]], tools: list[Function] | None, fmt: ToolFormat,
                  native: bool) -> list[dict[str, Any]]:
    """OpenAI-shaped messages (assistant ``tool_calls``, ``role: "tool"`` results) -> what the chat
    template renders. ``native``: the template handles ``tools``/``tool_calls`` itself (it gets the
    calls with parsed arguments, as HF templates expect); otherwise the tools are described in the
    system message and calls are written into the assistant's content in the family's format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if m.get("role") == "assistant" and calls:
            parsed = [ToolCall(c["function"]["name"], c["function"].get("arguments") or "{}", c.get("id") or "")
                      for c in calls]
            if native:
                m["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.loads(c.arguments)}} for c in parsed]
            else:
                text = m.get("content") or ""
                m["content"] = (text + "\n" if text else "") + fmt.render(parsed)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools and not native:
        prompt = fmt.system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
