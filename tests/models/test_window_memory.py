"""Sliding-window memory: a model whose every layer slides (Mistral) releases KV blocks no query can
reach again, so the blocks a sequence holds stay bounded by its window as it grows — and its text is
still HF's greedy text. (Models that also have global layers: test_local_pool.py.)"""

from __future__ import annotations

import pytest

from ratchetlm import LLM, SamplingParams
from tests.models.tiny import drain, engine_on, hf_logits, hf_model, save_hf

WINDOW, BLOCK, CHUNK = 16, 4, 8
PROMPT = list(b"The ratchet only moves forward and the window slides along with it. ")  # 68 tokens
NEW = 90  # 158 positions = 40 blocks; the cache below has 14


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(model, out)[-1].argmax()))
    return out[len(ids):]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model = hf_model("MistralForCausalLM", sliding_window=WINDOW)
    llm = LLM(str(save_hf(tmp_path_factory.mktemp("mistral"), model)), progress=False, dtype="float32")
    return model, llm


def _run_counting(engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[int]]:
    """Greedy to completion; the KV blocks in use at every forward (the peak of each step)."""
    used = []
    execute = engine.runner.execute

    def counting(*args, **kwargs):
        used.append(engine.blocks.num_blocks - engine.blocks.num_free)
        return execute(*args, **kwargs)

    engine.runner.execute = counting
    sids = [engine.add_request(p, _greedy(n)) for p in prompts]
    drain(engine)  # fails, not hangs, when blocks are never released (a request then waits forever)
    return [engine.release(s).output_ids for s in sids], used


def _bound(engine) -> int:
    """Blocks one sequence may hold: the window behind its next query, one step's tokens, and one
    partially reached block."""
    return engine.blocks.blocks_needed(WINDOW - 1 + engine.cfg.max_num_batched_tokens) + 1


def test_blocks_stay_bounded_by_the_window_and_text_equals_hf(mistral):
    model, llm = mistral
    eng = engine_on(llm, kv_cache_blocks=14, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    assert eng.blocks.window == WINDOW
    # without release this request (158 positions) could not even be admitted
    assert eng.blocks.blocks_needed(len(PROMPT) + NEW) > eng.blocks.num_blocks
    (out,), used = _run_counting(eng, [PROMPT], NEW)
    assert out == _hf_greedy(model, PROMPT, NEW)
    assert max(used) <= _bound(eng) == 7, used
    assert eng.blocks.audit()["referenced"] == 0 and eng.scheduler.num_preemptions == 0  # finished: all back


def test_released_blocks_serve_prefix_hits(mistral):
    """A block is named before it is released, so a cache big enough to keep them serves the same
    prompt again; the hit is not held past the window either. Prefill chunks longer than the window
    release blocks in the step that fills them."""
    _, llm = mistral
    want = llm.generate([PROMPT], _greedy(NEW))[0].outputs[0].token_ids
    for budget in (CHUNK, 3 * WINDOW):
        roomy = engine_on(llm, kv_cache_blocks=64, block_size=BLOCK, max_num_batched_tokens=budget)
        for _ in range(2):
            (out,), used = _run_counting(roomy, [PROMPT], NEW)
            assert out == want and max(used) <= _bound(roomy), (budget, used)
        assert roomy.blocks.stats.hits == (len(PROMPT) - 1) // BLOCK * BLOCK
        roomy.blocks.audit()


def test_batched_preempted_and_speculative_with_released_blocks_equal_alone(mistral):
    _, llm = mistral
    prompts = [PROMPT, PROMPT[::-1], list(b"abcabcabcabcabcabcabcabc" * 3)]
    alone = [llm.generate([p], _greedy(NEW))[0].outputs[0].token_ids for p in prompts]
    tight = engine_on(llm, kv_cache_blocks=14, block_size=BLOCK, max_num_batched_tokens=CHUNK + 2)
    got, _ = _run_counting(tight, prompts, NEW)
    assert got == alone and tight.scheduler.num_preemptions > 0
    for opts in ({"method": "ngram", "depth": 4, "num_candidates": 2, "depth_schedule": "constant"},
                 {"method": "draft", "draft_layers": 1, "depth": 3, "depth_schedule": "constant"}):
        spec = engine_on(llm, kv_cache_blocks=40, block_size=BLOCK, max_num_batched_tokens=2 * CHUNK,
                         decoding="speculative", decoding_options=opts)
        got, used = _run_counting(spec, prompts, NEW)
        assert got == alone, opts["method"]
        assert max(used) <= 3 * _bound(spec), used  # 27, not 3 x 41
        assert spec.strategy.metrics()["spec_decode_num_drafts"] > 0


def test_a_hit_needs_only_the_window(mistral):
    """In the 14-block cache a 158-position sequence keeps only its last blocks cached (the first ones
    were evicted for the later ones): a prompt ending there still hits everything its window reaches,
    and the released blocks before it are not looked for."""
    _, llm = mistral
    eng = engine_on(llm, kv_cache_blocks=14, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    sid = eng.add_request(PROMPT, _greedy(NEW))
    drain(eng)
    seq = eng.release(sid)
    done = seq.token_ids  # 158 tokens, 157 with K/V: blocks 0-38 named, the early ones evicted since
    (out,), used = _run_counting(eng, [done[:155]], 3)
    assert eng.blocks.stats.hits == 152 and out == done[155:158]
    assert max(used) <= _bound(eng)
    eng.blocks.audit()
