"""Speculative decoding on the prefix cache: the same tokens as plain greedy without caching, while
draft trees are staged and rejected on top of shared blocks; named blocks hold exactly a plain
prefill's K/V (no rejected token leaked in)."""

from __future__ import annotations

import pytest

from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.sampling_params import SamplingParams
from tests.conftest import make_tiny_hf_folder
from tests.core.prefix_oracle import assert_cached_blocks_match_prefill, committed

from .prompts import CODE_EDITS, SUMMARIES, _chat

# 12 tokens (16 before): every request still drafts after its hit, and the tree rows staged and rejected on
# top of the shared blocks are the same in the first 12 tokens as over 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(llm, decoding: str = "autoregressive", caching: bool = True, **options) -> LLMEngine:
    cfg = EngineConfig(dtype="float32", decoding=decoding, decoding_options=options, kv_cache_blocks=96,
                       enable_prefix_caching=caching, progress=False)
    return LLMEngine(cfg, llm.engine.model, llm.model_config)


@pytest.fixture(scope="module")
def prompts(spec_llm) -> list[list[int]]:
    code = CODE_EDITS[0]
    variant = _chat(code[len("<|im_start|>user\n"):].split("<|im_end|>")[0] + "\nKeep the comments.")
    return [spec_llm.tokenize(p) for p in (code, code, variant, SUMMARIES[0], SUMMARIES[0])]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, spec_llm) -> str:
    """A separate random-weight draft model (own KV cache; it prefills whole prompts itself)."""
    path, _ = make_tiny_hf_folder(tmp_path_factory.mktemp("tiny_draft"), "LlamaForCausalLM", spec_llm.tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def plain(spec_llm, prompts) -> list[list[int]]:
    eng = engine(spec_llm, caching=False)
    outs: dict[tuple[int, ...], list[int]] = {}  # the repeated prompts (the cache hits below) run once
    for p in prompts:
        if tuple(p) not in outs:
            outs[tuple(p)] = run(eng, [p], [])[0]
    return [outs[tuple(p)] for p in prompts]


def run(eng: LLMEngine, prompts: list[list[int]], history: list[list[int]], drafted_after_hit: list[bool] | None = None
        ) -> list[list[int]]:
    sids = [eng.add_request(p, PARAMS) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    history += [committed(eng, s) for s in sids]
    seqs = [eng.release(s) for s in sids]
    if drafted_after_hit is not None:  # did requests that started from cached blocks still draft?
        drafted_after_hit += [s.stats.get("spec_num_drafts", 0) > 0 for s in seqs if s and s.num_prefix_hit_tokens]
    return [s.output_ids for s in seqs]  # type: ignore[union-attr]


@pytest.mark.parametrize("method, options", [
    ("ngram", dict(depth=4, num_candidates=2)),
    ("draft", dict(depth=3, draft_layers=8)),
    ("eagle", dict(depth=4)),  # the bundled head: a cached prefix has no target features (eagle.py)
    ("draft_model", dict(depth=3)),
])
def test_speculative_with_prefix_cache_equals_plain_greedy(spec_llm, prompts, plain, method, options, request):
    if method == "draft_model":
        options = {**options, "draft_model": request.getfixturevalue("tiny_draft")}
    eng = engine(spec_llm, "speculative", method=method, depth_schedule="constant", **options)
    history: list[list[int]] = []
    drafted: list[bool] = []
    assert [run(eng, [p], history, drafted)[0] for p in prompts] == plain  # one at a time: later ones hit
    assert run(eng, prompts, history) == plain  # all at once, racing for the same blocks
    assert len(drafted) >= 2 and all(drafted)  # a cached prefix does not stop a proposer from drafting
    m = eng.metrics()  # the strategy's counters and the staging buffer's
    assert m["spec_decode_num_drafts"] > 0 and m["kv_staging_tokens_rejected"] > 0  # tentative tokens existed
    s = eng.blocks.stats
    assert s.requests_hit >= 4 and s.hits >= 2 * (len(prompts[0]) - 1) // 16 * 16
    assert assert_cached_blocks_match_prefill(eng, history) > 0
    counts = eng.blocks.audit()
    assert counts["referenced"] == 0 and counts["free"] + counts["cached_unreferenced"] == eng.blocks.num_blocks
    if method == "draft_model":  # the draft's own cache does not share blocks: all of them are free again
        draft_blocks = eng.strategy.proposer.draft.blocks
        assert not draft_blocks.enable_caching and draft_blocks.num_free == draft_blocks.num_blocks
