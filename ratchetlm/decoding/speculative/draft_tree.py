"""A step's draft trees: every sequence's beam packed in one ``pack`` call, cut to what one verify
forward carries (chunks, token budget), continued within the step (SCV), and turned back into
candidates for the seed's verified-beam check.

Trees are :class:`~ratchetlm.decoding.speculative.verify.DraftTree` (nodes in topological order,
parent -1 = a child of the root). Every cut keeps a subset of nodes closed under ancestors, in the
same order, so the result is again a valid tree.
"""

from __future__ import annotations

import torch

from ratchetlm.decoding.speculative.proposers import PAD
from ratchetlm.decoding.speculative.tree_attention import pack, parent_rows
from ratchetlm.decoding.speculative.verify import (
    DraftTree,
    NodeRule,
    greedy_accept,
    match_rule,
    prefix_tree,
    residual_rule,
)
from ratchetlm.layers.sampler import argmax
from ratchetlm.layers.seeded_draw import inverse_cdf


def trees_from_beams(beams: list[torch.Tensor]) -> list[DraftTree]:  # beams[i]: [M_i, C_i] with PAD
    """All sequences' beams in one :func:`pack` over ``[B, max M, max C]`` (PAD-filled), each row's
    real, non-PAD nodes as a tree (parents read off ``unpack_map``: the entry before a node in any
    candidate holding it). A step of chains alone (one candidate each) is read off directly: ``pack``
    of a single candidate is its tokens in order, each the child of the one before."""
    m, c = max(bm.shape[0] for bm in beams), max(bm.shape[1] for bm in beams)
    if m == 1:
        return [prefix_tree([[t for t in bm[0].tolist() if t != PAD]]) for bm in beams]
    batch = torch.stack([torch.nn.functional.pad(bm, (0, c - bm.shape[1], 0, m - bm.shape[0]), value=PAD)
                         for bm in beams])  # [B, M, C]
    packed = pack(batch)
    tokens, depth = packed.tokens.tolist(), packed.position_offsets.tolist()
    out = []
    for i, umap in enumerate(packed.unpack_map.tolist()):
        if m == 1:  # a chain
            n, parent = c, list(range(-1, c - 1))
        else:
            n = 1 + max(max(row) for row in umap)
            parent = [-1] * n
            for row in umap:
                for k in range(1, c):
                    parent[row[k]] = row[k - 1]
        # PAD nodes (short candidates, padding rows) only ever have PAD descendants: drop them all
        keep = [j for j in range(n) if tokens[i][j] != PAD]
        tree = DraftTree(tokens[i][:n], parent, depth[i][:n]) if len(keep) == n else None
        out.append(tree or restrict(DraftTree(tokens[i][:n], parent, depth[i][:n]), keep))
    return out


