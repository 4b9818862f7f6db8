"""Greedy speculative decoding is token-identical to plain greedy decoding on the real model,
batched and alone, for every proposer and tree shape; caps and stops are respected."""

from __future__ import annotations

import pytest

from ratchetlm.sampling_params import SamplingParams

from .conftest import GREEDY, make_engine, run_engine
from .prompts import CODE, PROMPTS, SUMMARY

CONFIGS = {
    "ngram_chain": dict(method="ngram", depth=4),
    "ngram_tree": dict(method="ngram", num_candidates=3, depth=4),
    "self_draft_chain": dict(method="draft", draft_layers=4, depth=3),
    "self_draft_beam": dict(method="draft", draft_layers=4, depth=3, num_candidates=2),
    "ngram_chunked": dict(method="ngram", depth=6, chunk_size=2, min_n=2),
    "ngram_tree_chunked": dict(method="ngram", num_candidates=3, depth=6, chunk_size=2),
    "ngram_adaptive": dict(method="ngram", num_candidates=2, depth=6, depth_schedule="adaptive"),
    # training-free trees (tree_proposers.py): static 16-node trees, and the hybrid shaped by gain
    "recycling_tree": dict(method="recycling"),
    "suffix_tree": dict(method="suffix"),
    "hybrid_tree": dict(method="hybrid"),
    "hybrid_gain": dict(method="hybrid", depth_schedule="gain"),
}


# every prompt for each proposer / tree shape; chunking is orthogonal to prompt variety
BATCHED = {name: list(range(len(PROMPTS))) for name in CONFIGS} | {"self_draft_chain": [0, 1, 3, 5, 7, 9],
                                                                    "self_draft_beam": [0, 1, 3, 5, 7, 9],
                                                                    "ngram_chunked": [0, 1, 3, 9],
                                                                    "ngram_tree_chunked": [0, 1, 3, 8],
                                                                    "ngram_adaptive": [0, 1, 3, 5, 9],
                                                                    "hybrid_gain": [0, 1, 3, 9]}
# (self_draft_*: the model drafts, whatever the prompt copies: six prompts of every kind batch its rows as 11 did;
# the n-gram, suffix and recycling proposers keep all 11, their drafts depend on what each prompt repeats)
# (hybrid_gain: 11 at once, the gain rule drafts nothing in the first steps and the idle gate closes,
# idle_gate.py, tested at batch 8 in test_idle_gate.py; four copy-heavy prompts at once draft)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_equals_plain_greedy(spec_llm, encoded, reference, name):
    eng = make_engine(spec_llm, "speculative", **CONFIGS[name])
    out = run_engine(eng, [encoded[i] for i in BATCHED[name]], GREEDY)
    for i, a in zip(BATCHED[name], out, strict=True):
        assert a == reference[i], f"{name}: prompt {i} diverged"
    m = eng.strategy.metrics()
    assert m["spec_decode_num_drafts"] > 0
    assert eng.runner.staging.metrics.fallback_count == 0
    if name in ("ngram_chain", "ngram_tree", "suffix_tree", "hybrid_tree"):
        assert_ngram_accepts_on_copy_heavy_prompts(eng)
    if name in ("recycling_tree", "hybrid_gain"):  # drafts accepted somewhere
        assert m["spec_decode_num_accepted_tokens"] > 0


def assert_ngram_accepts_on_copy_heavy_prompts(eng) -> None:
    """Not a speed claim: on code/summary prompts the n-gram drafts must actually be accepted,
    otherwise the equality tests would pass vacuously. Per-request counters add up."""
    ids = (0, 1, 3)  # request i is prompt i (run_engine adds them in order to a fresh engine)
    for i in ids:
        st = eng.seqs[i].stats
        assert st["spec_num_accepted_tokens"] > 0
        assert st["spec_mean_acceptance_length"] == pytest.approx(
            1 + st["spec_num_accepted_tokens"] / st["spec_num_drafts"])
        assert st["spec_acceptance_rate"] == pytest.approx(st["spec_num_accepted_tokens"] / st["spec_num_draft_tokens"])
        assert st["spec_accepted_per_pos"][0] <= st["spec_num_drafts"]
    agg = eng.strategy.metrics()
    assert agg["spec_decode_num_accepted_tokens"] == sum(s.stats["spec_num_accepted_tokens"] for s in eng.seqs.values())


# one request alone per config, alternating code editing / summarization (self-draft is slow on CPU);
# ngram_chain and ngram_tree run alone on prompts 0, 1 and 3 in test_trees_of_a_batch_are_packed_...
ALONE = {"self_draft_chain": 3, "self_draft_beam": 0, "ngram_chunked": 0, "ngram_tree_chunked": 1,
         "ngram_adaptive": 3, "recycling_tree": 5, "suffix_tree": 1, "hybrid_tree": 3, "hybrid_gain": 0}


