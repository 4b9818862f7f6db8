"""EAGLE draft head (method="eagle"): lossless against plain greedy, fed exactly the target's
features, drafting what a whole-sequence pass of the head predicts; the bundled trained head is
actually accepted. Random-weight heads (tiny draft vocabulary) test the plumbing; the bundled
head (trained by ``ratchet train-eagle`` for the default model) tests acceptance."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.decoding.speculative.eagle import BUNDLED_HEAD, EagleConfig, EagleHead
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.training.eagle_train import head_pass, target_features

from .conftest import GREEDY, make_engine, run_engine
from .prompts import CHATS, CODE_EDITS, SUMMARIES


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, exact_llm) -> str:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(exact_llm.model_config, 512))
    head.draft_vocab.copy_(torch.randperm(exact_llm.model_config.vocab_size)[:512])
    path = tmp_path_factory.mktemp("eagle") / "random_head"
    head.save(path)
    return str(path)


def eagle_engine(llm, head: str | None, **kw):
    return make_engine(llm, "speculative", method="eagle", draft_model=head, **kw)


def test_random_head_is_lossless_batched_alone_and_under_preemption(exact_llm, encoded, exact_reference, random_head):
    eng = eagle_engine(exact_llm, random_head, depth=3)
    # six at once (all 11 before): code, summaries, chat turns, a story and a list; a random head's drafts are
    # nearly all rejected whatever the prompt, so the other five only added rows to the same steps
    batch = [0, 1, 3, 5, 7, 9]
    assert run_engine(eng, [encoded[i] for i in batch], GREEDY) == [exact_reference[i] for i in batch]
    m = eng.strategy.metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["spec_draft_forwards"] > 0
    assert m["spec_draft_kv_blocks_used"] == 0, "head KV blocks leaked"
    # alone: one request (a chat turn) is the batch-of-one path; the engine's batched run above had all 11
    assert run_engine(eng, [encoded[5]], GREEDY) == [exact_reference[5]]
    gain = eagle_engine(exact_llm, random_head, depth=6, depth_schedule="gain")  # confidence-cut chains
    assert run_engine(gain, [encoded[i] for i in (0, 3, 9)], GREEDY) == [exact_reference[i] for i in (0, 3, 9)]
    tight = eagle_engine(exact_llm, random_head, depth=3, kv_cache_blocks=10)
    subset = [0, 3, 4, 8]
    assert run_engine(tight, [encoded[i] for i in subset], GREEDY) == [exact_reference[i] for i in subset]
    assert tight.scheduler.num_preemptions > 0
    assert tight.strategy.metrics()["spec_draft_kv_blocks_used"] == 0


def test_head_reads_the_targets_features_and_drafts_its_whole_sequence_prediction(exact_llm, encoded, random_head):
    """Oracles: the features observed for committed positions equal a teacher-forced target pass;
    each first draft token equals the argmax of one whole-sequence head pass over true features."""
    eng = eagle_engine(exact_llm, random_head, depth=2)
    prop = eng.strategy.proposer
    seen: dict[int, torch.Tensor] = {}
    drafts: list[tuple[list[int], int]] = []
    observe, propose = prop.observe, prop.propose

    def spy_observe(seq, start, hidden):
        for k in range(hidden.shape[0]):
            seen[start + k] = hidden[k].clone()
        observe(seq, start, hidden)

    def spy_propose(seqs, depths):
        beams = propose(seqs, depths)
        drafts.extend((list(s.token_ids), int(b.tokens[0, 0])) for s, b in zip(seqs, beams, strict=True) if b)
        return beams

    prop.observe, prop.propose = spy_observe, spy_propose
    sid = eng.add_request(encoded[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    tokens = eng.seqs[sid].token_ids
    model = exact_llm.engine.model
    with torch.inference_mode():
        ref = target_features(model, tokens)  # [n, hidden]
        positions = sorted(seen)
        assert positions == list(range(len(positions))) and len(positions) >= len(tokens) - 1
        torch.testing.assert_close(torch.stack([seen[p] for p in positions]), ref[positions], atol=2e-3, rtol=2e-3)
        head = prop.head
        assert len(drafts) >= 5
        for ctx, first in drafts:
            t = len(ctx) - 1
            g = head_pass(head, model.embed(torch.tensor(ctx[1:])), ref[:t])[-1]  # g_T
            want = int(prop.vocab[prop.lm(g[None]).argmax()])
            assert first == want


def test_options_and_bad_heads_raise_value_errors(exact_llm, random_head, tmp_path):
    with pytest.raises(ValueError, match="num_candidates"):
        eagle_engine(exact_llm, random_head, num_candidates=2)
    with pytest.raises(ValueError, match="config.json"):
        eagle_engine(exact_llm, str(tmp_path))
    small = EagleHead(EagleConfig(64, 128, 4, 2, 16, exact_llm.model_config.vocab_size, 32))
    small.save(tmp_path / "small")
    with pytest.raises(ValueError, match="hidden size 64"):
        eagle_engine(exact_llm, str(tmp_path / "small"))
    with pytest.raises(ValueError, match="draft_model"):
        make_engine(exact_llm, "speculative", method="ngram", draft_model=random_head)


def test_seeded_sampling_with_a_head_is_reproducible(spec_llm, encoded, random_head):
    """In the default numerics (the random head fits the same model in every mode): a seed's draws are the
    seed's in every mode, at ~0.4x the exact mode's CPU per forward."""
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = run_engine(eagle_engine(spec_llm, random_head, depth=3), [encoded[3]], p)
    b = run_engine(eagle_engine(spec_llm, random_head, depth=3), [encoded[3]], p)
    assert a == b and len(a[0]) == 16


def test_bundled_head_is_accepted_and_lossless(spec_llm):
    """Not a speed claim: the shipped head must actually predict the default model's answers on
    the benchmark's requests (held out of its training data), otherwise equality passes vacuously.
    In the mode users run (``spec_llm``: the default numerics; ~0.4x the exact mode's CPU here): the
    bundled head is lossless in the exact mode too, under penalties and grammars
    (test_controls_equivalence.py), and the random head's tests above run in the exact mode."""
    prompts = [spec_llm.tokenize(p) for p in CODE_EDITS + SUMMARIES + CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = run_engine(make_engine(spec_llm), prompts, params)
    assert BUNDLED_HEAD.is_dir()
    eng = eagle_engine(spec_llm, None, depth=4)  # None: the bundled head
    assert run_engine(eng, prompts, params) == ref
    m = eng.strategy.metrics()
    # measured when the head was shipped (exact mode): 1.37 and 58 of 204; in int8 (the default on the
    # bundled Q4_1 file), 1.39 and 55 of 200 (a random head: 1.0 and 0)
    assert m["spec_decode_mean_acceptance_length"] > 1.2, m
    assert m["spec_decode_num_accepted_tokens_per_pos_0"] > 0.15 * m["spec_decode_num_drafts"], m


def test_lookup_with_head_fallback_is_lossless_and_uses_both(exact_llm, encoded, exact_reference, random_head):
    """method="eagle_ngram": a prompt-lookup draft where one is found, the head's chain elsewhere; the head
    catches up over positions the lookup served. Both kinds of draft are verified, output unchanged."""
    eng = make_engine(exact_llm, "speculative", method="eagle_ngram", draft_model=random_head, depth=3,
                      depth_schedule="constant")
    batch = [0, 3, 5, 9]  # code edits copy their prompt (lookups), chat turns mostly do not (head)
    assert run_engine(eng, [encoded[i] for i in batch], GREEDY) == [exact_reference[i] for i in batch]
    m = eng.strategy.metrics()
    assert m["spec_lookup_drafts"] > 0 and m["spec_head_drafts"] > 0, m
    assert m["spec_draft_kv_blocks_used"] == 0, "head KV blocks leaked"
    assert run_engine(eng, [encoded[5]], GREEDY) == [exact_reference[5]]


def test_lookup_with_head_fallback_backs_off_a_head_that_declines(exact_llm, encoded, exact_reference, random_head):
    """A random head is rarely confident enough to pay under the gain rule: after each run of declines the
    sequence's head is asked again only after a growing wait (skipped steps counted), output unchanged."""
    eng = make_engine(exact_llm, "speculative", method="eagle_ngram", draft_model=random_head, depth=3,
                      depth_schedule="gain", verify_token_cost=0.09)
    batch = [3, 5]
    assert run_engine(eng, [encoded[i] for i in batch], GREEDY) == [exact_reference[i] for i in batch]
    m = eng.strategy.metrics()
    assert m["spec_head_skipped"] > 0, m
