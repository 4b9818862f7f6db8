"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``; ``code`` is the HTTP
status as a string (OpenAI's schema: a string or null).

Handlers raise :class:`APIError`; the app turns it (and pydantic/JSON/``ValueError`` failures)
into a JSON response with the matching HTTP status, or into a ``data: {"error": ...}`` SSE event
once a stream has started.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
          413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error to report to the client with HTTP ``status``; ``param`` names the offending field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": str(self.status)}}


def from_validation(e: ValidationError) -> APIError:
    """First pydantic error as one readable 400 naming the field (``messages.0.role``)."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith("function-"))
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    return APIError(f"{loc}: {msg}" if loc else msg, 400, loc or None)


def from_value_error(e: ValueError) -> APIError:
    """SamplingParams / engine ValueErrors name the field as the message's first word."""
    msg = str(e)
    first = msg.split(" ", 1)[0]
    param = first if first.isidentifier() else None
    return APIError(msg, 400, param)
