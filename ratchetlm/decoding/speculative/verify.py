"""Tree verification: which root-to-node path of a draft tree the target accepts, plus one more token.

Row 0 of the target's outputs belongs to the root (the last committed token, whose logits
predict the first draft token); row ``1 + n`` belongs to tree node ``n`` and predicts its
children. Siblings always carry distinct tokens (the tree is a deduplicated prefix tree).

* Greedy: follow the child whose token equals the target argmax; the first row without such
  a child yields the correction (or, at a leaf, bonus) token. Token-identical to plain greedy.
* Sampling: multi-candidate speculative sampling with deterministic drafts (each child is a
  point-mass proposal). At a node with target distribution ``p`` the children are tried in
  order; child ``x`` is accepted with probability ``p(x)``, otherwise ``p`` becomes the
  residual ``normalise(p with x removed)`` and the next child is tried; if all are rejected
  the token is drawn from the residual. The emitted token is then distributed exactly as
  ``p`` (the rejection factors telescope), so the output equals sampling from the target.
* Seeded sampling (``match_rule``): each level has its own uniform ``u`` (layers/seeded_draw.py:
  a function of the request's seed and the level's position); the target's token at a node is
  ``inverse_cdf(p, u)`` and the child equal to it, if any, is accepted. For point-mass drafts the
  acceptance probabilities are the residual rule's (child ``x`` is reached with probability
  ``p(x)``), each emitted token is drawn from ``p`` exactly, and the output is plain sampling's
  with the same uniforms, whatever the drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ratchetlm.layers.seeded_draw import inverse_cdf


@dataclass(frozen=True)
class DraftTree:
    """One sequence's packed tree (padding already stripped). Nodes are in topological order."""

    tokens: list[int]  # [L] token id per node
    parent: list[int]  # [L] parent node, -1 = child of the root
    depth: list[int]  # [L] 0 for the root's children
    children: list[list[int]] = field(init=False)  # [L + 1] children of the root (index 0) and of node n (1+n)

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parent) == len(self.depth)
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for n, par in enumerate(self.parent):
            assert par < n, "nodes must be in topological order"
            kids[par + 1].append(n)
        object.__setattr__(self, "children", kids)

    def __len__(self) -> int:
        return len(self.tokens)


def prefix_tree(candidates: list[list[int]]) -> DraftTree:
    """Candidate continuations (no padding) as their deduplicated prefix tree, nodes in the order
    ``tree_attention.pack`` gives them (first appearance, candidate-major, depth-minor), so the same
    tree as ``draft_tree.trees_from_beams`` of their padded beam, built in Python: a proposer with a
    few short candidates (n-gram lookup) then skips the beam tensor's round trip through ``pack``."""
    if len(candidates) == 1:  # a chain
        n = len(candidates[0])
        return DraftTree(list(candidates[0]), list(range(-1, n - 1)), list(range(n)))
    tokens: list[int] = []
    parent: list[int] = []
    depth: list[int] = []
    node: dict[tuple[int, int], int] = {}  # (parent node, token) -> node: a prefix is its parent's and its token
    for cand in candidates:
        par = -1
        for d, tok in enumerate(cand):
            k = node.get((par, tok))
            if k is None:
                k = node[(par, tok)] = len(tokens)
                tokens.append(tok)
                parent.append(par)
                depth.append(d)
            par = k
    return DraftTree(tokens, parent, depth)


class RowTokens(Protocol):
    """The target's greedy token of each row, by row index (a list, or rows reduced on demand)."""

    def __getitem__(self, row: int, /) -> int: ...


def greedy_accept(tree: DraftTree, argmax: RowTokens) -> tuple[list[int], int]:
    """``argmax``: [1 + L] target argmax per row (each read once at most, and only on the accepted
    path and the row after it). Returns (accepted node path, next token)."""
    path: list[int] = []
    row = 0
    while True:
        want = argmax[row]
        nxt = next((c for c in tree.children[row] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = nxt + 1


# A node-level rule: (target probs [V] fp64, child tokens, generator — or, for a seeded request, the
# level's uniform) -> (index of the accepted child or None, token to emit when none is accepted or -1).
NodeRule = Callable[[torch.Tensor, list[int], torch.Generator | float | None], tuple[int | None, int]]


def residual_rule(p: torch.Tensor, child_tokens: list[int],
                  gen: torch.Generator | float | None) -> tuple[int | None, int]:
    """The exact rule for deterministic drafts (see module docstring)."""
    assert not isinstance(gen, float), "the residual rule draws from a generator"
    p = p.clone()
    for i, tok in enumerate(child_tokens):
        u = float(torch.rand((), dtype=torch.float64, generator=gen))
        if u < float(p[tok]):  # p(tok) == 0 is never accepted since u >= 0
            return i, tok
        p[tok] = 0.0
        total = float(p.sum())
        if total <= 0.0:  # numerically all mass was on rejected children; cannot happen exactly
            p[tok] = 1.0
            return i, tok
        p /= total
    return None, int(torch.multinomial(p, 1, generator=gen))


def match_rule(p: torch.Tensor, child_tokens: list[int],
               gen: torch.Generator | float | None) -> tuple[int | None, int]:
    """Seeded sampling's rule: the target's own token ``inverse_cdf(p, u)`` (``gen`` is the level's
    uniform ``u``); the child equal to it is accepted, else it is emitted (see module docstring)."""
    assert isinstance(gen, float), "the match rule reads the level's uniform"
    tok = inverse_cdf(p, gen)
    return (child_tokens.index(tok), tok) if tok in child_tokens else (None, tok)


def sample_accept(
    tree: DraftTree,
    probs: torch.Tensor,  # [1 + L, V] target distribution per row (filtered_probs)
    gen: torch.Generator | None,
    rule: NodeRule = residual_rule,
) -> tuple[list[int], int]:
    """Walk the tree with ``rule``. Returns (accepted node path, next token)."""
    probs = probs.double()
    path: list[int] = []
    row = 0
    while True:
        kids = tree.children[row]
        if not kids:  # leaf (or empty tree): bonus token from the target itself
            return path, int(torch.multinomial(probs[row], 1, generator=gen))
        idx, tok = rule(probs[row], [tree.tokens[c] for c in kids], gen)
        if idx is None:
            return path, tok
        path.append(kids[idx])
        row = kids[idx] + 1
