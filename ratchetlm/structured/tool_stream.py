"""Streaming a choice's tool calls: split the text as it is committed into content deltas and
OpenAI ``delta.tool_calls`` pieces — a call's id and name as soon as they are written, then its
arguments piece by piece as the model writes them, like vLLM's streaming parsers.

A call is streamed while it has the shape every format here writes (and every grammar-forced call
has): ``{"name": "<name>", "<arguments|parameters>": {...}}``, calls separated by the formats'
tags, brackets, commas or semicolons. Text that does not have that shape waits for the end of
the choice, where :meth:`ToolFormat.parse` reads the whole output: calls it finds that were not
streamed go out then, whole. Streamed argument text is the model's own (for grammar-forced calls
it is byte for byte the non-streamed ``arguments``; otherwise it may differ in whitespace).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ratchetlm.structured.tool_calls import Llama3JsonFormat, ToolCall, ToolFormat

# What may stand between calls (and before the first): whitespace, list brackets and separators,
# the tags of the formats.
_SEP = r"(?:\s|[\[\],;]|</?tool_call>|<\|python_tag\|>)*"
_HEAD = re.compile(_SEP + r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolCallDelta:
    """One ``delta.tool_calls`` entry: the head of call ``index`` (``id`` and ``name`` set) or a
    piece of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


class StreamingToolParser:
    """Incremental split of streamed text into content and tool-call deltas. Text from the
    format's opening marker on (or a possible start of it) is held back from the content;
    ``calls_only``: the whole output is calls (tool_choice required / named); ``max_calls``: calls
    beyond it are dropped (``parallel_tool_calls: false``)."""

    def __init__(self, fmt: ToolFormat, calls_only: bool = False, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.calls_only = calls_only
        self.max_calls = max_calls
        self.text = ""
        self.sent = 0  # characters of ``text`` released as content
        self.held: int | None = 0 if calls_only else None  # where the held-back (call) text starts
        self.streamed: list[ToolCall] = []  # calls whose head went out (arguments: what went out)
        self._pos = 0  # scan position in ``text`` (calls phase)
        self._depth = 0  # JSON nesting at ``_pos`` inside the current call object
        self._in_str = False
        self._esc = False
        self._args_from: int | None = None  # start of the current call's arguments, while streaming them
        self._stopped = False  # text that is not a streamable call: the rest waits for finish

    # ------------------------------------------------------------------ content

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """New text -> (content that can be released now, tool-call deltas)."""
        self.text += delta
        content = "" if self.held is not None else self._content()
        return content, self._calls() if self.held is not None else []

    def _content(self) -> str:
        start = self.fmt.stream_start()
        if isinstance(self.fmt, Llama3JsonFormat):
            stripped = self.text.lstrip()
            if not stripped:
                return ""
            if stripped.startswith(("{", "<|python_tag|>")) and self.sent == 0:
                self.held = self._pos = len(self.text) - len(stripped)
                return ""
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        i = self.text.find(start, self.sent)
        if i >= 0:
            self.held = self._pos = i
            out, self.sent = self.text[self.sent:i], i
            return out
        keep = _partial_suffix(self.text, start)  # "<tool" could become "<tool_call>"
        end = max(self.sent, len(self.text) - keep)
        out, self.sent = self.text[self.sent:end], end
        return out

    # ------------------------------------------------------------------ calls

    def _calls(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while not self._stopped:
            if self._depth == 0:  # between calls: is the next head complete?
                if self.max_calls is not None and len(self.streamed) >= self.max_calls:
                    break
                m = _HEAD.match(self.text, self._pos)
                if m is None or m.end() == len(self.text):  # not (yet) a head, or its value not begun
                    break
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    name = None
                if not isinstance(name, str) or self.text[m.end()] != "{":  # arguments as a JSON string:
                    self._stopped = True  # the rest is read whole at the end
                    break
                call = ToolCall(name, "", id=f"call_{uuid.uuid4().hex[:24]}")
                self.streamed.append(call)
                out.append(ToolCallDelta(len(self.streamed) - 1, id=call.id, name=name))
                self._pos, self._depth, self._args_from = m.end(), 1, m.end()
            start = self._pos
            closed = self._scan()
            if self._args_from is not None:
                piece = self.text[start:self._pos]
                if piece:
                    call = self.streamed[-1]
                    self.streamed[-1] = ToolCall(call.name, call.arguments + piece, call.id)
                    if out and out[-1].index == len(self.streamed) - 1 and out[-1].id is None:
                        out[-1].arguments += piece
                    else:
                        out.append(ToolCallDelta(len(self.streamed) - 1, piece))
                if closed == "arguments":
                    self._args_from = None
            if closed is None:  # the text ran out
                break
        return out

    def _scan(self) -> str | None:
        """Advance through the current call object: "arguments" when its arguments object closed,
        "call" when the call object closed (``_pos`` after the closing brace), None at the end of
        the text."""
        t = self.text
        while self._pos < len(t):
            c = t[self._pos]
            self._pos += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                continue
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return "call"
                if self._depth == 1 and self._args_from is not None:
                    return "arguments"
        return None

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the choice: (the rest of the content, the deltas of calls not streamed yet)."""
        content, calls = self.fmt.parse(self.text)
        if self.max_calls is not None:
            calls = calls[: self.max_calls]
        n = len(self.streamed)
        if not calls and not n:  # no calls after all: the held text is content (minus "no call" blocks)
            held, _ = self.fmt.parse(self.text[self.sent:])
            held = self.text[self.sent:] if held is None else held
            self.sent = len(self.text)
            return held, []
        rest = (content or "") if self.sent == 0 and calls else ""
        if [c.name for c in calls[:n]] != [c.name for c in self.streamed]:
            return rest, []  # what was streamed stands (a call cut short); nothing is added to it
        out: list[ToolCallDelta] = []
        for i, call in enumerate(calls[n:], start=n):
            out.append(ToolCallDelta(i, id=call.id, name=call.name))
            out.append(ToolCallDelta(i, call.arguments))
        self.streamed.extend(calls[n:])
        return rest, out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
