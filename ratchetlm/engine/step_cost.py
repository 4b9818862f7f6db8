"""What one engine step costs in milliseconds, predicted from its rows: the scheduler's step-time budget.

A fixed token budget is the wrong unit on a CPU: 2,048 prefill rows cost seconds, while a decode row
costs a fraction of a one-row forward once the weights are being read anyway. The scheduler therefore
asks a :class:`StepCost` what a step would cost and fills it up to ``max_step_ms``
(engine/scheduler.py). A step is a list of :class:`Rows`, one per sequence: ``n`` new rows on top of
``context`` cached tokens, ``logits`` of them needing the LM head (every decode and draft row; only the
last prefill row).

:class:`MeasuredStepCost` is the model the engine uses:

    ms = fixed + per_row * work,   work = R + head * L + attention * sum_i n_i * (context_i + n_i / 2)

``fixed`` is what any forward costs (reading the weights, Python, sampling), ``per_row`` what each row
adds; ``head`` (the LM head per row) and ``attention`` (one row reading one cached token) are relative
to a row. A probe at first use times forwards over 1, 16 and 128 new rows and the head
(decoding/speculative/cost_curve.py's timing: a few layers scaled to the stack, fastest of the runs,
wall time) for the prior; ``attention`` comes from the model's shape. Then every finished step's
measured time refits ``fixed`` and ``per_row``: least squares with exponential forgetting (each step
weighs 0.9 of the one after it), held toward the probe by a small constant prior, so the budget follows
a machine that gets busier or quieter and learns what a prompt row costs beside decode rows. Only speed
depends on the model: it changes how prompts are chunked, never a token (rows are batch-invariant).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 16, 128)
DEFAULT_MAX_STEP_MS = {"cpu": 100.0, "cuda": 50.0}  # EngineConfig.max_step_ms=None resolves to these
# A step that holds decode rows and a prompt chunk is sized to max_step_ms, kept between these multiples
# of its decode rows' own predicted time (the streams' inter-token latency, ITL). At least STRETCH_MIN:
# the chunk gets >= 3/4 of the step, so a prompt fed beside streams reaches its first token within ~4/3
# of its time on an idle server (a prompt row costs about what it costs in one whole-prompt forward on
# a CPU) however busy the machine or many the streams. At most STRETCH_MAX: the streams' largest gap
# stays <= 5x their ITL when max_step_ms is many times a decode step (a quiet machine, a GPU).
STRETCH_MIN = 4.0
STRETCH_MAX = 5.0


@dataclass(frozen=True)
class Rows:
    """One sequence's part of a step: ``n`` new rows after ``context`` cached tokens, ``logits`` of them
    through the LM head."""

    n: int
    context: int
    logits: int

    @staticmethod
    def decode(n: int, context: int) -> Rows:
        """A decode row and its draft / grammar-forced rows: each needs logits."""
        return Rows(n, context, n)

    @staticmethod
    def prefill(n: int, context: int) -> Rows:
        """A prompt chunk: only its last row's logits are read (or none, mid prompt; one is counted)."""
        return Rows(n, context, 1)


class StepCost(Protocol):
    def predict_ms(self, rows: list[Rows]) -> float: ...

    def observe(self, rows: list[Rows], ms: float) -> None: ...


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

    def observe(self, rows: list[Rows], ms: float) -> None:
        return None


@dataclass(frozen=True)
class Prior:
    """The probe's estimate: ``ms = fixed + per_row * work`` (see the module docstring)."""

    fixed: float
    per_row: float
    head: float  # LM head per row, relative to a row
    attention: float  # one row reading one cached token, relative to a row

    def work(self, rows: list[Rows]) -> float:
        return (sum(x.n for x in rows) + self.head * sum(x.logits for x in rows)
                + self.attention * sum(x.n * (x.context + x.n / 2) for x in rows))


