"""The FastAPI app: ``build_app(llm_or_loader, served_model_name(s), config)``.

Give it a loaded ``LLM`` (anything with ``.engine``, ``.tokenizer``, ``.tokenize`` and
``.apply_chat_template``) or a zero-argument loader; with a loader the server answers at once and
``/health`` says 503 until the model is loaded in a background thread. If loading fails, ``/health``
says why (without file paths) and ``on_load_failed`` runs (``ratchet serve`` then exits non-zero).

A request's body is read with a size limit, an idle timeout per chunk and a deadline for the whole
body, then parsed, validated, templated, tokenized and its grammar compiled in a bounded pool
(server/prepare.py), so a huge prompt blocks neither the event loop (``/health`` stays fast) nor
other requests' preparation.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (and ``GET``/``DELETE``
``/v1/responses/{id}``), ``/v1/embeddings`` (``--runner pooling``), ``/v1/models`` (every served name),
``/v1/models/{id}``,
``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (vLLM's), ``/health``, ``/metrics``, ``/version``.
CORS headers only with ``allowed_origins``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ratchetlm.engine.llm_engine import PromptTooLongError, QueueFullError
from ratchetlm.server.async_engine import EngineError
from ratchetlm.server.common import Runner, ServingContext
from ratchetlm.server.config import ServerConfig
from ratchetlm.server.errors import APIError, from_validation, from_value_error
from ratchetlm.server.guard import Guard
from ratchetlm.server.protocol import (
    IGNORED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_unsupported,
    lone_surrogate_path,
)
from ratchetlm.server.serving_chat import ChatPlan
from ratchetlm.server.serving_completion import CompletionPlan
from ratchetlm.server.serving_embedding import EmbeddingRequest, create_embeddings, runner_of
from ratchetlm.server.serving_responses import ResponsesPlan, ResponsesRequest, add_response_routes
from ratchetlm.server.serving_tokenize import detokenize, tokenize, tokenizer_info
from ratchetlm.server.state import ServerState

log = logging.getLogger("ratchetlm")

def build_app(llm_or_loader: Any, served_model_name: str | list[str], config: ServerConfig | None = None,
              hide: tuple[str, ...] = ()) -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("served model names must be non-empty strings")
    state = ServerState(names, config or ServerConfig(), hide)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        if hasattr(llm_or_loader, "engine"):
            state.ready(llm_or_loader)
        else:
            state.load_thread = threading.Thread(target=state.load, args=(llm_or_loader,), name="ratchet-load",
                                                 daemon=True)
            state.load_thread.start()
        yield
        if state.engine is not None:
            state.engine.shutdown()
        state.prep.shutdown()

    app = FastAPI(title="ratchetlm", lifespan=lifespan)
    app.state.ratchet = state
    app.add_middleware(Guard, api_key=state.cfg.api_key)
    if state.cfg.allowed_origins:  # outermost: a browser's preflight is answered before auth
        app.add_middleware(CORSMiddleware, allow_origins=list(state.cfg.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in state.cfg.allowed_origins)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return await _api_error(_, APIError(str(e.errors()[0].get("msg", e)), 400))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return await _api_error(_, APIError(str(e.detail), e.status_code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return await _api_error(_, APIError(f"internal error: {type(e).__name__}: {e}", 500))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine is None or not state.engine.alive or state.draining:
            msg = state.load_error or ("Loading model" if state.engine is None else
                                       "the server is shutting down" if state.draining else
                                       getattr(state.engine, "dead", None) or "engine thread stopped")
            return JSONResponse(APIError(msg, 503).body(), status_code=503)
        s = state.engine.snapshot
        body = {"status": "ok", "requests_running": s.running, "requests_waiting": s.waiting,
                "kv_blocks_free": s.kv_blocks_free, "kv_blocks_total": s.kv_blocks_total,
                "http_requests_active": state.active}
        status = getattr(state.engine, "status", None)
        if status is not None:  # data parallelism: each replica, alive or not
            body["replicas"] = status()
        return JSONResponse(body)

    def model_card(name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": state.created, "owned_by": "ratchetlm",
                                "root": state.model_name}
        if state.ctx is not None:
            card["max_model_len"] = state.ctx.max_model_len
        return card

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in state.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        """OpenAI's ``GET /v1/models/{model}``: one served name's card, else a 404 naming it."""
        if model_id not in state.model_names:
            raise APIError(f"the model `{model_id}` does not exist (serving `{'`, `'.join(state.model_names)}`)",
                           404, "model")
        return JSONResponse(model_card(model_id))

    @app.get("/version")
    async def version() -> JSONResponse:
        from ratchetlm import __version__

        return JSONResponse({"version": __version__})

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(await _simple(state, request, TokenizeRequest, tokenize))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(await _simple(state, request, DetokenizeRequest, detokenize))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> JSONResponse:
        if state.ctx is None:
            raise APIError("the model is still loading", 503)
        return JSONResponse(tokenizer_info(state.ctx))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _serve(state, request, CompletionRequest, CompletionPlan)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, ChatCompletionRequest, ChatPlan)

    @app.post("/v1/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await _serve(state, request, ResponsesRequest,
                            partial(ResponsesPlan, store=state.responses, limits=state.cfg))

    add_response_routes(app, state.responses)

    @app.post("/v1/embeddings", openapi_extra=_body_schema(EmbeddingRequest))
    async def embeddings(request: Request) -> JSONResponse:
        return JSONResponse(await _simple(state, request, EmbeddingRequest, create_embeddings))

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request models (the handlers parse bodies themselves, to
        answer every failure in OpenAI's error shape, so FastAPI cannot see them)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in (CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest, TokenizeRequest,
                      DetokenizeRequest):
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                # unknown fields are a 400 (check_unsupported): say so, and declare the harmless
                # OpenAI fields that are accepted and ignored
                for name in sorted(IGNORED_FIELDS):
                    js.setdefault("properties", {}).setdefault(name, {"description": "accepted and ignored"})
                js["additionalProperties"] = False
                comps[m.__name__] = js
            if state.cfg.api_key:
                schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _body_schema(model: type[Any]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def _read_body(request: Request, cfg: ServerConfig) -> bytes:
    """The body, refused with 413 past ``max_body_bytes`` (by its Content-Length before reading
    anything, else as it arrives) and with 408 if a chunk takes longer than ``idle_timeout`` or the
    whole body longer than ``body_timeout`` (a client trickling a byte at a time resets no timer)."""
    limit = cfg.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(f"the request body has {int(declared)} bytes; the limit is {limit}", 413)
    chunks, size = [], 0
    stream = request.stream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.body_timeout
    while True:
        wait = min(cfg.idle_timeout, deadline - loop.time())
        try:
            if wait <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(anext(stream), wait)
        except StopAsyncIteration:
            break
        except TimeoutError:
            if wait < cfg.idle_timeout:
                raise APIError(f"the request body did not complete within {cfg.body_timeout:g} s", 408) from None
            raise APIError(f"the request body did not arrive within {cfg.idle_timeout:g} s", 408) from None
        size += len(chunk)
        if size > limit:
            raise APIError(f"the request body is over the limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(state: ServerState, raw: bytes, model: type[Any]) -> Any:
    """Body bytes -> a validated request model (unknown fields checked, the model name served)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, invalid UTF-8, absurd nesting
        raise APIError(f"malformed JSON body: {e}", 400) from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400)
    try:
        bad = lone_surrogate_path(body)
    except RecursionError:
        raise APIError("the request body is nested too deeply", 400) from None
    if bad is not None:
        raise APIError(f"{bad}: the text contains a lone UTF-16 surrogate (not valid Unicode)", 400, bad)
    try:
        req = model.model_validate(body, context={"limits": state.cfg})
    except ValidationError as e:
        raise from_validation(e) from None
    if req.model is not None and req.model not in state.model_names:
        raise APIError(f"the model `{req.model}` does not exist (serving `{'`, `'.join(state.model_names)}`)", 404,
                       "model")
    check_unsupported(req)
    return req


