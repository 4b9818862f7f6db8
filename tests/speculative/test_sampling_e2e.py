"""End to end through the engine: speculative sampling gives the target's distribution.

Target: ``tiny_sampler`` (conftest.py), a tiny random-weight Llama with a 258-token byte
vocabulary, so a few thousand seeded requests, batched in one engine, take seconds. Draft: the
same model loaded again as a separate ``draft_model`` (beam width 2, depth 2), so drafts are
plausible and both accepted and rejected; the tree verification, residual sampling, bonus token
and staged commit all run. The joint distribution of the first 3 generated tokens (top-k 3: at
most 27 cells) is compared by a chi-square test with the exact one computed by HF transformers on
the same weights; plain sampling passes the same test (the oracle is right), and a wrong
acceptance rule plugged into the engine fails it (the test has power).
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from ratchetlm import LLM
from ratchetlm.decoding import tentative
from ratchetlm.decoding.speculative import draft_tree
from ratchetlm.decoding.speculative.draft_tree import sample_verify
from ratchetlm.layers.sampler import filtered_probs
from ratchetlm.sampling_params import SamplingParams

from .conftest import make_engine
from .test_rejection_sampling import chi_square_pvalue, own_rows, wrong_full_resample

N_REQ = 300  # measured: the wrong rule scores p = 3e-17 under the draft model, the wrong mapping 0; the
# correct rule and plain sampling 0.08-0.3 (20 of the 27 cells expect >= 5 samples)
N_OUT = 3
PROMPT = "The weather today is"
SPEC = dict(method="draft_model", num_candidates=2, depth=2)


def params(seed: int) -> SamplingParams:
    # max_tokens 4: after the prefill's first token the tree has depth 2, covering tokens 2-3
    return SamplingParams(temperature=0.1, top_k=3, max_tokens=N_OUT + 1, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def exact(tiny_sampler) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) under the request's filtered target distribution, from HF's forward."""
    _, llm, hf = tiny_sampler
    prompt = llm.tokenize(PROMPT)
    p = params(0)

    @functools.cache
    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1:]
        return filtered_probs(logits, p)[0]

    out: dict[tuple[int, ...], float] = {}
    for t1 in probs(()).nonzero().flatten().tolist():
        for t2 in probs((t1,)).nonzero().flatten().tolist():
            for t3 in probs((t1, t2)).nonzero().flatten().tolist():
                out[(t1, t2, t3)] = float(probs(())[t1] * probs((t1,))[t2] * probs((t1, t2))[t3])
    assert abs(sum(out.values()) - 1.0) < 1e-4 and len(out) <= 27
    return out


def sample_counts(llm: LLM, decoding: str, max_num_seqs: int = N_REQ, n_req: int = N_REQ, **opts
                  ) -> tuple[Counter, dict]:
    eng = make_engine(llm, decoding, kv_cache_blocks=2 * n_req + 8, max_num_seqs=max_num_seqs, **opts)
    prompt = llm.tokenize(PROMPT)
    ids = [eng.add_request(prompt, params(seed)) for seed in range(n_req)]
    while eng.has_unfinished():
        eng.step()
    counts = Counter(tuple(eng.seqs[i].output_ids[:N_OUT]) for i in ids)
    return counts, eng.strategy.metrics()


def test_speculative_sampling_through_the_engine_matches_the_target(tiny_sampler, exact, monkeypatch):
    """A draft model's trees, sampled: the target's law. Verification reads the target rows through the
    seed's beam-to-row mapping (``parent_rows``), called for every sampled verify
    (test_the_engine_samples_through_the_tree_api breaks that mapping)."""
    path, llm, _ = tiny_sampler
    calls = []
    real = draft_tree.parent_rows
    monkeypatch.setattr(draft_tree, "parent_rows", lambda umap: calls.append(umap.shape) or real(umap))
    counts, m = sample_counts(llm, "speculative", draft_model=path, **SPEC)
    # the trees really were verified, with both outcomes, each through the tree API
    assert m["spec_decode_num_drafts"] >= N_REQ and 0.2 < m["spec_decode_acceptance_rate"] < 0.9, m
    assert len(calls) >= m["spec_decode_num_drafts"]
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p > 1e-3, f"speculative sampling through the engine deviates from the target (p={p:.2e})"


# the training-free trees: the successor table (filled by the batch's own forwards, shared by all
# requests; 30 at a time, so later waves draft from a warm table) and the hybrid with static
# 8-node trees, so every step verifies a real tree
TREES = {"recycling": dict(method="recycling", tree_nodes=8, max_num_seqs=30),
         "hybrid": dict(method="hybrid", tree_nodes=8, max_num_seqs=30)}


@pytest.mark.parametrize("name", list(TREES))
def test_tree_proposers_sample_the_target_distribution(tiny_sampler, exact, name, monkeypatch):
    _, llm, _ = tiny_sampler
    counts, m = sample_counts(llm, "speculative", **TREES[name])
    assert m["spec_decode_num_drafts"] >= N_REQ // 2 and m["spec_decode_num_accepted_tokens"] > N_REQ // 10, m
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p > 1e-3, f"{name} speculative sampling deviates from the target (p={p:.2e})"
    if name != "recycling":  # the hybrid's suffix drafts are rarely rejected here (the history holds the
        return  # earlier waves' outputs), too rarely for a wrong residual to show in 300 requests
    monkeypatch.setattr(tentative, "sample_verify", functools.partial(sample_verify, rule=wrong_full_resample))
    # the same drafts, a wrong rule: caught (with twice the requests: the table's drafts are often
    # accepted, so fewer steps than with a draft model reach the residual the wrong rule gets wrong;
    # measured p = 9e-19 at 600, 2e-6 at 300)
    counts, _ = sample_counts(llm, "speculative", n_req=2 * N_REQ, **TREES[name])
    p = chi_square_pvalue(counts, exact, 2 * N_REQ)
    assert p < 1e-4, f"the chi-square test missed a wrong acceptance rule under {name} drafts (p={p:.2e})"


def test_plain_sampling_passes_and_a_wrong_rule_fails(tiny_sampler, exact, monkeypatch):
    path, llm, _ = tiny_sampler
    counts, _ = sample_counts(llm, "autoregressive")
    assert chi_square_pvalue(counts, exact, N_REQ) > 1e-3, "the oracle disagrees with plain sampling"
    wrong = functools.partial(sample_verify, rule=wrong_full_resample)
    monkeypatch.setattr(tentative, "sample_verify", wrong)  # the verify step speculative decoding uses
    counts, _ = sample_counts(llm, "speculative", draft_model=path, **SPEC)
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p < 1e-6, f"the engine-level chi-square test missed a wrong acceptance rule (p={p:.2e})"


def test_the_engine_samples_through_the_tree_api(tiny_sampler, exact, monkeypatch):
    """Sampled verification reads the target rows through the seed's beam-to-row mapping
    (``parent_rows``; that the engine calls it for every sampled verify is checked with the correct
    mapping in test_speculative_sampling_through_the_engine_matches_the_target): the same engine with
    that mapping shifted by one level (each entry judged on its own row) fails the chi-square."""
    path, llm, _ = tiny_sampler
    monkeypatch.setattr(draft_tree, "parent_rows", own_rows)
    counts, _ = sample_counts(llm, "speculative", draft_model=path, **SPEC)
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p < 1e-6, f"the engine-level chi-square test missed a wrong beam-to-row mapping (p={p:.2e})"


def test_exact_distribution_has_enough_cells(exact):
    """The chi-square needs several unpooled cells to mean anything."""
    assert len([c for c, q in exact.items() if q * N_REQ >= 5]) >= 6
