"""The app served by uvicorn in a thread of the test process, around engines the test controls:
/health while loading, an engine failure after a stream started, and a stop string that lands
inside a multi-token (speculative) commit."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx

from ratchetlm import SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from tests.server.conftest import serve_in_thread


@contextmanager
def serve(llm_or_loader, name="m", config=None):
    with serve_in_thread(llm_or_loader, name, config) as port:
        yield f"http://127.0.0.1:{port}"


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_health_is_503_while_loading(oracle):
    gate = threading.Event()

    def loader():
        gate.wait(30)
        return oracle

    with serve(loader) as base:
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "503"
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 503
        gate.set()
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_engine_error_after_stream_started_is_an_error_event(oracle, monkeypatch):
    real_step = oracle.engine.step
    calls = {"n": 0}

    def failing_step():  # fault injection: the third step of the engine raises
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(oracle.engine, "step", failing_step)
    with serve(oracle) as base:
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "m", "prompt": "Tell me a story", "max_tokens": 20, "temperature": 0, "stream": True,
            "ignore_eos": True})
        assert r.status_code == 200
        events = _sse(r.text)
        assert events[-1] == "[DONE]"
        assert "error" in events[-2] and "injected fault" in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2]) and len(events) >= 3  # tokens came before the error
        h = httpx.get(base + "/health").json()
        assert h["requests_running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]
        ok = httpx.post(base + "/v1/completions", timeout=60,
                        json={"model": "m", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200  # still serving


def _spec_llm(oracle):
    """A speculative (n-gram) engine on the oracle's weights: commits several tokens per step."""
    cfg = EngineConfig(dtype="float32", kv_cache_blocks=64, decoding="speculative",
                       decoding_options={"method": "ngram", "depth_schedule": "constant"}, progress=False)
    engine = LLMEngine(cfg, oracle.engine.model, oracle.model_config)
    return SimpleNamespace(engine=engine, tokenizer=oracle.tokenizer, tokenize=oracle.tokenize,
                           apply_chat_template=oracle.apply_chat_template)


def test_stop_string_inside_multi_token_commit(oracle):
    llm = _spec_llm(oracle)
    prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"
    ids = oracle.tokenize(prompt)
    sid = llm.engine.add_request(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    commits = []
    while llm.engine.has_unfinished():
        commits += [o.new_token_ids for o in llm.engine.step() if o.seq_id == sid and o.new_token_ids]
    llm.engine.release(sid)
    full_ids = [t for c in commits for t in c]
    assert full_ids == oracle.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                              ignore_eos=True))[0].token_ids
    dec = lambda toks: oracle.tokenizer.decode(toks)  # noqa: E731
    full = dec(full_ids)
    stop, expected = None, None
    pos = 0
    for c in commits:  # a stop string made of two tokens in the middle of one commit of >= 3 tokens
        if len(c) >= 3:
            for j in range(len(c) - 2):
                cand = dec(c[j:j + 2])
                start = len(dec(full_ids[: pos + j]))
                if cand.strip() and full.find(cand) == start:
                    stop, expected = cand, full[:start]
                    break
        if stop:
            break
        pos += len(c)
    assert stop is not None, f"no multi-token commit to test with: {commits}"
    with serve(llm) as base:
        body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.json()["choices"][0]["text"] == expected and r.json()["choices"][0]["finish_reason"] == "stop"
        s = httpx.post(base + "/v1/completions", json={**body, "stream": True}, timeout=120)
        events = _sse(s.text)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
        h = httpx.get(base + "/health").json()
        assert h["requests_running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]
        metrics = httpx.get(base + "/metrics").text  # the strategy's counters are exported as gauges
        accepted = next(line for line in metrics.splitlines()
                        if line.startswith("ratchet:strategy_spec_decode_num_accepted_tokens{"))
        assert float(accepted.rsplit(" ", 1)[1]) > 0


def _gauges(text: str, prefix: str) -> dict[str, float]:
    """``ratchet:strategy_<name>{...} value`` lines of a /metrics page whose name starts with prefix."""
    out = {}
    for line in text.splitlines():
        if line.startswith("ratchet:strategy_" + prefix):
            name = line[len("ratchet:strategy_"): line.index("{")]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _check_staging(m: dict[str, float], num_layers: int, bytes_per_token: int) -> None:
    """The no-write-on-reject metrics with the design's meaning (kv/staging.py)."""
    assert m["kv_staging_tokens_committed"] > 0 and m["kv_staging_tokens_rejected"] > 0
    assert m["kv_staging_unique_tokens"] == m["kv_staging_tokens_committed"] + m["kv_staging_tokens_rejected"]
    assert m["kv_staging_stage_operations"] == m["kv_staging_unique_tokens"] * num_layers  # layer x token
    assert abs(m["kv_staging_efficiency"] - 1 / num_layers) < 1e-9
    assert abs(m["kv_staging_acceptance_rate"] - m["kv_staging_tokens_committed"]
               / m["kv_staging_unique_tokens"]) < 1e-9
    assert m["kv_staging_bytes_avoided"] == m["kv_staging_tokens_rejected"] * bytes_per_token
    for cause in ("fake_tensor", "overflow", "stage_fail", "commit_fail"):  # fallbacks by cause
        assert m[f"kv_staging_fallback_{cause}"] == 0
    assert m["kv_staging_fallbacks"] == 0


def test_staging_metrics_on_metrics_after_speculative_and_wedlm_requests(oracle):
    from ratchetlm import LLM
    from tests.speculative.prompts import CODE
    from tests.wedlm.conftest import TRAINED

    spec = _spec_llm(oracle)
    body = {"model": "m", "prompt": CODE, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with serve(spec) as base:
        assert httpx.post(base + "/v1/completions", json=body, timeout=120).status_code == 200
        text = httpx.get(base + "/metrics").text
    m = _gauges(text, "kv_staging_")
    _check_staging(m, oracle.model_config.num_layers, spec.engine.cache.bytes_per_token())
    assert _gauges(text, "spec_decode_num_accepted_tokens")["spec_decode_num_accepted_tokens"] > 0

    wedlm = LLM(str(TRAINED), dtype="float32", progress=False, wedlm={"window_size": 16})
    body = {"model": "m", "prompt": "count from 40 to 60 :", "max_tokens": 24, "temperature": 0}
    with serve(wedlm) as base:
        assert httpx.post(base + "/v1/completions", json=body, timeout=120).status_code == 200
        text = httpx.get(base + "/metrics").text
    _check_staging(_gauges(text, "kv_staging_"), wedlm.model_config.num_layers, wedlm.engine.cache.bytes_per_token())
    w = _gauges(text, "wedlm_")
    assert w["wedlm_tokens_per_forward"] == w["wedlm_commits"] / w["wedlm_forwards"]  # committed tokens per forward
    assert w["wedlm_fills_per_forward"] == w["wedlm_fills"] / w["wedlm_forwards"]  # masks filled per step
    assert w["wedlm_efficiency"] == w["wedlm_commits"] / w["wedlm_fills"]
    assert w["wedlm_commits"] > 0
