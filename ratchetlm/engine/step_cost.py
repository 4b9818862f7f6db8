"""What one engine step costs in milliseconds, predicted from its rows: the scheduler's step-time budget.

A fixed token budget is the wrong unit on a CPU: 2,048 prefill rows cost seconds, while a decode row
costs a fraction of a one-row forward once the weights are being read anyway. The scheduler therefore
asks a :class:`StepCost` what a step would cost and fills it up to ``max_step_ms``
(engine/scheduler.py). A step is a list of :class:`Rows`, one per sequence: ``n`` new rows on top of
``context`` cached tokens, ``logits`` of them needing the LM head (every decode and draft row; only the
last prefill row).

:class:`MeasuredStepCost` is the model the engine uses:

    ms = fixed + per_row * D + per_prompt_row * P + per_read * sum_i n_i * (context_i + n_i / 2)
         + per_context * sum_i context_i + per_chunk * [a prompt chunk in the step]

``fixed`` is what any forward costs (reading the weights, Python, sampling), ``per_row`` what each of
its D decode and draft rows adds and ``per_prompt_row`` each of its P prompt-chunk rows (a row through
the LM head counts ``1 + head``, the head relative to a row), ``per_read`` what one row reading one
cached token adds (attention's arithmetic), ``per_context`` what each cached token of the step's
sequences adds (its K/V are read once a layer whatever the rows: late in a long prompt even a
one-token chunk costs a decode step or two), ``per_chunk`` what steps with a prompt chunk share
beyond those (see :class:`MeasuredStepCost`). A probe (engine/step_probe.py) at first
use times forwards over 1, 16 and 128 new rows and the head (decoding/speculative/cost_curve.py's
timing: a few layers scaled to the stack, fastest of the runs, wall time) for the prior; its
``attention`` (``per_read / per_row``) comes from the model's shape. Then every finished step's
measured time enters the fit of the parts (solved lazily, when a prediction needs it): least squares
with exponential forgetting (each step weighs 0.9 of the newer one of its kind), none negative, held
toward the probe by a few pseudo-steps on its line, so the model learns what a prompt row and a cached
token cost beside decode rows (the attention kernel's cost per cached token is not its share of the
multiply-adds). What the budget scales, the decode rows' time now (:meth:`MeasuredStepCost.decode_ms`),
follows a machine that gets busier or quieter from the last decode-only steps, which the scheduler
keeps taking while a long prompt is fed. Only speed depends on the model: it changes how prompts are
chunked, never a token (rows are batch-invariant).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_MAX_STEP_MS = {"cpu": 60.0, "cuda": 50.0}  # EngineConfig.max_step_ms=None resolves to these
# A step that holds decode rows and a prompt chunk is sized to max_step_ms, kept at least STRETCH_MIN
# times d, its decode rows' own time *now* (StepCost.decode_ms: the streams' inter-token latency, ITL,
# on the machine as it is while the prompt is fed), at most STRETCH_MAX times d0, their time in this
# prompt's first chunk step (their ITL before it arrived), and never under STRETCH_FLOOR times d
# (engine/scheduler.py). The targets (issue 40): the streams' largest gap <= 6x their median ITL
# *before the prompt arrived*, the prompt's time to first token (TTFT) <= 1.5x its TTFT on an idle
# server. The cost model is right (a chunk step's CPU time / its prediction: median 0.9, at most 1.2,
# traced over HTTP; docs/benchmarks.md, "lat2"), and so is d; but each stream's context grows a token a
# step (attention reads every held token once a layer), so over a 2,000-token prompt's ~250 steps d
# grows g ~ 1.25-1.35x, prompt or not. Steps scaled from d (3.5-3.75 d until 2026-11-29) therefore
# end at ~3.5 g ~ 4.5x the ITL before, and the largest gap, that times the largest step's wall-time
# noise (1.3-1.6 over HTTP on this shared 2-core machine: the engine thread does not run while another
# process has the core), at 6.8x in the last quiet round. Bounded by d0 instead, the late steps stay
# at STRETCH_MAX = 3.85 x the ITL before; the early ones are STRETCH_MIN = 3.75 x it (3.5 before:
# larger early steps, where the prompt's tokens are cheap, buy back the TTFT the late ones lose).
# Simulated with the cost parts measured here (benchmarks/sim_step_budget.py: a prompt row at context c
# costs 1.6 ms + 2.8 us x c, a held token 3.5 us; +-10% noise a step): largest step 5.5 -> 4.4x the
# ITL before (p90 4.5 -> 4.1x), TTFT 1.63 -> 1.68x idle, with a decode sample every 16 chunk steps
# instead of 8 (SAMPLE_EVERY: a TTFT point of the trade back; 3.5-4 x: 4.7x, 1.66x). The floor keeps
# the prompt's share when d grows for another reason (a machine that gets busier mid-prompt, many
# streams joining, streams whose context grows a lot): then each step is STRETCH_FLOOR x d and the prompt keeps
# 1 - 1 / 2.75 = 64% of it (TTFT ~1.6x idle on that machine; without the floor, a machine 2x busier
# would leave the prompt half of each step). The CPU default max_step_ms, 60, is ~3.5 d0 for the
# default model on this project's CPU (d0 ~ 16-20 ms, 4 streams), under the band: the budget sits at
# STRETCH_MIN x d early in a prompt and at STRETCH_MAX x d0 late in it.
STRETCH_MIN = 3.75
STRETCH_MAX = 3.85
STRETCH_FLOOR = 2.75
SAMPLE_EVERY = 16  # steps with a prompt chunk between two decode-only steps that re-measure d
MIN_RECENT = 3  # decode-only steps a median of them needs (one outlier among them does not move it)


@dataclass(frozen=True)
class Rows:
    """One sequence's part of a step: ``n`` new rows after ``context`` cached tokens, ``logits`` of them
    through the LM head."""

    n: int
    context: int
    logits: int
    prompt: bool = False  # a prompt chunk (the fit tells the steps that hold one apart)

    @staticmethod
    def decode(n: int, context: int) -> Rows:
        """A decode row and its draft / grammar-forced rows: each needs logits."""
        return Rows(n, context, n)

    @staticmethod
    def prefill(n: int, context: int) -> Rows:
        """A prompt chunk: only its last row's logits are read (or none, mid prompt; one is counted)."""
        return Rows(n, context, 1, prompt=True)