def restrict(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes ``keep`` (ascending, closed under ancestors) as a tree of their own."""
    new = {old: j for j, old in enumerate(keep)}
    return DraftTree([tree.tokens[k] for k in keep], [new[tree.parent[k]] if tree.parent[k] >= 0 else -1 for k in keep],
                     [tree.depth[k] for k in keep])


def cut(tree: DraftTree, chunk: int, max_nodes: int) -> list[int]:
    """Nodes one verify forward carries: the first ``chunk`` levels (0 = all), then the first
    ``max_nodes`` of those in topological order (the step's token budget)."""
    keep = [k for k, d in enumerate(tree.depth) if not chunk or d < chunk]
    return keep[:max_nodes]


def continuation(tree: DraftTree, verified: list[int], last: int, token: int) -> DraftTree | None:
    """SCV: the verifier accepted ``last`` (-1 = the root) and then chose ``token``. If ``token`` is a
    child of ``last`` that this forward did not verify (``verified``: the nodes it carried), the
    draft continues from it: that child becomes the next root, its descendants the next tree."""
    seen = set(verified)
    child = next((k for k in tree.children[last + 1] if tree.tokens[k] == token and k not in seen), None)
    if child is None:
        return None
    inside = [False] * len(tree)
    for k in range(child + 1, len(tree)):
        p = tree.parent[k]
        inside[k] = p == child or (p >= 0 and inside[p])
    keep = [k for k in range(len(tree)) if inside[k]]
    new = {old: j for j, old in enumerate(keep)}
    base = tree.depth[child] + 1
    return DraftTree([tree.tokens[k] for k in keep], [new.get(tree.parent[k], -1) for k in keep],
                     [tree.depth[k] - base for k in keep])


def candidates(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, C] tokens with PAD, [M, C] nodes, -1)
    """The tree as a beam again: one candidate per leaf (its root-to-leaf path), with the node of
    every entry — the ``(beam, unpack_map)`` pair :func:`tree_attention.unpack_verified` reads."""
    leaves = [k for k in range(len(tree)) if not tree.children[k + 1]]
    width = max(1, max((tree.depth[k] + 1 for k in leaves), default=0))
    beam = [[PAD] * width for _ in range(max(1, len(leaves)))]
    umap = [[-1] * width for _ in beam]
    for i, leaf in enumerate(leaves):  # filled as lists: a tensor's item assignment costs ~us each
        k = leaf
        while k >= 0:
            beam[i][tree.depth[k]], umap[i][tree.depth[k]] = tree.tokens[k], k
            k = tree.parent[k]
    return torch.tensor(beam, dtype=torch.long), torch.tensor(umap, dtype=torch.long)


def greedy_verify(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:  # logits [1 + L, V]
    """Greedy verification: the walk from the root along the children that match the target's greedy
    token (:func:`verify.greedy_accept`), which it reads row by row on the walk only: the rows of
    rejected nodes are never reduced (a 49k-logit row's argmax costs ~10-30 us on one core, and most
    of a draft is rejected at a mean acceptance of 1-2 tokens). The same accepted path and next
    token as reading the seed's verified beam (``tree_attention.unpack_verified``: every candidate
    accepted as far as it agrees, the longest wins; tests/speculative/test_tree_attention.py checks
    the two agree) without building the beam, which cost ~0.5 ms a step at the default depth."""
    return greedy_accept(tree, _RowArgmax(logits))


class _RowArgmax:
    """``logits`` ``[1 + L, V]`` as the list of its rows' argmax, each computed when first read."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __getitem__(self, row: int) -> int:
        return int(argmax(self.logits[row]))


def sample_verify(tree: DraftTree, probs: torch.Tensor, gen: torch.Generator | list[float] | None,
                  rule: NodeRule | None = None) -> tuple[list[int], int]:  # probs [1 + L, V]
    """Sampled verification through the seed's API: the tree as candidates ``(beam, unpack_map)``,
    each beam entry judged on the distribution of its parent's row (:func:`parent_rows`, the
    mapping ``unpack_verified`` reads). Candidate by candidate, the entries at depth ``c`` of the
    candidates still alive are the children of the last accepted node (in node order); ``rule``
    accepts one of them or emits a token of its own. A leaf's bonus token comes from the leaf's
    own row. Returns (accepted node path, next token) — the tree walk :func:`verify.sample_accept`
    draws the same with the same generator.

    ``gen``: a generator (``rule`` defaults to the residual rule), or a seeded request's uniforms,
    one per level (``u[c]`` for the token ``c`` places after the root; ``rule`` defaults to
    ``match_rule`` and a leaf's bonus token is ``inverse_cdf`` of its row with its level's ``u``)."""
    beam, umap = candidates(tree)  # [M, C] each
    rows = parent_rows(umap[None])[0].tolist()  # [M][C]
    toks, nodes = beam.tolist(), umap.tolist()
    probs = probs.double()
    draws = gen if isinstance(gen, list) else None  # seeded: one uniform per level
    shared = gen if not isinstance(gen, list) else None  # else: the generator every level draws from
    if rule is None:
        rule = residual_rule if draws is None else match_rule
    alive = list(range(len(toks)))
    path: list[int] = []
    for c in range(len(toks[0]) + 1):
        kids: dict[int, tuple[int, int]] = {}  # node -> (token, candidate)
        for m in alive:
            if c < len(toks[m]) and nodes[m][c] >= 0:
                kids.setdefault(nodes[m][c], (toks[m][c], m))
        level: torch.Generator | float | None = draws[c] if draws is not None else shared
        if not kids:  # a leaf (or an empty tree): the target's own token from the last accepted row
            last = probs[1 + path[-1] if path else 0]
            if isinstance(level, float):
                return path, inverse_cdf(last, level)
            return path, int(torch.multinomial(last, 1, generator=level))
        order = sorted(kids)
        row = rows[kids[order[0]][1]][c]  # every alive candidate has the same parent here
        idx, tok = rule(probs[row], [kids[k][0] for k in order], level)
        if idx is None:
            return path, tok
        path.append(order[idx])
        alive = [m for m in alive if c < len(toks[m]) and nodes[m][c] == order[idx]]
    raise AssertionError("unreachable: a candidate ends at its leaf")
