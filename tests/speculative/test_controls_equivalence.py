"""Logits controls under every strategy: penalties + speculative == penalties plain, constrained +
speculative == constrained plain, and grammar-forced tokens (jump-forward) change nothing but the
number of forwards — token for token, greedy, batched."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ratchetlm.models.loader import default_model_path
from ratchetlm.sampling_params import SamplingParams, StructuredOutputsParams

from .conftest import make_engine, run_engine
from .prompts import PROMPTS

PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.3)
SPECS = {
    "ngram_chain": dict(method="ngram", depth=4),
    "ngram_tree": dict(method="ngram", num_candidates=3, depth=4),
    "self_draft": dict(method="draft", draft_layers=4, depth=3),
    # the bundled EAGLE head and the default model loaded again as a separate draft model: both draft
    # (close to) the unconstrained, unpenalised greedy continuation (the draft model: exactly it), so
    # acceptance hinges on each row's penalty seeing the draft tokens before it
    "eagle": dict(method="eagle", depth=4),
    "draft_model": dict(method="draft_model", draft_model=str(default_model_path()), depth=3),
}
# two chat turns, a repeated phrase, a counting list and a request to repeat a word: 5 rows a step (7 before, with
# a story opening and a Q/A that repeat nothing: each row's penalties are its own, so more rows add no path)
CHATTY = [PROMPTS[i] for i in (5, 6, 8, 9)] + [
    "<|im_start|>user\nRepeat the word 'go' ten times.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def plain_runs() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """The plain runs (with and without the controls), once per (prompts, params): the parametrised
    specs share their reference (greedy, so deterministic)."""
    return {}


def assert_same_as_plain(llm, prompts, params, spec, plain_runs) -> None:
    key = repr((llm.config.numerics, prompts, params))
    if key not in plain_runs:
        free_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        plain_runs[key] = (run_engine(make_engine(llm), prompts, params),
                           run_engine(make_engine(llm), prompts, free_params))
    plain, free = plain_runs[key]
    assert plain != free, "the controls changed nothing: the comparison would be vacuous"
    eng = make_engine(llm, "speculative", **SPECS[spec])
    assert run_engine(eng, prompts, params) == plain
    assert eng.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0


# (a self-draft on 29 of the 30 layers ran here too: its drafts are nearly the unpenalised continuation that
# the draft model's are exactly, and the penalties see them through the same verification rows)
@pytest.mark.parametrize("spec", ["ngram_tree", "eagle", "draft_model"])
def test_penalties_with_speculation_equal_plain(exact_llm, spec, plain_runs):
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, **PENALTIES)
    assert_same_as_plain(exact_llm, [exact_llm.tokenize(p) for p in CHATTY], params, spec, plain_runs)


def test_bans_with_speculation_equal_plain(spec_llm, encoded, plain_runs):
    """A two-token bad word the n-gram draft copies from the prompt ("(j"): banned inside the draft. (In the
    default numerics, like the grammar grid's lookup-drafted points below: a lookup's drafts do not depend on
    the mode; the model-drafted penalty points above run in the exact mode.)"""
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, bad_words=("(j", "self.items"),
                            min_tokens=6, logit_bias={spec_llm.tokenize(" the")[0]: -3.0})
    assert_same_as_plain(spec_llm, encoded[:5], params, "ngram_chain", plain_runs)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"enum": ["Paris", "London", "Warsaw"]},
        "fields": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "fields"],
    "additionalProperties": False,
}
# two extractions a step (three before): every row walks the same schema (strings, an integer, an enum, an array)
# on a matcher of its own, so a third row added no path; two still batch rows in different grammar states
TEXTS = [
    "Marie Curie was a physicist and chemist born in Warsaw; she died at 66.",
    "Victor Hugo (83) was a French writer who lived in Paris.",
]


@pytest.fixture(scope="module")
def extraction(exact_llm):
    prompts = [exact_llm.tokenize(exact_llm.apply_chat_template([{"role": "user", "content": f"Extract name, age, city "
                                                              f"and fields as JSON: {t}"}])) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=StructuredOutputsParams(json=SCHEMA))
    eng = make_engine(exact_llm, jump_forward=False)
    ref = run_engine(eng, prompts, params)
    return prompts, params, ref, eng


@pytest.fixture(scope="module")
def extraction_default(spec_llm, extraction):
    """``extraction`` in the default numerics (``spec_llm``; the same file's tokens): the reference of the grid
    points whose drafts do not come from a model (n-gram lookups, their schedules, SCV, no drafts), at ~0.4x
    the exact mode's forward cost. Its engine compiles with the exact engine's compiler (the same tokenizer)."""
    prompts, params, _, exact_eng = extraction
    eng = make_engine(spec_llm, jump_forward=False)
    eng.controls._compiler = exact_eng.controls.compiler
    ref = run_engine(eng, prompts, params)
    assert all(eng.seqs[i].finish_reason == "stop" for i in range(len(prompts))), "the grammar completed"
    return prompts, params, ref, eng


def test_constrained_output_validates(exact_llm, extraction):
    _, _, ref, eng = extraction
    for i, out in enumerate(ref):
        assert eng.seqs[i].finish_reason == "stop", "the grammar completed"
        doc = json.loads(exact_llm.tokenizer.decode(out, skip_special_tokens=True))
        jsonschema.validate(doc, SCHEMA)


# Each point against plain decoding in the same numerics: the exact (HF-identical) mode where a model drafts
# (the layer-skip self-draft, the EAGLE head, the draft model: their drafts are the exact mode's own), the
# default mode (int8 here) where drafts come from lookups or do not come at all, which the mode does not change.
@pytest.mark.parametrize("mode, decoding, opts, jf", [
    ("default", "autoregressive", {}, True),
    ("default", "speculative", SPECS["ngram_chain"], False),
    ("default", "speculative", SPECS["ngram_chain"], True),
    ("default", "speculative", SPECS["ngram_tree"], True),
    # a tree proposer hands over its tree alone: the grammar cuts the tree's candidates (draft_tree.candidates)
    ("default", "speculative", dict(method="hybrid"), False),
    ("default", "speculative", dict(SPECS["ngram_chain"], depth_schedule="gain"), True),  # forced tokens whatever
    ("default", "speculative", dict(SPECS["ngram_chain"], disable_by_batch_size=2), True),  # the depth; drafting off
    ("exact", "speculative", SPECS["self_draft"], False),
    # drafts from a model that knows nothing of the grammar: cut where it rejects them, the rest
    # verified on the masked rows (without jump-forward, drafts cover the schema's fixed parts too)
    # (the draft model without jump-forward verifies its drafts like the EAGLE head's: the same grammar cut
    # of a chain; with jump-forward, its own cache catches up over the forced tokens)
    ("exact", "speculative", SPECS["eagle"], False),
    ("exact", "speculative", SPECS["eagle"], True),
    ("exact", "speculative", SPECS["draft_model"], True),
    # SCV: a draft's later chunks are verified on the grammar state its earlier chunks committed
    ("default", "speculative", dict(method="ngram", depth=6, chunk_size=2, depth_schedule="constant"), True),
], ids=["plain+jf", "ngram", "ngram+jf", "ngram_tree+jf", "hybrid", "gain+jf", "drafting_off+jf", "self_draft", "eagle",
        "eagle+jf", "draft_model+jf", "scv+jf"])
def test_constrained_is_identical_across_strategies(request, mode, decoding, opts, jf):
    llm = request.getfixturevalue("exact_llm" if mode == "exact" else "spec_llm")
    prompts, params, ref, ref_eng = request.getfixturevalue("extraction" if mode == "exact" else "extraction_default")
    eng = make_engine(llm, decoding, jump_forward=jf, **opts)
    # the reference engine's grammar compiler (the same tokenizer, vocabulary and EOS, so the same
    # matchers): an engine's own would build the ~0.7 s token trie of the 49k vocabulary again
    eng.controls._compiler = ref_eng.controls.compiler
    assert run_engine(eng, prompts, params) == ref
    stats = [s.stats for s in eng.seqs.values()]
    forced = sum(st.get("forced_tokens_accepted", 0) for st in stats)
    if jf:
        assert forced > 0, "jump-forward never committed a forced token"
        assert eng.runner.num_forwards < ref_eng.runner.num_forwards
    else:
        assert forced == 0
    if decoding == "speculative" and not opts.get("disable_by_batch_size"):
        m = eng.strategy.metrics()  # drafts were verified under the grammar (n-gram ones copy the prompt: accepted)
        assert m["spec_decode_num_drafts"] > 0
        assert m["spec_decode_num_accepted_tokens"] > 0 or opts["method"] == "draft"
        if opts.get("chunk_size") == 2:
            assert m["spec_decode_scv_continued_chunks"] > 0, "no chunk was verified on top of another"
