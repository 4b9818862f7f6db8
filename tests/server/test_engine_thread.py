"""The server's engine thread survives faults outside ``engine.step`` (issue 12): a fault while
delivering one request's output fails that request alone, and an engine that cannot recover
answers 503 instead of leaving requests waiting forever."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx

import ratchetlm.server.async_engine as async_engine
from ratchetlm import SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from tests.server.test_inprocess import serve

PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "The poisoned prompt says"]
MAX_TOKENS = 8


def _body(prompt: str) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def test_a_delivery_fault_fails_only_its_request(oracle, monkeypatch):
    """Detokenizing one request's tokens raises (a text-layer bug hit by one request): that request
    gets a 500 naming the fault; the three beside it finish with the greedy text of a clean run."""
    refs = [o.text for o in oracle.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                        ignore_eos=True))]
    poison_ids = oracle.tokenize(PROMPTS[3])
    real = async_engine.TextStream

    class PoisonedStream(real):  # type: ignore[valid-type, misc]
        def __init__(self, tokenizer, prompt_ids, *args, **kwargs):
            super().__init__(tokenizer, prompt_ids, *args, **kwargs)
            if list(prompt_ids) == poison_ids:
                def feed(ids):
                    raise UnicodeError("injected detokenizer fault")
                self.feed = feed  # type: ignore[method-assign]

    monkeypatch.setattr(async_engine, "TextStream", PoisonedStream)
    with serve(oracle) as base:
        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(base + "/v1/completions", json=_body(p)) for p in PROMPTS))

        *good, bad = asyncio.run(run())
        assert [r.status_code for r in good] == [200, 200, 200]
        assert [r.json()["choices"][0]["text"] for r in good] == refs
        assert bad.status_code == 500 and "injected detokenizer fault" in bad.json()["error"]["message"]
        h = httpx.get(base + "/health").json()
        assert h["requests_running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]
        again = httpx.post(base + "/v1/completions", json=_body(PROMPTS[0]), timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == refs[0]


def test_an_engine_that_cannot_recover_answers_503_never_hangs(oracle, monkeypatch):
    """The step raises and so does abort (a corrupted scheduler): the request in flight gets its
    error, the engine thread gives up after a bounded number of tries, /health turns 503 and
    later requests are refused at once. Before, the thread died and the request waited forever."""
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_blocks=32, progress=False), oracle.engine.model,
                       oracle.model_config)  # its own engine: this one is left broken
    llm = SimpleNamespace(engine=engine, tokenizer=oracle.tokenizer, tokenize=oracle.tokenize,
                          apply_chat_template=oracle.apply_chat_template)

    def broken(*args, **kwargs):
        raise RuntimeError("injected engine corruption")

    monkeypatch.setattr(engine, "step", broken)
    monkeypatch.setattr(engine, "abort", broken)
    with serve(llm) as base:
        r = httpx.post(base + "/v1/completions", json=_body(PROMPTS[0]), timeout=30)
        assert r.status_code == 500 and "injected engine corruption" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() < deadline, "the broken engine still reports healthy"
            time.sleep(0.05)
        later = httpx.post(base + "/v1/completions", json=_body(PROMPTS[1]), timeout=30)
        assert later.status_code == 503 and "internal errors" in later.json()["error"]["message"]
