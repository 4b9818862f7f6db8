"""Embeddings (the pooling runner, engine/pooling.py): ``LLM.embed`` / ``LLM.encode`` offline and
``/v1/embeddings`` through the openai client equal the same pooling computed from HF
transformers' final hidden states on the same GGUF; base64 carries the same floats; no KV block
is ever left taken."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch

from ratchetlm import LLM
from ratchetlm.engine.engine_args import split_engine_args
from ratchetlm.engine.pooling import PoolingParams
from tests.server.conftest import MODEL_NAME, serve_main_in_thread
from tests.server.openai_schema import violations

TEXTS = ["Hello world", "The capital of France is Paris.", "def add(a, b):\n    return a + b",
         "A quick brown fox jumps over the lazy dog, twice."]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1))


def _hf_pooled(hf, ids: list[int], kind: str, normalize: bool = True) -> torch.Tensor:
    """The reference: HF's final hidden states (after the last norm), pooled the same way."""
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()  # [n, hidden]
    v = h[-1] if kind == "last" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def _assert_matches_hf(ours: torch.Tensor, ref: torch.Tensor, others: list[torch.Tensor]) -> None:
    assert _cos(ours, ref) >= 0.9999
    # the threshold discriminates: other prompts' vectors are further than that from this one
    assert all(_cos(ref, o) < 0.9999 for o in others)
    assert (ours - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.fixture(scope="module")
def pooling_llm():
    torch.set_num_threads(1)
    return LLM(progress=False, dtype="float32", runner="pooling", pooling_type="mean", kv_cache_blocks=16)


def test_llm_embed_and_encode_equal_hf_mean_pooling(pooling_llm, hf_smollm):
    outs = pooling_llm.embed(TEXTS)
    vecs = [torch.tensor(o.outputs.embedding) for o in outs]
    refs = [_hf_pooled(hf_smollm, o.prompt_token_ids, "mean") for o in outs]
    for i, (v, r) in enumerate(zip(vecs, refs, strict=True)):
        _assert_matches_hf(v, r, [x for j, x in enumerate(refs) if j != i])
        assert abs(float(v.norm()) - 1) < 1e-5
    # vLLM's pooling call: the same vectors as tensors; packing several prompts in a forward changes nothing
    enc = pooling_llm.encode(TEXTS, pooling_task="embed")
    for o, v in zip(enc, vecs, strict=True):
        assert torch.equal(o.outputs.data, v)
    alone = pooling_llm.embed(TEXTS[1])[0].outputs.embedding
    assert torch.allclose(torch.tensor(alone), vecs[1], atol=1e-6)
    raw = pooling_llm.embed(TEXTS[0], PoolingParams(normalize=False))[0]
    ref_raw = _hf_pooled(hf_smollm, raw.prompt_token_ids, "mean", normalize=False)
    assert torch.allclose(torch.tensor(raw.outputs.embedding), ref_raw, rtol=1e-3, atol=1e-3)
    per_token = pooling_llm.encode(TEXTS[0], pooling_task="token_embed")[0].outputs.data
    assert per_token.shape == (len(outs[0].prompt_token_ids), pooling_llm.model_config.hidden_size)
    eng = pooling_llm.engine
    assert eng.blocks.num_free == eng.blocks.num_blocks  # nothing was ever written to the cache
    # no step-time probe: its forwards on the engine thread would race the pooling forwards run on the
    # server's preparation threads on the same runner (a crashed server, seen on a slow CI machine)
    assert eng.step_cost is None


def test_pooling_runner_refuses_generation_and_bad_params(pooling_llm, llm_default):
    with pytest.raises(ValueError, match="pooling runner"):
        pooling_llm.generate("hi")
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm_default.embed("hi")
    with pytest.raises(ValueError, match="dimensions=8"):
        pooling_llm.embed("hi", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="runner must be"):
        LLM(progress=False, runner="embedding")
    from ratchetlm.engine.config import EngineConfig

    assert EngineConfig(runner="pooling").kv_cache_blocks == 1  # it writes no K/V: no ~1 GiB cache
    assert EngineConfig(runner="pooling").numerics == "exact"  # whole prompts: the faster mode, HF-identical
    assert EngineConfig(runner="pooling", kv_cache_bytes=1 << 20).kv_cache_blocks is None  # unless sized


def test_vllm_spellings_select_the_pooling_runner():
    fields, _ = split_engine_args({"task": "embed", "pooler_config": {"pooling_type": "MEAN", "normalize": False}})
    assert fields == {"runner": "pooling", "pooling_type": "mean", "pooling_normalize": False}
    assert split_engine_args({"runner": "pooling", "convert": "embed"})[0] == {"runner": "pooling"}
    with pytest.raises(ValueError, match="pooler_config.softmax"):
        split_engine_args({"pooler_config": {"softmax": True}})
    from ratchetlm.cli import engine_kwargs
    from ratchetlm.server.cli import build_parser

    kw = engine_kwargs(build_parser().parse_args(["--runner", "pooling", "--pooling-type", "mean",
                                                  "--pooling-normalize", "false"]))
    assert (kw["runner"], kw["pooling_type"], kw["pooling_normalize"]) == ("pooling", "mean", False)


@pytest.fixture(scope="module")
def pool_server():
    # serve's main on a thread here (its parser, pooling runner, app and uvicorn; not the process, which the
    # other server tests start): a subprocess cost ~5 CPU-s more
    with serve_main_in_thread(["--runner", "pooling", "--numerics", "int16"]) as srv:  # the integer path
        yield srv  # (default: exact)


def test_openai_embeddings_equal_hf_last_token_pooling(pool_server, hf_smollm):
    from openai import OpenAI

    client = OpenAI(base_url=pool_server.v1, api_key="unused", max_retries=0, timeout=120)
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64 and decodes it
    tok = hf_smollm_tokens(TEXTS)
    refs = [_hf_pooled(hf_smollm, ids, "last") for ids in tok]
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for i, d in enumerate(r.data):
        _assert_matches_hf(torch.tensor(d.embedding), refs[i], [x for j, x in enumerate(refs) if j != i])
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(t) for t in tok)
    assert r.model == MODEL_NAME

    by_ids = client.embeddings.create(model=MODEL_NAME, input=tok[1])  # token ids give the same vector
    assert by_ids.data[0].embedding == r.data[1].embedding


