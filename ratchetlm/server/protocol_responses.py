"""Request model of ``POST /v1/responses`` (OpenAI's Responses API) and its translation into the
chat request the chat machinery serves (server/serving_chat.py).

A Responses request is a chat request in another shape: ``instructions`` is the system message,
``input`` a string (one user message) or a list of items (messages with ``input_text`` /
``output_text`` parts, ``function_call`` items the model made, ``function_call_output`` items the
client answered them with), ``tools`` are function tools in the flat shape
(``{"type": "function", "name", "parameters", ...}``), ``text.format`` is ``response_format``,
``max_output_tokens`` is ``max_completion_tokens``. :func:`chat_messages` turns the items into
OpenAI chat messages; :func:`chat_request_body` builds the chat request body.

Fields that would change what is generated and are not supported here (``reasoning``,
``background``, built-in tools, images, ``truncation: "auto"``, ...) are a 400 naming them; a
field we do not know is a 400 too (``check_unsupported``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ratchetlm.server.errors import APIError
from ratchetlm.server.protocol import _INT64, _Model, _Request


class FunctionTool(_Model):
    """A function tool in the Responses API's flat shape."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Model):
    """``text.format``: ``text`` | ``json_object`` | ``json_schema`` (its fields flat)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextParam(_Model):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # "low" / "high" would change the output: refused


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # {"include_obfuscation": ...}: nothing to obfuscate here
    tools: list[FunctionTool] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=_INT64)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    # harmless: they do not change what is generated
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _refused(self) -> ResponsesRequest:
        """A field that would change the output is a 400 unless its value asks for nothing."""
        extra = self.model_extra or {}
        for name in [n for n in extra if n in REFUSED]:
            if extra[name] not in REFUSED[name]:
                raise APIError(f"{name} is not supported by this server{REFUSED_HINTS.get(name, '')}", 400, name)
            del extra[name]
        return self


# Responses fields this server cannot honour: accepted only with a value that asks for nothing
REFUSED: dict[str, tuple[Any, ...]] = {
    "reasoning": (None, {}), "background": (None, False), "max_tool_calls": (None,), "top_logprobs": (None, 0),
    "prompt": (None,), "conversation": (None,), "include": (None, []), "truncation": (None, "disabled"),
    "context_management": (None,), "prompt_cache_retention": (None,),
}
REFUSED_HINTS = {"truncation": " (only 'disabled': a too-long input is a 400)",
                 "conversation": " (use previous_response_id)"}


def _text_of(content: Any, path: str, allowed: tuple[str, ...]) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{path}: must be a string or a list of content parts", 400, path)
    out = []
    for j, part in enumerate(content):
        p = f"{path}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise APIError(f"{p}: a content part must be an object with a type", 400, p)
        if part["type"] not in allowed:
            raise APIError(f"{p}.type: {part['type']!r} is not supported here (this server takes "
                           f"{' / '.join(allowed)} parts)", 400, f"{p}.type")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise APIError(f"{p}.text: field required (a string)", 400, f"{p}.text")
        out.append(text)
    return "".join(out)


def _str_field(item: dict[str, Any], key: str, path: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise APIError(f"{path}.{key}: field required (a string)", 400, f"{path}.{key}")
    return v


def chat_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` -> OpenAI chat messages (dicts :class:`ChatMessage` validates). Consecutive
    ``function_call`` items (and the assistant text just before them) become one assistant
    message with ``tool_calls``; a ``function_call_output`` becomes a ``tool`` message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError("input: must not be empty", 400, "input")
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{path}: an input item must be an object", 400, path)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{path}.role: must be user, system, developer or assistant, got {role!r}", 400,
                               f"{path}.role")
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            msgs.append({"role": role, "content": _text_of(item.get("content"), f"{path}.content", parts)})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", path), "type": "function",
                    "function": {"name": _str_field(item, "name", path),
                                 "arguments": _str_field(item, "arguments", path)}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            text = out if isinstance(out, str) else _text_of(out, f"{path}.output", ("input_text",))
            msgs.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", path), "content": text})
        else:
            raise APIError(f"{path}.type: input items of type {kind!r} are not supported here (message, "
                           "function_call and function_call_output are)", 400, f"{path}.type")
    return msgs


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Flat function tools -> chat ``tools``; any other tool type is a 400 naming it."""
    if req.tools is None:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise APIError(f"tools[{i}].type: {t.type!r} tools are not supported here (only function tools)", 400,
                           f"tools[{i}].type")
        if not t.name:
            raise APIError(f"tools[{i}].name: field required", 400, f"tools[{i}].name")
        fn: dict[str, Any] = {"name": t.name}
        for k in ("description", "parameters", "strict"):
            if getattr(t, k) is not None:
                fn[k] = getattr(t, k)
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(f"tool_choice: {choice!r} is not supported here (none, auto, required or "
                   "{\"type\": \"function\", \"name\": ...})", 400, "tool_choice")


def chat_response_format(text: TextParam | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError("text.format.schema: field required for type json_schema", 400, "text.format.schema")
    js: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        js["strict"] = fmt.strict
    if fmt.description is not None:
        js["description"] = fmt.description
    return {"type": "json_schema", "json_schema": js}


def chat_request_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body for ``req`` after the conversation ``history`` (the earlier
    turns of ``previous_response_id``; its instructions are not carried over, as OpenAI does)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
    messages += history + chat_messages(req.input)
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    for key, value in (("tools", chat_tools(req)), ("tool_choice", chat_tool_choice(req.tool_choice)),
                       ("parallel_tool_calls", req.parallel_tool_calls),
                       ("response_format", chat_response_format(req.text)),
                       ("max_completion_tokens", req.max_output_tokens),
                       ("temperature", req.temperature), ("top_p", req.top_p), ("user", req.user)):
        if value is not None:
            body[key] = value
    return body


# chat request names -> the Responses names a client sent (for errors raised by the chat machinery)
CHAT_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens"}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    return CHAT_PARAMS.get(head, head) + ("." + rest if rest else "") if head in CHAT_PARAMS else param
