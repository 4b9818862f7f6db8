"""``ratchet serve --decoding wedlm`` on the trained model: streamed text equals offline WeDLM
generation, and the window stats reach /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from ratchetlm import LLM, SamplingParams
from tests.server.conftest import start_server, stop_server

from .conftest import TRAINED

PROMPT = "count from 40 to 60 :"
WEDLM = {"window_size": 16, "entropy_threshold": 0.4}


@pytest.fixture(scope="module")
def wedlm_server():
    srv = start_server(["--model", str(TRAINED), "--decoding", "wedlm", "--decoding-options", json.dumps(WEDLM)])
    yield srv
    stop_server(srv)


def test_streamed_completion_equals_offline_wedlm(wedlm_server):
    want = LLM(str(TRAINED), dtype="float32", progress=False, wedlm=WEDLM).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=48))[0]
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", wedlm_server.v1 + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason
    metrics = httpx.get(wedlm_server.base + "/metrics", timeout=10).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("ratchet:strategy_wedlm_tokens_per_forward{"))
    assert float(line.split()[-1]) > 0
    assert "ratchet:strategy_wedlm_avg_window{" in metrics
