"""Request models for the OpenAI-compatible endpoints (pydantic, strict types).

Strict mode: a string where a number is expected is a 400, not a silent coercion; every float
must be finite (JSON's ``Infinity``/``NaN`` are 400s). Unknown top-level fields are checked by
:func:`check_unsupported` against a table (docs/serving.md): fields OpenAI clients send harmlessly
(``user``, ``metadata``, ``store``, ...) are ignored; a field that would change the meaning of the
request and is not supported (``audio``, ``prediction``, ``web_search_options``, ...) and any field
we do not know are a 400 naming it, never silently dropped. The server's configurable limits
(:class:`ServerConfig`) are checked by the models' validators, given as
``model_validate(body, context={"limits": cfg})``, so a new field slots its own limit in next to
its declaration.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ratchetlm.server.config import ServerConfig
from ratchetlm.server.errors import APIError

_INT64 = 2**63 - 1
_DEFAULT_LIMITS = ServerConfig()


def limits_of(info: ValidationInfo) -> ServerConfig:
    ctx = info.context if isinstance(info.context, dict) else {}
    return ctx.get("limits") or _DEFAULT_LIMITS


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)


class _Request(_Model):
    """A request body: unknown fields are kept (``model_extra``) for :func:`check_unsupported`."""

    model_config = ConfigDict(extra="allow")


class JSONSchemaFormat(_Model):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's ``structured_outputs`` object (one of json / regex / choice / grammar / json_object)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=4096)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # vLLM's switch; ours defaults to no free whitespace


class StreamOptions(_Model):
    include_usage: bool = False


class CommonRequest(_Request):
    """Fields shared by completions and chat completions (vLLM's extras included: top_k, min_p, ...)."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=100)  # OpenAI: [0, 2]
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=_INT64)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM's: special tokens the model writes are left out of the text
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(default=None, le=_INT64)  # clamped to what is left of the context
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=1000)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=4096)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=1 << 20)
    bad_words: list[str] | None = Field(default=None, max_length=256)
    min_tokens: int | None = Field(default=None, ge=0, le=_INT64)
    user: str | None = None
    # output constraints (server/structured.py): OpenAI's, vLLM's current and its older spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=4096)
    guided_grammar: str | None = None
    # vLLM's extra: requests share prefix-cache blocks only with requests of the same salt, so one
    # tenant cannot probe another's prompts through time to first token
    cache_salt: str | None = Field(default=None, min_length=1)

    def num_choices(self) -> int:
        return self.n

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> CommonRequest:
        cfg = limits_of(info)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > cfg.max_stop_strings:
            raise APIError(f"stop has {len(stops)} strings; at most {cfg.max_stop_strings} are allowed", 400, "stop")
        longest = max((len(x) for x in stops), default=0)
        if longest > cfg.max_stop_string_length:
            raise APIError(f"a stop string has {longest} characters; at most {cfg.max_stop_string_length} are "
                           "allowed", 400, "stop")
        if self.num_choices() > cfg.max_choices:
            raise APIError(f"this request asks for {self.num_choices()} choices (prompts x n); at most "
                           f"{cfg.max_choices} are allowed per request", 400, "n")
        return self


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (per its metadata) before text prompts
    logprobs: int | None = Field(default=None, le=_INT64)  # number of top alternatives per token (0..20)
    echo: bool = False
    suffix: str | None = None

    def num_choices(self) -> int:
        p = self.prompt
        prompts = 1 if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)) else len(p)
        return prompts * self.n


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"  # a JSON object, as text


class ToolCallIn(_Model):
    """A call in an assistant message of the conversation so far."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    """OpenAI's rules: every message but an assistant's has content (an assistant's may be null, as
    in one that only calls tools); a tool message names the call it answers (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)
    # an earlier assistant turn's thinking (vLLM's names), handed to the template as reasoning_content
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content (a string or a list of text parts); only an "
                             "assistant message's may be null")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_required(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id: the id of the tool call it answers")
        return v

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for system
        d: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            d["content"] = content
        for k in ("name", "tool_call_id"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            d["reasoning_content"] = thinking
        return d


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, le=_INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, le=_INT64)
    tools: list[ToolSpec] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras (engine/prompts.py:render_chat)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes its own BOS; true never doubles it
    include_reasoning: bool = True  # vLLM's: false drops the thinking a --reasoning-parser splits off


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolSpec] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # None: the endpoint's own default (completions: true, chat: false), so the ids are what it feeds
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


# Fields the server accepts without acting on them: OpenAI clients send them and they do not change
# what is generated (docs/serving.md has the whole table).
IGNORED_FIELDS = frozenset({
    "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id", "priority",
    "guided_decoding_backend", "spaces_between_special_tokens",
})
# Fields that would change the request's meaning and are not supported: a 400 unless the value is
# one that asks for nothing (listed).
REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "functions": (None,), "function_call": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "echo": (None, False), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "documents": (None,), "return_tokens_as_token_ids": (None, False),
    "logits_processors": (None,), "structural_tag": (None,), "guided_whitespace_pattern": (None,),
    "mm_processor_kwargs": (None,),
}
_HINTS = {"functions": "use tools", "function_call": "use tool_choice"}


def check_unsupported(req: _Request) -> None:
    """Reject what this server cannot honour instead of ignoring it (see :data:`IGNORED_FIELDS`)."""
    for name, value in (req.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name in REFUSED_FIELDS:
            if value in REFUSED_FIELDS[name]:
                continue
            hint = f" ({_HINTS[name]})" if name in _HINTS else ""
            raise APIError(f"{name} is not supported by this server{hint}", 400, name)
        raise APIError(f"unknown field {name!r}: not an OpenAI or vLLM request field this server supports", 400,
                       name)
    if isinstance(req, CompletionRequest) and req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    if isinstance(req, CommonRequest) and req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream=true", 400, "stream_options")


def lone_surrogate_path(obj: Any, path: str = "") -> str | None:
    """Dotted path of the first string holding a lone UTF-16 surrogate (JSON ``"\\ud800"`` decodes
    to one; no tokenizer can encode it), or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if isinstance(k, str) and lone_surrogate_path(k) is not None:
            return path or "body"
        found = lone_surrogate_path(v, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None
