"""Process lifecycle of ``ratchet serve`` (issue 12, defects 5 and 6): graceful SIGTERM, and a model
that fails to load."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx

from tests.server.conftest import MODEL_NAME, free_port, start_server


async def _stream(c: httpx.AsyncClient, base: str, max_tokens: int) -> tuple[int, str | None, dict | None, bool]:
    """(content chunks, finish_reason, error event, saw [DONE]) of one streamed completion."""
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks, reason, error, done = 0, None, None, False
    async with c.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
            elif "error" in (obj := json.loads(data)):
                error = obj["error"]
            else:
                chunks += 1
                reason = obj["choices"][0]["finish_reason"] or reason
    return chunks, reason, error, done


def test_sigterm_drains_then_ends_streams_with_an_error_and_done():
    """SIGTERM: short requests finish normally; long ones get ``--shutdown-timeout`` seconds, then an
    error event and ``[DONE]`` (never a cut chunked stream); new requests and ``/health`` get a 503
    (the listener stays open: a probe must not read a refused connection); the process exits."""
    srv = start_server(["--shutdown-timeout", "3"])
    base = srv.base

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            long = [asyncio.ensure_future(_stream(c, base, 900)) for _ in range(4)]
            short = [asyncio.ensure_future(_stream(c, base, 6)) for _ in range(2)]
            # every request admitted before the signal: running, or (a short one) already finished;
            # waiting for 6 running raced with the short ones finishing on a fast engine (and hung)
            deadline = time.monotonic() + 60
            while httpx.get(base + "/health").json()["requests_running"] + sum(f.done() for f in short) < 6:
                assert time.monotonic() < deadline, "the requests never all started"
                await asyncio.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            await asyncio.sleep(0.5)
            # the listener stays open while draining: new work and probes get a 503, not a refused connection
            late = httpx.post(base + "/v1/completions", json={"prompt": "hi"}, timeout=5)
            health = httpx.get(base + "/health", timeout=5)
            return await asyncio.gather(*short), await asyncio.gather(*long), time.monotonic() - t0, (late, health)

    short, long, elapsed, (late, health) = asyncio.run(run())
    for r in (late, health):
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    for chunks, reason, error, done in short:
        assert done and error is None and reason == "length" and chunks >= 1
    for chunks, reason, error, done in long:
        assert done, "every stream ends with [DONE]"
        assert chunks >= 1, "it was streaming when the signal came"
        assert reason is None and error is not None and "shutting down" in error["message"]
        assert error["code"] == "503"
    assert 2.5 < elapsed < 10, elapsed  # they had the shutdown timeout to finish
    srv.proc.wait(15)  # and exited once they had ended


def test_model_load_failure_is_reported_without_the_path_and_exits_nonzero():
    secret = "/nonexistent/private-dir/model.gguf"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ratchetlm", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--model", secret, "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=5) as probe:  # one client: a new one per probe cost ~4 CPU-s over a slow start
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                r = probe.get(f"http://127.0.0.1:{port}/health")
                if "failed to load" in r.text:
                    seen.append(r)
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    rc = proc.wait(30)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert rc == 1, (rc, stderr)
    assert seen, "/health reported the failure before the process exited"
    for r in seen:
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert "does not exist" in msg and "private-dir" not in msg and "model.gguf" not in msg, msg
    assert secret in stderr  # the operator's log has the full message


def test_ctrl_c_while_the_step_cost_probe_runs_exits_130_promptly():
    """The engine thread probes the step cost right after the model loads (seconds on a busy CPU; here
    made to last minutes). Ctrl-C then stops the probe before its next forward and the server exits
    with 130: it neither waits for the probe nor exits with the thread inside a forward, which aborts
    the process in torch's teardown ("terminate called without an active exception", -6)."""
    srv = start_server(launcher="tests.server.slow_probe_launcher", stderr=subprocess.PIPE,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(1.0)  # the probe is running (it would for minutes)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    _, err = srv.proc.communicate(timeout=120)
    text = err.decode()
    assert srv.proc.returncode == 130, text[-2000:]
    assert "terminate called" not in text and "Traceback" not in text
    assert time.monotonic() - t0 < 20  # not shutdown's 60 s wait for a thread that would not stop
