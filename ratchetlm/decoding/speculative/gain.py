"""The ``gain`` depth schedule: draft only as many n-gram tokens as are expected to pay.

A verify forward costs more than a plain one. On a CPU it is compute bound: a forward over ``R``
rows costs ``C(R)`` one-row forwards, where ``C`` is the target's measured cost curve
(cost_curve.py; ``verify_token_cost=c`` fixes it to ``1 + c·(R − 1)``). Drafting ``d`` tokens
adds ``d + 1`` rows' worth to the step (the ``+ 1`` is the staging/commit work of a speculative
step, measured at about one token's worth). A draft pays only when the tokens it is expected to
add outweigh that, and how likely an n-gram continuation is to be right depends strongly on
the length ``m`` of the suffix match it came from (on the default model: a 1-token match's first
token is accepted 4-29% of the time, a 4-token match's 96-100%). So per step and sequence the
schedule drafts the length ``d`` in ``[0, depth]`` maximising committed tokens per unit of cost::

    value(d) = (1 + Σ_{j ≤ d} P(≥ j | m)) / (share + C(B + e + d + 1) − C(B + e) + d·r·L),   value(0) = 1 / share

``P(≥ j | m)`` is the probability that a continuation found with an ``m``-token match agrees
with the output for at least ``j`` tokens; ``share = C(B) / B + f·L`` is one sequence's part of a
plain forward over ``B`` decoding sequences (at batch 1 and no context, ``share = 1``), ``f·L`` its
first row's reading of the sequence's ``L`` cached tokens, ``r·L`` what each further row's attention over them
adds (``f``, ``r``: the curve's per-token terms, cost_curve.py) and ``e`` the rows the
step's earlier sequences already drafted, so the same rule drafts less in big batches, where a
CPU verify is most compute bound.

The estimate is judged after the fact: each step records the continuation the lookup found
(drafted or not, full ``depth``), and once the committed tokens have passed it, how many of its
tokens agreed. It therefore does not depend on which lengths were drafted (no exploration is
needed), and a draft's length depends only on committed tokens, so speculative sampling stays
exact. Counts are kept per sequence and shrunk towards the strategy-wide counts
(``PRIOR_WEIGHT`` pseudo-observations), which start from a uniform ``Beta(1, 1)``.

A trained draft head (eagle.py) uses the same value with its own confidence instead of a
history: ``P(≥ j)`` is the product of the head's top-1 probabilities of its first ``j`` tokens,
and it stops drafting once another token would lower the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ratchetlm.decoding.speculative.cost_curve import CostCurve
from ratchetlm.decoding.speculative.draft_price import DraftPrice, Price

PRIOR_WEIGHT = 2.0  # pseudo-observations of the strategy-wide rate in a sequence's estimate
# In a batch (B > 1) a draft must beat a plain step by this much (expected tokens per unit of cost): its
# price there is an estimate (a draft row at batch 4-8 measured ~2x the curve's price, the measured factor
# of draft_price.py moves by tens of percent between runs on a shared CPU), and a draft that only breaks
# even on paper loses as often as it wins; the drafts it stops are the ones that were worth least. At
# batch 1 a chain costs about its price and the margin only cost speed (Spec-Bench, docs/benchmarks.md).
MARGIN = 0.1


@dataclass
class AgreementCounts:
    """``tries[m, j]``: continuations with an ``m``-token match judged at position ``j`` (their first
    ``j - 1`` tokens agreed); ``hits[m, j]``: of those, the ones whose ``j``-th token agreed too."""

    max_n: int
    depth: int
    # Python lists, not arrays: these are read and added to for every decoding sequence every step, and
    # numpy's per-call cost on rows of 9 was most of the gain rule's time (~40 us a sequence and step)
    tries: list[list[int]] = field(init=False)  # [max_n + 1][depth + 1] (index 0 unused)
    hits: list[list[int]] = field(init=False)  # [max_n + 1][depth + 1]

    def __post_init__(self) -> None:
        self.tries = [[0] * (self.depth + 1) for _ in range(self.max_n + 1)]
        self.hits = [[0] * (self.depth + 1) for _ in range(self.max_n + 1)]

    def add(self, m: int, length: int, agreed: int) -> None:
        """One judged continuation of ``length`` tokens whose first ``agreed`` tokens agreed."""
        upto = min(agreed + 1, length)  # positions 1..upto were judged; only the last may have failed
        tries, hits = self.tries[m], self.hits[m]
        for j in range(1, upto + 1):
            tries[j] += 1
        for j in range(1, min(agreed, length) + 1):
            hits[j] += 1


@dataclass
class PendingContinuation:
    start: int  # index in the sequence's tokens of the continuation's first token
    m: int  # suffix match length it came from
    tokens: list[int]  # [<= depth]


@dataclass
class SequenceRecord:
    """Per sequence (``seq.strategy_state``): its own counts and continuations not yet judged."""

    counts: AgreementCounts
    pending: list[PendingContinuation] = field(default_factory=list)


def agreed_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class GainSchedule:
    """``price``: the measured price factor of draft rows per batch size (draft_price.py), None = the
    curve's price as is (a fixed ``verify_token_cost``)."""

    def __init__(self, max_n: int, depth: int, verify_token_cost: float | CostCurve,
                 price: DraftPrice | None = None) -> None:
        self.max_n, self.depth = max_n, depth
        self.cost = verify_token_cost if isinstance(verify_token_cost, CostCurve) else CostCurve.linear(
            verify_token_cost)
        self.price = price
        self.totals = AgreementCounts(max_n, depth)  # strategy-wide, the prior of every sequence
        self._c: list[float] = [1.0]  # self.cost(r) at r = 0..R (r = 0 read as 1; grown on demand; Python floats
        # index faster than a numpy array in length()'s per-sequence loop)
        self.last_extra = 0.0  # the curve's price of the last length() choice (unscaled; 0 for no draft)

    def new_record(self) -> SequenceRecord:
        return SequenceRecord(AgreementCounts(self.max_n, self.depth))

    def judge(self, rec: SequenceRecord, token_ids: list[int]) -> None:
        """Score the pending continuations the committed ``token_ids`` have decided."""
        keep = []
        for p in rec.pending:
            seen = token_ids[p.start : p.start + len(p.tokens)]
            agreed = agreed_prefix(p.tokens, seen)
            if agreed < len(seen) or len(seen) == len(p.tokens):  # a mismatch, or every token agreed
                rec.counts.add(p.m, len(p.tokens), agreed)
                self.totals.add(p.m, len(p.tokens), agreed)
            else:
                keep.append(p)
        rec.pending = keep

    def agreement(self, rec: SequenceRecord, m: int, upto: int | None = None) -> list[float]:
        """``[upto]`` (default ``depth``) ``P(>= j | m)``, j = 1..upto: the per-position agreement
        (the strategy-wide rate, ``Beta(1, 1)`` prior, shrinking the sequence's own), multiplied up."""
        gh, gt = self.totals.hits[m], self.totals.tries[m]
        sh, st = rec.counts.hits[m], rec.counts.tries[m]
        out: list[float] = []
        prod = 1.0
        for j in range(1, (self.depth if upto is None else min(upto, self.depth)) + 1):
            glob = (gh[j] + 1.0) / (gt[j] + 2.0)
            prod = prod * ((sh[j] + PRIOR_WEIGHT * glob) / (st[j] + PRIOR_WEIGHT))
            out.append(prod)
        return out

    def length(self, rec: SequenceRecord, m: int, max_depth: int, batch: int, drafted: int = 0,
               context: int = 0) -> int:
        """The draft length in ``[0, max_depth]`` with the most expected tokens per unit of cost
        (``drafted``: rows the step's earlier sequences already drafted; ``context``: the sequence's
        cached tokens, which every verified row reads). A draft's price is the curve's times the
        measured factor at this batch size (``price``)."""
        p = self.agreement(rec, m, max_depth)
        base = batch + drafted
        c = self.costs(base + max_depth + 1)
        share = c[batch] / batch + self.cost.first_token * context
        # (batch 1: the curve's price; a chain there costs about it, and the fit's noise only cut drafts)
        price = Price() if self.price is None or batch == 1 else self.price.price(batch)
        reads = self.cost.row_token * context  # each draft row's attention over the context
        # draft_value for every length (the same float operations, in plain Python: this runs for every
        # decoding sequence every step, and numpy's per-call cost on 8-element arrays was ~0.1 ms)
        margin = MARGIN if batch > 1 else 0.0
        best, best_value, best_extra = 0, (1.0 + margin) / share, 0.0
        agreed = 0.0
        for d in range(1, max_depth + 1):
            agreed += p[d - 1]
            extra = c[base + d + 1] - c[base] + reads * d
            value = (1.0 + agreed) / (share + (price.factor * extra + price.fixed))
            if value > best_value:  # ties go to the shorter draft
                best, best_value, best_extra = d, value, extra
        self.last_extra = best_extra
        return best

    def plain_cost(self, batch: int, context: int) -> float:
        """The curve's cost of a plain step over ``batch`` decoding sequences holding ``context`` cached
        tokens in all (one-row forwards): what a step costs with no draft."""
        return self.costs(batch)[batch] + self.cost.first_token * context

    def costs(self, rows: int) -> list[float]:  # [>= rows + 1] the cost curve at 0..rows rows (0: as 1)
        if len(self._c) <= rows:
            self._c = [float(self.cost(max(r, 1))) for r in range(2 * rows + 1)]
        return self._c


def draft_value(expected_tokens: float, draft_len: int, cost: CostCurve | float, batch: int,
                drafted: int = 0, context: int = 0, drafting: float = 0.0) -> float:
    """Expected committed tokens per unit of forward cost for one of ``batch`` decoding sequences
    that drafts ``draft_len`` tokens (0 = a plain step) after the step's other sequences drafted
    ``drafted`` rows; ``cost``: the cost curve (a number: ``verify_token_cost``, the linear one);
    ``context``: the sequence's cached tokens (each of its rows reads them); ``drafting``: what
    making the draft cost (a draft head's forwards), in one-row target forwards."""
    c = cost if isinstance(cost, CostCurve) else CostCurve.linear(cost)
    share = c(batch) / batch + c.first_token * context  # this sequence's part of a plain forward
    if not draft_len:
        return expected_tokens / share
    base = batch + drafted
    return expected_tokens / (share + c(base + draft_len + 1) - c(base) + c.row_token * context * draft_len
                              + drafting)
