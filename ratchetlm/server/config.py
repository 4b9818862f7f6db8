"""Server configuration: ``ratchet serve`` flags map 1:1 onto these fields (engine flags go to
:class:`~ratchetlm.engine.config.EngineConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    max_body_bytes: int = 8 << 20  # request body size (413 beyond)
    max_choices: int = 64  # prompts x n of one request
    max_stop_strings: int = 16
    max_stop_string_length: int = 512  # characters per stop string

    def __post_init__(self) -> None:
        for name in ("shutdown_timeout", "idle_timeout"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("max_body_bytes", "max_choices", "max_stop_strings", "max_stop_string_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