@pytest.mark.parametrize("name", list(ALONE))
def test_alone_equals_plain_greedy(spec_llm, encoded, reference, name):
    eng = make_engine(spec_llm, "speculative", **CONFIGS[name])
    i = ALONE[name]
    assert run_engine(eng, [encoded[i]], GREEDY) == [reference[i]], f"{name}: prompt {i} diverged alone"


def test_max_tokens_and_stop_ids_inside_accepted_drafts(spec_llm, encoded, reference):
    eng = make_engine(spec_llm, "speculative", method="ngram", num_candidates=2, depth=6)
    for max_tokens in (1, 2, 5):
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert run_engine(eng, [encoded[1]], p) == [reference[1][:max_tokens]], max_tokens
    # stop on a token the reference emits mid-stream: the commit must end exactly there
    stop_tok = reference[1][7]
    cut = reference[1].index(stop_tok) + 1
    p = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop_token_ids=(stop_tok,))
    assert run_engine(eng, [encoded[1]], p) == [reference[1][:cut]]


def test_max_model_len_caps_the_tree(spec_llm, encoded, reference):
    n = len(encoded[1])
    from ratchetlm.engine.config import EngineConfig
    from ratchetlm.engine.llm_engine import LLMEngine

    for decoding, opts in (("autoregressive", {}), ("speculative", dict(method="ngram", depth=8))):
        cfg = EngineConfig(dtype="float32", decoding=decoding, decoding_options=opts, kv_cache_blocks=64,
                           max_model_len=n + 6, progress=False)
        eng = LLMEngine(cfg, spec_llm.engine.model, spec_llm.model_config)
        assert run_engine(eng, [encoded[1]], GREEDY) == [reference[1][:6]]


def test_mixed_with_prefill_and_preemption(spec_llm, encoded, reference):
    """Tight KV (10 blocks for 15 blocks of demand): sequences get preempted and recomputed;
    prefill rows mix with tree rows."""
    eng = make_engine(spec_llm, "speculative", kv_cache_blocks=10, method="ngram", num_candidates=2, depth=4)
    subset = [0, 3, 4, 8]
    out = run_engine(eng, [encoded[i] for i in subset], GREEDY)
    assert out == [reference[i] for i in subset]
    assert eng.scheduler.num_preemptions > 0


def test_bad_options_raise_value_error_naming_the_field(spec_llm):
    for opts, field in ((dict(method="medusa"), "method"), (dict(depth=0), "depth"),
                        (dict(chunk_size=-1), "chunk_size"), (dict(min_n=3, max_n=2), "min_n"),
                        (dict(depht=3), "depht"), (dict(method="draft", draft_layers=30), "draft_layers")):
        with pytest.raises(ValueError, match=field):
            make_engine(spec_llm, "speculative", **opts)


def test_code_and_summary_prompts_present():
    assert CODE in PROMPTS and SUMMARY in PROMPTS and len(PROMPTS) >= 10


