"""Request models for the OpenAI-compatible endpoints (pydantic, strict types).

Strict mode: a string where a number is expected is a 400, not a silent coercion; every float
must be finite (JSON's ``Infinity``/``NaN`` are 400s). Unknown fields are ignored (clients send many
optional OpenAI fields); fields we cannot honour are rejected in :func:`check_unsupported` rather
than silently dropped. The server's configurable limits (:class:`ServerConfig`) are checked by the
models' validators, given as ``model_validate(body, context={"limits": cfg})``, so a new field
slots its own limit in next to its declaration.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from ratchetlm.server.config import ServerConfig
from ratchetlm.server.errors import APIError

_INT64 = 2**63 - 1
_DEFAULT_LIMITS = ServerConfig()


def limits_of(info: ValidationInfo) -> ServerConfig:
    ctx = info.context if isinstance(info.context, dict) else {}
    return ctx.get("limits") or _DEFAULT_LIMITS


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class CommonRequest(_Model):
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
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(default=None, le=_INT64)  # clamped to what is left of the context
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

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


class ChatMessage(_Model):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, le=_INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, le=_INT64)


def check_unsupported(req: CommonRequest) -> None:
    """Reject OpenAI options this server cannot honour instead of ignoring them."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v not in (None, 0, 0.0):
            raise APIError(f"{name} is not supported (only 0)", 400, name)
    if req.logit_bias:
        raise APIError("logit_bias is not supported", 400, "logit_bias")
    if isinstance(req, CompletionRequest) and req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    if req.stream_options is not None and not req.stream:
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
