"""A real ``ratchet serve`` subprocess on 127.0.0.1 (free port), shared by the server tests, and
the in-process ``LLM`` used as the oracle."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch

MODEL_NAME = "test-model"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-blocks", "384", "--max-num-seqs", "32",
               "--max-waiting", "36", "--torch-threads", "1", "--served-model-name", MODEL_NAME,
               "--log-level", "warning"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(llm_or_loader: Any, name: str = "m", config: Any = None) -> Iterator[int]:
    """``build_app`` served by uvicorn on a thread of this process (free port); yields the port."""
    import uvicorn

    from ratchetlm.server.app import build_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(llm_or_loader, name, config), host="127.0.0.1", port=port,
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        t.join(30)


@dataclass
class Server:
    base: str
    proc: subprocess.Popen | None  # None: served on a thread of this process (serve_main_in_thread)
    headers: dict[str, str] = field(default_factory=dict)  # what every /v1 request must carry (auth)

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def health(self) -> httpx.Response:
        return httpx.get(self.base + "/health", timeout=10)


def start_server(extra: list[str] | None = None, timeout: float = 240.0, launcher: str | None = None,
                 env: dict[str, str] | None = None, base_args: list[str] | None = None, **popen) -> Server:
    """``ratchet serve`` with the test arguments (``base_args``, default ``SERVER_ARGS``) plus
    ``extra``; ``launcher`` names a test module that patches something (fault injection) and
    then runs the same ``ratchet serve`` main."""
    port = free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
    cmd = [sys.executable, "-m", launcher] if launcher else [sys.executable, "-m", "ratchetlm", "serve"]
    args = SERVER_ARGS if base_args is None else base_args
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port), *args, *(extra or [])],
                            env=env, **popen)
    srv = Server(f"http://127.0.0.1:{port}", proc)
    ended = lambda: None if proc.poll() is None else f"ratchet serve exited with {proc.returncode}"  # noqa: E731
    if not wait_healthy(srv.base, timeout, ended, pause=0.5):
        proc.terminate()
        raise RuntimeError("ratchet serve did not become healthy")
    return srv


def wait_healthy(base: str, timeout: float, ended: Callable[[], str | None], pause: float) -> bool:
    """Poll ``base``/health until it answers 200 (True) or ``timeout`` passes (False); ``ended`` says why the
    server is gone (raised as a RuntimeError), None while it runs. One client for the whole loop: a new one
    per probe cost ~3 CPU-s over a slow start."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as probe:
        while time.monotonic() < deadline:
            why = ended()
            if why is not None:
                raise RuntimeError(why)
            try:
                if probe.get(base + "/health").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(pause)
    return False


def stop_server(srv: Server) -> None:
    srv.proc.terminate()
    try:
        srv.proc.wait(15)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


@contextmanager
def serve_main_in_thread(extra: list[str] | None = None, base_args: list[str] | None = None,
                         timeout: float = 240.0) -> Iterator[Server]:
    """``ratchet serve``'s own code (ratchetlm/server/cli.py: the same argv through its parser, flag checks,
    model load, app and uvicorn server, on a free port) on a thread of this process: for a server whose
    process is not the point (no signal, exit code or killed process; those tests start ``ratchet serve``
    with start_server). It saves the interpreter, torch and transformers start-up and the model's first
    load in a new process (~5 CPU-s a server). On leaving, the server stops as on a signal, and the test
    asserts that serve ended with 0 and no thread of it still running."""
    import logging

    from ratchetlm.server import cli, http

    servers: list[Any] = []
    served: list[Any] = []

    class Captured(http.RatchetServer):  # the instance serve builds, to stop it as its signal handler would
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            servers.append(self)

    log = logging.getLogger("ratchetlm")  # serve sets its logger up (a handler, no propagation): put back after
    saved = list(log.handlers), log.level, log.propagate
    threads = torch.get_num_threads()  # --torch-threads sets this process's
    port = free_port()
    args = SERVER_ARGS if base_args is None else base_args
    argv = ["--host", "127.0.0.1", "--port", str(port), *args, *(extra or [])]
    result: dict[str, Any] = {}
    patch = pytest.MonkeyPatch()
    patch.setattr(http, "RatchetServer", Captured)  # serve's main imports it from there when it runs
    t = threading.Thread(target=lambda: result.update(code=cli._main(argv, served)), name="ratchet-serve-main",
                         daemon=True)
    t.start()
    srv = Server(f"http://127.0.0.1:{port}", None)
    try:
        ended = lambda: None if t.is_alive() else f"ratchet serve ended with {result.get('code')}"  # noqa: E731
        assert wait_healthy(srv.base, timeout, ended, pause=0.2), "ratchet serve did not become healthy"
        yield srv
    finally:
        if servers:
            servers[0].should_exit = True
        t.join(60)
        patch.undo()
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]
        torch.set_num_threads(threads)
    assert not t.is_alive() and result.get("code") == 0, result
    assert [name for st in served for name in st.busy_threads()] == []


@pytest.fixture(scope="session")
def server():
    srv = start_server()
    yield srv
    stop_server(srv)


API_KEY = "test-key-8c1f"
# every limit small, an API key from the environment, and the fault-injection hook
HARDENED_ARGS = ["--max-model-len", "96", "--idle-timeout", "2", "--max-body-bytes", "65536", "--max-choices", "8",
                 "--max-stop-strings", "4", "--max-stop-string-length", "32"]


@pytest.fixture(scope="session")
def hardened():
    srv = start_server(HARDENED_ARGS, launcher="tests.server.fault_launcher", env={"RATCHET_API_KEY": API_KEY})
    srv.headers = {"Authorization": f"Bearer {API_KEY}"}
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def oracle(llm_default):
    """The offline LLM with the server's dtype and defaults (numerics "auto"): greedy text here must
    equal the server's, whose requests share batches (the integer mode is batch-invariant)."""
    torch.set_num_threads(1)  # the shared CPU is oversubscribed; one thread is several times faster
    return llm_default


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def wait_idle(server: Server, within: float) -> dict:
    """Poll /health until no request runs or waits and every KV block is free; returns the last JSON."""
    deadline = time.monotonic() + within
    with httpx.Client(timeout=10) as probe:  # one client for the polling (a new one per probe: ~10 ms of CPU)
        while True:
            h = probe.get(server.base + "/health").json()
            if h["requests_running"] == 0 and h["requests_waiting"] == 0 and \
                    h["kv_blocks_free"] == h["kv_blocks_total"]:
                return h
            if time.monotonic() > deadline:
                return h
            time.sleep(0.02)