class StepCost(Protocol):
    def predict_ms(self, rows: list[Rows]) -> float:
        """What a step over ``rows`` is predicted to take (ms)."""

    def decode_ms(self, rows: list[Rows]) -> float:
        """What decode ``rows`` alone take now (ms): the streams' inter-token latency the budget scales."""

    def wants_decode_sample(self) -> bool:
        """Asked once for a step that could feed a prompt beside decode rows: True if this step should
        hold the decode rows alone (to re-measure what they cost); answering True counts as taken."""

    def observe(self, rows: list[Rows], ms: float) -> None:
        """A step over ``rows`` took ``ms``."""


@dataclass
class LinearStepCost:
    """``ms = fixed + per_row * R + per_logit * L + per_context * sum n (context + n / 2)``: a
    deterministic model for tests and for callers that know their machine. ``observe`` is ignored."""

    fixed: float = 0.0
    per_row: float = 1.0
    per_logit: float = 0.0
    per_context: float = 0.0

    def predict_ms(self, rows: list[Rows]) -> float:
        if not rows:
            return 0.0
        r = sum(x.n for x in rows)
        lg = sum(x.logits for x in rows)
        ctx = sum(x.n * (x.context + x.n / 2) for x in rows)
        return self.fixed + self.per_row * r + self.per_logit * lg + self.per_context * ctx

    def decode_ms(self, rows: list[Rows]) -> float:
        return self.predict_ms(rows)

    def wants_decode_sample(self) -> bool:
        return False

    def observe(self, rows: list[Rows], ms: float) -> None:
        return None


