"""What drafts really cost, and whether proposing pays at all, learnt from the steps themselves.

The gain rule (gain.py) prices a draft by the cost curve (cost_curve.py): bare forwards of one sequence
timed at start-up, fastest of a few runs. A real speculative step also builds and verifies the draft
in Python, stages and commits its K/V, and runs its rows beside the batch's other sequences. Measured on
Spec-Bench at batch 8 (default model, int8, one core, thread CPU time, engines in lockstep, 2026-11-29,
docs/benchmarks.md, "Spec-Bench at batch 8 and the prefill-bound groups"): a drafting step cost ~1.4x
a plain one at batch 2-5, 1.5-2.5 ms of it outside the forward (Python, staging), and a draft row at
batch 4-8 about as much as a whole sequence's row, about twice the curve's price; priced at the curve,
n-gram drafts made the decode phase 0.955x plain decoding.

**Price** (:class:`DraftPrice`). The strategy times every step that decodes only (propose → forward →
commit; the engine thread's CPU time with one torch thread on a CPU, else wall time) and hands the
proposer the step's time and committed tokens; the proposer adds its predicted plain cost ``P``
(``C(B) + f·ΣL``, one-row forwards), the curve's price ``E`` of its drafts and how many sequences
drafted, ``n``. Per batch size, least squares through the steps' ``y = t / P`` against ``x = E / P``
and ``z = n / P`` gives ``y = α + β·x + γ·z``: ``α`` the time of a unit of plain work, ``β`` of a unit
of the curve's draft price, ``γ`` the fixed time of a drafting sequence. The rule then prices a draft
``factor·E + fixed`` with ``factor = β / α`` and ``fixed = γ / α``. Older steps weigh less (``FORGET``),
``α`` is held near the time of plain work pooled over every batch size (``PRIOR_PLAIN`` steps' worth:
at a batch size whose steps nearly all draft it cannot be told apart from the drafts' own time), and a
ridge term (``PRIOR``) pulls the factor to 1 and the fixed part to 0 (the curve as measured) until
drafting steps say otherwise; both are kept within bounds.

**Ledger** (:class:`DraftLedger`). Both the price and the acceptance estimates err, and every proposing
step pays for its lookups whether it drafts or not; so per batch size the proposer also compares the
measured rate of steps in which it proposed with that of plain steps, and stops proposing where it
lost (see the class). This is what makes a batch of eight at worst plain decoding's speed on a CPU
where, at that batch, a draft row costs about what a sequence's token does.

**Who uses them.** ``ngram`` (gain.py) and the tree proposers (tree_proposers.py, tree_select.py), each
through :class:`MeasuredDrafts`. ``ngram`` prices at batch 1 by the curve (a chain there costs about its
price, and the fit's noise only cut drafts); a tree step at batch 1 measured ~1.6x the curve's price of
its rows, so the trees take the fit at every batch size, starting from and pulled towards that factor
(``DraftPrice.prior``) rather than the curve's 1.

Only speed depends on either: they change how many tokens are drafted, never which are accepted, so
greedy output is unchanged (tested), and so is seeded sampling's: a seeded request's token ``n`` is
drawn with a uniform keyed by ``(seed, n)`` and a draft is accepted exactly when it is that token
(layers/seeded_draw.py), so its draws do not depend on how many tokens were drafted. Unseeded requests
share the engine's generator and need not repeat across runs (a fixed ``verify_token_cost`` turns both
measurements off, and tests pin one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

FORGET = 0.98  # weight of a step against the next one of the same batch size (~50 steps' memory)
PLAIN_FORGET = 0.99  # the same for the plain steps of every batch size (the pooled time of plain work)
PRIOR_PLAIN = 20.0  # the pull of a batch size's α towards the pooled one, in steps
PRIOR = 4.0  # the pull towards the curve's price (β = α, γ = 0), in steps with a typical draft (PRIOR_X, PRIOR_Z)
PRIOR_X = 0.1  # a typical draft's curve price against the step's plain cost
PRIOR_Z = 0.5  # a typical drafting sequence count against the step's plain cost
LOW, HIGH = 0.5, 8.0  # bounds of the factor
HIGH_FIXED = 2.0  # bound of the fixed price of a drafting sequence (one-row forwards)


@dataclass(frozen=True)
class Price:
    """A draft of the curve's price ``e`` costs ``factor · e + fixed`` one-row forwards."""

    factor: float = 1.0
    fixed: float = 0.0


def solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """``x`` with ``a·x = b`` for a 3x3 ``a`` (Gaussian elimination with partial pivoting, numpy's LU
    to rounding), None where ``a`` is singular. In Python: :meth:`_Fit.price` runs every step (the
    tree proposers price at every batch size), and ``np.linalg.solve`` with its arrays cost ~50 us there."""
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for k in range(3):
        p = max(range(k, 3), key=lambda i: abs(m[i][k]))
        if m[p][k] == 0.0:
            return None
        m[k], m[p] = m[p], m[k]
        inv = 1.0 / m[k][k]
        for i in range(k + 1, 3):
            lik = m[i][k] * inv
            for j in range(k + 1, 4):
                m[i][j] -= lik * m[k][j]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (m[i][3] - sum(m[i][j] * x[j] for j in range(i + 1, 3))) / m[i][i]
    return x[0], x[1], x[2]


class _Fit:
    """Decayed sums of one batch size's steps for ``y = α + β·x + γ·z`` (y = t / P, x = E / P, z = n / P):
    ``vv`` = Σ v·vᵀ and ``vy`` = Σ v·y over v = (1, x, z). Kept as Python floats (the same float64
    operations numpy's ``outer`` and adds did): :meth:`add` runs every step, and numpy's per-call cost
    made it ~50 us a step on one core."""

    def __init__(self) -> None:
        self.vv = [[0.0] * 3 for _ in range(3)]
        self.vy = [0.0] * 3

    def add(self, x: float, z: float, y: float) -> None:
        v = (1.0, x, z)
        self.vv = [[FORGET * row[j] + v[i] * v[j] for j in range(3)] for i, row in enumerate(self.vv)]
        self.vy = [FORGET * self.vy[i] + v[i] * y for i in range(3)]

    def price(self, plain: float | None, prior: float = 1.0) -> Price:
        """Least squares plus ``ρa·(α − plain)² + ρx·(β − prior·α)² + ρz·γ²``: α held near ``plain`` (the
        pooled time of a unit of plain work; None: not yet measured) by PRIOR_PLAIN steps, so that a batch
        size whose steps nearly all draft still separates their price from plain work; ``β / α`` and
        ``γ / α``, the factor and the fixed price, are ``prior`` and 0 until the steps say otherwise (PRIOR
        steps' worth)."""
        rx, rz = PRIOR * PRIOR_X**2, PRIOR * PRIOR_Z**2
        f = prior
        ridge = [[rx * f * f, -rx * f, 0.0], [-rx * f, rx, 0.0], [0.0, 0.0, rz]]
        a = [[v + r for v, r in zip(row, rrow, strict=True)] for row, rrow in zip(self.vv, ridge, strict=True)]
        b = list(self.vy)
        if plain is not None:
            a[0][0] += PRIOR_PLAIN
            b[0] += PRIOR_PLAIN * plain
        x = solve3(a, b)
        if x is None:  # no step yet
            return Price(prior)
        alpha, beta, gamma = x
        if alpha <= 0.0:
            return Price(HIGH, HIGH_FIXED)
        return Price(float(min(max(beta / alpha, LOW), HIGH)), float(min(max(gamma / alpha, 0.0), HIGH_FIXED)))


def step_clock(device: torch.device | str = "cpu") -> Callable[[], float]:
    """The engine thread's CPU time with one torch thread on a CPU (a shared machine's neighbours then
    do not count, and the forward runs on this thread); wall time otherwise (more threads, a GPU)."""
    return time.thread_time if torch.get_num_threads() == 1 and torch.device(device).type == "cpu" \
        else time.perf_counter


