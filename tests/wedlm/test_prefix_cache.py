"""WeDLM on the prefix cache: windows are staged on top of shared blocks and only the committed
prefix of a window reaches a block; outputs equal the no-KV reference decoder, and named blocks
hold exactly a plain prefill's K/V (no mask slot leaked in)."""

from __future__ import annotations

from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.sampling_params import SamplingParams
from tests.core.prefix_oracle import assert_cached_blocks_match_prefill, committed, expected_hit

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BASE = list(range(40, 80))  # 40 tokens: two full blocks of 16 + 8
PROMPTS = [BASE, BASE, BASE[:30] + [5, 6, 7, 8, 9], BASE + [100, 101, 102]]


def test_wedlm_with_prefix_cache_equals_reference(tiny):
    opts = dict(window_size=8, entropy_threshold=0.4)
    want = [tiny.reference(p, GREEDY, **opts).output_ids for p in PROMPTS]
    cfg = EngineConfig(dtype="float32", decoding="wedlm", decoding_options=opts, kv_cache_blocks=64,
                       max_model_len=256, block_size=16, progress=False)
    eng = LLMEngine(cfg, tiny.llm.engine.model, tiny.llm.model_config)
    history: list[list[int]] = []
    for p, w in zip(PROMPTS, want, strict=True):  # one at a time: later prompts hit earlier blocks
        hit = expected_hit(p, history, 16)
        sid = eng.add_request(p, GREEDY)
        while eng.has_unfinished():
            eng.step()
        assert eng.seqs[sid].num_prefix_hit_tokens == hit
        history.append(committed(eng, sid))
        assert eng.release(sid).output_ids == w  # type: ignore[union-attr]
    # BASE's two full blocks hit twice (the repeat and BASE + 3); the third prompt differs in block 1
    assert (eng.blocks.stats.hits, eng.blocks.stats.requests_hit) == (32 + 16 + 32, 3)
    sids = [eng.add_request(p, GREEDY) for p in PROMPTS]  # all at once
    while eng.has_unfinished():
        eng.step()
    history += [committed(eng, i) for i in sids]
    assert [eng.release(i).output_ids for i in sids] == want  # type: ignore[union-attr]
    assert eng.strategy.metrics()["wedlm_fills"] > 0
    assert assert_cached_blocks_match_prefill(eng, history) > 0
    assert eng.blocks.audit()["referenced"] == 0
