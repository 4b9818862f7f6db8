"""What a forward over R rows costs, in one-row forwards: the gain schedule's price of a draft.

On a CPU a forward's time grows with its rows at a rate that depends on the model, the numerics
mode and the machine (docs/architecture.md: with the integer kernels a 135M model's 8-row forward
measured ~1.6x one row, a 1B model's ~3x). :func:`measured` times the target model once per
process and thread count (a forward over 1, 2, 4, 8, 16, 32 new rows, no context), like the BLAS
switch point in layers/block_quant.py; :meth:`CostCurve.linear` is the old constant model
``1 + c (R - 1)`` (``verify_token_cost=c``: a fixed per-row price, e.g. 0 on a GPU, and what tests
pin so that their draft lengths do not depend on how busy the machine is).

Only speed depends on the curve: it changes how many tokens are drafted, never which drafted
tokens are accepted, so greedy text is the same whatever it says. Seeded speculative sampling
draws the same tokens for the same draft lengths, so it repeats exactly within a process (one
measurement per model) and with a fixed ``verify_token_cost``.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class CostCurve:
    """``cost(R)``: time of a forward over R rows / time over one row; piecewise linear through the
    measured points, extended past the last one with the last segment's slope."""

    rows: tuple[int, ...]  # increasing, starting at 1
    cost: tuple[float, ...]  # cost[0] == 1, non-decreasing
    # what a sequence's cached context adds, per cached token, in one-row forwards (:func:`context_terms`):
    # its first row (reads the context's K/V from memory) and each further row of the same sequence
    # (attention's arithmetic again: the kernel reads the context once per row). 0: context is free.
    first_token: float = 0.0
    row_token: float = 0.0

    def __post_init__(self) -> None:
        assert len(self.rows) == len(self.cost) >= 2 and self.rows[0] == 1 and self.cost[0] == 1.0, self
        assert self.first_token >= 0.0 and self.row_token >= 0.0, self
        assert all(a < b for a, b in zip(self.rows, self.rows[1:], strict=False)), self.rows
        assert all(a <= b for a, b in zip(self.cost, self.cost[1:], strict=False)), self.cost

    @staticmethod
    def linear(per_row: float) -> CostCurve:
        """The constant model: every row after the first costs ``per_row`` of a one-row forward."""
        return CostCurve((1, 2), (1.0, 1.0 + per_row))

    def __call__(self, rows: float) -> float:
        i = min(max(bisect.bisect_right(self.rows, rows) - 1, 0), len(self.rows) - 2)
        r0, r1, c0, c1 = self.rows[i], self.rows[i + 1], self.cost[i], self.cost[i + 1]
        return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)

    def __str__(self) -> str:
        ctx = f"; per cached token: first row {self.first_token:.2e}, each further row {self.row_token:.2e}"
        return " ".join(f"{r}:{c:.2f}" for r, c in zip(self.rows, self.cost, strict=True)) + (
            ctx if self.first_token or self.row_token else "")


def from_times(rows: tuple[int, ...], seconds: list[float]) -> CostCurve:
    """Times per row count -> the curve: ratios to one row, at most ``R`` (R rows never cost more
    than R one-row forwards) and made non-decreasing (noise must not make more rows look cheaper)."""
    cost, top = [], 1.0
    for r, s in zip(rows, seconds, strict=True):
        top = max(top, min(s / seconds[0], float(r)))
        cost.append(top)
    cost[0] = 1.0
    return CostCurve(tuple(rows), tuple(cost))


_measured: weakref.WeakKeyDictionary[Any, dict[int, CostCurve]] = weakref.WeakKeyDictionary()

PROBE_LAYERS = 4  # decoder layers timed per row count (they are alike; the rest is scaled from them)


def measured(model: Any, device: torch.device | str = "cpu", fallback: float = 0.09, cache: Any = None) -> CostCurve:
    """The cost curve of ``model`` on this machine with the current torch threads, measured on first
    use and kept for the process (logged once). Only ``PROBE_LAYERS`` decoder layers and the head
    run per probe, a fraction of full forwards (at 2 threads on a busy 2-core box: 0.1-0.3 s for
    the default model, 1-2.8 s for a 1B file, exact the slowest; benchmarks/bench_cost_curve.py). A
    model the probe does not fit (not a Llama-shaped stack, or a tensor-parallel rank, whose forward
    waits for the other ranks) gets the linear model with
    ``fallback``. ``cache``: the runner's KV cache, to time forwards on top of a cached context as
    well (:func:`context_terms`; without it context is priced free)."""
    from ratchetlm.models.llama import LlamaModel

    if not isinstance(model, LlamaModel) or getattr(model.tp, "size", 1) > 1:
        return CostCurve.linear(fallback)
    threads = torch.get_num_threads()
    per_model = _measured.setdefault(model, {})
    if threads not in per_model:
        try:
            # one thread: the process's CPU time is the forward's own work, where wall time on a shared
            # machine also measures the neighbours (measured at load 10 on 2 cores: 4 rows 1.97x, 8 rows
            # 6.6x by wall time, which starved every draft); with more threads CPU time counts their
            # waiting too, so wall time stays
            clock = time.process_time if threads == 1 and torch.device(device).type == "cpu" else time.perf_counter
            c = curve(model, torch.device(device), clock=clock)
            if cache is not None:
                try:
                    c = context_terms(model, torch.device(device), cache, c, clock=clock)
                except Exception as e:  # noqa: BLE001 (the curve stands; context is priced free)
                    log.warning("context cost not measured (%s: %s)", type(e).__name__, e)
            per_model[threads] = c
            log.info("forward cost curve at %d threads (rows:time / one row): %s", threads, per_model[threads])
        except Exception as e:  # noqa: BLE001 (the schedule still works, with the constant model)
            log.warning("cost curve not measured (%s: %s); verify_token_cost=%s", type(e).__name__, e, fallback)
            per_model[threads] = CostCurve.linear(fallback)
    return per_model[threads]


