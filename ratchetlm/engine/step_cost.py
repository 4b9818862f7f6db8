"""What one engine step costs in milliseconds, predicted from its rows: the scheduler's step-time budget.

A fixed token budget is the wrong unit on a CPU: 2,048 prefill rows cost seconds, while a decode row
costs a fraction of a one-row forward once the weights are being read anyway. The scheduler therefore
asks a :class:`StepCost` what a step would cost and fills it up to ``max_step_ms``
(engine/scheduler.py). A step is a list of :class:`Rows`, one per sequence: ``n`` new rows on top of
``context`` cached tokens, ``logits`` of them needing the LM head (every decode and draft row; only the
last prefill row).

:class:`MeasuredStepCost` is the model the engine uses, in units of a one-row forward's body:

    units = body(R) + head * L + attention * sum_i n_i * (context_i + n_i / 2)

``body(R)`` is piecewise linear through forwards over 1, 8, 64 and 256 new rows timed once at start-up
(decoding/speculative/cost_curve.py's probe: a few layers scaled to the stack, fastest of the runs,
wall time), ``head`` the LM head's time per row relative to it, ``attention`` the cost of one row
reading one cached token (from the model's shape: its attention FLOPs per token over a row's matmul
FLOPs at the large-R slope). The probe gives the shape, the step timings give the scale:
``ms_per_unit`` is an exponential moving average of each finished step's measured milliseconds over
its predicted units, so the budget follows a machine that gets busier or quieter. Only speed depends on
the model: it changes how prompts are chunked, never a token (rows are batch-invariant).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 8, 64, 256)
DEFAULT_MAX_STEP_MS = {"cpu": 100.0, "cuda": 50.0}  # EngineConfig.max_step_ms=None resolves to these


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
class Shape:
    """The measured shape of a forward's cost, relative to a one-row body (see the module docstring)."""

    rows: tuple[int, ...]  # increasing, starting at 1
    body: tuple[float, ...]  # body[0] == 1, non-decreasing
    head: float  # LM head per row
    attention: float  # one row reading one cached token
    one_row_ms: float  # the probe's one-row body, the scale until steps are observed

    def units(self, rows: list[Rows]) -> float:
        if not rows:
            return 0.0
        r = sum(x.n for x in rows)
        i = min(max(bisect.bisect_right(self.rows, r) - 1, 0), len(self.rows) - 2)
        r0, r1, b0, b1 = self.rows[i], self.rows[i + 1], self.body[i], self.body[i + 1]
        body = b0 + (b1 - b0) * (r - r0) / (r1 - r0)
        return (body + self.head * sum(x.logits for x in rows)
                + self.attention * sum(x.n * (x.context + x.n / 2) for x in rows))


class MeasuredStepCost:
    """The engine's model: :class:`Shape` probed on first use (``calibrate``; the server calls it at
    start-up so no request waits for it), scaled by an EMA of observed step times."""

    def __init__(self, probe: Callable[[], Shape], alpha: float = 0.2, warmup: int = 2) -> None:
        self.probe = probe
        self.alpha = alpha  # weight of the newest step in the EMA
        self.shape: Shape | None = None
        self.ms_per_unit: float | None = None
        self.observed = 0
        self.warmup = warmup  # the first steps' times (weight packing, buffer sizing) are not the steady state

    def calibrate(self) -> Shape:
        if self.shape is None:
            self.shape = self.probe()
            self.ms_per_unit = self.shape.one_row_ms
            log.info("step cost: one-row forward %.1f ms; body %s; head %.2f/row; attention %.2e/row/token",
                     self.shape.one_row_ms,
                     " ".join(f"{r}:{b:.2f}" for r, b in zip(self.shape.rows, self.shape.body, strict=True)),
                     self.shape.head, self.shape.attention)
        return self.shape

    def predict_ms(self, rows: list[Rows]) -> float:
        shape = self.calibrate()
        assert self.ms_per_unit is not None
        return self.ms_per_unit * shape.units(rows)

    def observe(self, rows: list[Rows], ms: float) -> None:
        """A step over ``rows`` took ``ms``: move the scale toward it (only once calibrated: a step
        before any prediction was needed says nothing the probe will not)."""
        if self.shape is None or not rows or not math.isfinite(ms) or ms <= 0:
            return
        self.observed += 1
        if self.observed <= self.warmup:
            return
        assert self.ms_per_unit is not None
        per_unit = ms / max(self.shape.units(rows), 1e-9)
        # one outlier (a page fault, another process's burst) moves the scale at most 2x a step
        per_unit = min(max(per_unit, self.ms_per_unit / 2), self.ms_per_unit * 2)
        self.ms_per_unit += self.alpha * (per_unit - self.ms_per_unit)


def attention_per_token(model_config: Any) -> float:
    """One row reading one cached token, relative to one row through the matmuls: QK and PV dot
    products (2 x heads x head_dim multiply-adds a layer) over the layer's weight multiply-adds,
    doubled because attention runs nearer memory speed than the batched matmuls."""
    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer_weights = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return 2.0 * (2 * q) / per_layer_weights


def probe_shape(model: Any, model_config: Any, device: torch.device, dtype: torch.dtype,
                rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 2, probe_layers: int = 4) -> Shape:
    """Time body and head of forwards over ``rows`` new rows (cost_curve's probe: the first
    ``probe_layers`` layers scaled to the stack, fastest of ``repeats`` after a warm-up). A model the
    probe does not fit (not Llama-shaped, a tensor-parallel rank) gets a linear guess that the
    observed steps then scale."""
    from ratchetlm.decoding.speculative.cost_curve import seconds
    from ratchetlm.models.llama import LlamaModel

    attn = attention_per_token(model_config)
    if not isinstance(model, LlamaModel) or getattr(model.tp, "size", 1) > 1:
        return Shape((1, 256), (1.0, 64.0), 0.1, attn * 16, 20.0)  # ~16x a row's matmul rate at 256 rows
    try:
        seconds(model, device, 1, 1, None)  # every layer once: packs weights, so the probe times the real path
        body_s = [seconds(model, device, r, repeats, probe_layers, agg=min) - _head_s(model, device, dtype, r, repeats)
                  for r in rows]
    except Exception as e:  # noqa: BLE001 (the budget still works, scaled by the observed steps)
        log.warning("step cost probe failed (%s: %s); a linear guess is used", type(e).__name__, e)
        return Shape((1, 256), (1.0, 64.0), 0.1, attn * 16, 20.0)
    one = max(body_s[0], 1e-6)
    body, top = [], 1.0
    for r, s in zip(rows, body_s, strict=True):
        top = max(top, min(s / one, float(r)))  # R rows never cost more than R one-row forwards
        body.append(top)
    body[0] = 1.0
    slope = (body[-1] - body[-2]) / (rows[-1] - rows[-2])  # a row's cost where the matmuls are compute-bound
    head = _head_s(model, device, dtype, rows[-1], repeats) / rows[-1] / one
    return Shape(tuple(rows), tuple(body), head, attn * max(slope, 1e-3), one * 1000.0)


def _head_s(model: Any, device: torch.device, dtype: torch.dtype, rows: int, repeats: int) -> float:
    hidden = torch.randn(rows, int(model.config.hidden_size), device=device).to(dtype)  # [rows, hidden]
    best = math.inf
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model.logits(hidden)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - t0)
    return best