@dataclass
class DraftPrice:
    """Per batch size, the measured price of drafts (see the module doc). ``prior``: the factor a batch
    size's price starts from and is pulled towards (1: the curve's price; the tree proposers start from
    what their steps measured, tree_proposers.TREE_PRICE)."""

    prior: float = 1.0
    fits: dict[int, _Fit] = field(default_factory=dict)
    plain_w: float = 0.0  # decayed count and sum of y over plain steps of every batch size
    plain_y: float = 0.0
    _cache: dict[int, Price] = field(default_factory=dict)  # batch size -> its price (until the next step)

    def price(self, batch: int) -> Price:
        p = self._cache.get(batch)
        if p is None:
            fit = self.fits.get(batch)
            plain = self.plain_y / self.plain_w if self.plain_w > 0.0 else None
            p = self._cache[batch] = Price(self.prior) if fit is None else fit.price(plain, self.prior)
        return p

    def observe(self, batch: int, plain: float, extra: float, drafting: int, seconds: float) -> None:
        """A decode-only step of ``batch`` sequences: its predicted plain cost ``plain`` (> 0, one-row
        forwards), the curve's price ``extra`` of its drafts, how many sequences drafted and the
        ``seconds`` it took."""
        if plain <= 0.0 or seconds <= 0.0:
            return
        y = seconds / plain
        self.fits.setdefault(batch, _Fit()).add(extra / plain, drafting / plain, y)
        if not drafting:
            self.plain_w = PLAIN_FORGET * self.plain_w + 1.0
            self.plain_y = PLAIN_FORGET * self.plain_y + y
        self._cache.clear()


LEDGER_FORGET = 0.9  # weight of a step against the next one of the same kind and batch size (~10 steps)
LEDGER_MIN = 4.0  # steps' worth of each kind before a batch size is judged
LEDGER_PROBE = 8  # where proposing lost, every LEDGER_PROBE-th step proposes anyway (keeps measuring it)
LEDGER_EXPLORE = 8  # where it did not (or is not judged yet), every LEDGER_EXPLORE-th step is plain...
LEDGER_EXPLORE_RARE = 64  # ... or every LEDGER_EXPLORE_RARE-th once proposing is clearly ahead
LEDGER_CLEAR = 1.2  # "clearly": its rate at least this times the plain steps'
# Batch 1 is not judged: there a draft's extra rows cost about the curve's price (an n-gram chain of at
# most 4 measured 1.19x a plain step, its price, docs/speculative.md), while the ledger's plain steps cost
# a share of the speed-up (Spec-Bench batch 1, 7 cases, one core: decode 1.28x with it, 1.31x without)
LEDGER_FROM = 2


@dataclass
class _Rate:
    w: float = 0.0
    s: float = 0.0

    def add(self, v: float) -> None:
        self.w, self.s = LEDGER_FORGET * self.w + 1.0, LEDGER_FORGET * self.s + v

    @property
    def rate(self) -> float:
        return self.s / self.w


