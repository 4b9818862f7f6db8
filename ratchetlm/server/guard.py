"""ASGI middleware in front of the app: Bearer auth and JSON-only POST bodies on ``/v1/*`` and the
tokenizer routes.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``), so streaming responses and the handlers'
disconnect detection pass through untouched.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

from ratchetlm.server.errors import APIError


def is_json(content_type: str) -> bool:
    """``application/json`` or any ``application/*+json``, parameters (charset) ignored."""
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def bearer_token(authorization: bytes) -> bytes:
    """The credentials of an ``Authorization: Bearer <token>`` header, b"" for any other scheme. The
    scheme is case-insensitive (RFC 9110, 11.1): ``bearer`` and ``BEARER`` are ``Bearer``."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else b""


_ROOT_API = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})  # vLLM's, outside /v1


class Guard:
    """401 without the API key (when one is set); 415 for a POST whose body is not declared JSON:
    a web page can send text/plain or form bodies cross-origin without a CORS preflight, so only a
    JSON content type (which needs the preflight) may start a request."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/") or path in _ROOT_API):
            headers = dict(scope["headers"])
            err = None
            if self.expected is not None and not hmac.compare_digest(bearer_token(headers.get(b"authorization", b"")),
                                                                     self.expected):
                err = APIError("invalid or missing API key: send the header 'Authorization: Bearer <key>'", 401)
            elif scope["method"] == "POST" and not is_json(headers.get(b"content-type", b"").decode("latin-1")):
                err = APIError("the request body must be JSON: send the header 'Content-Type: application/json'",
                               415)
            if err is not None:
                extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
                await JSONResponse(err.body(), status_code=err.status, headers=extra)(scope, receive, send)
                return
        await self.app(scope, receive, send)
