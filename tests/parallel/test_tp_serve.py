"""``ratchet serve --tensor-parallel-size 2`` answers the official openai client with the text the
one-rank engine generates; a worker that dies turns into clean 503 errors and a /health that names
it; a server killed outright takes its worker with it. ``ratchet generate`` takes the same flag."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from ratchetlm import LLM, SamplingParams
from ratchetlm.cli import main
from tests.parallel.conftest import children
from tests.server.conftest import MODEL_NAME, start_server, stop_server

PROMPT = "hello world"


def _server(tiny_gguf):
    return start_server(["--tensor-parallel-size", "2"], base_args=[
        "--model", tiny_gguf, "--dtype", "float32", "--numerics", "exact", "--kv-cache-blocks", "64",
        "--torch-threads", "1",
        "--served-model-name", MODEL_NAME, "--log-level", "warning"])


def _workers(srv) -> list[psutil.Process]:
    kids = psutil.Process(srv.proc.pid).children(recursive=True)
    return [p for p in kids if "ratchetlm.parallel.worker" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def oracle(tiny_gguf):
    return LLM(tiny_gguf, dtype="float32", progress=False, numerics="exact", kv_cache_blocks=64)


def test_openai_client_gets_the_one_rank_text_then_a_dead_worker_is_a_clean_503(tiny_gguf, oracle):
    from openai import APIStatusError, OpenAI

    ref = oracle.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    srv = _server(tiny_gguf)
    try:
        client = OpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
        assert whole.choices[0].text == ref.text and whole.usage.completion_tokens == len(ref.token_ids)
        chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks) == ref.text

        (worker,) = _workers(srv)
        worker.kill()
        with pytest.raises(APIStatusError) as e:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
        assert e.value.status_code == 503 and "rank 1 exited with code -9" in str(e.value)
        h = srv.health()
        assert h.status_code == 503 and "rank 1" in h.json()["error"]["message"]
        with pytest.raises(APIStatusError) as e:  # later requests too, at once
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
        assert e.value.status_code == 503
    finally:
        stop_server(srv)


def test_a_killed_server_leaves_no_worker(tiny_gguf):
    srv = _server(tiny_gguf)
    (worker,) = _workers(srv)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()
    deadline = time.monotonic() + 15  # it notices within a second; exiting on a busy machine takes longer
    while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    with pytest.raises(httpx.TransportError):
        srv.health()


def test_ratchet_generate_takes_the_flag_and_stops_its_worker(tiny_gguf, oracle, capsys):
    ref = oracle.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    before = children()
    assert main(["generate", PROMPT, "--model", tiny_gguf, "--dtype", "float32", "--max-tokens", "8",
                 "--tensor-parallel-size", "2", "--progress", "false"]) == 0
    assert capsys.readouterr().out == PROMPT + ref.text + "\n"
    assert children() == before  # the worker exited when the command closed its LLM
