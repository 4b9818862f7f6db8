"""vLLM's ``generation_config``: the model's recommended sampling parameters (an HF folder's
``generation_config.json``, a GGUF's ``general.sampling.*``) are the defaults of requests that leave
them out — offline (``LLM.get_default_sampling_params``, ``generate`` without sampling params) and on
the server — while a request's own values win; ``"vllm"`` ignores them; ``override_generation_config``
goes on top.

The models are tiny random Llamas written here. Their next-token distributions are nearly flat, so
a sampled continuation is practically never the greedy one: a model default of ``temperature: 0``
shows as requests (with any seed) that equal an explicit greedy request."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.generation_config import default_sampling
from tests.core.gguf_factory import write_tiny_gguf
from tests.models.tiny import hf_model, save_hf
from tests.server.test_inprocess import serve

MODEL_DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1,
                  "max_new_tokens": 5, "do_sample": True, "bos_token_id": 256}
AS_SAMPLING = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 5}
KW = dict(progress=False, numerics="exact", dtype="float32", kv_cache_blocks=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = save_hf(tmp_path_factory.mktemp("genconf"), hf_model("LlamaForCausalLM"))
    cfg = json.loads((path / "generation_config.json").read_text())  # transformers wrote the token ids
    (path / "generation_config.json").write_text(json.dumps({**cfg, **MODEL_DEFAULTS}))
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return path


@pytest.fixture(scope="module")
def tiny(folder):
    return LLM(str(folder), **KW)


def test_the_model_file_is_read_as_vllm_reads_it(folder, tmp_path):
    assert default_sampling("auto", folder, "hf", None) == AS_SAMPLING
    assert default_sampling("vllm", folder, "hf", None) == {}
    assert default_sampling("auto", folder, "hf", {"temperature": 0.7, "max_new_tokens": 9}) == {
        **AS_SAMPLING, "temperature": 0.7, "max_tokens": 9}
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 3}))
    assert default_sampling(str(other), folder, "hf", None) == {"top_k": 3}  # a folder's file instead
    with pytest.raises(ValueError, match="unknown sampling parameter.*do_sampel"):
        default_sampling("auto", folder, "hf", {"do_sampel": True})


def test_a_gguf_carries_its_defaults_in_general_sampling(tmp_path):
    path = write_tiny_gguf(tmp_path / "s.gguf", "llama", ["F16"], metadata={
        "general.sampling.temp": 0.25, "general.sampling.top_k": 11, "general.sampling.top_p": 0.5,
        "general.sampling.min_p": 0.125, "general.sampling.penalty_repeat": 1.5})
    llm = LLM(str(path), **KW)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repetition_penalty) == (0.25, 11, 0.5, 0.125, 1.5)
    assert LLM(str(path), generation_config="vllm", **KW).get_default_sampling_params() == SamplingParams()


def test_offline_defaults_and_generate_without_params(tiny, folder, caplog):
    sp = tiny.get_default_sampling_params()
    assert {k: getattr(sp, k) for k in AS_SAMPLING} == AS_SAMPLING
    greedy = SamplingParams(**{**AS_SAMPLING, "seed": 1})
    out = tiny.generate("the tea", use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tiny.generate("the tea", greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out.token_ids) == 5
    with caplog.at_level(logging.INFO, logger="ratchetlm"):
        plain = LLM(str(folder), generation_config="vllm", **KW)
    assert plain.get_default_sampling_params() == SamplingParams()  # vLLM's neutral defaults
    assert not any("default sampling parameters" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.INFO, logger="ratchetlm"):
        LLM(str(folder), override_generation_config={"temperature": 0.5}, **KW)
    said = [r.getMessage() for r in caplog.records if "default sampling parameters" in r.getMessage()]
    assert len(said) == 1 and "temperature=0.5" in said[0] and "top_k=7" in said[0]


def test_the_server_applies_them_to_requests_that_leave_them_out(tiny, folder):
    def chat(base, **kw):
        body = {"model": "m", "messages": [{"role": "user", "content": "the tea"}], **kw}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def tokens(r):
        return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]

    with serve(tiny, "m") as base:
        greedy = tokens(chat(base, temperature=0, max_tokens=5, ignore_eos=True))
        for seed in (1, 2, 3):  # no temperature: the model's 0 (greedy), whatever the seed; 5 tokens
            assert tokens(chat(base, seed=seed, ignore_eos=True)) == greedy
        sampled = {tokens(chat(base, seed=seed, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0,
                               ignore_eos=True)) for seed in (1, 2, 3)}
        assert greedy not in sampled  # the request's temperature wins
        assert chat(base, max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2  # and its max_tokens
        resp = httpx.post(base + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2},
                          timeout=120).json()
        assert (resp["temperature"], resp["top_p"]) == (0.0, 0.9)  # what it ran with
    with serve(LLM(str(folder), generation_config="vllm", **KW), "m") as base:
        runs = {tokens(chat(base, seed=seed, max_tokens=5, ignore_eos=True)) for seed in (1, 2, 3)}
        assert greedy not in runs and len(runs) > 1  # vLLM's defaults: temperature 1


def test_an_overridden_max_new_tokens_caps_every_request(folder):
    """vLLM: --override-generation-config's max_new_tokens is also a ceiling on what a request asks."""
    with serve(LLM(str(folder), override_generation_config={"max_new_tokens": 3}, **KW), "m") as base:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "the tea"}]}),
                           ("/v1/completions", {"prompt": "the tea"})):
            r = httpx.post(base + path, json={"model": "m", "max_tokens": 8, "ignore_eos": True, **body}, timeout=120)
            assert r.json()["usage"]["completion_tokens"] == 3, path


def test_serve_takes_the_flags(folder):
    from ratchetlm.cli import engine_kwargs
    from ratchetlm.server.cli import build_parser, check_engine_flags

    args = build_parser().parse_args([str(folder), "--generation-config", "auto",
                                      "--override-generation-config", '{"temperature": 0.5}'])
    kw = engine_kwargs(args)
    kw.pop("model")
    assert kw["generation_config"] == "auto" and kw["override_generation_config"] == {"temperature": 0.5}
    assert check_engine_flags(str(folder), kw) is None
    assert build_parser().parse_args([str(folder)]).generation_config == "auto"  # vLLM's default
    bad = check_engine_flags(str(folder), {**kw, "override_generation_config": {"temp": 1}})
    assert bad is not None and "unknown sampling parameter(s) temp" in bad