def _prepare(state: ServerState, raw: bytes, model: type[Any], plan_cls: Callable[..., Any]) -> Any:
    """Body bytes -> plan (validated request, tokenized prompts, engine submissions). Runs on the
    preparation thread; raises :class:`APIError` for anything the client got wrong."""
    req = _parse(state, raw, model)
    plan = plan_cls(req, state.ctx)
    queue = state.ctx.llm.engine.cfg.max_waiting if state.ctx is not None else None
    if isinstance(queue, int) and len(plan.subs) > queue:
        raise APIError(f"this request has {len(plan.subs)} choices but the server queues at most {queue}: "
                       "it can never be accepted; send fewer prompts or a smaller n", 400, "n")
    return req, plan


async def _simple(state: ServerState, request: Request, model: type[Any],
                  handler: Callable[[Any, ServingContext], dict[str, Any]]) -> dict[str, Any]:
    """A request answered without the engine (``/tokenize``, ``/detokenize``), on the prep thread."""
    if state.ctx is None:
        raise APIError("the model is still loading", 503)
    raw = await _read_body(request, state.cfg)
    ctx = state.ctx
    return await state.prep.run(len(raw), lambda: handler(_parse(state, raw, model), ctx))


async def _serve(state: ServerState, request: Request, model: type[Any], plan_cls: Callable[..., Any]) -> Response:
    arrival = time.perf_counter()
    if state.draining:
        raise APIError("the server is shutting down", 503)
    if state.engine is None or state.ctx is None:
        raise APIError("the model is still loading", 503)
    if runner_of(state.ctx) == "pooling":
        raise APIError("this server runs the pooling runner (--runner pooling): it serves /v1/embeddings, not "
                       "generation", 400, "model")
    raw = await _read_body(request, state.cfg)
    req, plan = await state.prep.run(len(raw), _prepare, state, raw, model, plan_cls)
    group = state.engine.group(plan.subs)
    prompt_param = getattr(plan, "prompt_param", "messages" if model is ChatCompletionRequest else "prompt")
    try:
        await group.start()
    except QueueFullError as e:
        raise APIError(str(e), 503) from None
    except PromptTooLongError as e:
        raise APIError(str(e), 400, prompt_param) from None
    except ValueError as e:
        raise from_value_error(e) from None
    except EngineError as e:  # no replica left to take it
        raise APIError(str(e), e.status) from None
    m = state.metrics
    m.prompt_tokens.labels(m.model_name).inc(sum(len(s.prompt_ids) for s in plan.subs))
    state.active += 1

    def ended() -> None:
        state.active -= 1

    runner = Runner(request, group, m, arrival, len(plan.subs), on_end=ended)
    respond = getattr(plan, "respond", None)
    if respond is not None:  # /v1/responses renders its own body and events (server/serving_responses.py)
        return await respond(runner)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage_chunk = (lambda: plan.usage_chunk(runner.states)) if include_usage else None
        return StreamingResponse(runner.stream(plan.chunk, usage_chunk), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    await runner.collect()  # an engine fault is the request's 4xx/5xx (Runner.collect)
    return JSONResponse(plan.response(runner.states))