@dataclass(frozen=True)
class Prior:
    """The probe's estimate: ``ms = fixed + per_row * work`` (see the module docstring)."""

    fixed: float
    per_row: float
    head: float  # LM head per row, relative to a row
    attention: float  # one row reading one cached token, relative to a row

    def rows(self, rows: list[Rows]) -> float:
        """Rows, each through the LM head counting ``1 + head``."""
        return sum(x.n for x in rows) + self.head * sum(x.logits for x in rows)

    def work(self, rows: list[Rows]) -> float:
        return self.rows(rows) + self.attention * reads(rows)


def reads(rows: list[Rows]) -> float:
    """Cached tokens the step's rows read: each of a chunk's ``n`` rows reads its context and the
    chunk's rows before it."""
    return sum(x.n * (x.context + x.n / 2) for x in rows)


def _features(prior: Prior, rows: list[Rows]) -> tuple[float, ...]:
    """(1, decode and draft rows, prompt-chunk rows, cached tokens read, cached tokens of the step's
    sequences, 1 if a prompt chunk is in the step); rows through the LM head count ``1 + head``."""
    prompt = [x for x in rows if x.prompt]
    return (1.0, prior.rows([x for x in rows if not x.prompt]), prior.rows(prompt), reads(rows),
            float(sum(x.context for x in rows)), float(bool(prompt)))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting (a few unknowns); None if singular."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for c in reversed(range(n)):
        x[c] = (m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))) / m[c][c]
    return x


def nonnegative_least_squares(a: list[list[float]], b: list[float], tol: float = 1e-12) -> list[float]:
    """``argmin_{x >= 0} x^T a x - 2 b^T x`` for a small symmetric positive definite ``a`` (the normal
    equations of a least-squares fit): Lawson and Hanson's active-set method."""
    n = len(b)
    x = [0.0] * n
    free: list[int] = []

    def gradient() -> list[float]:  # b - a x: where the objective still falls
        return [b[i] - sum(a[i][j] * x[j] for j in range(n)) for i in range(n)]

    for _ in range(3 * n):
        w = gradient()
        j = max((i for i in range(n) if i not in free), key=lambda i: w[i], default=None)
        if j is None or w[j] <= tol * max(1.0, abs(b[j])):
            break
        free.append(j)
        while True:
            sub = _solve([[a[r][c] for c in free] for r in free], [b[r] for r in free])
            if sub is None:
                free.remove(j)
                return x
            z = [0.0] * n
            for i, v in zip(free, sub, strict=True):
                z[i] = v
            if all(z[i] > 0 for i in free):
                x = z
                break
            # step toward z until the first free part reaches 0; it leaves the free set
            alpha = min(x[i] / (x[i] - z[i]) for i in free if z[i] <= 0)
            x = [xi + alpha * (zi - xi) for xi, zi in zip(x, z, strict=True)]
            free = [i for i in free if x[i] > tol]
            for i in range(n):
                if i not in free:
                    x[i] = 0.0
            if not free:
                break
    return x


