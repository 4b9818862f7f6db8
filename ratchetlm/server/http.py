"""uvicorn, hardened: a deadline for each request's headers, and SIGTERM as a graceful drain.

uvicorn times out idle keep-alive connections only *between* requests, and any byte resets that
timer, so a connection that opens and sends nothing (or stalls in the middle of its headers) stays
open forever. :class:`GuardedH11Protocol` closes it after ``timeout_keep_alive`` seconds without a
complete request head. Bodies are read by the handler with the same per-chunk deadline.

:class:`RatchetServer` tells the app when a shutdown signal arrives, so running requests can
finish (up to ``--shutdown-timeout``) and the rest end with an error event and ``[DONE]`` instead
of being cut mid-stream when uvicorn cancels them; meanwhile the listener stays open, so a probe
reads ``/health``'s 503 rather than a refused connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _head_timeout(self) -> None:
        self._head_deadline = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: the handler owns the connection now
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class RatchetServer(uvicorn.Server):
    """The first SIGTERM/SIGINT starts a drain, not uvicorn's shutdown: ``on_shutdown_signal`` runs
    on the event loop (the app then answers new requests and ``/health`` with 503), the listener
    stays open so that probes get that answer instead of a refused connection, and uvicorn's own
    shutdown starts once ``drained()`` is true (the running requests ended) or after
    ``drain_timeout`` seconds. A second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, on_shutdown_signal: Callable[[], None],
                 drained: Callable[[], bool] = lambda: True, drain_timeout: float = 0.0) -> None:
        super().__init__(config)
        self.on_shutdown_signal = on_shutdown_signal
        self.drained = drained
        self.drain_timeout = drain_timeout
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet (signal during startup): nothing to drain
            loop = None
        if self.draining or self.should_exit or loop is None:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        self._captured_signals.append(sig)  # re-raised once the server stopped (the exit status)
        loop.call_soon(self.on_shutdown_signal)
        loop.call_soon(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while not self.should_exit and not self.drained() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True
