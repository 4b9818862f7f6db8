"""What the serving benchmarks share: starting a server on a free loopback port and waiting until it
answers (``ratchet serve`` from any checkout, or llama-cpp-python's OpenAI server as a peer), and one
streamed completion's timings."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

# llama-cpp-python's server imports these beside the library (its [server] extra)
LLAMA_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings", "fastapi", "uvicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], health: str, port: int, env: dict[str, str] | None = None, cwd: str | None = None,
          timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """Run ``cmd`` (a server listening on ``port``) and wait until GET ``health`` answers 200. Its
    output goes to stderr: a benchmark's tables are its stdout."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + health).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"server did not become healthy: {' '.join(cmd)}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def start_ratchet(extra: list[str], pythonpath: str | None = None, nice: int = 0,
                  trace: str | None = None) -> tuple[subprocess.Popen, str]:
    """``ratchet serve`` on a free port; ``pythonpath``: run that checkout's server (also its working
    directory: ``python -m`` puts the working directory ahead of PYTHONPATH); ``nice``: its niceness;
    ``trace``: run it through benchmarks/serve_trace.py, which writes its per-step trace to this file
    on SIGUSR1."""
    port = free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    launch = ["-m", "ratchetlm"]
    if trace is not None:
        env["RATCHET_STEP_TRACE"] = trace
        launch = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_trace.py")]
    cmd = [sys.executable, *launch, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *extra]
    return start((["nice", "-n", str(nice)] if nice else []) + cmd, "/health", port, env=env, cwd=pythonpath)


def llama_server_missing() -> list[str]:
    """The modules llama-cpp-python's server needs that this Python lacks (``pip install
    'llama-cpp-python[server]'``, or sse-starlette and starlette-context beside the library)."""
    return [m for m in LLAMA_SERVER_MODULES if importlib.util.find_spec(m) is None]


def start_llama_cpp(model: str, threads: int, n_ctx: int = 4096) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``) on a free port."""
    missing = llama_server_missing()
    if missing:
        raise SystemExit(f"llama-cpp-python's server needs {', '.join(missing)} (pip install "
                         f"'llama-cpp-python[server]', or those modules on PYTHONPATH)")
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--host", "127.0.0.1", "--port", str(port),
           "--interrupt_requests", "False"]  # (its default cancels a running request when the next one arrives)
    return start(cmd, "/v1/models", port)


@dataclass
class Timings:
    """One streamed completion: seconds to the first choice event, gaps between the next ones (each
    event's arrival time too), output tokens (``usage`` when the server sends it, else one a
    non-empty event: llama-cpp-python streams one token an event)."""

    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    ok: bool = False


async def sse_chunks(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST ``body`` to ``url`` streamed and yield its server-sent JSON events (an HTTP error raises)."""
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            path: str = "/v1/completions") -> Timings:
    """POST ``body`` streamed and time its events (TTFT: the first event with non-empty ``choices``)."""
    res = Timings()
    t0 = time.perf_counter()
    events = 0
    async for chunk in sse_chunks(client, url + path, body):
        now = time.perf_counter()
        choices = chunk.get("choices")
        if choices:
            if res.times:
                res.itl.append(now - res.times[-1])
            else:
                res.ttft = now - t0
            res.times.append(now)
            c = choices[0]
            events += bool(c.get("text") or (c.get("delta") or {}).get("content"))
        if chunk.get("usage"):
            res.output_tokens = int(chunk["usage"]["completion_tokens"])
    res.e2e = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or events
    res.ok = bool(res.times)
    return res
