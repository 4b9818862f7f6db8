"""The server's state: the model's loading status and, once loaded, the engine thread and the serving
context every route reads (server/app.py builds one per app). Loading happens in a background thread
(``ServerState.load``); a failure is kept for ``/health`` with file paths hidden (``public_error``)."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ratchetlm.server.async_engine import AsyncEngine
from ratchetlm.server.common import ServingContext, TokenText
from ratchetlm.server.config import ServerConfig
from ratchetlm.server.metrics import ServerMetrics
from ratchetlm.server.prepare import PrepPool
from ratchetlm.server.replicas import ReplicaPool
from ratchetlm.server.responses_store import ResponseStore
from ratchetlm.structured.reasoning import ReasoningFormat, reasoning_format

log = logging.getLogger("ratchetlm")

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][^\s'\"\\/:]+)+[\\/]?")  # absolute paths in an error message


def public_error(e: Exception, hide: tuple[str, ...] = ()) -> str:
    """``Type: message`` with file paths (the given ones, and anything absolute) replaced by ``<path>``."""
    msg = str(e)
    for h in sorted((h for h in hide if h), key=len, reverse=True):
        msg = msg.replace(h, "<path>")
    return f"{type(e).__name__}: {_PATH.sub('<path>', msg)}"


def reasoning_of(llm: Any, name: str | None) -> ReasoningFormat | None:
    """The ``--reasoning-parser`` format, or None when not asked for or when the model has no think
    tags (neither in its vocabulary nor in its chat template: nothing to split, as the log says)."""
    if name is None:
        return None
    fmt = reasoning_format(name)
    if not fmt.applies_to(llm.tokenizer, getattr(llm.tokenizer, "chat_template", None)):
        log.info("--reasoning-parser %s: the model has no %s...%s tags (neither in its vocabulary nor in its chat "
                 "template): nothing to split, the output stays in the content", name, fmt.start, fmt.end)
        return None
    log.info("--reasoning-parser %s: %s...%s goes to message.reasoning / reasoning_content", name, fmt.start, fmt.end)
    return fmt


def _override_cap(llm: Any) -> int | None:
    """``--override-generation-config``'s ``max_new_tokens``: vLLM caps every request with it."""
    override = getattr(getattr(llm, "config", None), "override_generation_config", None) or {}
    cap = override.get("max_new_tokens")
    return None if cap is None else int(cap)


class ServerState:
    """Loading status and, once loaded, the engine thread and serving context."""

    def __init__(self, model_names: list[str], cfg: ServerConfig, hide: tuple[str, ...] = ()) -> None:
        self.model_names = model_names  # any may be named in a request; responses name the first
        self.model_name = model_names[0]
        self.cfg = cfg
        self.hide = hide  # strings (the model path) never shown to clients
        self.engine: AsyncEngine | None = None
        self.ctx: ServingContext | None = None
        self.load_error: str | None = None
        self.on_load_failed: Callable[[], None] | None = None  # called on the load thread
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once started
        self.load_thread: threading.Thread | None = None  # loads the model after the server started
        self.draining = False
        self.active = 0  # HTTP generation handlers running now (a leak shows here)
        self.prep = PrepPool(cfg.prep_workers, cfg.prep_timeout)
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_name, lambda: self.engine.snapshot if self.engine else None)
        self.responses = ResponseStore(cfg.responses_store_size)  # previous_response_id (server/responses_store.py)

    def busy_threads(self) -> list[str]:
        """The server's threads that are still running (after shutdown: none, unless a step or the
        model load outlived shutdown's wait)."""
        busy = [self.load_thread.name] if self.load_thread is not None and self.load_thread.is_alive() else []
        return busy + (["ratchet-engine"] if isinstance(self.engine, AsyncEngine) and self.engine.alive else [])

    def begin_shutdown(self) -> None:
        """SIGTERM (on the event loop): refuse new requests; after ``shutdown_timeout`` end the
        ones still running with an error (streams get an error event and ``[DONE]``)."""
        if self.draining:
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        engine = self.engine
        if engine is not None:
            loop.call_later(self.cfg.shutdown_timeout, engine.fail_all,
                            "the server is shutting down (shutdown timeout reached)")

    def ready(self, llm: Any, engine: Any = None) -> None:
        """``engine``: a :class:`~ratchetlm.server.replicas.ReplicaPool` (data parallelism), else
        one :class:`AsyncEngine` on ``llm``'s engine."""
        eng = engine if engine is not None else AsyncEngine(llm.engine, llm.tokenizer)
        eng.start()
        self.ctx = ServingContext(llm, self.model_name, self.metrics, TokenText(llm.tokenizer),
                                  tool_call_parser=self.cfg.tool_call_parser, response_role=self.cfg.response_role,
                                  content_format=self.cfg.chat_template_content_format,
                                  reasoning=reasoning_of(llm, self.cfg.reasoning_parser),
                                  sampling_defaults=dict(getattr(llm, "default_sampling", {}) or {}),
                                  max_tokens_cap=_override_cap(llm))
        self.engine = eng

    def load(self, loader: Any) -> None:
        """``loader()``: the model (server/cli.py:ModelLoader); with data parallelism, pickled into
        each replica, and ``loader.front(facts)`` is what this process serves from."""
        try:
            if self.cfg.data_parallel_size > 1:
                # the replicas load the model, each with its own engine and KV cache; this process
                # prepares requests, from the tokenizer and template alone (server/front.py)
                pool = ReplicaPool(loader, self.cfg.data_parallel_size)
                try:
                    self.ready(loader.front(pool.facts), pool)
                except BaseException:
                    pool.shutdown()
                    raise
            else:
                self.ready(loader())
        except Exception as e:  # reported by /health (no paths); the full message goes to the log
            self.load_error = "the model failed to load: " + public_error(e, self.hide)
            print(f"ratchet serve: failed to load the model: {type(e).__name__}: {e}", file=sys.stderr)
            if self.on_load_failed is not None:
                self.on_load_failed()
