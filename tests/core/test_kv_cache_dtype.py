"""A half-precision KV cache (``kv_cache_dtype``): the fixed-order attention kernel on half K/V against
itself on the same values widened to fp32; what ``auto`` chooses; and the contract of the integer
modes (speculative == plain, alone == batched) with the cache in half. The quality gates with it are
a benchmark (benchmarks/bench_numerics.py ``int16+kv16``), not a test."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from ratchetlm import LLM, SamplingParams, kernels
from ratchetlm.cli import add_engine_args, engine_kwargs
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.model_runner import build_runner
from ratchetlm.runners import register_layout
from tests.models.tiny import engine_on, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The history of the bicycle", "def fib(n):", "Write a poem about the sea.", "List three colors:",
           "Summarize: the cat sat on the mat because the mat was warm and the cat was cold."]


def _attention(lib, q, k, v, kc, vc, slots, meta, mask, max_ctx, max_new, half: int) -> torch.Tensor:
    out = torch.full_like(q, 7.0)
    b, (_, h, d), hkv = meta.shape[0], q.shape, k.shape[1]
    lib.ratchet_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(),
                          max_ctx, meta.data_ptr(), max_new, 0 if mask is None else mask.data_ptr(), b, h, hkv, d,
                          0.125, 0.0, half, out.data_ptr(), 2)
    return out


def test_the_kernel_reads_a_half_cache_as_its_values_widened():
    """Half context rows, fp32 new rows: bit for bit the fp32 kernel on the context widened and the new
    rows rounded to half (what the cache write will hold), with masks, GQA, odd head sizes, prefills."""
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C compiler")
    rng = random.Random(0)
    torch.manual_seed(0)
    for trial in range(40):
        b, hkv, g, d = rng.randint(1, 4), rng.choice([1, 2, 3]), rng.choice([1, 3]), rng.choice([16, 48, 64])
        ctxs = [rng.choice([0, 1, 17, 40]) for _ in range(b)]
        news = [rng.randint(1, 40 if trial % 4 == 0 else 5) for _ in range(b)]
        max_ctx, max_new, nslots = max(max(ctxs), 1), max(news), sum(ctxs) + 8
        kc, vc = torch.randn(nslots, hkv, d), torch.randn(nslots, hkv, d)
        slots = torch.zeros(b, max_ctx, dtype=torch.int64)
        perm, o = torch.randperm(nslots), 0
        for i, c in enumerate(ctxs):
            slots[i, :c] = perm[o:o + c]
            o += c
        t = sum(news)
        meta = torch.tensor([[c, sum(news[:i]), n] for i, (c, n) in enumerate(zip(ctxs, news, strict=True))],
                            dtype=torch.int32)
        q, k, v = torch.randn(t, hkv * g, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        mask = None
        if trial % 3 == 0:
            mask = torch.where(torch.rand(b, max_new, max_ctx + max_new) < 0.3, float("-inf"), 0.0)
        r = lambda x: x.half().float()  # noqa: E731
        want = _attention(lib, q, r(k), r(v), r(kc), r(vc), slots, meta, mask, max_ctx, max_new, 0)
        got = _attention(lib, q, k, v, kc.half(), vc.half(), slots, meta, mask, max_ctx, max_new, 1)
        assert torch.equal(want.nan_to_num(1e9), got.nan_to_num(1e9)), trial
        unrounded = _attention(lib, q, k, v, r(kc), r(vc), slots, meta, mask, max_ctx, max_new, 0)
        assert trial % 3 == 0 or not torch.equal(unrounded, got)  # the new rows' rounding is not vacuous


@pytest.fixture(scope="module")
def llm_int8():
    return LLM(progress=False, numerics="int8", kv_cache_blocks=64)  # auto: a half cache (int8: the mode where a
    # last-bit difference most often flips a token)


def test_auto_is_half_in_the_integer_modes_and_the_run_dtype_in_exact(llm_int8, llm_fp32):
    assert llm_int8.engine.cache.k.dtype == torch.float16
    assert llm_fp32.engine.cache.k.dtype == torch.float32  # exact: HF-identical, fp32 K/V
    cfg = EngineConfig(numerics="int8", kv_cache_dtype="float32")
    assert cfg.kv_dtype(torch.float32, "int16") == torch.float32  # asked for: kept
    assert EngineConfig(kv_cache_dtype="float16").kv_dtype(torch.float32, "exact") == torch.float16
    assert EngineConfig().kv_dtype(torch.bfloat16, "exact") == torch.bfloat16  # a GPU run's dtype
    # the same bytes hold twice the tokens
    half = build_runner(EngineConfig(kv_cache_bytes=1 << 24), llm_int8.engine.model, llm_int8.model_config,
                        torch.float32, torch.device("cpu"), 64)
    full = build_runner(EngineConfig(kv_cache_bytes=1 << 24, kv_cache_dtype="float32"), llm_int8.engine.model,
                        llm_int8.model_config, torch.float32, torch.device("cpu"), 64)
    assert half.blocks.num_blocks // 2 == full.blocks.num_blocks  # (each count floored)
    assert half.dtype == full.dtype == torch.float32  # activations stay fp32


def test_the_integer_modes_keep_their_contract_with_a_half_cache(llm_int8):
    """Alone == batched and n-gram speculative (a tree) == plain greedy, token for token (more prompts and
    methods, the n-gram chain among them, in both integer modes in tests/speculative/test_int8_engine.py, whose
    engines run a half cache too: test_the_engines_here_run_a_half_kv_cache)."""
    enc = [llm_int8.tokenize(p) for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm_int8.generate(enc, GREEDY)]
    assert batched == [llm_int8.generate([p], GREEDY)[0].outputs[0].token_ids for p in enc]
    for opts in ({"method": "ngram", "depth": 3, "num_candidates": 3, "depth_schedule": "constant"},):
        # a speculative engine (its own half cache: kv_cache_dtype "auto") on the loaded int8 model
        spec = engine_on(llm_int8, kv_cache_blocks=64, decoding="speculative", decoding_options=opts)
        assert spec.cache.k.dtype == torch.float16
        assert run(spec, enc, GREEDY.max_tokens) == batched, opts
        assert spec.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0, opts  # it did speculate


def test_exact_mode_with_a_half_cache_stays_close(llm_fp32):
    """Opt-in in the exact mode (SDPA reads the half cache widened): the greedy text of the fp32 cache."""
    half = engine_on(llm_fp32, kv_cache_dtype="float16", kv_cache_blocks=64)  # on the loaded exact model
    assert half.cache.k.dtype == torch.float16 and half.dtype == torch.float32
    enc = [llm_fp32.tokenize(p) for p in PROMPTS[:3]]
    got = run(half, enc, GREEDY.max_tokens)
    assert got == [o.outputs[0].token_ids for o in llm_fp32.generate(enc, GREEDY)]


def test_a_cache_layout_of_its_own_refuses_a_narrower_dtype():
    class OwnLayout:  # a model family with its own cache layout (DeepSeek-V4)
        pass

    def make_runner(*a):
        raise AssertionError("not reached")

    register_layout(OwnLayout, make_runner)
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' is not supported by OwnLayout"):
        build_runner(EngineConfig(kv_cache_dtype="float16"), OwnLayout(), None, torch.float32,
                     torch.device("cpu"), 64)


def test_the_flag_maps_to_the_field():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "float16"]))["kv_cache_dtype"] == "float16"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp8"])
