"""The step cost's prior, measured once at first use: forwards over a few row counts and the LM head
timed on the model itself (a few layers scaled to the stack, fastest of the runs, wall time), and
attention's share of a row from the model's shape. engine/step_cost.py fits the observed steps on top
of it."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ratchetlm.engine.step_cost import Prior

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 16, 128)


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


class ProbeStopped(Exception):
    """The probe was asked to stop (the server is shutting down)."""


def probe_prior(model: Any, model_config: Any, device: torch.device, dtype: torch.dtype,
                rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 2, probe_layers: int = 2,
                stop: Callable[[], bool] = lambda: False) -> Prior:
    """Time the body over ``rows`` new rows (the first ``probe_layers`` layers scaled to the stack,
    fastest of ``repeats`` after a warm-up) and the head over 16 rows. A model the probe does not fit
    (not Llama-shaped, a tensor-parallel rank) gets a guess that the observed steps then correct.
    ``stop`` is asked before every forward; once true, :class:`ProbeStopped` is raised (a process must
    not exit while this thread is inside a torch op: torch's teardown then aborts it)."""
    attn = attention_per_token(model_config)
    guess = Prior(fixed=20.0, per_row=2.0, head=0.2, attention=attn)
    if not getattr(model, "step_cost_probe", False) or getattr(model.tp, "size", 1) > 1:
        return guess
    try:
        _body_ms(model, device, 1, 0, None, stop)  # every layer once: packs weights, so the probe times the real path
        body = [_body_ms(model, device, r, repeats, probe_layers, stop) for r in rows]
        head = _head_ms(model, device, dtype, 16, repeats, stop) / 16
    except ProbeStopped:
        raise
    except Exception as e:  # noqa: BLE001 (the budget still works, fitted to the observed steps)
        log.warning("step cost probe failed (%s: %s); a guess is used", type(e).__name__, e)
        return guess
    per_row = max((body[-1] - body[-2]) / (rows[-1] - rows[-2]), 1e-3)  # where the matmuls are compute-bound
    fixed = max(body[0] + head - per_row, 0.0)
    return Prior(fixed=fixed, per_row=per_row, head=head / per_row, attention=attn)


def _best_ms(run: Callable[[], object], device: torch.device, repeats: int, stop: Callable[[], bool]) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` after one untimed warm-up, in ms (0 if none)."""
    best = math.inf
    with torch.inference_mode():
        for i in range(repeats + 1):
            if stop():
                raise ProbeStopped
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first run warms up
                best = min(best, time.perf_counter() - t0)
    return best * 1000.0 if repeats else 0.0


def _body_ms(model: Any, device: torch.device, rows: int, repeats: int, probe_layers: int | None,
             stop: Callable[[], bool]) -> float:
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch

    n_layers = len(model.layers)
    k = n_layers if probe_layers is None else min(probe_layers, n_layers)
    ids = ((torch.arange(rows) * 7919 + 100) % int(model.config.vocab_size)).to(device)  # [rows]
    batch = build_attention_batch(torch.arange(rows, device=device), [rows], [torch.empty(0, dtype=torch.long)],
                                  [None], NullSink(), None)
    return _best_ms(lambda: model(ids, batch, num_layers=k), device, repeats, stop) * n_layers / k  # [rows, hidden]


def _head_ms(model: Any, device: torch.device, dtype: torch.dtype, rows: int, repeats: int,
             stop: Callable[[], bool]) -> float:
    hidden = torch.randn(rows, int(model.config.hidden_size), device=device).to(dtype)  # [rows, hidden]
    return _best_ms(lambda: model.logits(hidden), device, repeats, stop)
