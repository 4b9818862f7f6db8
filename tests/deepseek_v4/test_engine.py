"""DeepSeek-V4 served by the one engine: continuous batching, admission by cache bytes,
preemption (free and recompute) under a small cache, abort, stop tokens."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.engine.llm_engine import PromptTooLongError
from ratchetlm.models.deepseek_v4.layout import GROWING, STATE
from ratchetlm.sampling_params import SamplingParams

from .conftest import v4_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(engine, prompts, params=GREEDY, watch=None):
    sids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        if watch is not None:
            watch(engine)
    return [engine.seqs[s].output_ids for s in sids]


def _budget(model, seqs: int, csa_blocks: int, max_model_len: int) -> int:
    """Cache bytes for which the V4 layout plans ``seqs`` sequences' fixed pools and
    ``csa_blocks`` compressed-KV (+ indexer-key) blocks."""
    layout = v4_engine(model, max_model_len=max_model_len, max_num_seqs=1).runner.layout
    fixed = sum(n * layout.block_bytes(k) for k, n in layout.fixed_blocks_per_seq().items())
    spare = sum(max(1, seqs // 4) * layout.block_bytes(k) for k in STATE)
    hca = seqs * layout.growing_blocks(max_model_len)["hca_cmp"] * layout.block_bytes("hca_cmp")
    return seqs * fixed + spare + hca + csa_blocks * (layout.block_bytes("csa_cmp") + layout.block_bytes("idx"))


def test_continuous_batching_beyond_the_old_slot_count(model, hf_model):
    # 10 requests of different lengths join and leave one running batch (the old V4 engine had
    # 4 fixed slots and prefilled one request per step); each equals HF's greedy continuation alone.
    prompts = _prompts(10, 5, 140, seed=1)
    engine = v4_engine(model, max_num_seqs=10)
    widths = []
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True) for i in range(10)]
    sids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
        widths.append(len(engine.scheduler.running))
    assert max(widths) == 10
    for sid, p, sp in zip(sids, prompts, params, strict=True):
        # HF greedy, teacher-forced: one forward over the prompt and our output, whose every token must be HF's
        # argmax after the tokens before it (what HF's generate would pick, token by token, without its
        # max_tokens single-token forwards)
        out = engine.seqs[sid].output_ids
        assert len(out) == sp.max_tokens
        with torch.no_grad():
            logits = hf_model(torch.tensor([p + out[:-1]])).logits[0, len(p) - 1 :]  # [max_tokens, vocab]
        assert logits.argmax(-1).tolist() == out
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every pool returned


def test_admission_follows_cache_bytes_not_a_slot_count(model):
    # A budget that holds two sequences' fixed pools: with max_num_seqs = 8 only two run at once,
    # and the rest wait for their bytes (outputs unchanged).
    prompts = _prompts(5, 20, 60, seed=2)
    want = _run(v4_engine(model, max_num_seqs=8), prompts)
    budget = _budget(model, seqs=2, csa_blocks=4, max_model_len=1024)
    engine = v4_engine(model, max_num_seqs=8, max_model_len=1024, kv_cache_bytes=budget)
    assert engine.runner.layout.plan.fixed_seqs == 2
    widths: list[int] = []
    assert _run(engine, prompts, watch=lambda e: widths.append(len(e.scheduler.running))) == want
    assert max(widths) == 2
    # bytes per sequence grow with its length (compressed KV), and the ring + state stay fixed
    layout = engine.runner.layout
    assert layout.bytes_per_sequence(100) == layout.bytes_per_sequence(500) < layout.bytes_per_sequence(600)
    assert layout.plan.nbytes() <= budget


def test_preemption_under_a_small_cache_is_identical_to_no_preemption(model):
    # Three ~500-token prompts cross position 512 (a second compressed-KV block each) while
    # decoding; 5 blocks hold only two of them there, so the scheduler preempts (frees the
    # victim's pools, recomputes it later). Outputs equal a run with plenty of cache.
    prompts = _prompts(3, 490, 505, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _run(v4_engine(model, max_num_seqs=3, max_model_len=1024), prompts, params)
    engine = v4_engine(model, max_num_seqs=3, max_model_len=1024,
                       kv_cache_bytes=_budget(model, seqs=3, csa_blocks=5, max_model_len=1024))
    assert engine.runner.layout.plan.blocks["csa_cmp"] == 5
    assert _run(engine, prompts, params) == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_sampling_is_reproducible_under_preemption(model):
    prompts = _prompts(3, 490, 505, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=11)
    want = _run(v4_engine(model, max_num_seqs=3, max_model_len=1024), prompts, params)
    engine = v4_engine(model, max_num_seqs=3, max_model_len=1024,
                       kv_cache_bytes=_budget(model, seqs=3, csa_blocks=5, max_model_len=1024))
    assert _run(engine, prompts, params) == want
    assert engine.scheduler.num_preemptions > 0


def test_abort_frees_every_pool(model):
    engine = v4_engine(model, max_num_seqs=4)
    alloc = engine.blocks
    total = {k: alloc.free_blocks(k) for k in ("ori",) + GROWING + STATE}
    a = engine.add_request(_prompts(1, 600, 601, seed=5)[0], SamplingParams(temperature=0.0, max_tokens=50))
    b = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    held = alloc.mapped(a)
    assert held["ori"] == 1 and held["csa_cmp"] == 2 and held["csa_state"] > 0  # 600 tokens: 2 compressed blocks
    engine.abort(a)
    assert alloc.mapped(a) == {} and engine.seqs[a].finish_reason == "abort"
    assert {k: alloc.free_blocks(k) for k in total} == {k: total[k] - n for k, n in alloc.mapped(b).items()}
    engine.abort(b)
    assert {k: alloc.free_blocks(k) for k in total} == total
    assert not engine.has_unfinished()


def test_stop_token_and_errors(model):
    engine = v4_engine(model, max_num_seqs=2)
    a = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()  # prefill a -> first token
    first = engine.seqs[a].output_ids[0]
    b = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=(first,)))
    engine.abort(a)
    while engine.has_unfinished():
        engine.step()
    assert engine.seqs[b].output_ids == [first] and engine.seqs[b].finish_reason == "stop"
    with pytest.raises(PromptTooLongError):
        engine.add_request([1] * 16384, GREEDY)
    small = v4_engine(model, max_model_len=1024, kv_cache_bytes=_budget(model, 1, 2, 1024))
    with pytest.raises(ValueError, match="kv_cache_bytes|too small"):
        v4_engine(model, max_model_len=1024, kv_cache_bytes=1000)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        v4_engine(model, kv_cache_blocks=64)
    assert small.runner.layout.plan.fixed_seqs == 1


def test_prefix_caching_is_off_for_v4_and_changes_nothing(model):
    # prefix caching is on by default for the engine; V4's allocator opts out: the same prompt twice
    # is prefilled twice (no hit), with the same output
    engine = v4_engine(model, max_num_seqs=2)
    assert engine.cfg.enable_prefix_caching and not engine.blocks.enable_caching
    prompt = _prompts(1, 300, 301, seed=6)[0]
    first, second = _run(engine, [prompt]), _run(engine, [prompt])
    assert first == second
    assert all(s.num_prefix_hit_tokens == 0 for s in engine.seqs.values())
    assert engine.blocks.metrics() == {}