def curve(model: Any, device: torch.device, rows: tuple[int, ...] = ROWS, repeats: int = 3,
          probe_layers: int | None = PROBE_LAYERS, clock: Callable[[], float] = time.perf_counter) -> CostCurve:
    """Time a forward over each of ``rows`` new rows (no context, K/V written nowhere): the first
    ``probe_layers`` decoder layers (None: all of them) scaled to the whole stack, plus the head on
    every row (a verify forward takes logits of all its rows). Each count runs once to warm up (packs
    integer weights, sizes buffers), then the fastest of ``repeats`` runs is kept: other processes
    only ever add time, so the minimum is the estimate least disturbed by them. Wall time, not the
    process's CPU time: with 2 threads a one-row forward keeps them less busy than 32 rows do, and
    CPU-time ratios came out up to 2x the wall-time ones on the default model."""
    if probe_layers is not None:  # every layer once first: the probe must time the path the engine's
        # forwards take, and the decode chain (models/decode_chain.py) runs only once every layer's
        # integer weights are packed (at its first call); a probe of 4 layers never packed the rest
        # and timed the layer-by-layer path, whose Python overhead flattened the curve
        seconds(model, device, 1, 1, None, clock=clock)
    return from_times(rows, [seconds(model, device, r, repeats, probe_layers, clock=clock) for r in rows])


CONTEXT = 1024  # cached tokens under the context probe's forwards
CONTEXT_ROWS = 8  # rows of its multi-row forward (a typical verify)


def context_terms(model: Any, device: torch.device, cache: Any, base: CostCurve, context: int = CONTEXT,
                  rows: int = CONTEXT_ROWS, repeats: int = 3, probe_layers: int | None = PROBE_LAYERS,
                  clock: Callable[[], float] = time.perf_counter) -> CostCurve:
    """``base`` with its per-cached-token terms: forwards over 1 and ``rows`` rows with and without
    ``context`` cached tokens under them (the cache's first slots, whatever they hold: only time is
    read). A verify forward's rows each read the whole context (measured on the default model, int8,
    one core: 9 rows after 1,500 tokens 2.85x one row there, against 1.84x after 100), which the bare
    curve does not see; priced without it, n-gram drafts on Spec-Bench's 700-1,500-token
    summarization prompts lost to plain decoding at MAL 1.98."""
    context = min(context, int(cache.num_slots) - rows)
    if context < 64:
        return base
    t = {(r, c): seconds(model, device, r, repeats, probe_layers, clock=clock, cache=cache, context=c)
         for r in (1, rows) for c in (0, context)}
    one = t[1, 0]
    first = max(t[1, context] - one, 0.0) / (context * one)
    further = max(t[rows, context] - t[rows, 0] - (t[1, context] - one), 0.0) / ((rows - 1) * context * one)
    return CostCurve(base.rows, base.cost, first, further)


def seconds(model: Any, device: torch.device, rows: int, repeats: int = 2, probe_layers: int | None = None,
            agg: Callable[[list[float]], float] = min, clock: Callable[[], float] = time.perf_counter,
            cache: Any = None, context: int = 0) -> float:
    """Time of one forward over ``rows`` new rows plus its logits, ``agg`` over ``repeats`` timed
    runs after one warm-up (``probe_layers``: time that many layers, scale to all; ``clock``: wall
    time by default; ``context``: cached tokens under the rows, the first slots of ``cache``)."""
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch

    n_layers = len(model.layers)
    k = n_layers if probe_layers is None else min(probe_layers, n_layers)
    ids = ((torch.arange(rows) * 7919 + 100) % int(model.config.vocab_size)).to(device)  # [rows]
    groups = 1 if cache is None else len(cache.slot_groups)
    slots = torch.arange(context, dtype=torch.long).expand(groups, context).reshape(-1)  # [G * context]
    batch = build_attention_batch(torch.arange(context, context + rows, device=device), [rows], [slots], [None],
                                  NullSink(), cache if context else None)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    body, head = [], []
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = clock()
            hidden = model(ids, batch, num_layers=k)  # [rows, hidden]
            sync()
            t1 = clock()
            model.logits(hidden)  # [rows, vocab]
            sync()
            if i:  # the first run warms up
                body.append(t1 - t0)
                head.append(clock() - t1)
    return float(agg(body)) * n_layers / k + float(agg(head))
