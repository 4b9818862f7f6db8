"""Request models for the OpenAI-compatible endpoints (pydantic, strict types).

Strict mode: a string where a number is expected is a 400, not a silent coercion. Unknown fields
are ignored (clients send many optional OpenAI fields); fields we cannot honour are rejected in
:func:`check_unsupported` rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchetlm.server.errors import APIError


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class CommonRequest(_Model):
    """Fields shared by completions and chat completions (vLLM's extras included: top_k, min_p, ...)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # number of top alternatives per token (0..20)
    echo: bool = False
    suffix: str | None = None


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
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


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
