"""The FastAPI app: ``build_app(llm_or_loader, served_model_name)``.

Give it a loaded ``LLM`` (anything with ``.engine``, ``.tokenizer``, ``.encode`` and
``.apply_chat_template``) or a zero-argument loader; with a loader the server answers at once and
``/health`` says 503 until the model is loaded in a background thread.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ratchetlm.engine.llm_engine import PromptTooLongError, QueueFullError
from ratchetlm.server.async_engine import AsyncEngine
from ratchetlm.server.common import Runner, ServingContext, TokenText
from ratchetlm.server.errors import APIError, from_validation, from_value_error
from ratchetlm.server.metrics import ServerMetrics
from ratchetlm.server.protocol import ChatCompletionRequest, CommonRequest, CompletionRequest, check_unsupported
from ratchetlm.server.serving_chat import ChatPlan
from ratchetlm.server.serving_completion import CompletionPlan


class ServerState:
    """Loading status and, once loaded, the engine thread and serving context."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: AsyncEngine | None = None
        self.ctx: ServingContext | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name, lambda: self.engine.snapshot if self.engine else None)

    def ready(self, llm: Any) -> None:
        eng = AsyncEngine(llm.engine, llm.tokenizer)
        eng.start()
        self.ctx = ServingContext(llm, self.model_name, self.metrics, TokenText(llm.tokenizer))
        self.engine = eng

    def load(self, loader: Callable[[], Any]) -> None:
        try:
            self.ready(loader())
        except Exception as e:  # reported by /health; the process keeps answering
            self.load_error = f"{type(e).__name__}: {e}"
            print(f"ratchet serve: failed to load the model: {self.load_error}", file=sys.stderr)


def build_app(llm_or_loader: Any, served_model_name: str) -> FastAPI:
    state = ServerState(served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if hasattr(llm_or_loader, "engine"):
            state.ready(llm_or_loader)
        else:
            threading.Thread(target=state.load, args=(llm_or_loader,), name="ratchet-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="ratchetlm", lifespan=lifespan)
    app.state.ratchet = state

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
        if state.engine is None or not state.engine.alive:
            msg = state.load_error or ("Loading model" if state.engine is None else "engine thread stopped")
            return JSONResponse(APIError(msg, 503).body(), status_code=503)
        s = state.engine.snapshot
        return JSONResponse({"status": "ok", "requests_running": s.running, "requests_waiting": s.waiting,
                             "kv_blocks_free": s.kv_blocks_free, "kv_blocks_total": s.kv_blocks_total})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": served_model_name, "object": "model", "created": state.created, "owned_by": "ratchetlm"}
        if state.ctx is not None:
            card["max_model_len"] = state.ctx.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(state, request, CompletionRequest, CompletionPlan)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, ChatCompletionRequest, ChatPlan)

    return app


async def _serve(state: ServerState, request: Request, model: type[CommonRequest], plan_cls: type) -> Response:
    arrival = time.perf_counter()
    if state.engine is None or state.ctx is None:
        raise APIError("the model is still loading", 503)
    try:
        body = await request.json()
    except Exception as e:  # noqa: BLE001 - any decode failure is the client's malformed body
        raise APIError(f"malformed JSON body: {e}", 400) from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400)
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e) from None
    if req.model is not None and req.model != state.model_name:
        raise APIError(f"the model `{req.model}` does not exist (serving `{state.model_name}`)", 404, "model")
    check_unsupported(req)
    plan = plan_cls(req, state.ctx)
    group = state.engine.group(plan.subs)
    prompt_param = "messages" if model is ChatCompletionRequest else "prompt"
    try:
        await group.start()
    except QueueFullError as e:
        raise APIError(str(e), 503) from None
    except PromptTooLongError as e:
        raise APIError(str(e), 400, prompt_param) from None
    except ValueError as e:
        raise from_value_error(e) from None
    m = state.metrics
    m.prompt_tokens.labels(m.model_name).inc(sum(len(s.prompt_ids) for s in plan.subs))
    runner = Runner(request, group, m, arrival, len(plan.subs))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage_chunk = (lambda: plan.usage_chunk(runner.states)) if include_usage else None
        return StreamingResponse(runner.stream(plan.chunk, usage_chunk), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        await runner.collect()
    except APIError:
        raise
    except Exception as e:
        raise APIError(str(e), 500) from None
    return JSONResponse(plan.response(runner.states))
