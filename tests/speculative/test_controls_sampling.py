"""Speculative *sampling* with penalties gives the penalised target distribution: the joint law of
the first generated tokens, chi-square against the exact one computed from HF transformers'
logits with HF's repetition-penalty processor and the OpenAI frequency/presence formula (an
oracle independent of ours). A logit bias lifts three tokens to the top so that the penalties
decide what follows them. Verifying drafts against the unpenalised rows fails the test (rows that
ignore the draft tokens before them are caught by the greedy test_controls_equivalence.py).
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from ratchetlm.decoding import tentative
from ratchetlm.layers.sampler import filtered_probs
from ratchetlm.sampling_params import SamplingParams

from .conftest import make_engine
from .test_rejection_sampling import chi_square_pvalue
from .test_sampling_e2e import N_OUT, N_REQ, PROMPT, SPEC

PENALTIES = dict(repetition_penalty=3.0, frequency_penalty=1.0, presence_penalty=0.5)
BIAS = 1.0


@pytest.fixture(scope="module")
def case(tiny_sampler):
    """(params(seed), exact joint distribution of the first N_OUT tokens)."""
    _, llm, hf = tiny_sampler
    prompt = llm.tokenize(PROMPT)

    def raw(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([prompt + list(prefix)])).logits[0, -1:].float()

    favoured = torch.topk(raw(())[0], 3).indices.tolist()

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.1, top_k=3, max_tokens=N_OUT + 1, ignore_eos=True, seed=seed,
                              logit_bias={t: BIAS for t in favoured}, **PENALTIES)

    @functools.cache
    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        x = raw(prefix)
        x[0, favoured] += BIAS
        x = RepetitionPenaltyLogitsProcessor(PENALTIES["repetition_penalty"])(torch.tensor([prompt + list(prefix)]), x)
        counts = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=x.shape[-1]).float()
        x = x - PENALTIES["frequency_penalty"] * counts - PENALTIES["presence_penalty"] * (counts > 0).float()
        return filtered_probs(x, params(0))[0]

    exact = {}
    for t1 in probs(()).nonzero().flatten().tolist():
        for t2 in probs((t1,)).nonzero().flatten().tolist():
            for t3 in probs((t1, t2)).nonzero().flatten().tolist():
                exact[(t1, t2, t3)] = float(probs(())[t1] * probs((t1,))[t2] * probs((t1, t2))[t3])
    assert abs(sum(exact.values()) - 1.0) < 1e-4
    return params, exact


def counts_of(llm, params, decoding: str, **opts) -> tuple[Counter, dict]:
    eng = make_engine(llm, decoding, kv_cache_blocks=2 * N_REQ + 8, max_num_seqs=N_REQ, **opts)
    prompt = llm.tokenize(PROMPT)
    ids = [eng.add_request(prompt, params(seed)) for seed in range(N_REQ)]
    while eng.has_unfinished():
        eng.step()
    return Counter(tuple(eng.seqs[i].output_ids[:N_OUT]) for i in ids), eng.strategy.metrics()


# (on conftest.tiny_sampler, measured: 5 of the 27 cells expect >= 5 of the 300 samples; plain p = 0.06,
# speculative p = 0.09, the unpenalised rows p = 0: they sample cells the penalties rule out)
def test_penalised_speculative_sampling_matches_the_target(tiny_sampler, case):
    path, llm, _ = tiny_sampler
    params, exact = case
    plain, _ = counts_of(llm, params, "autoregressive")
    assert chi_square_pvalue(plain, exact, N_REQ) > 1e-3, "the oracle disagrees with plain sampling"
    counts, m = counts_of(llm, params, "speculative", draft_model=path, **SPEC)
    assert m["spec_decode_num_drafts"] >= N_REQ and m["spec_decode_num_accepted_tokens"] > 0, m
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p > 1e-3, f"penalised speculative sampling deviates from the target (p={p:.2e})"


def test_verifying_against_the_unpenalised_rows_fails(tiny_sampler, case, monkeypatch):
    path, llm, _ = tiny_sampler
    params, exact = case
    monkeypatch.setattr(tentative, "target_logits", lambda logits, controls, paths=None: logits)
    counts, _ = counts_of(llm, params, "speculative", draft_model=path, **SPEC)
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p < 1e-4, f"the chi-square test missed verification against the unpenalised rows (p={p:.2e})"