def test_adaptive_depth_schedule(spec_llm, encoded):
    """+2 after a fully accepted draft, -1 otherwise, clamped to [1, depth]; the engine's drafts follow it."""
    from ratchetlm.decoding.speculative.strategy import _DEPTH

    eng = make_engine(spec_llm, "speculative", method="ngram", depth=6, depth_schedule="adaptive")
    strat = eng.strategy

    class Seq:
        strategy_state: dict = {}

    seq = Seq()
    seq.strategy_state = {}
    seen = []
    for drafted, accepted in [(6, 6), (6, 2), (5, 0), (4, 4), (6, 1), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1)]:
        strat._adapt_depth(seq, drafted, accepted)
        seen.append(seq.strategy_state[_DEPTH])
    assert seen == [6, 5, 4, 6, 5, 4, 3, 2, 1, 1, 3]
    # wired into the engine: on real prompts some sequence's depth dropped below the maximum
    run_engine(eng, [encoded[i] for i in (0, 3, 5)], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert any(s.stats["spec_num_drafts"] > 0 for s in eng.seqs.values())
    assert any(s.strategy_state.get(_DEPTH, 6) < 6 for s in eng.seqs.values())


def test_disable_by_batch_size(spec_llm, encoded, reference):
    """A step with >= disable_by_batch_size sequences decodes plainly (no drafts, same output);
    once the batch has shrunk below the limit, drafting resumes."""
    eng = make_engine(spec_llm, "speculative", method="ngram", depth=4, disable_by_batch_size=3)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = [eng.add_request(encoded[9], short)] + [eng.add_request(encoded[i], GREEDY) for i in (0, 3)]
    steps_of_three = 0
    while eng.has_unfinished():
        steps_of_three += len(eng.scheduler.running) + len(eng.scheduler.waiting) == 3
        eng.step()
    assert eng.seqs[ids[0]].output_ids == reference[9][:3]
    assert [eng.seqs[i].output_ids for i in ids[1:]] == [reference[0], reference[3]]
    m = eng.strategy.metrics()
    assert m["spec_decode_disabled_steps"] == steps_of_three > 0
    assert eng.seqs[ids[0]].stats.get("spec_num_drafts", 0) == 0  # it only ever ran in a batch of 3
    assert m["spec_decode_num_drafts"] > 0  # the two left drafted after it finished
    never = make_engine(spec_llm, "speculative", method="ngram", depth=4)  # default 0: always draft
    run_engine(never, [encoded[i] for i in (9, 0, 3)], GREEDY)
    assert never.strategy.metrics()["spec_decode_disabled_steps"] == 0
    for limit in (-1, 1.5, True):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            make_engine(spec_llm, "speculative", disable_by_batch_size=limit)


# test_gain_schedule_drafts_what_pays alone, at batch 1: the first 7 prompts (code, summaries, chat turns; the
# batched run covers all 11). An engine's gain decisions depend on what it accepted before, so a prefix of the
# prompts decides as the full list did: gain skips drafts on prompts 4-6 and verifies 51 draft tokens (24
# accepted) against the constant chain's 128 (34). All 11 alone on both engines were 22 of 23 runs.
GAIN_ALONE = range(7)


def test_gain_schedule_drafts_what_pays(spec_llm, encoded, reference):
    """depth_schedule="gain": the same tokens as plain greedy, batched and alone; alone (batch 1),
    weak matches are not drafted, so fewer draft tokens are verified than by the constant chain
    and a larger share of them is accepted."""
    batched = make_engine(spec_llm, "speculative", method="ngram", depth=6, depth_schedule="gain")
    assert run_engine(batched, encoded, GREEDY) == reference
    engines = {name: make_engine(spec_llm, "speculative", method="ngram", depth=6, **opts)
               for name, opts in (("constant", {}), ("gain", dict(depth_schedule="gain")))}
    for name, eng in engines.items():
        for i in GAIN_ALONE:  # one at a time: every gain decision is made at batch 1
            assert run_engine(eng, [encoded[i]], GREEDY) == [reference[i]], (name, i)
    gain, const = engines["gain"].strategy.metrics(), engines["constant"].strategy.metrics()
    assert gain["spec_decode_gain_skipped_drafts"] > 0
    assert "spec_decode_gain_skipped_drafts" not in const
    assert gain["spec_decode_num_draft_tokens"] < const["spec_decode_num_draft_tokens"]
    assert gain["spec_decode_acceptance_rate"] > const["spec_decode_acceptance_rate"]
    for opts, field in ((dict(method="draft", draft_layers=4, depth_schedule="gain"), "depth_schedule"),
                        (dict(depth_schedule="gain", verify_token_cost=-0.1), "verify_token_cost"),
                        (dict(verify_token_cost=float("nan")), "verify_token_cost")):
        with pytest.raises(ValueError, match=field):
            make_engine(spec_llm, "speculative", **opts)


@pytest.mark.parametrize("num_candidates,own_tree", [(1, True), (3, True), (3, False)])
def test_trees_of_a_batch_are_packed_and_verified_in_one_forward(spec_llm, encoded, reference, monkeypatch,
                                                                  num_candidates, own_tree):
    """Production runs the seed's tree API with B > 1: every step hands all its drafting sequences'
    beams to exactly one pack() call (a step of chains alone reads its trees off without one) and
    verifies their trees in one forward; each output equals running it alone. The n-gram proposer
    builds its trees itself (verify.prefix_tree, pack's tree: no pack call); without them
    (``own_tree=False``, a proposer that hands beams only: draft_model, eagle, mtp) the strategy packs."""
    from ratchetlm.decoding.speculative import draft_tree, proposers

    if not own_tree:
        monkeypatch.setattr(proposers, "prefix_tree", lambda candidates: None)
    packs: list[int] = []  # batch size of each pack() call
    steps = []  # per step: (pack batch sizes during propose, staged proposals)
    real_pack = draft_tree.pack
    monkeypatch.setattr(draft_tree, "pack", lambda beam: packs.append(beam.shape[0]) or real_pack(beam))
    subset = [0, 1, 3]
    # CONFIGS' ngram_chain (1) and ngram_tree (3): their runs alone are the ones below
    opts = dict(method="ngram", num_candidates=num_candidates, depth=4, depth_schedule="constant")
    eng = make_engine(spec_llm, "speculative", **opts)
    propose = eng.strategy.propose

    def spy(seqs, budgets):
        packs.clear()
        props = propose(seqs, budgets)
        steps.append((list(packs), sum(not p.direct_write for p in props)))
        return props

    eng.strategy.propose = spy
    together = run_engine(eng, [encoded[i] for i in subset], GREEDY)
    for calls, staged in steps:
        if num_candidates == 1 or own_tree:
            assert calls == [], steps
        else:
            assert calls == ([] if not staged else [calls[0]]) and (not staged or calls[0] >= staged), steps
    assert max(staged for _, staged in steps) == len(subset)
    alone = [run_engine(make_engine(spec_llm, "speculative", **opts), [encoded[i]], GREEDY)[0] for i in subset]
    assert together == alone == [reference[i] for i in subset]
