"""The price of a drafting step as this engine pays it, fitted to the engine's own recent steps.

The cost curve (cost_curve.py) is a probe: forwards without context, timed once per process in
isolation. A drafting step in the engine also pays attention over its context for every row, the
proposal, the staging of its K/V and the commit of the accepted rows (on the default model ~1.3 ms
of Python where a plain step has ~0.45 ms around its forward), and the probe's small-row ratios
move by +-30% from process to process. On the default model the probe read 2 and 4 rows at ~1.0x
one row while the engine's drafting steps took 1.3-1.5x its plain steps: drafts that could not pay
were drafted.

The schedule (gain.py) prices a sequence's draft of ``d`` tokens after ``e`` row-equivalents the
step's earlier sequences drafted as ``C(B) * (D(e + d + 1) - D(e))`` (``C(B) / B`` is its share of a
plain step; a drafting sequence counts one row more than its draft, its share of the staging and
commit work). ``D(x)`` is the cost of a step with ``x`` extra row-equivalents in plain steps of the
same batch size ``B`` (``D(0) = 1``). Before anything is measured ``D(x) = C(B + x) / C(B)``, the
curve as it is; once ``MIN_STEPS`` plain and ``MIN_STEPS`` drafting steps of that batch size were
seen (LLMEngine.step's wall time, steps whose sequences were all decoding), it is the line

    D(x) = 1 + a + b x    (x >= 1; a: a drafting step's fixed extra, b: per row-equivalent)

fitted to the last ``WINDOW`` drafting steps, each as its time over the median of the last
``WINDOW`` plain steps (least squares over the median of each ``x``, so one stalled step moves
little; ``b`` from the curve when the drafts were all of one length; ``a, b >= 0``).

Like the curve, the price changes only how many tokens are drafted, never which drafted tokens are
accepted: greedy text is the same whatever it says. Draft lengths then depend on timings, so seeded
speculative *sampling* repeats exactly only with a fixed ``verify_token_cost`` (nothing measured).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ratchetlm.decoding.speculative.cost_curve import CostCurve

WINDOW = 32  # recent steps kept per batch size and kind
MIN_STEPS = 3  # steps of each kind before the measured line replaces the curve


@dataclass
class StepPrice:
    curve: CostCurve  # the forward's cost in one-row forwards (probe or linear)
    adaptive: bool = False  # fit D from observed steps (False: the curve alone)
    plain: dict[int, deque[float]] = field(default_factory=dict)  # batch -> recent plain step seconds
    drafting: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # batch -> (x, seconds)
    fitted: dict[int, tuple[float, float]] = field(default_factory=dict)  # batch -> (a, b) of D
    _last: int | None = None  # the batch size fitted last (metrics)

    def step_cost(self, batch: int, x: float) -> float:
        """``D(x)``: a step of ``batch`` decoding sequences with ``x`` extra row-equivalents, in plain
        steps of that batch size."""
        if x <= 0:
            return 1.0
        ab = self.fitted.get(batch)
        if ab is None:
            return self.curve(batch + x) / self.curve(batch)
        return 1.0 + ab[0] + ab[1] * x

    def extra(self, batch: int, drafted: float, draft_len: int) -> float:
        """What a draft of ``draft_len`` tokens adds to the step, in one-row forwards (the curve's
        unit), after the step's earlier sequences drafted ``drafted`` row-equivalents."""
        return self.curve(batch) * (self.step_cost(batch, drafted + draft_len + 1) - self.step_cost(batch, drafted))

    def observe(self, batch: int, rows: int, drafting_seqs: int, seconds: float) -> None:
        """One engine step of ``batch`` decoding sequences that ran ``rows`` rows, ``drafting_seqs``
        of them with a draft (0: a plain step), in ``seconds`` of wall time."""
        assert batch >= 1 and rows >= batch and seconds > 0, (batch, rows, seconds)
        if not self.adaptive:
            return
        if drafting_seqs == 0:
            self.plain.setdefault(batch, deque(maxlen=WINDOW)).append(seconds)
        else:
            self.drafting.setdefault(batch, deque(maxlen=WINDOW)).append((rows - batch + drafting_seqs, seconds))
        plain, drafts = self.plain.get(batch), self.drafting.get(batch)
        if plain and drafts and len(plain) >= MIN_STEPS and len(drafts) >= MIN_STEPS:
            self.fitted[batch] = self._fit(batch, statistics.median(plain), drafts)
            self._last = batch

    def _fit(self, batch: int, plain_s: float, drafts: deque[tuple[int, float]]) -> tuple[float, float]:
        by_x: dict[int, list[float]] = {}
        for x, s in drafts:
            by_x.setdefault(x, []).append(s / plain_s - 1.0)  # this step's extra, in plain steps
        pts = [(x, statistics.median(ys), len(ys)) for x, ys in by_x.items()]  # [(x, y, weight)]
        c = self.curve
        b_curve = max((c(batch + 8) - c(batch)) / (8 * c(batch)), 0.0)
        n = sum(w for _, _, w in pts)
        mx = sum(w * x for x, _, w in pts) / n
        my = sum(w * y for _, y, w in pts) / n
        sxx = sum(w * (x - mx) ** 2 for x, _, w in pts)
        b = sum(w * (x - mx) * (y - my) for x, y, w in pts) / sxx if len(pts) > 1 else b_curve
        b = max(b, 0.0)
        return max(my - b * mx, 0.0), b

    def metrics(self) -> dict[str, float]:
        """The fitted line at the batch size fitted last: a drafting step's fixed extra and its
        extra per drafted row, in plain steps (none until measured)."""
        if self._last is None:
            return {}
        a, b = self.fitted[self._last]
        return {"spec_decode_draft_step_overhead": a, "spec_decode_draft_row_cost": b}
