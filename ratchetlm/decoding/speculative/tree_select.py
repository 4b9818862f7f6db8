"""Shape a draft tree by expected gain: best-first over scored candidate nodes, cut where the cost
curve says one more node no longer pays. Shared by the training-free tree proposers (recycling,
suffix and their hybrid, tree_proposers.py).

A *source* proposes, for a node of the tree being built, its candidate children (token, a
calibration key, the source's state at the child). Children proposed by several sources merge into
one node. A child's *edge probability* — the chance the target's next token is that child, given
its parent was accepted — is read from :class:`Calibration`: strategy-wide acceptance counts per
key (a successor table's rank; a suffix match's length and continuation frequency), judged after
the fact from the committed tokens. With siblings mutually exclusive, the expected number of draft
tokens a tree gets accepted is the sum over its nodes of their path probabilities (the product of
the edge probabilities from the root), so with nodes taken best-first by path probability (a
child's never exceeds its parent's: every prefix of the order is a tree) the tree of ``n`` nodes
is worth::

    value(n) = (1 + Σ_{first n} p_path) / (share + k·E(n) + g),   value(0) = (1 + margin) / share
    E(n) = C(B + e + n + 1) − C(B + e) + n·r·L

— the gain schedule's rule (gain.py) with the chain's ``P(≥ j)`` replaced by node path
probabilities: ``C`` the measured cost curve, ``share = C(B)/B + f·L`` (``f``, ``r``: the curve's
per-cached-token terms, ``L`` the sequence's cached tokens), ``e`` the rows earlier sequences
of the step drafted. The tree is the ``n`` maximising it (0: a plain step). ``E(n)`` is the curve's
price of the tree; ``k`` and ``g`` (a :class:`Price`: factor and fixed part) what a tree step's rows
really cost against it, learnt per batch size from the steps' own times (draft_price.py; starting
from ``TREE_PRICE`` in tree_proposers.py: the curve times bare forwards with no context, mask,
staging or per-row top-k, and a tree step measured ~1.6x the curve's extra cost); ``margin`` (in a
batch, gain.MARGIN) what a draft must beat a plain step by where its price is an estimate.

Judging: every candidate child of every node the tree *selected* (drafted or not) is scored once the
committed tokens pass it — hit if it is the committed token — walking down the committed path while
it stays inside the tree. No exploration is needed for the children of accepted nodes, and drafts
depend only on committed tokens and earlier forwards, so sampling stays exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ratchetlm.decoding.speculative.cost_curve import CostCurve
from ratchetlm.decoding.speculative.draft_price import Price
from ratchetlm.decoding.speculative.verify import DraftTree

CURVE = Price()  # the curve's price as it is
PRIOR = 2.0  # pseudo-observations of a key's source-wide rate in the key's own estimate


class DraftSource(Protocol):
    def expand(self, state: Any, token: int) -> list[tuple[int, Hashable, Any]]:
        """Children of a node whose token is ``token`` (``state``: this source's state there, never
        None): (child token, calibration key, state at the child or None when the source cannot
        expand the child further)."""


@dataclass
class Calibration:
    """Acceptance counts per key and per source (``key[0]``). A key's estimate starts from
    ``prior(key)`` when given (a source's guess, e.g. longer suffix matches are likelier right),
    else from its source's rate (itself from Beta(1, 2)), worth ``PRIOR`` observations."""

    hits: dict[Hashable, float] = field(default_factory=dict)
    tries: dict[Hashable, float] = field(default_factory=dict)
    prior: Callable[[tuple], float | None] | None = None

    def add(self, key: tuple, hit: bool) -> None:
        for k in (key, key[:1]):
            self.tries[k] = self.tries.get(k, 0.0) + 1.0
            self.hits[k] = self.hits.get(k, 0.0) + hit

    def p(self, key: tuple) -> float:
        guess = self.prior(key) if self.prior is not None else None
        if guess is None:
            src = key[:1]
            guess = (self.hits.get(src, 0.0) + 1.0) / (self.tries.get(src, 0.0) + 3.0)
        return (self.hits.get(key, 0.0) + PRIOR * guess) / (self.tries.get(key, 0.0) + PRIOR)


@dataclass(slots=True)
class Node:
    token: int
    parent: int  # index in the selected list, -1 = the root
    depth: int  # 0 for the root's children
    p: float  # path probability
    keys: list[tuple]  # calibration keys of the sources that proposed it
    states: dict[int, Any]  # source index -> its state at this node
    kids: list[tuple[int, list[tuple]]] = field(default_factory=list)  # candidate children: (token, keys)


@dataclass
class Plan:
    """A step's tree for one sequence, kept until the committed tokens judge it."""

    start: int  # len(seq.token_ids) when proposed: the first committed token after the root
    root_kids: list[tuple[int, list[tuple]]]
    nodes: list[Node]
    extra: float = 0.0  # the curve's price of ``nodes`` (E(n), unscaled; 0 for no tree)


def _children(sources: list[DraftSource], states: dict[int, Any], token: int, calib: Calibration,
              memo: dict[Hashable, float] | None = None) -> list[tuple[int, float, list[tuple], dict[int, Any]]]:
    """Merged candidate children: (token, edge probability = the most confident source's, keys, states).
    ``memo``: ``calib.p`` of the keys already read while the calibration stays unchanged (one tree's
    build: the table's ranks recur at every node it expands)."""
    merged: dict[int, list[Any]] = {}  # token -> [edge probability, keys, states] (made once per child)
    for i, st in states.items():
        for tok, key, child in sources[i].expand(st, token):
            q = None if memo is None else memo.get(key)
            if q is None:
                q = calib.p(key)  # type: ignore[arg-type]
                if memo is not None:
                    memo[key] = q
            m = merged.get(tok)
            if m is None:
                merged[tok] = [q if q > 0.0 else 0.0, [key], {} if child is None else {i: child}]
            else:
                m[1].append(key)
                if child is not None:
                    m[2][i] = child
                if q > m[0]:
                    m[0] = q
    return [(t, p, k, s) for t, (p, k, s) in merged.items()]


class CostTable:
    """The cost curve at 0..R rows as a list of floats (grown on demand; row 0 read as 1)."""

    def __init__(self, cost: CostCurve) -> None:
        self.cost, self.c = cost, [1.0]

    def __call__(self, rows: int) -> list[float]:
        if len(self.c) <= rows:
            self.c = [float(self.cost(max(r, 1))) for r in range(2 * rows + 1)]
        return self.c


def build(sources: list[DraftSource], roots: dict[int, Any], root_token: int, calib: Calibration, costs: CostTable,
          max_nodes: int, max_depth: int, batch: int, drafted: int, gain: bool, start: int,
          context: int = 0, price: Price = CURVE, margin: float = 0.0) -> Plan:
    """Best-first tree from the root (``roots``: each source's state at the root; sources without a
    state there propose nothing). ``gain``: cut at the best value; else keep ``max_nodes`` nodes
    (a static size). ``context``: the sequence's cached tokens (every verified row reads them);
    ``price``: a tree's real cost against the curve's price ``E(n)``, ``factor·E(n) + fixed``;
    ``margin``: what a tree must beat a plain step's value by. The plan's ``extra`` is ``E(n)`` of
    the tree kept (the curve's price, unscaled: what the measured price is fitted against)."""
    memo: dict[Hashable, float] = {}  # nothing judges the calibration during a build
    root_kids = _children(sources, roots, root_token, calib, memo)
    heap: list[tuple[float, int, int, int, list[tuple], dict[int, Any]]] = []  # (-p, order, token, parent, ...)
    order = 0
    for tok, p, keys, sts in root_kids:
        heapq.heappush(heap, (-p, order, tok, -1, keys, sts))
        order += 1
    c = costs(batch + drafted + max_nodes + 2)
    curve = costs.cost
    share = c[batch] / batch + curve.first_token * context
    base = batch + drafted
    # extra[base + n + 1] = E(n): the curve's price of n nodes (and the root's staging row), each node's
    # row also reading the context; cost[...] the same at its real price
    # (lists, not arrays: the same float operations, without numpy's per-call cost, ~5 us a call, every step)
    # (only indices base + 1 .. base + max_nodes + 1 are read: the ones below stay 0)
    reads = curve.row_token * context
    cb, hi = c[base], base + max_nodes + 2
    extra = [0.0] * (base + 1) + [c[r] - cb + reads * (r - base - 1) for r in range(base + 1, hi)]
    fac, fix = price.factor, price.fixed
    cost = [0.0] * (base + 1) + [fac * e + fix for e in extra[base + 1:]]  # a list's item costs ~50x less
    nodes: list[Node] = []
    expected, best, best_n = 1.0, (1.0 + margin) / share, 0
    while heap and len(nodes) < max_nodes:
        negp, _, tok, parent, keys, sts = heapq.heappop(heap)
        depth = 0 if parent < 0 else nodes[parent].depth + 1
        node = Node(tok, parent, depth, -negp, keys, sts)
        nodes.append(node)
        expected += node.p
        value = expected / (share + cost[base + len(nodes) + 1])
        if value > best or not gain:
            best, best_n = value, len(nodes)
        if gain and not _may_improve(expected, node.p, len(nodes), max_nodes, cost, base, share, best):
            break  # no later node (none is likelier than this one) can lift the value above the best
        if depth + 1 < max_depth and sts:
            kids = _children(sources, sts, tok, calib, memo)
            node.kids = [(t, k) for t, _, k, _ in kids]
            for t, p, k, s in kids:
                heapq.heappush(heap, (-node.p * p, order, t, len(nodes) - 1, k, s))
                order += 1
    return Plan(start, [(t, k) for t, _, k, _ in root_kids], nodes[:best_n],
                float(extra[base + best_n + 1]) if best_n else 0.0)


def _may_improve(expected: float, p: float, n: int, max_nodes: int, cost: list[float], base: int, share: float,
                 best: float) -> bool:
    """Whether some tree of ``n + k`` nodes could beat ``best``, every further node at most ``p``
    (``cost[base + m + 1]``: the price of ``m`` nodes). A loop over a dozen floats: the same IEEE
    operations as the array form, at a fifth of its ~10 us."""
    for k in range(1, max_nodes - n + 1):  # (a loop, not any() of a generator: ~2x quicker)
        if (expected + p * k) / (share + cost[base + n + k + 1]) > best:
            return True
    return False


def judge(plan: Plan, token_ids: list[int], calib: Calibration) -> bool:
    """Score the plan's candidate children against the committed tokens; False while the tokens
    that decide it are not all committed yet (keep the plan)."""
    kids, at, j = plan.root_kids, -1, 0
    while kids:
        if plan.start + j >= len(token_ids):
            return j > 0  # nothing committed after the root yet: undecided
        nxt = token_ids[plan.start + j]
        for tok, keys in kids:
            for key in keys:
                calib.add(key, tok == nxt)
        step = next((i for i, n in enumerate(plan.nodes) if n.parent == at and n.token == nxt), None)
        if step is None:  # the committed path left the tree
            return True
        at, kids, j = step, plan.nodes[step].kids, j + 1
    return True


def to_beam(nodes: list[Node]) -> torch.Tensor:  # [M, C] int64, PAD = -1 after a candidate's end
    """The tree as candidates, one per leaf (its root-to-leaf path), for ``trees_from_beams``."""
    has_kid = [False] * len(nodes)
    for n in nodes:
        if n.parent >= 0:
            has_kid[n.parent] = True
    leaves = [i for i in range(len(nodes)) if not has_kid[i]]
    width = 1 + max(nodes[i].depth for i in leaves)
    rows = []
    for i in leaves:  # (lists, then one tensor: a tensor write per entry cost ~2 us each)
        row = [-1] * width
        while i >= 0:
            row[nodes[i].depth] = nodes[i].token
            i = nodes[i].parent
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


def to_tree(nodes: list[Node]) -> DraftTree:
    """The selected nodes as the verify forward's tree, in selection order (best first: parents
    before children, every prefix a tree)."""
    return DraftTree([n.token for n in nodes], [n.parent for n in nodes], [n.depth for n in nodes])