class MeasuredStepCost:
    """The engine's model: a :class:`Prior` probed on first use (``calibrate``; the server calls it at
    start-up so no request waits for it), refit to the observed step times."""

    def __init__(self, probe: Callable[[], Prior], forget: float = 0.9, prior_weight: float = 0.05,
                 warmup: int = 2) -> None:
        self.probe = probe
        self.forget = forget  # each older step's weight relative to the next one's
        self.prior_weight = prior_weight  # pseudo-steps at one and at 64 rows that the fit never forgets
        self.warmup = warmup  # the first steps' times (weight packing, buffer sizing) are not the steady state
        self.prior: Prior | None = None
        self.fixed = self.per_row = 0.0
        self.observed = 0
        self._s = [[0.0, 0.0], [0.0, 0.0]]  # forgotten sums of x x^T, x = (1, work)
        self._r = [0.0, 0.0]  # and of x * ms

    def calibrate(self) -> Prior:
        if self.prior is None:
            self.prior = self.probe()
            self.fixed, self.per_row = self.prior.fixed, self.prior.per_row
            log.info("step cost prior: %.1f ms + %.2f ms a row; head %.2f, attention %.2e per cached token "
                     "(relative to a row)", self.fixed, self.per_row, self.prior.head, self.prior.attention)
        return self.prior

    def predict_ms(self, rows: list[Rows]) -> float:
        prior = self.calibrate()
        return self.fixed + self.per_row * prior.work(rows) if rows else 0.0

    def observe(self, rows: list[Rows], ms: float) -> None:
        """A step over ``rows`` took ``ms``: refit (only once calibrated: steps before any prediction
        was needed say nothing the probe does not)."""
        if self.prior is None or not rows or not math.isfinite(ms) or ms <= 0:
            return
        self.observed += 1
        if self.observed <= self.warmup:
            return
        w = self.prior.work(rows)
        pred = self.predict_ms(rows)
        y = min(max(ms, pred / 4), pred * 4)  # one outlier (another process's burst) moves the fit a bounded step
        f, s, r = self.forget, self._s, self._r
        s[0][0] = f * s[0][0] + 1.0
        s[0][1] = f * s[0][1] + w
        s[1][1] = f * s[1][1] + w * w
        r[0] = f * r[0] + y
        r[1] = f * r[1] + w * y
        # the prior as pseudo-observations at work 1 and 64 on the probe's line (a ridge toward it)
        p, q = self.prior, self.prior_weight
        a00, a01, a11 = s[0][0] + 2 * q, s[0][1] + q * 65, s[1][1] + q * (1 + 64 * 64)
        b0 = r[0] + q * (2 * p.fixed + 65 * p.per_row)
        b1 = r[1] + q * (p.fixed + p.per_row + 64 * (p.fixed + 64 * p.per_row))
        det = a00 * a11 - a01 * a01
        if det <= 0:
            return
        fixed = (b0 * a11 - b1 * a01) / det
        per_row = (a00 * b1 - a01 * b0) / det
        # both parts are costs: a fit that makes one negative (noise in a narrow range of steps) moves
        # all of the time into the other
        if per_row <= 0:
            self.fixed, self.per_row = r[0] / s[0][0], 1e-3
        elif fixed < 0:
            self.fixed, self.per_row = 0.0, b1 / a11
        else:
            self.fixed, self.per_row = fixed, per_row


def attention_per_token(model_config: Any) -> float:
    """One row reading one cached token, relative to one row through the matmuls: QK and PV dot
    products (2 x heads x head_dim multiply-adds a layer) over the layer's weight multiply-adds,
    doubled because attention runs nearer memory speed than the batched matmuls."""
    c = model_config
    if not all(hasattr(c, f) for f in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size")):
        return 0.0  # not Llama-shaped (DeepSeek-V4, compressed KV): the fitted per-row cost absorbs attention
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer_weights = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return 2.0 * (2 * q) / per_layer_weights


def probe_prior(model: Any, model_config: Any, device: torch.device, dtype: torch.dtype,
                rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 2, probe_layers: int = 2) -> Prior:
    """Time the body over ``rows`` new rows (the first ``probe_layers`` layers scaled to the stack,
    fastest of ``repeats`` after a warm-up) and the head over 16 rows. A model the probe does not fit
    (not Llama-shaped, a tensor-parallel rank) gets a guess that the observed steps then correct."""
    attn = attention_per_token(model_config)
    guess = Prior(fixed=20.0, per_row=2.0, head=0.2, attention=attn)
    if not getattr(model, "step_cost_probe", False) or getattr(model.tp, "size", 1) > 1:
        return guess
    try:
        _body_ms(model, device, 1, 0, None)  # every layer once: packs weights, so the probe times the real path
        body = [_body_ms(model, device, r, repeats, probe_layers) for r in rows]
        head = _head_ms(model, device, dtype, 16, repeats) / 16
    except Exception as e:  # noqa: BLE001 (the budget still works, fitted to the observed steps)
        log.warning("step cost probe failed (%s: %s); a guess is used", type(e).__name__, e)
        return guess
    per_row = max((body[-1] - body[-2]) / (rows[-1] - rows[-2]), 1e-3)  # where the matmuls are compute-bound
    fixed = max(body[0] + head - per_row, 0.0)
    return Prior(fixed=fixed, per_row=per_row, head=head / per_row, attention=attn)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _body_ms(model: Any, device: torch.device, rows: int, repeats: int, probe_layers: int | None) -> float:
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch

    n_layers = len(model.layers)
    k = n_layers if probe_layers is None else min(probe_layers, n_layers)
    ids = ((torch.arange(rows) * 7919 + 100) % int(model.config.vocab_size)).to(device)  # [rows]
    batch = build_attention_batch(torch.arange(rows, device=device), [rows], [torch.empty(0, dtype=torch.long)],
                                  [None], NullSink(), None)
    best = math.inf
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model(ids, batch, num_layers=k)  # [rows, hidden]
            _sync(device)
            if i:  # the first run warms up
                best = min(best, time.perf_counter() - t0)
    return best * 1000.0 * n_layers / k if repeats else 0.0


def _head_ms(model: Any, device: torch.device, dtype: torch.dtype, rows: int, repeats: int) -> float:
    hidden = torch.randn(rows, int(model.config.hidden_size), device=device).to(dtype)  # [rows, hidden]
    best = math.inf
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model.logits(hidden)
            _sync(device)
            if i:
                best = min(best, time.perf_counter() - t0)
    return best * 1000.0
