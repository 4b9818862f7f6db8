"""Seeded verification (``match_rule`` with one uniform per level) emits plain sampling's tokens: on a
chain whose rows are the target distributions along plain sampling's own path, a draft is accepted
exactly as far as it agrees with the tokens plain sampling draws with the same uniforms, and the next
token is plain sampling's, whatever the draft (the reference: ``inverse_cdf`` row by row)."""

from __future__ import annotations

import torch

from ratchetlm.decoding.speculative.draft_tree import sample_verify
from ratchetlm.decoding.speculative.verify import DraftTree
from ratchetlm.layers.seeded_draw import inverse_cdf, position_uniforms


def test_seeded_chain_verify_is_plain_sampling_whatever_the_draft():
    g = torch.Generator().manual_seed(0)
    V, L = 7, 4
    for trial in range(200):
        probs = torch.softmax(torch.randn(L + 1, V, generator=g) * 2, -1)  # [1 + L, V] rows along the path
        probs[:, int(torch.randint(0, V, (), generator=g))] = 0.0  # a zero-mass token: never drawn
        u = position_uniforms(trial, 100, L + 1)
        plain = [inverse_cdf(probs[c], u[c]) for c in range(L + 1)]  # plain sampling, token by token
        wrong = int(torch.randint(0, L + 1, (), generator=g))  # first wrong draft (L: none)
        draft = plain[:L]
        if wrong < L:
            draft = draft[:wrong] + [(plain[wrong] + 1 + int(torch.randint(0, V - 1, (), generator=g))) % V] \
                + draft[wrong + 1:]
        tree = DraftTree(draft, list(range(-1, L - 1)), list(range(L)))
        path, nxt = sample_verify(tree, probs, u)
        assert path == list(range(min(wrong, L))) and nxt == plain[len(path)]
        assert float(probs[len(path), nxt]) > 0