class MeasuredStepCost:
    """The engine's model: a :class:`Prior` probed on first use (``calibrate``; the server calls it at
    start-up so no request waits for it), refit to the observed step times as

        ms = fixed + per_row * decode_rows + [per_chunk + per_prompt_row * prompt_rows]
             + per_read * reads + per_context * held

    (rows through the LM head count ``1 + head``; ``reads``: cached tokens read, see :func:`reads`;
    ``held``: the step's sequences' cached tokens; the bracket only in a step with a prompt chunk).
    Decode and prompt rows get their own costs: on a CPU a step's first few rows cost less each than
    the next ones (the weights are read once for all of them), so four decode rows are not four
    fifteenths of a 15-row step. A long prompt's hundred chunk steps (nearly one shape, on a machine
    whose load drifts) teach the fit what a chunk costs: ``per_chunk`` takes what they share, and a
    step is forgotten only by newer steps of its kind, so they do not move what a decode step is
    predicted to cost.

    That prediction is the fit's; what the budget scales is :meth:`decode_ms`, the decode rows' time
    now: the fit's prediction times the median, over the last ``recent`` decode-only steps, of their
    measured time over the fit's prediction for them. While a prompt is fed every step holds a chunk,
    so nothing would re-measure the decode rows: after ``sample_every`` chunk steps
    :meth:`wants_decode_sample` asks the scheduler for one step of decode rows alone (a real token
    for the streams; the prompt loses one short step in ``sample_every + 1``). When the machine gets
    busier mid-prompt, the decode time follows within a few samples and the chunks keep their share
    of each step.

    The refit (a 6x6 non-negative least squares in Python, ~0.15 ms) is lazy: ``observe`` only adds
    the step to the sums; the parts are solved again when a prediction needs them and steps arrived
    since the last solve, or after ``refit_every`` steps (so an outlier's bound stays near the fit).
    A server whose streams only decode asks for no prediction and solves once every ``refit_every``
    steps."""

    # the prior as pseudo-steps the fit never forgets (a ridge toward it; the prior has no per_context
    # and no per_chunk): [Rows] of one and 64 decode rows, 4 decode rows after 1,024 cached tokens, a
    # 16-row chunk at the start of a prompt and one after 1,024 cached tokens
    PSEUDO = ((Rows.decode(1, 0),), (Rows.decode(64, 0),), (Rows.decode(1, 1024),) * 4, (Rows.prefill(16, 0),),
              (Rows.prefill(16, 1024),))
    N = 6  # parts: fixed, per_row, per_prompt_row, per_read, per_context, per_chunk
    NAMES = ("fixed", "per_row", "per_prompt_row", "per_read", "per_context", "per_chunk")

    def __init__(self, probe: Callable[[Callable[[], bool]], Prior], forget: float = 0.9, prior_weight: float = 0.05,
                 warmup: int = 2, recent: int = 5, sample_every: int = SAMPLE_EVERY, refit_every: int = 16) -> None:
        self.probe = probe  # probe(stop) -> Prior; raises ProbeStopped once stop() is true
        self.forget = forget  # each older step's weight relative to the next one's
        self.prior_weight = prior_weight  # the weight of each of PSEUDO's steps
        self.warmup = warmup  # the first steps' times (weight packing, buffer sizing) are not the steady state
        self.sample_every = sample_every
        self.refit_every = refit_every
        self.prior: Prior | None = None
        self._theta = [0.0] * self.N  # the parts, in NAMES' order, as of the last solve
        self._pending = 0  # steps added to the sums since the last solve
        self.observed = 0
        self.since_decode = 0  # steps with a prompt chunk observed since the last decode-only one (or sample)
        # per kind of step (decode rows only; with a prompt chunk): forgotten sums of x x^T (x: the
        # features; upper triangle) and of x * ms. A step is forgotten only by newer steps of its kind,
        # so a long prompt's hundred chunk steps do not wash out what the decode steps before it measured
        self._s = {kind: [[0.0] * self.N for _ in range(self.N)] for kind in (False, True)}
        self._r = {kind: [0.0] * self.N for kind in (False, True)}
        self._s0: list[list[float]] = []  # PSEUDO's part of the normal equations (set by calibrate)
        self._r0: list[float] = []
        # the last decode-only steps: (features, measured ms)
        self._recent: deque[tuple[tuple[float, ...], float]] = deque(maxlen=recent)
        # the last steps before the probe (an offline engine probes when a prompt first needs a chunk):
        # replayed by calibrate, so the decode steps just before it say what a decode step costs now
        self._early: deque[tuple[list[Rows], float]] = deque(maxlen=2 * refit_every)

    def calibrate(self, stop: Callable[[], bool] = lambda: False) -> Prior:
        """Probe now if not yet done. ``stop`` is asked between the probe's forwards: a server that
        shuts down while it runs gets :class:`ProbeStopped` within one forward (the prior stays unset)."""
        if self.prior is None:
            p = self.prior = self.probe(stop)
            self._theta = [p.fixed, p.per_row, p.per_row, p.per_row * p.attention, 0.0, 0.0]
            n, q = self.N, self.prior_weight
            self._s0, self._r0 = [[0.0] * n for _ in range(n)], [0.0] * n
            for pseudo in self.PSEUDO:
                xp = _features(p, list(pseudo))
                yp = p.fixed + p.per_row * p.work(list(pseudo))
                for i in range(n):
                    self._r0[i] += q * xp[i] * yp
                    for j in range(n):
                        self._s0[i][j] += q * xp[i] * xp[j]
            log.info("step cost prior: %.1f ms + %.2f ms a row; head %.2f, attention %.2e per cached token "
                     "(relative to a row)", p.fixed, p.per_row, p.head, p.attention)
            early, self._early = list(self._early), deque()
            for rows, ms in early:
                self.observe(rows, ms)
        return self.prior

    def parts(self) -> list[float]:
        """The fitted parts in ``NAMES``' order (solved now if steps arrived since the last solve)."""
        self.calibrate()
        if self._pending:
            self._refit()
        return self._theta

    fixed = property(lambda self: self.parts()[0])
    per_row = property(lambda self: self.parts()[1])
    per_prompt_row = property(lambda self: self.parts()[2])
    per_read = property(lambda self: self.parts()[3])
    per_context = property(lambda self: self.parts()[4])
    per_chunk = property(lambda self: self.parts()[5])

    def predict_ms(self, rows: list[Rows]) -> float:
        if not rows:
            return 0.0
        theta = self.parts()
        assert self.prior is not None
        return _dot(theta, _features(self.prior, rows))

    def decode_ms(self, rows: list[Rows]) -> float:
        """Decode ``rows``' time now: the fit's prediction scaled by the median ratio of the last
        decode-only steps' measured times to the fit's prediction for them (the ratio, not the times:
        their contexts differ from ``rows``')."""
        base = self.predict_ms(rows)
        ratios = [ms / p for x, ms in self._recent if (p := _dot(self._theta, x)) > 0]
        return base * statistics.median(ratios) if len(ratios) >= MIN_RECENT and base > 0 else base

    def wants_decode_sample(self) -> bool:
        if self.since_decode < self.sample_every:
            return False
        self.since_decode = 0  # taken: the next sample only after sample_every more chunk steps
        return True

    def observe(self, rows: list[Rows], ms: float) -> None:
        """A step over ``rows`` took ``ms``: add it to the fit (before the probe, keep it for
        ``calibrate`` to add: the features need the probe's head cost)."""
        if not rows or not math.isfinite(ms) or ms <= 0:
            return
        if self.prior is None:
            self._early.append((rows, ms))
            return
        x = _features(self.prior, rows)
        n, kind = self.N, x[5] > 0
        self.since_decode = self.since_decode + 1 if kind else 0
        self.observed += 1
        if self.observed <= self.warmup:
            return
        pred = _dot(self._theta, x)  # the last solve's: a bound, so it need not be the latest
        y = min(max(ms, pred / 4), pred * 4)  # one outlier (another process's burst) moves the fit a bounded step
        f, s, r = self.forget, self._s[kind], self._r[kind]
        for i in range(n):
            xi = x[i]
            r[i] = f * r[i] + xi * y
            si = s[i]
            for j in range(i, n):
                si[j] = f * si[j] + xi * x[j]
        if not kind:
            self._recent.append((x, ms))
        self._pending += 1
        if self._pending >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        n, s0, s1, s2 = self.N, self._s0, self._s[False], self._s[True]
        a = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i, n):
                a[i][j] = a[j][i] = s0[i][j] + s1[i][j] + s2[i][j]
        b = [self._r0[i] + self._r[False][i] + self._r[True][i] for i in range(n)]
        # every part is a cost: the best fit with none negative (noise in a narrow range of steps
        # would otherwise make one negative and another too large)
        self._theta = nonnegative_least_squares(a, b)
        self._pending = 0


def _dot(theta: list[float], x: tuple[float, ...]) -> float:
    return sum(t * v for t, v in zip(theta, x, strict=True))
