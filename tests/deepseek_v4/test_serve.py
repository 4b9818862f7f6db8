"""``ratchet serve`` with a DeepSeek-V4 folder, MTP speculative decoding on, driven by the official
openai client: the same server code as the llama family (no second engine). Greedy text, streamed
and not, equals offline plain generation; /metrics reports the engine's cache and the drafts."""

from __future__ import annotations

import json

import httpx
import pytest

from ratchetlm import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, start_server, stop_server

PROMPTS = ["w5 w17 w33 w2 w9 w61 w70", "w40 w41 w42"]
ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8", "--torch-threads", "1",
        "--served-model-name", MODEL_NAME, "--log-level", "warning"]


@pytest.fixture(scope="module")
def v4_server(v4_with_tokenizer):
    spec = json.dumps({"method": "mtp", "depth": 1})
    srv = start_server(["--model", str(v4_with_tokenizer), "--speculative", spec], base_args=ARGS)
    yield srv
    stop_server(srv)


def test_openai_client_against_a_v4_server(v4_server, v4_with_tokenizer):
    from openai import OpenAI

    want = LLM(str(v4_with_tokenizer), progress=False, dtype="float32", max_model_len=1024).generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    client = OpenAI(base_url=v4_server.v1, api_key="none")
    for prompt, ref in zip(PROMPTS, want, strict=True):
        whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert whole.choices[0].text == ref.text
        assert whole.usage.completion_tokens == 12
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    # a bad request gets a 4xx in OpenAI's shape, and the server keeps serving
    too_long = " ".join(["w1"] * 1100)  # max_model_len is 1024
    r = httpx.post(v4_server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": too_long, "max_tokens": 4},
                   timeout=30)
    assert 400 <= r.status_code < 500 and "error" in r.json()
    metrics = httpx.get(v4_server.base + "/metrics", timeout=10).text
    assert "kv_cache_usage_perc" in metrics
    drafts = [line for line in metrics.splitlines() if "spec_decode_num_drafts" in line and not line.startswith("#")]
    assert drafts, metrics
    assert drafts and float(drafts[0].split()[-1]) > 0
