"""A separate draft model on its own paged KV cache (``method="draft_model"``).

Two drafts bracket the acceptance range: the default model itself, loaded separately (same
weights: every draft token must be accepted, and the draft cache must hold exactly the
target's committed K/V), and a tiny random-weight model with the SmolLM2 vocab (drafts
almost always rejected). Both must be token-identical to plain greedy decoding, batched
under a tight KV cache (preemption) and alone, and give every draft block back.
"""

from __future__ import annotations

import pytest
import torch

from ratchetlm.models.loader import default_model_path
from ratchetlm.sampling_params import SamplingParams
from tests.conftest import make_tiny_hf_folder

from .conftest import GREEDY, make_engine, run_engine

BATCH = [0, 3, 4, 8]  # code, summary x2, chat-ish: 10 target blocks force preemption
ALONE = 1  # code continuation


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, exact_llm) -> str:
    path, _ = make_tiny_hf_folder(tmp_path_factory.mktemp("tiny_draft"), "LlamaForCausalLM", exact_llm.tokenizer)
    return str(path)


def assert_draft_blocks_freed(eng) -> None:
    blocks = eng.strategy.proposer.draft.blocks
    assert blocks.num_free == blocks.num_blocks, "draft KV blocks leaked"
    assert eng.strategy.metrics()["spec_draft_kv_blocks_used"] == 0


def test_same_weights_draft_is_fully_accepted_and_mirrors_the_target_kv(exact_llm, encoded, exact_reference):
    eng = make_engine(exact_llm, "speculative", kv_cache_blocks=10, method="draft_model",
                      draft_model=str(default_model_path()), depth=3)
    prop = eng.strategy.proposer
    # alone on the fresh caches, stopping mid-way to compare the draft cache with the target cache
    sid = eng.add_request(encoded[ALONE], GREEDY)
    seq = eng.seqs[sid]
    while seq.num_output_tokens < 8:
        eng.step()
    st = seq.strategy_state["spec_draft_model"]
    n = st.num_cached
    assert 0 < n <= seq.num_cached  # only committed tokens in the draft cache
    d_slots, t_slots = prop.draft.blocks.slots(st, 0, n), eng.blocks.slots(seq, 0, n)
    torch.testing.assert_close(prop.cache.k[:, d_slots], eng.cache.k[:, t_slots], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prop.cache.v[:, d_slots], eng.cache.v[:, t_slots], atol=1e-4, rtol=1e-4)
    rest = prop.draft.blocks.slots(st, n, len(st.block_table) * prop.draft.blocks.block_size)
    assert not prop.cache.k[:, rest].any(), "a draft-chain token's K/V reached the draft cache"
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == exact_reference[ALONE]
    assert_draft_blocks_freed(eng)
    # batched, tight target KV: sequences are preempted (their draft blocks freed) and recomputed
    assert run_engine(eng, [encoded[i] for i in BATCH], GREEDY) == [exact_reference[i] for i in BATCH]
    assert eng.scheduler.num_preemptions > 0
    assert_draft_blocks_freed(eng)
    m = eng.strategy.metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_acceptance_rate"] >= 0.95, m
    assert m["spec_draft_alloc_fallbacks"] == 0


def test_random_draft_beam_is_rejected_yet_lossless(exact_llm, tiny_draft, encoded, exact_reference):
    """Beam search of width 2 (the greedy chain is covered by the same-weights test)."""
    width, n = 2, 8  # nearly every draft is rejected: one step per token, so fewer tokens
    short = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    eng = make_engine(exact_llm, "speculative", kv_cache_blocks=10, method="draft_model", draft_model=tiny_draft,
                      depth=2, num_candidates=width)
    assert run_engine(eng, [encoded[i] for i in BATCH], short) == [exact_reference[i][:n] for i in BATCH]
    assert eng.scheduler.num_preemptions > 0
    assert run_engine(eng, [encoded[ALONE]], short) == [exact_reference[ALONE][:n]]
    m = eng.strategy.metrics()
    assert m["spec_decode_num_drafts"] >= 2 * n  # drafted on most steps
    assert m["spec_decode_acceptance_rate"] < 0.2, m
    assert_draft_blocks_freed(eng)


def test_full_draft_cache_falls_back_to_plain_steps(exact_llm, tiny_draft, encoded, exact_reference):
    """3 draft blocks (48 tokens) cannot hold every sequence: those left out take plain steps."""
    eng = make_engine(exact_llm, "speculative", method="draft_model", draft_model=tiny_draft, depth=2,
                      draft_kv_blocks=3)
    subset, n = [0, 7, 10], 6  # 47 + 11 + 13 prompt tokens
    short = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    assert run_engine(eng, [encoded[i] for i in subset], short) == [exact_reference[i][:n] for i in subset]
    m = eng.strategy.metrics()
    assert m["spec_draft_alloc_fallbacks"] > 0 and m["spec_decode_num_drafts"] > 0
    assert eng.seqs[0].stats.get("spec_draft_alloc_fallbacks", 0) > 0  # the 47-token prompt never fits
    assert_draft_blocks_freed(eng)


def test_abort_frees_draft_blocks(exact_llm, tiny_draft, encoded):
    eng = make_engine(exact_llm, "speculative", method="draft_model", draft_model=tiny_draft, depth=2)
    sid = eng.add_request(encoded[3], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.strategy.metrics()["spec_draft_kv_blocks_used"] > 0
    eng.abort(sid)
    assert_draft_blocks_freed(eng)


def test_draft_model_options_are_validated(exact_llm, tiny_draft, tmp_path):
    mismatched, _ = make_tiny_hf_folder(tmp_path, "LlamaForCausalLM", exact_llm.tokenizer, vocab_size=1024)
    cases = [
        (dict(method="draft_model", draft_model=str(mismatched)), "vocab size 1024"),
        (dict(method="draft_model"), "draft_model"),
        (dict(method="draft_model", draft_model=str(tmp_path / "missing")), "draft_model"),
        (dict(method="ngram", draft_model=tiny_draft), "draft_model"),
        (dict(method="draft_model", draft_model=tiny_draft, draft_kv_blocks=-1), "draft_kv_blocks"),
    ]
    for opts, msg in cases:
        with pytest.raises(ValueError, match=msg):
            make_engine(exact_llm, "speculative", **opts)