@dataclass
class DraftLedger:
    """Whether proposing has paid at a batch size, measured rather than predicted. Per batch size, the
    tokens a decode-only step committed per unit of its time — the time divided by the step's plain
    cost ``P``, so that longer contexts do not count against a kind of step — for steps in which the
    proposer ran (looked up matches and drafted where the rule said so) and for plain steps (no
    lookups: the idle gate's, this ledger's). Where both kinds have ``LEDGER_MIN`` steps' worth and the
    proposing steps' rate is below the plain steps', proposing loses at that batch size on this machine,
    whatever the gain rule predicted (its price and acceptance estimates both err, and the lookups
    cost every step something): :meth:`allows` then refuses it but for every ``LEDGER_PROBE``-th
    step. Elsewhere every ``LEDGER_EXPLORE``-th step (``LEDGER_EXPLORE_RARE``-th where proposing is
    ``LEDGER_CLEAR`` times ahead) is plain, so that both rates stay measured; the rates forget, so a
    batch size where the balance turns is judged again. Steps the ledger makes plain draft nothing,
    so the output is unchanged (verification is lossless for any draft policy)."""

    on: dict[int, _Rate] = field(default_factory=dict)
    off: dict[int, _Rate] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)  # batch size -> steps asked about
    skipped: int = 0  # steps made plain (a metric)

    def _judged(self, batch: int) -> bool | None:
        on, off = self.on.get(batch), self.off.get(batch)
        if on is None or off is None or on.w < LEDGER_MIN or off.w < LEDGER_MIN:
            return None
        return on.rate < off.rate

    def loses(self, batch: int) -> bool | None:
        """Whether proposing loses at ``batch`` (None: not judged yet). A batch size not judged yet takes
        a loss measured at the largest smaller one judged: a bigger batch only makes a draft's rows
        dearer against a sequence's share of the step (a batch of eight visits every size below it
        for a few steps each, too few to judge them all in time)."""
        own = self._judged(batch)
        if own is not None:
            return own
        below = [b for b in self.on if LEDGER_FROM <= b < batch and self._judged(b) is not None]
        return True if below and self._judged(max(below)) else None

    def allows(self, batch: int) -> bool:
        """Whether a step of ``batch`` decoding sequences may propose (always at batch 1, see LEDGER_FROM)."""
        if batch < LEDGER_FROM:
            return True
        n = self.steps[batch] = self.steps.get(batch, 0) + 1
        loses = self.loses(batch)
        if loses:
            ok = n % LEDGER_PROBE == 0
        else:
            clear = loses is False and self.on[batch].rate >= LEDGER_CLEAR * self.off[batch].rate
            ok = n % (LEDGER_EXPLORE_RARE if clear else LEDGER_EXPLORE) != 0
        self.skipped += not ok
        return ok

    def observe(self, batch: int, plain: float, proposed: bool, tokens: int, seconds: float) -> None:
        """A decode-only step: its plain cost ``plain``, whether the proposer ran, the tokens it
        committed and the ``seconds`` it took."""
        if plain > 0.0 and seconds > 0.0:
            (self.on if proposed else self.off).setdefault(batch, _Rate()).add(tokens * plain / seconds)


@dataclass
class MeasuredDrafts:
    """A proposer's bookkeeping for :class:`DraftPrice` and :class:`DraftLedger` (``ngram`` and the tree
    proposers share it): :meth:`allows` asks the ledger whether a step may propose, :meth:`record` keeps
    what the step proposed — its plain cost ``P``, the curve's price ``E`` of its drafts, the sequences
    that drafted, whether the proposer ran — and :meth:`observe_step` hands both the step's measured time
    once the strategy has it (``Proposer.observe_step``)."""

    price: DraftPrice = field(default_factory=DraftPrice)
    ledger: DraftLedger = field(default_factory=DraftLedger)
    # the last step: (batch, plain cost, the curve's price of its drafts, sequences that drafted, proposed)
    _last: tuple[int, float, float, int, bool] | None = None

    def allows(self, batch: int) -> bool:
        self._last = None
        return self.ledger.allows(batch)

    def record(self, batch: int, plain: float, extra: float, drafting: int, proposed: bool) -> None:
        self._last = (batch, plain, extra, drafting, proposed)

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        last, self._last = self._last, None
        if last is not None and last[0] == batch:
            self.price.observe(batch, last[1], last[2], last[3], seconds)
            self.ledger.observe(batch, last[1], last[4], tokens, seconds)

    def metrics(self) -> dict[str, float]:
        """Steps the ledger made plain, and the measured price per batch size seen."""
        out: dict[str, float] = {"spec_decode_ledger_plain_steps": self.ledger.skipped}
        for b in sorted(self.price.fits):
            p = self.price.price(b)
            out[f"spec_decode_draft_price_factor_batch_{b}"] = p.factor
            out[f"spec_decode_draft_price_fixed_batch_{b}"] = p.fixed
        return out
