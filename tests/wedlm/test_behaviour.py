"""WeDLM engine behaviour: stops inside multi-token commits, committed KV parity with an AR
prefill, the max_model_len budget, mixed windows in one forward, refusal on models without a
mask token, preemption, streaming text and stats."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM
from ratchetlm.sampling_params import SamplingParams

from .conftest import run
from .factory import make_tiny_wedlm_folder
from .test_engine_vs_reference import TINY_PROMPTS

KV = 64  # KV blocks (1024 tokens) for the LLMs built here: the default ~1 GiB cache is resident memory
OPTS = dict(window_size=8, entropy_threshold=0.8)


def commits_per_step(engine, prompt, params):
    """Committed token groups, one per engine step, for a single request."""
    sid = engine.add_request(prompt, params)
    groups = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq_id == sid and out.new_token_ids:
                groups.append(out.new_token_ids)
    return groups


def test_stop_token_inside_a_multi_token_commit_ends_there(tiny):
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    groups = commits_per_step(tiny.engine(**OPTS), TINY_PROMPTS[0], free)
    flat = [t for g in groups for t in g]
    # a token that first appears in the middle of a commit of >= 3 tokens
    pick = next((g[1], sum(map(len, groups[:i])) + 1) for i, g in enumerate(groups)
                if len(g) >= 3 and g[1] not in flat[: sum(map(len, groups[:i])) + 1])
    stop_tok, at = pick
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok])
    eng = tiny.engine(**OPTS)
    out, reasons, _ = run(eng, [TINY_PROMPTS[0]], params)
    assert out[0] == flat[: at + 1] and out[0][-1] == stop_tok
    assert reasons == ["stop"]
    assert out[0] == tiny.reference(TINY_PROMPTS[0], params, **OPTS).output_ids
    assert eng.blocks.num_free == eng.blocks.num_blocks  # KV freed at the stop


def test_committed_kv_equals_ar_prefill_kv(tiny):
    """Mid-generation, the cache rows of every committed token equal what a plain causal
    prefill of the same tokens writes (window rows never leak into the committed cache)."""
    eng = tiny.engine(**OPTS)
    sid = eng.add_request(TINY_PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    while len(eng.seqs[sid].output_ids) < 20:
        eng.step()
    seq = eng.seqs[sid]
    assert seq.num_cached == len(seq.token_ids)  # WeDLM commits tokens together with their KV
    slots = eng.blocks.slots(seq, 0, seq.num_cached)
    got_k, got_v = eng.cache.k[:, slots].clone(), eng.cache.v[:, slots].clone()

    ar = tiny.engine(decoding="autoregressive")  # a separate engine and cache
    sid2 = ar.add_request(list(seq.token_ids), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    ar.step()  # one direct-write prefill of all committed tokens
    seq2 = ar.seqs[sid2]
    assert seq2.num_cached == len(seq.token_ids)
    slots2 = ar.blocks.slots(seq2, 0, seq2.num_cached)
    torch.testing.assert_close(got_k, ar.cache.k[:, slots2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, ar.cache.v[:, slots2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("room", [1, 3, 10])
def test_generation_stops_exactly_at_max_model_len(tiny, room):
    prompt = TINY_PROMPTS[1]
    mml = len(prompt) + room
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    opts = dict(window_size=16, entropy_threshold=0.4)
    out, reasons, steps = run(tiny.engine(max_model_len=mml, **opts), [prompt], params, max_steps=4 * room + 4)
    assert len(out[0]) == room and reasons == ["length"]
    assert out[0] == tiny.reference(prompt, params, max_model_len=mml, **opts).output_ids


def test_window_shrinks_with_the_budget(tiny):
    prompt = TINY_PROMPTS[0]
    eng = tiny.engine(max_model_len=len(prompt) + 5, window_size=16, entropy_threshold=0.4)
    sid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    eng.step()  # prefill
    assert eng.strategy.tokens_wanted(eng.seqs[sid]) == 5  # min(window 16, 5 positions left)


def test_sequences_with_different_windows_share_one_forward(tiny):
    """A sequence near max_model_len (window capped) batched with fresh ones: one forward per step."""
    eng = tiny.engine(max_model_len=24, window_size=8, entropy_threshold=0.4)
    prompts = [list(range(5, 25))[:20], TINY_PROMPTS[0], TINY_PROMPTS[2]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out, _, steps = run(eng, prompts, params)
    assert eng.runner.num_forwards == steps
    for p, o in zip(prompts, out, strict=True):
        assert o == tiny.reference(p, params, max_model_len=24, window_size=8, entropy_threshold=0.4).output_ids
    assert len(out[0]) == 4  # 24 - 20


def test_short_step_budget_still_finishes_and_commits_exact_kv(tiny):
    """max_num_batched_tokens smaller than the windows: a prefix of the topological order runs."""
    eng = tiny.engine(max_num_batched_tokens=12, **OPTS)
    out, reasons, _ = run(eng, TINY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert reasons == ["length"] * len(TINY_PROMPTS) and all(len(o) == 20 for o in out)


def test_preemption_recomputes_and_frees(tiny):
    eng = tiny.engine(kv_cache_blocks=6, **OPTS)  # 4 requests of ~40 tokens + windows need more
    out, reasons, _ = run(eng, TINY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0
    assert reasons == ["length"] * 4 and all(len(o) == 30 for o in out)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_refuses_a_model_without_mask_token(tmp_path):
    path, _ = make_tiny_wedlm_folder(tmp_path, declare_mask=False)
    with pytest.raises(ValueError, match="mask_token_id"):
        LLM(str(path), dtype="float32", progress=False, decoding="wedlm", kv_cache_blocks=KV)
    LLM(str(path), dtype="float32", progress=False, kv_cache_blocks=KV)  # the same model decodes autoregressively


def test_refuses_the_default_ar_model(llm_fp32):
    from ratchetlm.engine.config import EngineConfig
    from ratchetlm.engine.llm_engine import LLMEngine

    cfg = EngineConfig(dtype="float32", decoding="wedlm", kv_cache_blocks=8, progress=False)
    with pytest.raises(ValueError, match="no mask_token_id"):
        LLMEngine(cfg, llm_fp32.engine.model, llm_fp32.model_config)


def test_streamed_text_and_stats(trained):
    llm = LLM(str(trained.path), dtype="float32", progress=False, wedlm=dict(window_size=16), kv_cache_blocks=KV)
    prompt = "count from 10 to 30 :"
    params = SamplingParams(temperature=0.0, max_tokens=40)
    events = list(llm.stream([prompt], params))
    text = "".join(e.text for e in events)
    final = llm.generate([prompt], params)[0]
    assert text == final.text and final.text.strip()
    m = final.metrics
    assert m["wedlm_forwards"] > 0 and m["wedlm_commits"] == len(final.token_ids)
    assert m["wedlm_tokens_per_forward"] == pytest.approx(m["wedlm_commits"] / m["wedlm_forwards"])
    assert 1 <= m["wedlm_avg_window"] <= 32
    agg = llm.engine.strategy.metrics()
    assert agg["wedlm_forwards"] >= m["wedlm_forwards"]


def test_llm_keeps_decoding_options_given_by_their_field_name(tiny):
    """``LLM(decoding="wedlm", decoding_options=...)`` (EngineConfig's own names) decodes with those
    options, as ``wedlm={...}`` does; both at once is an error, not a silent choice."""
    opts = {"window_size": 4, "entropy_threshold": 0.2}
    for kw in ({"decoding": "wedlm", "decoding_options": opts}, {"wedlm": opts}):
        llm = LLM(str(tiny.path), dtype="float32", progress=False, numerics="exact", max_model_len=256,
                  kv_cache_blocks=KV, **kw)
        cfg = llm.engine.strategy.cfg
        assert (cfg.window_size, cfg.entropy_threshold) == (4, 0.2), kw
    with pytest.raises(ValueError, match="not both"):
        LLM(str(tiny.path), dtype="float32", progress=False, wedlm=opts, decoding="wedlm", decoding_options=opts)
