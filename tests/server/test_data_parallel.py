"""``ratchet serve --data-parallel-size 2`` (server/replicas.py): two engine processes behind one
front. Streams are unchanged (greedy text == the offline engine), requests spread over both
replicas, and a replica that dies fails only its own requests while the other keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from ratchetlm import SamplingParams
from tests.server.conftest import MODEL_NAME, start_server, stop_server, wait_idle
from tests.server.test_concurrency import _stream_one

PROMPTS = [f"Question {i}: what is {i} times {i}? Answer:" for i in range(16)]


@pytest.fixture(scope="module")
def dp_server():
    """One front and two replica processes for the whole file (~28 CPU-s to start): the dead-replica test,
    the file's last, kills one replica and shuts the server down itself."""
    srv = start_server(["--data-parallel-size", "2", "--kv-cache-blocks", "128"])
    yield srv
    if srv.proc.poll() is None:
        stop_server(srv)


def _replicas(srv) -> list[dict]:
    return srv.health().json()["replicas"]


def test_16_concurrent_streams_are_correct_and_spread_over_both_replicas(dp_server, oracle):
    refs = oracle.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(_stream_one(c, dp_server.base, p) for p in PROMPTS))

    before = [r["requests_routed"] for r in _replicas(dp_server)]
    results = asyncio.run(run())
    for (text, reason, ntok), ref in zip(results, refs, strict=True):
        assert (text, reason, ntok) == (ref.text, ref.finish_reason, len(ref.token_ids))
    routed = [r["requests_routed"] - b for r, b in zip(_replicas(dp_server), before, strict=True)]
    assert sum(routed) == 16
    assert min(routed) >= 6, f"least-loaded routing should split 16 concurrent streams about evenly: {routed}"
    h = wait_idle(dp_server, within=5.0)
    assert h["requests_running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"], h


def test_a_dead_replica_fails_its_own_requests_and_the_other_keeps_serving(dp_server, oracle):
    """Last in the file: it kills a replica of the shared server and ends the server."""
    srv = dp_server
    assert all(r["alive"] for r in _replicas(srv)) and wait_idle(srv, within=5.0)["requests_running"] == 0
    try:
        # long enough to be running on both replicas when the victim is killed (~0.1 s after both start);
        # the survivor's request then runs to the end
        body = {"model": MODEL_NAME, "prompt": "Tell a long story.", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=300) as c:
                long = [asyncio.create_task(c.post(srv.v1 + "/completions", json=body)) for _ in range(2)]
                while sum(r["requests_running"] for r in _replicas(srv)) < 2:  # one on each replica
                    await asyncio.sleep(0.05)
                victim = next(r for r in _replicas(srv) if r["alive"])
                os.kill(victim["pid"], signal.SIGKILL)
                return victim["replica"], await asyncio.gather(*long)

        victim, answers = asyncio.run(run())
        codes = sorted(a.status_code for a in answers)
        assert codes == [200, 503], [a.text for a in answers]
        err = next(a for a in answers if a.status_code == 503).json()["error"]
        assert f"replica {victim} stopped" in err["message"]
        deadline = time.monotonic() + 10
        while _replicas(srv)[victim]["alive"] and time.monotonic() < deadline:
            time.sleep(0.1)
        reps = _replicas(srv)
        assert [r["alive"] for r in reps] == [r["replica"] != victim for r in reps]
        ref = oracle.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0]
        for _ in range(3):  # everything now goes to the live replica
            r = httpx.post(srv.v1 + "/completions", timeout=120, json={
                "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
        survivor = next(r["pid"] for r in reps if r["alive"])
    finally:
        stop_server(srv)
    assert srv.proc.returncode is not None
    deadline = time.monotonic() + 10
    while _pid_exists(survivor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_exists(survivor), "shutdown left a replica process behind"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
