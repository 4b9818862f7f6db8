"""A tensor-parallel rank that dies or hangs is an error in the caller within a bounded time, never
a silent hang; the engine then refuses to go on, and no worker process outlives it."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from ratchetlm import LLM, SamplingParams
from ratchetlm.parallel.group import TensorParallelError
from tests.parallel.conftest import children

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _start(tiny_gguf) -> tuple[LLM, list[int]]:
    before = children()
    llm = LLM(tiny_gguf, dtype="float32", progress=False, kv_cache_blocks=32, tensor_parallel_size=2)
    workers = sorted(children() - before)
    assert len(workers) == 1
    assert llm.generate([[20, 21, 22]], PARAMS)[0].outputs[0].finish_reason == "length"  # serving
    return llm, workers


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_killed_worker_is_an_error_naming_it_and_the_engine_stops(tiny_gguf):
    llm, workers = _start(tiny_gguf)
    os.kill(workers[0], signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 exited with code -9"):
        llm.generate([[30, 31, 32]], PARAMS)
    assert time.monotonic() - t < 10
    with pytest.raises(TensorParallelError, match="rank 1"):  # at once, and every time after
        llm.generate([[30, 31]], PARAMS)
    llm.close()
    assert llm.engine.scheduler.running == [] and llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_a_hung_worker_is_an_error_after_the_collective_timeout(tiny_gguf, monkeypatch):
    monkeypatch.setenv("RATCHET_TP_TIMEOUT", "3")
    llm, workers = _start(tiny_gguf)
    os.kill(workers[0], signal.SIGSTOP)
    t = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match="tensor parallelism failed"):
            llm.generate([[30, 31, 32]], PARAMS)
        assert 2.5 < time.monotonic() - t < 15
        assert _gone(workers, within=5), "the hung worker was not stopped"
    finally:
        if psutil.pid_exists(workers[0]):
            os.kill(workers[0], signal.SIGKILL)
        llm.close()


def test_a_worker_that_fails_to_load_is_reported_with_its_own_error():
    from ratchetlm.engine.config import EngineConfig
    from ratchetlm.parallel.group import TPGroup

    before = children()
    group = TPGroup.start(EngineConfig(model="/nonexistent/model.gguf", dtype="float32", tensor_parallel_size=2),
                          None)  # rank 0 would fail the same way; here only the worker loads
    with pytest.raises(TensorParallelError, match=r"rank 1 failed to start.*model path .* does not exist"):
        group.wait_ready()
    assert children() == before
