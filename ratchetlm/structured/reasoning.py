"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reasoning model's thinking, written between
``<think>`` and ``</think>``, is split from its answer. The server sends the thinking as
``message.reasoning`` (vLLM's current name) and ``message.reasoning_content`` (its earlier name,
still read by many clients), the answer as ``content``; tool calls are parsed from the answer only.

One splitter serves whole and streamed outputs alike (a whole output is one piece), so both always
agree. It reads text pieces as the detokenizer releases them and holds back only what may still
become a tag: a tag split over several tokens (``<``, ``think``, ``>``) is recognised, and never
leaks into either side.

The formats, as vLLM's parsers of the same names read an output:

- ``deepseek_r1``: the model's template opens ``<think>`` in the prompt, so the output starts
  inside the reasoning (a leading ``<think>`` is dropped); everything up to the first ``</think>``
  is reasoning, the rest content. An output that never closes the tag is all reasoning.
- ``qwen3``: the output is content unless it starts with ``<think>`` (after whitespace) or the
  prompt left a ``<think>`` open (Qwen3 thinking models' templates); then reasoning up to the
  first ``</think>``. ``enable_thinking: false`` renders a closed ``<think></think>`` into the
  prompt, so the output is all content.

An output a grammar forces to be JSON (or a tool call) from its first token has no room for
thinking: the server starts it outside the reasoning whatever the format (server/serving_chat.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens_in_prompt: bool = False  # the template always opens the reasoning (the output starts inside it)

    def starts_inside(self, prompt: str) -> bool:
        """Whether an output continuing ``prompt`` starts inside the reasoning."""
        if self.opens_in_prompt:
            return True
        i = prompt.rfind(self.start)
        return i >= 0 and prompt.rfind(self.end) < i

    def applies_to(self, tokenizer: Any, chat_template: str | None) -> bool:
        """Whether the model can write these tags: its vocabulary has them as tokens, or its chat
        template mentions them. Without either there is nothing to split."""
        if chat_template and self.end in chat_template:
            return True
        try:
            vocab = tokenizer.get_vocab()
        except (AttributeError, NotImplementedError):
            return False
        return self.start in vocab and self.end in vocab


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", opens_in_prompt=True),
    "qwen3": ReasoningFormat("qwen3"),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The registered format ``name``; a ValueError naming the known ones otherwise."""
    fmt = REASONING_PARSERS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return fmt


class ReasoningSplitter:
    """Splits one output, piece by piece: :meth:`feed` returns the ``(reasoning, content)`` text each
    piece releases, :meth:`finish` what was held back at the end."""

    def __init__(self, fmt: ReasoningFormat, inside: bool) -> None:
        self.fmt = fmt
        self.inside = inside  # the output starts inside the reasoning (ReasoningFormat.starts_inside)
        self.state = "head"  # head (only whitespace so far: a leading start tag may come) | reasoning | content
        self.buf = ""  # text not released yet: a possible tag, or the head's whitespace
        self.reasoned = False  # any reasoning was found (even empty: "<think></think>")

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.state == "head":
                s = self.buf.lstrip()
                if s.startswith(self.fmt.start):
                    self.buf, self.state, self.reasoned = s[len(self.fmt.start):], "reasoning", True
                elif self.fmt.start.startswith(s):  # whitespace, or a start tag still arriving
                    break
                else:
                    self.state = "reasoning" if self.inside else "content"
                    self.reasoned = self.inside
            elif self.state == "reasoning":
                i = self.buf.find(self.fmt.end)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(self.fmt.end):], "content"
                    continue
                keep = _partial_suffix(self.buf, self.fmt.end)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                content += self.buf
                self.buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "head":
            self.state = "reasoning" if self.inside else "content"
            self.reasoned = self.inside
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split_reasoning(fmt: ReasoningFormat, text: str, inside: bool) -> tuple[str | None, str]:
    """A whole output -> (reasoning, or None when it has none; content)."""
    sp = ReasoningSplitter(fmt, inside)
    r1, c1 = sp.feed(text)
    r2, c2 = sp.finish()
    return (r1 + r2 if sp.reasoned else None), c1 + c2


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
