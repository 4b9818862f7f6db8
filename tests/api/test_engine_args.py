"""vLLM engine arguments on ``LLM(...)``: honoured where they mean something here, refused where
they would change results, otherwise ignored with ONE warning that lists them."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.engine_args import speculative_options, split_engine_args
from ratchetlm.engine.kv_budget import activation_reserve, kv_budget_bytes, sized_config
from ratchetlm.models.loader import default_model_path

GiB = 1 << 30


def test_ignored_arguments_warn_once_listing_all():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kw, extras = split_engine_args({"trust_remote_code": True, "swap_space": 4, "disable_log_stats": True,
                                        "max_model_len": 64, "enforce_eager": True})
    assert kw == {"max_model_len": 64, "enforce_eager": True} and extras == {}
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert all(n in msg for n in ("trust_remote_code", "swap_space", "disable_log_stats"))
    assert "max_model_len" not in msg


def test_mapped_arguments():
    kw, extras = split_engine_args({"kv_cache_memory_bytes": 1 << 24, "tokenizer": "x", "tensor_parallel_size": 1,
                                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 5, "prompt_lookup_min": 2}})
    assert kw == {"kv_cache_bytes": 1 << 24, "decoding": "speculative", "tensor_parallel_size": 1,
                  "decoding_options": {"method": "ngram", "depth": 3, "max_n": 5, "min_n": 2}}
    assert extras == {"tokenizer": "x"}
    assert speculative_options({"model": "/d.gguf", "num_speculative_tokens": 2}) == \
        {"draft_model": "/d.gguf", "method": "draft_model", "depth": 2}
    assert split_engine_args({"num_gpu_blocks_override": 7})[0] == {"kv_cache_blocks": 7}


@pytest.mark.parametrize("name, value", [
    ("quantization", "awq"), ("enable_lora", True), ("pipeline_parallel_size", 2),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
])
def test_arguments_that_would_change_results_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        split_engine_args({name: value})


@pytest.mark.parametrize("name, value", [("quantization", None), ("quantization", "gguf"), ("enable_lora", False),
                                         ("task", "generate")])
def test_their_neutral_values_are_accepted(name, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert split_engine_args({name: value}) == ({}, {})


def test_kv_cache_dtype_is_a_field_and_fp8_is_refused():
    from ratchetlm.engine.config import EngineConfig

    assert split_engine_args({"kv_cache_dtype": "float16"}) == ({"kv_cache_dtype": "float16"}, {})
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(no_such_arg=1)


def test_gpu_memory_utilization_budget_arithmetic():
    # 80 GiB device, 10 GiB in use (our weights + others), 2 GiB activation reserve, 0.9 utilization
    assert kv_budget_bytes(0.9, free=70 * GiB, total=80 * GiB, reserve=2 * GiB) == int(0.9 * 80 * GiB) - 12 * GiB
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_budget_bytes(0.1, free=70 * GiB, total=80 * GiB, reserve=2 * GiB)


def test_gpu_memory_utilization_sizes_a_cuda_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here: the memory query is faked
    cfg = EngineConfig(device="cuda", gpu_memory_utilization=0.5, max_num_batched_tokens=512, max_num_seqs=8)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GiB, 40 * GiB))

    class MC:
        hidden_size, intermediate_size, vocab_size = 2048, 8192, 32000

    reserve = activation_reserve(cfg, MC, torch.bfloat16)
    assert reserve == 512 * (4 * 2048 + 3 * 8192) * 2 + 8 * 32000 * 4
    assert sized_config(cfg, MC, torch.bfloat16).kv_cache_bytes == 20 * GiB - 10 * GiB - reserve
    explicit = EngineConfig(gpu_memory_utilization=0.5, kv_cache_bytes=GiB)
    assert sized_config(explicit, MC, torch.bfloat16) is explicit  # explicit sizing wins, as in vLLM


def test_gpu_memory_utilization_on_cpu_warns_and_keeps_the_default(caplog):
    cfg = EngineConfig(gpu_memory_utilization=0.9)
    with caplog.at_level(logging.WARNING, logger="ratchetlm"):
        assert sized_config(cfg, object(), torch.float32) is cfg
    assert "ignored on cpu" in caplog.text
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_vllm_style_construction_runs(caplog):
    path = str(default_model_path())
    with caplog.at_level(logging.INFO, logger="ratchetlm"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(model=path, tokenizer=path, dtype="float", gpu_memory_utilization=0.5, max_model_len=256,
                  enforce_eager=True, trust_remote_code=True, seed=0, progress=False)
    assert [str(w.message) for w in caught if "ignores" in str(w.message)] == \
        ["ratchetlm ignores these vLLM engine arguments (they change nothing here): trust_remote_code"]
    assert caplog.text.count("dtype=float32 (GGUF on CPU, as requested, block kernels:") == 1  # once at start
    assert llm.engine.max_model_len == 256 and llm.get_tokenizer() is llm.tokenizer
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))
    assert out[0].outputs[0].text.strip().startswith("Paris")
