"""vLLM's parallel sampling through ``LLM.generate``: ``n`` independent choices per prompt (seeded
choice ``i`` samples exactly as a lone request with ``seed + i``), ``best_of`` keeps the most likely,
and the choices share the prompt's KV blocks instead of computing it ``n`` times."""

from __future__ import annotations

import math
import uuid

import pytest

from ratchetlm import LLM, SamplingParams

PROMPT = "Write one sentence about the sea, then one about mountains, then one about the old ratchet."


def _sample(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.9, "max_tokens": 6, "ignore_eos": True, **kw})


def test_n_choices_are_the_seeded_children_vllm_derives(llm_fp32):
    out = llm_fp32.generate([PROMPT], _sample(n=3, seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    alone = [llm_fp32.generate([PROMPT], _sample(seed=7 + i))[0].outputs[0] for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert [c.text for c in out.outputs] == [a.text for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # independent samples, not copies
    again = llm_fp32.generate([PROMPT], _sample(n=3, seed=7))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_unseeded_choices_differ(llm_fp32):
    out = llm_fp32.generate(PROMPT, _sample(n=4))[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_choices_share_the_prompt_blocks(llm_fp32):
    """Choices 1..n-1 start once choice 0's prompt is cached and take its full blocks; the tokens are
    those of the same seeded requests run with prefix caching off."""
    ids = llm_fp32.tokenize(f"Session {uuid.uuid4().hex}. {PROMPT}")  # nothing of it is cached yet
    full = (len(ids) - 1) // 16 * 16
    assert full >= 16
    blocks = llm_fp32.engine.blocks
    before = blocks.stats.hits
    shared = llm_fp32.generate([ids], _sample(n=4, seed=3))[0]
    assert blocks.stats.hits - before == 3 * full  # three followers hit every full prompt block
    assert shared.outputs[0].token_ids == llm_fp32.generate([ids], _sample(seed=3))[0].outputs[0].token_ids
    plain = LLM(progress=False, numerics="exact", dtype="float32", enable_prefix_caching=False, kv_cache_blocks=64)
    assert [c.token_ids for c in plain.generate([ids], _sample(n=4, seed=3))[0].outputs] == \
        [c.token_ids for c in shared.outputs]


def test_best_of_returns_the_n_most_likely(llm_fp32):
    out = llm_fp32.generate([PROMPT], _sample(n=2, best_of=4, seed=11))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].logprobs is None  # not asked for: ranked internally only
    scored = []
    for i in range(4):
        c = llm_fp32.generate([PROMPT], _sample(seed=11 + i, logprobs=0))[0].outputs[0]
        assert c.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(c.logprobs, c.token_ids, strict=True)))
        scored.append((c.cumulative_logprob, c.token_ids))
    best = sorted(scored, key=lambda s: -s[0])[:2]
    assert [c.token_ids for c in out.outputs] == [b[1] for b in best]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([b[0] for b in best])


def test_logprobs_carry_rank_and_decoded_token(llm_fp32):
    c = llm_fp32.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    lp = c.outputs[0].logprobs
    assert len(lp) == len(c.outputs[0].token_ids)
    for d, tok in zip(lp, c.outputs[0].token_ids, strict=True):
        assert d[tok].rank == 1  # greedy: the picked token is the most likely
        assert sorted(v.rank for v in d.values()) == [1, 2, 3]
        assert d[tok].decoded_token == llm_fp32.tokenizer.decode([tok])
        assert d[tok].logprob == float(d[tok]) <= 0
    picked = [d[t] for d, t in zip(lp, c.outputs[0].token_ids, strict=True)]
    assert c.outputs[0].cumulative_logprob == pytest.approx(math.fsum(picked))
    sampled = llm_fp32.generate([PROMPT], _sample(seed=5, logprobs=0, max_tokens=16))[0].outputs[0]
    ranks = [d[t].rank for d, t in zip(sampled.logprobs, sampled.token_ids, strict=True)]
    assert any(r > 1 for r in ranks)  # the sampled token's real rank


def test_prompt_logprobs_once_per_request(llm_fp32):
    out = llm_fp32.generate(["The capital of France is"], _sample(n=2, seed=1, prompt_logprobs=1))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(len(d) >= 1 for d in out.prompt_logprobs[1:])


def test_stop_reason_names_the_stop_string_or_token(llm_fp32):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    base = llm_fp32.generate(["The capital of France is"], greedy)[0].outputs[0]
    word = base.text.split()[0]
    by_string = llm_fp32.generate(["The capital of France is"],
                                  SamplingParams(temperature=0, max_tokens=6, stop=[word]))[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", word)
    tok = base.token_ids[1]
    by_token = llm_fp32.generate(["The capital of France is"],
                                 SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[tok]))[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", tok)
    assert by_token.token_ids == base.token_ids[:2]
    long = llm_fp32.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0]
    assert (long.finish_reason, long.stop_reason) == ("length", None)


def test_max_tokens_none_runs_to_the_context_length():
    llm = LLM(progress=False, max_model_len=40, kv_cache_blocks=16)
    c = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert c.outputs[0].finish_reason == "length"
    assert len(c.prompt_token_ids) + len(c.outputs[0].token_ids) == 40


@pytest.mark.parametrize("kw, field", [
    ({"n": 2, "temperature": 0}, "greedy"), ({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "temperature": 0}, "greedy"), ({"n": 1000}, "n"),
])
def test_bad_choice_counts_are_named(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
