"""Server configuration: ``ratchet serve`` flags map 1:1 onto these fields (engine flags go to
:class:`~ratchetlm.engine.config.EngineConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass(frozen=True)
class ServerConfig:
    """Limits and hardening of the HTTP server. Every limit answers 400/413 in OpenAI's error shape.

    The defaults are generous for real clients (an lm-eval batch, a chat with a long history) and
    stop one request from starving the rest: ``max_choices`` bounds prompts × n of one request,
    the stop-string bounds keep the text layer's per-token matching cheap.
    """

    api_key: str | None = None  # Bearer token required on /v1/* (also RATCHET_API_KEY); None = open
    shutdown_timeout: float = 30.0  # SIGTERM: seconds running requests may finish before they are ended
    idle_timeout: float = 10.0  # seconds a connection may sit without a complete request (or body chunk)
    body_timeout: float = 30.0  # seconds a whole request body may take, however steadily it trickles (408)
    # request preparation (server/prepare.py): threads (None: the machine's cores, at least 2) and the
    # seconds one request's parsing, templating, tokenization and grammar compilation may take (400)
    prep_workers: int | None = None
    prep_timeout: float = 30.0
    max_body_bytes: int = 8 << 20  # request body size (413 beyond)
    max_choices: int = 64  # prompts x n of one request
    max_stop_strings: int = 16
    max_stop_string_length: int = 512  # characters per stop string
    # CORS: origins a browser page may call from ("*" = any); empty = no CORS headers (browsers refuse)
    allowed_origins: tuple[str, ...] = ()
    tool_call_parser: str = "auto"  # structured/tool_calls.py: auto | smollm2 | hermes (qwen) | llama3_json
    # vLLM's --reasoning-parser (structured/reasoning.py): <think>...</think> -> message.reasoning; None = off
    reasoning_parser: str | None = None
    data_parallel_size: int = 1  # engine replicas (processes) behind this front (server/replicas.py)
    response_role: str = "assistant"  # vLLM's --response-role: the role of the generated chat message
    # vLLM's --chat-template-content-format: message content reaches the template as a string, as
    # OpenAI's list of parts ({"type": "text", "text": ...}), or as the template reads it (auto)
    chat_template_content_format: str = "auto"
    # /v1/responses kept in memory for previous_response_id and GET /v1/responses/{id} (LRU; 0 = none)
    responses_store_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("shutdown_timeout", "idle_timeout", "body_timeout", "prep_timeout"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("max_body_bytes", "max_choices", "max_stop_strings", "max_stop_string_length",
                     "data_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
                             f"{self.chat_template_content_format!r}")
        if not isinstance(self.response_role, str) or not self.response_role.strip():
            raise ValueError("response_role must be a non-empty role name")
        n = self.responses_store_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"responses_store_size must be a non-negative integer, got {n!r}")
        w = self.prep_workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(f"prep_workers must be a positive integer, got {w!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if isinstance(self.allowed_origins, str):
            object.__setattr__(self, "allowed_origins", parse_origins(self.allowed_origins))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        for o in self.allowed_origins:
            if not isinstance(o, str) or not (o == "*" or o.startswith(("http://", "https://"))):
                raise ValueError(f"allowed_origins entries must be '*' or http(s)://host[:port] origins, got {o!r}")
        from ratchetlm.structured.tool_calls import tool_format

        tool_format(self.tool_call_parser)  # raises ValueError naming the choices
        if self.reasoning_parser is not None:
            from ratchetlm.structured.reasoning import reasoning_format

            reasoning_format(self.reasoning_parser)  # raises ValueError naming the known parsers


def parse_origins(text: str) -> tuple[str, ...]:
    """``'["https://a.example", "http://localhost:3000"]'`` (vLLM's JSON list) or a comma-separated list."""
    text = text.strip()
    if text.startswith("["):
        import json

        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError("allowed_origins must be a JSON list of origins")
        return tuple(str(i) for i in items)
    return tuple(o.strip() for o in text.split(",") if o.strip())