def test_base64_decodes_to_the_same_floats_and_bodies_follow_openai_schema(pool_server):
    def post(**kw):
        body = {"model": MODEL_NAME, "input": TEXTS[:2], **kw}
        assert violations("CreateEmbeddingRequest", body) == []
        return httpx.post(pool_server.v1 + "/embeddings", json=body, timeout=60).json()

    floats = post(encoding_format="float")
    b64 = post(encoding_format="base64")
    assert violations("CreateEmbeddingResponse", floats) == []
    for f, b in zip(floats["data"], b64["data"], strict=True):
        raw = base64.b64decode(b["embedding"])
        b["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert b["embedding"] == f["embedding"]
    # OpenAI's schema describes the float form only: decoded, the base64 body is that form
    assert violations("CreateEmbeddingResponse", b64) == [] and b64["usage"] == floats["usage"]
    lists = post(input=[[1, 2, 3], [4, 5]])
    assert len(lists["data"]) == 2 and lists["usage"]["prompt_tokens"] == 5
    assert violations("CreateEmbeddingResponse", lists) == []


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": ""}, "input"),
    ({"input": [[10**9]]}, "input"),
    ({"input": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
])
def test_bad_embedding_requests_are_400s(pool_server, body, param):
    r = httpx.post(pool_server.v1 + "/embeddings", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_pooling_server_refuses_generation_and_keeps_the_cache_free(pool_server):
    r = httpx.post(pool_server.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    assert r.status_code == 400 and "pooling runner" in r.json()["error"]["message"]
    h = pool_server.health().json()
    assert h["kv_blocks_free"] == h["kv_blocks_total"]


def test_litellm_embedding(pool_server, hf_smollm):
    litellm = pytest.importorskip("litellm")
    r = litellm.embedding(model=f"openai/{MODEL_NAME}", input=[TEXTS[1]], api_base=pool_server.v1, api_key="unused")
    ref = _hf_pooled(hf_smollm, hf_smollm_tokens([TEXTS[1]])[0], "last")
    assert _cos(torch.tensor(r.data[0]["embedding"]), ref) >= 0.9999


def hf_smollm_tokens(texts: list[str]) -> list[list[int]]:
    """The prompts' ids from the model's own tokenizer, without special tokens (SmolLM2 adds none)."""
    from ratchetlm.models.loader import default_model_path, resolve
    from ratchetlm.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(str(default_model_path())))
    return [list(tok.encode(t, add_special_tokens=False)) for t in texts]
