"""The decode chain (models/decode_chain.py): in the integer modes a forward of up to 64 new tokens
(decode steps alone or batched, a short prefill, a staged verify tree) calls the layer kernels
without the layer-by-layer Python, and its logits are bit-identical to the general path's; it is
built only where every op has that kernel form."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.decoding.base import Proposal
from ratchetlm.models.decode_chain import DecodeChain
from tests.models.tiny import engine_logits, engine_on, hf_model, run, write_gguf

PROMPT = "The ratchet only moves forward: committed tokens are never taken back."


@pytest.fixture(scope="module")
def llm_int16() -> LLM:
    """The bundled model in the int16 mode, loaded once for the tests below (each leaves its chain on and
    its engine empty; the speculative ones run engines of their own on it: tests/models/tiny.engine_on)."""
    return LLM(progress=False, numerics="int16", kv_cache_blocks=64)


def _chain_rows(monkeypatch) -> list[int]:
    """The row counts of the forwards the chain runs from now on."""
    rows: list[int] = []
    run = DecodeChain.run
    monkeypatch.setattr(DecodeChain, "run", lambda self, x, *a: rows.append(x.shape[0]) or run(self, x, *a))
    return rows


@contextlib.contextmanager
def _chain(llm: LLM, on: bool) -> Iterator[None]:
    """The model with its chain on or off (rebuilt by set_numerics; weights repacked at first use)."""
    model = llm.engine.model
    model.decode_chain = on
    try:
        model.set_numerics(model.numerics)
        yield
    finally:
        model.decode_chain = True
        model.set_numerics(model.numerics)


def _decode_logits(llm: LLM) -> dict[int, torch.Tensor]:
    """Prefill logits and 12 single-token decode steps (engine_logits)."""
    ids = llm.tokenize(PROMPT)
    return engine_logits(llm, ids, rows=[0, len(ids) - 13], n_decode=12)


@pytest.mark.parametrize("numerics", ["int8", "int16"])
def test_chain_steps_are_bit_identical_to_the_layer_path(numerics, monkeypatch, request):
    llm = request.getfixturevalue("llm_int16") if numerics == "int16" else \
        LLM(progress=False, numerics=numerics, kv_cache_blocks=32)
    rows = _chain_rows(monkeypatch)
    with _chain(llm, True):
        on, ran = _decode_logits(llm), len(rows)
    rows.clear()
    with _chain(llm, False):
        off = _decode_logits(llm)
    assert ran == 12 and not rows  # every decode step took the chain, none with it off
    assert on.keys() == off.keys()
    for pos in on:
        assert torch.equal(on[pos], off[pos]), pos


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_chain_of_each_family_is_bit_identical(tmp_path, arch, monkeypatch):
    """Llama, Qwen2 (Q/K/V biases) and Qwen3 (QK-norms) GGUFs chain their decode steps, bit-identically."""
    llm = LLM(str(write_gguf(tmp_path / "m.gguf", hf_model(arch), "Q8_0")), progress=False, numerics="int16",
              kv_cache_blocks=16)
    assert llm.engine.model._chain is not None
    rows = _chain_rows(monkeypatch)
    with _chain(llm, True):
        on, ran = _decode_logits(llm), len(rows)
    with _chain(llm, False):
        off = _decode_logits(llm)
    assert ran == 12 and all(torch.equal(on[p], off[p]) for p in on)


def test_chain_is_built_only_where_every_op_is_one_kernel(tmp_path, llm_fp32):
    assert llm_fp32.engine.model._chain is None  # exact mode: torch's ops, HF-identical
    for arch, overrides in (("MistralForCausalLM", {"sliding_window": 24}), ("Gemma2ForCausalLM", {
            "sliding_window": 24, "query_pre_attn_scalar": 16})):  # windows, sandwich norms: the general path
        path = write_gguf(tmp_path / f"{arch}.gguf", hf_model(arch, **overrides), "Q8_0")
        llm = LLM(str(path), progress=False, numerics="int8", kv_cache_blocks=16)
        assert llm.engine.model._chain is None, arch


def _prefill_and_tree_logits(llm: LLM) -> list[torch.Tensor]:
    """A 20-token prefill, then a staged tree-shaped proposal of 6 rows on top of it (two branches:
    rows 0-1-2 and 0-3-4-5), as speculative verification runs it: the logits of every row of both."""
    eng = llm.engine
    ids = llm.tokenize(PROMPT + " " + PROMPT)[:20]
    sid = eng.add_request(ids, SamplingParams(max_tokens=8, temperature=0))
    seq = eng.seqs[sid]
    eng.scheduler.schedule()
    eng.blocks.grow(seq, len(ids) + 6)
    pre = eng.runner.execute([seq], [Proposal(ids, list(range(20)), list(range(20)))]).logits[0]
    seq.num_cached = 20
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                         [1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    p = Proposal([5, 6, 7, 8, 9, 10], [20, 21, 22, 21, 22, 23], list(range(6)), mask=tree, direct_write=False)
    ver = eng.runner.execute([seq], [p]).logits[0]
    eng.abort(sid)
    eng.release(sid)
    return [pre, ver]


@pytest.mark.parametrize("arch", [None, "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_chain_prefill_and_tree_verify_are_bit_identical(tmp_path, arch, monkeypatch, request):
    """Several rows of one sequence (a short prefill, a staged verify tree over cached context) chain
    too, and equal the layer path bit for bit: verify == plain decoding still holds with both chained.
    The bundled model, and Qwen2's Q/K/V biases and Qwen3's QK-norms (whose heads the chain first
    copies out of the fused projection when a forward has more than one row)."""
    llm = request.getfixturevalue("llm_int16") if arch is None else \
        LLM(str(write_gguf(tmp_path / "m.gguf", hf_model(arch), "Q8_0")), progress=False, numerics="int16",
            kv_cache_blocks=32)
    rows = _chain_rows(monkeypatch)
    logits = {}
    for on in (True, False):
        with _chain(llm, on):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # the first forward packs the weights
            rows.clear()
            logits[on] = _prefill_and_tree_logits(llm), list(rows)
    (on_logits, on_rows), (off_logits, off_rows) = logits[True], logits[False]
    assert on_rows == [20, 6] and off_rows == []
    for a, b in zip(on_logits, off_logits, strict=True):
        assert torch.equal(a, b)


def test_chain_batched_decode_is_bit_identical(llm_int16, monkeypatch):
    """Decode steps of several sequences (their tokens packed, each attending its own context) chain as
    one forward, and every sequence's logprobs equal the layer path's."""
    llm = llm_int16
    prompts = [PROMPT, "def fib(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    rows = _chain_rows(monkeypatch)

    def outputs():
        outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs])
                for o in outs]

    on = outputs()
    assert 3 in rows
    rows.clear()
    with _chain(llm, False):
        assert outputs() == on and not rows


def test_chain_writes_and_stages_the_cache_as_the_layer_path(llm_int16, monkeypatch):
    """The chain hands the sink every layer's rows at once after the stack (write_layers): prefill and
    decode rows land in their slots, verify rows are staged and the accepted ones committed (no
    fallback), and the cache then holds exactly what the layer-by-layer path writes."""
    llm = llm_int16
    eng = engine_on(llm, kv_cache_blocks=64, decoding="speculative",
                    decoding_options={"method": "ngram", "verify_token_cost": 0.0})  # draft on every match
    ids = llm.tokenize(" ".join([PROMPT] * 3))
    rows = _chain_rows(monkeypatch)
    cache: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
    for on in (True, False):
        with _chain(llm, on):
            before = eng.runner.staging.metrics.tokens_committed
            sid = eng.add_request(ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            seq = eng.seqs[sid]
            while seq.num_output_tokens < 24:
                eng.step()
            slots = eng.runner.context_slots(seq)  # [num_cached]
            cache[on] = eng.cache.k[:, slots].clone(), eng.cache.v[:, slots].clone()
            assert eng.runner.staging.metrics.tokens_committed > before  # verify rows were staged and kept
            eng.abort(sid)
            eng.release(sid)
        if on:
            assert any(r > 1 for r in rows) and eng.runner.staging.metrics.fallback_count == 0
    assert torch.equal(cache[True][0], cache[False][0]) and torch.equal(cache[True][1], cache[False][1])


def test_chain_staging_fault_falls_back_to_recompute(llm_int16):
    """A staging failure in the chain's all-layers write abandons the forward's staging (counted once)
    and the tokens stay those of plain decoding (the next step recomputes their K/V)."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = llm_int16.tokenize(" ".join([PROMPT] * 3))
    plain = llm_int16.generate([ids], params)[0]
    eng = engine_on(llm_int16, kv_cache_blocks=64, decoding="speculative",
                    decoding_options={"method": "ngram", "verify_token_cost": 0.0})
    assert eng.model._chain is not None  # the fault is in the chain's write
    staging = eng.runner.staging
    staging.fault_stage_layer = 3
    assert run(eng, [ids], params.max_tokens) == [plain.outputs[0].token_ids]
    assert staging.metrics.fallback_stage_fail > 0 and staging.metrics.tokens_committed == 0
