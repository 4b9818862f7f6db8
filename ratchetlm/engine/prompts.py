"""Prompts into token ids, as vLLM and llama.cpp feed them.

Text is tokenized with the model's own special tokens (``add_special_tokens=True``, vLLM's default
for text and completions): the BOS where the tokenizer's metadata asks for one
(models/tokenizer.py:special_tokens). Chat messages are rendered by the chat template, whose text
already holds the special tokens it wants; it is tokenized with ``add_special_tokens=False`` by
default (vLLM's chat default). Either way a prompt that already starts with the BOS (a template
that writes ``{{ bos_token }}`` tokenized with ``add_special_tokens=True``, or text that begins
with it) never gets a second one: llama.cpp warns about exactly that double BOS, which degrades
the output. Token-id prompts are fed as given.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from ratchetlm.models.tokenizer import SpecialTokens

# a string, token ids, or vLLM's {"prompt": str} / {"prompt_token_ids": [...]}
Prompt = str | list[int] | Mapping[str, Any]

# arguments of apply_chat_template that chat_template_kwargs may not override
_RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                     "add_generation_prompt", "continue_final_message", "return_dict",
                                     "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"})

log = logging.getLogger("ratchetlm")


class PromptTokenizer:
    """Text -> token ids with the tokenizer's own special tokens, never doubled."""

    def __init__(self, tokenizer: Any, specials: SpecialTokens) -> None:
        self.tokenizer = tokenizer
        self.specials = specials
        self._warned = False

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: at least one token is required")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
            return self.with_specials(ids) if add_special_tokens else ids
        if isinstance(prompt, list | tuple):
            return [int(t) if not isinstance(t, bool) else -1 for t in prompt]
        if isinstance(prompt, Mapping):  # vLLM's TextPrompt / TokensPrompt
            if set(prompt) - {"prompt", "prompt_token_ids"} or len(prompt) != 1:
                raise ValueError("a prompt dict holds exactly one of 'prompt' (text) or 'prompt_token_ids', "
                                 f"got keys {sorted(prompt)}")
            inner = prompt.get("prompt", prompt.get("prompt_token_ids"))
            if isinstance(inner, Mapping):
                raise ValueError("a prompt dict's value must be text or token ids")
            return self.tokenize(inner, add_special_tokens)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def with_specials(self, ids: list[int]) -> list[int]:
        """``prefix + ids + suffix``, leaving out a prefix (suffix) that ``ids`` already start (end) with."""
        pre, suf = list(self.specials.prefix), list(self.specials.suffix)
        if pre and ids[: len(pre)] == pre:
            self._warn_once()
            pre = []
        if suf and len(ids) >= len(suf) and ids[len(ids) - len(suf):] == suf:
            suf = []
        return pre + ids + suf

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning("the prompt already starts with the BOS token (a chat template or the text wrote it): "
                        "not adding a second one")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                tool_parser: str | None = None, add_generation_prompt: bool = True,
                chat_template: str | None = None, continue_final_message: bool = False,
                chat_template_kwargs: Mapping[str, Any] | None = None, content_format: str = "auto") -> str:
    """The prompt text for ``messages`` (OpenAI shape: assistant ``tool_calls`` and ``role: "tool"``
    results allowed). ``tools`` (OpenAI function tools) reach a template that handles them, or are
    described in the system message in the ``tool_parser`` family's format (structured/tool_calls.py).
    ``continue_final_message``: the last (assistant) message is left open for the model to continue;
    ``chat_template_kwargs`` are extra template variables (``enable_thinking``, ...).
    ``content_format`` (vLLM's ``chat_template_content_format``): message content reaches the
    template as a string, as OpenAI's list of text parts (``"openai"``), or as the template reads it
    (``"auto"``: parts when it loops over a message's content)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError("this model has no chat template (a base model: send text prompts to completions)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: either a new "
                         "assistant turn starts, or the last message is continued")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(set(extra) & _RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (request fields of their own)")
    kw: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                          "continue_final_message": continue_final_message, **extra}
    if chat_template:
        kw["chat_template"] = chat_template
    msgs = messages
    if tools is not None or any(m.get("tool_calls") for m in messages):
        from ratchetlm.structured.tool_calls import chat_messages, functions_from, template_handles_tools, tool_format

        funcs = functions_from(tools or [])
        native = template_handles_tools(template)
        msgs = chat_messages(messages, funcs, tool_format(tool_parser, template), native)
        if native and funcs:
            kw["tools"] = [f.as_openai() for f in funcs]
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format must be auto, string or openai, got {content_format!r}")
    if (template_content_format(template) if content_format == "auto" else content_format) == "openai":
        msgs = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                else m for m in msgs]
    return tokenizer.apply_chat_template(msgs, tokenize=False, **kw)


# a template that loops over a message's content reads OpenAI's list of parts (vLLM's "auto" detection)
_LOOPS_OVER_CONTENT = re.compile(r"""{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['"]content['"]\s*\]|\.content)\s*-?%}""")


def template_content_format(template: str | None) -> str:
    """``"openai"`` when the chat template iterates over message content (a list of parts), else ``"string"``."""
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt or a list of them -> a list (a flat list of ints is one token-id prompt)."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        return [[int(t) for t in prompts]]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of those")
    return list(prompts)


def prompt_text(prompt: Prompt) -> str | None:
    """The text of a prompt (None for token ids): ``RequestOutput.prompt``."""
    return prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, Mapping) else None)
