"""Speculative sampling reproduces the target distribution exactly (chi-square), and a wrong
acceptance rule — or a wrong beam-to-row mapping in the tree API — is caught by the same test.

Verification runs what the engine runs: ``draft_tree.sample_verify`` (the seed's candidates +
``unpack_map`` + ``parent_rows``); ``verify.sample_accept`` (the tree walk) is its reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ratchetlm.decoding.speculative import draft_tree
from ratchetlm.decoding.speculative.draft_tree import sample_verify, trees_from_beams
from ratchetlm.decoding.speculative.verify import residual_rule
from ratchetlm.layers.sampler import filtered_probs
from ratchetlm.layers.seeded_draw import inverse_cdf
from ratchetlm.sampling_params import SamplingParams

V = 5
N_OUT = 3  # compare the joint distribution of the first 3 generated tokens (125 cells)
PARAMS = SamplingParams(temperature=0.9, top_k=4, top_p=0.95, max_tokens=N_OUT)


class TinyLM:
    """A fixed random trigram model over a 5-token vocabulary (the target)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.table = torch.randn(V, V, V, generator=g) * 1.5

    def logits(self, ctx: list[int]) -> torch.Tensor:  # [V]
        return self.table[ctx[-2], ctx[-1]]


def drafter_beam(lm: TinyLM, ctx: list[int], depth: int) -> torch.Tensor:
    """Two deterministic candidates: the target's greedy chain and a chain starting from its
    second choice — overlapping prefixes, some good, some bad drafts."""
    out = []
    for first_rank in (0, 1):
        c = list(ctx)
        cand = []
        for k in range(depth):
            order = lm.logits(c).argsort(descending=True)
            t = int(order[first_rank if k == 0 else 0])
            cand.append(t)
            c.append(t)
        out.append(cand)
    return torch.tensor(out)


def step_inputs(lm: TinyLM, ctx: list[int]):
    """(tree, target probs per row) for a context; row 1 + n = context + path to node n."""
    tree = trees_from_beams([drafter_beam(lm, ctx, 2)])[0]
    rows = [lm.logits(ctx)]
    for n in range(len(tree)):
        path, p = [], n
        while p >= 0:
            path.append(tree.tokens[p])
            p = tree.parent[p]
        rows.append(lm.logits(ctx + path[::-1]))
    return tree, filtered_probs(torch.stack(rows), PARAMS).double()


def generate(lm: TinyLM, gen: torch.Generator, rule, memo: dict) -> tuple[int, ...]:
    ctx = [0, 1]
    while len(ctx) - 2 < N_OUT:
        key = (ctx[-2], ctx[-1])  # the trigram target and the drafter only see the last two tokens
        if key not in memo:
            memo[key] = step_inputs(lm, ctx)
        tree, probs = memo[key]
        path, nxt = sample_verify(tree, probs, gen, rule)
        ctx += [tree.tokens[n] for n in path] + [nxt]
    return tuple(ctx[2 : 2 + N_OUT])


def exact_distribution(lm: TinyLM) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=N_OUT):
        ctx, p = [0, 1], 1.0
        for t in seq:
            p *= float(filtered_probs(lm.logits(ctx)[None], PARAMS)[0, t])
            ctx.append(t)
        out[seq] = p
    return out


def chi_square_pvalue(counts: dict, expected_p: dict, n: int) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled; p-value by Wilson–Hilferty.
    A sample the target gives probability 0 makes the p-value 0."""
    if any(cell not in expected_p for cell in counts):
        return 0.0
    stat, dof, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for cell, p in expected_p.items():
        e = n * p
        o = counts.get(cell, 0)
        if p == 0.0:
            if o:
                return 0.0
            continue
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        dof += 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def wrong_full_resample(p, child_tokens, gen):
    """A classic bug: after rejecting drafts, resample from the full target instead of the residual.
    A seeded request's verify passes its level's uniform ``u`` (match_rule's input) instead of a
    generator: the same bug then tests each child against a second uniform derived from ``u`` and,
    all rejected, emits the full target's token ``inverse_cdf(p, u)``."""
    if isinstance(gen, float):
        v = (gen * 7919.0) % 1.0  # ~independent of u (the low digits of a 53-bit uniform)
        for i, tok in enumerate(child_tokens):
            if v < float(p[tok]):
                return i, tok
        return None, inverse_cdf(p, gen)
    for i, tok in enumerate(child_tokens):
        if float(torch.rand((), dtype=torch.float64, generator=gen)) < float(p[tok]):
            return i, tok
    return None, int(torch.multinomial(p, 1, generator=gen))


def wrong_no_renormalise(p, child_tokens, gen):
    """Another bug: test every child against the original p (no residual update between siblings)."""
    p = p.clone()
    for i, tok in enumerate(child_tokens):
        if float(torch.rand((), dtype=torch.float64, generator=gen)) < float(p[tok]):
            return i, tok
    for tok in child_tokens:
        p[tok] = 0.0
    if float(p.sum()) == 0.0:
        return 0, child_tokens[0]
    return None, int(torch.multinomial(p / p.sum(), 1, generator=gen))


N_SAMPLES = 6000  # the law itself: the smallest deviation a chi-square detects shrinks as 1/sqrt(n)
# The planted bugs only have to show that the test catches them; a test that catches one in fewer samples
# catches it in more. At 1000 samples (seeds 7-11) each scores p < 1e-49 (wrong_no_renormalise's worst),
# wrong_full_resample < 1e-53, the wrong beam-to-row mapping 0 (it samples cells the target never does):
# far below 1e-6 at 1500.
N_MUTANT = 1500


def _counts(rule, seed: int, n: int = N_SAMPLES) -> dict:
    lm = TinyLM()
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}
    memo: dict = {}
    for _ in range(n):
        s = generate(lm, gen, rule, memo)
        counts[s] = counts.get(s, 0) + 1
    return counts


def test_speculative_sampling_matches_target_distribution():
    lm = TinyLM()
    pval = chi_square_pvalue(_counts(residual_rule, seed=7), exact_distribution(lm), N_SAMPLES)
    assert pval > 1e-3, f"speculative sampling deviates from the target (p={pval:.2e})"


@pytest.mark.parametrize("rule", [wrong_full_resample, wrong_no_renormalise])
def test_wrong_rule_is_detected(rule):
    lm = TinyLM()
    pval = chi_square_pvalue(_counts(rule, seed=7, n=N_MUTANT), exact_distribution(lm), N_MUTANT)
    assert pval < 1e-6, f"the chi-square test failed to catch {rule.__name__} (p={pval:.2e})"


def own_rows(unpack_map: torch.Tensor) -> torch.Tensor:
    """A wrong beam-to-row mapping: each entry judged on its own node's row (one level too deep)."""
    return torch.where(unpack_map >= 0, unpack_map + 1, unpack_map)


def test_a_wrong_beam_to_row_mapping_is_detected(monkeypatch):
    monkeypatch.setattr(draft_tree, "parent_rows", own_rows)
    lm = TinyLM()
    pval = chi_square_pvalue(_counts(residual_rule, seed=7, n=N_MUTANT), exact_distribution(lm), N_MUTANT)
    assert pval < 1e-6, f"the chi-square test missed a wrong beam-to-row mapping (p={pval:.2e})"


def test_seeded_sampling_is_reproducible():
    lm = TinyLM()
    ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = [generate(lm, ga, residual_rule, {}) for _ in range(5)]
    b = [generate(lm, gb, residual_rule, {}) for _ in range(5)]
    assert a == b
