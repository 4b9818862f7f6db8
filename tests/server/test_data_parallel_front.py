"""The front process of ``ratchet serve --data-parallel-size N`` (server/front.py) loads the tokenizer
and chat template, not the model: it never loads weights or builds an engine, and it prepares and
checks requests exactly as one engine's server does. The replicas are stood in for by the session's
engine on a thread of this process (tests/server/test_data_parallel.py runs the real processes)."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import httpx
import pytest

import ratchetlm.engine.llm as llm_module
import ratchetlm.engine.llm_engine as llm_engine_module
import ratchetlm.server.state as state_module
from ratchetlm import SamplingParams
from ratchetlm.sampling_params import StructuredOutputsParams
from ratchetlm.server.async_engine import AsyncEngine
from ratchetlm.server.cli import ModelLoader
from ratchetlm.server.config import ServerConfig
from ratchetlm.server.errors import APIError
from ratchetlm.server.front import EngineFacts, FrontEngine
from ratchetlm.server.structured import compile_constraint
from tests.server.conftest import serve_in_thread

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def front_server(oracle, monkeypatch):
    """A data-parallel app (2 "replicas") whose pool is the oracle's engine in this process, with loading a
    model or building a runner refused here: only the front can reach them."""

    def refuse(*_a, **_k):
        raise AssertionError("the data-parallel front process loaded the model")

    monkeypatch.setattr(llm_module, "load_model", refuse)
    monkeypatch.setattr(llm_engine_module, "build_runner", refuse)

    class InThreadPool(AsyncEngine):
        def __init__(self, loader, n):
            assert n == 2 and isinstance(loader, ModelLoader)
            pickle.dumps(loader)  # (a real replica receives it pickled)
            super().__init__(oracle.engine, oracle.tokenizer)
            self.facts = pickle.loads(pickle.dumps(EngineFacts.of(oracle)))  # as it comes over the pipe

    # the offline engine's greedy answer, before the server's engine thread runs on the same engine
    ref = oracle.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
    monkeypatch.setattr(state_module, "ReplicaPool", InThreadPool)
    loader = ModelLoader(None, {"dtype": "float32", "progress": False})  # the oracle's flags
    app_config = ServerConfig(data_parallel_size=2)
    with serve_in_thread(loader, "m", app_config) as port:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=120) as c:
            for _ in range(600):
                h = c.get("/health")
                if h.status_code == 200 or "failed" in h.text:
                    break
                time.sleep(0.05)
            assert h.status_code == 200, h.text
            yield c, ref


def test_the_front_loads_no_weights_and_answers_as_one_engine_would(front_server, oracle):
    c, ref = front_server
    # tokenization (the model's BOS rule) and the chat template, from the front's own tokenizer
    for prompt in ("The capital of France is", "  two spaces"):
        r = c.post("/tokenize", json={"model": "m", "prompt": prompt})
        assert r.status_code == 200 and r.json()["tokens"] == oracle.tokenize(prompt), r.text
    r = c.post("/tokenize", json={"model": "m", "messages": MESSAGES})
    assert r.json()["tokens"] == oracle.tokenize(oracle.apply_chat_template(MESSAGES), False), r.text
    # max_model_len and the vocabulary, as the replicas' engine has them
    assert c.get("/v1/models").json()["data"][0]["max_model_len"] == oracle.engine.max_model_len
    r = c.post("/v1/completions", json={"model": "m", "prompt": [oracle.model_config.vocab_size], "max_tokens": 2})
    assert r.status_code == 400 and f"[0, {oracle.model_config.vocab_size})" in r.json()["error"]["message"]
    # generation through the "replica": greedy text equals the offline engine's
    r = c.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref, r.text
    # a grammar is compiled (and a bad one refused, 400 naming the field) in the front
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    r = c.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 4,
                                             "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_a_strategy_that_refuses_grammars_is_honoured_by_the_front(oracle):
    """The front asks the replicas' strategy one question (server/structured.py): a WeDLM-like refusal
    travels in the facts and is a 400 there, before the request reaches a replica."""

    class NoGrammars:
        def check_request(self, params):
            if params.structured is not None:
                raise ValueError("structured outputs are not supported here")

    llm = SimpleNamespace(config=oracle.config, default_sampling={},
                          engine=SimpleNamespace(strategy=NoGrammars(), cfg=oracle.engine.cfg,
                                                 model_config=oracle.model_config, max_model_len=64))
    facts = EngineFacts.of(llm)
    assert facts.structured_refusal == "structured outputs are not supported here"
    front = SimpleNamespace(engine=FrontEngine(facts, oracle.tokenizer))
    with pytest.raises(APIError, match="response_format: structured outputs are not supported here") as e:
        compile_constraint(front, StructuredOutputsParams(json_object=True), "response_format")
    assert e.value.status == 400
    assert EngineFacts.of(oracle).structured_refusal is None  # plain decoding takes grammars


def test_a_pooling_front_keeps_the_model(oracle, monkeypatch):
    """Embeddings are computed where the request is served: the pooling runner's front loads it all."""
    monkeypatch.setattr(ModelLoader, "__call__", lambda self: "the whole model")
    facts = EngineFacts.of(oracle)
    pooling = SimpleNamespace(config=SimpleNamespace(runner="pooling"))
    assert ModelLoader(None, {}).front(pooling) == "the whole model"
    assert ModelLoader(None, {}).front(facts) != "the whole model"
