"""``ratchet serve`` with a per-step trace, for benchmarks/bench_latency.py ``--trace`` (benchmark only:
nothing here is part of the server).

    RATCHET_STEP_TRACE=/tmp/trace.json python benchmarks/serve_trace.py serve [ratchet serve flags]

Wraps, in this process only, ``Scheduler.schedule`` (what the step-time budget saw when it sized the
step: the step's predicted time, the decode rows' time now, the prompt chunk and its context),
``LLMEngine.step`` (the step's wall time and the engine thread's CPU time: a wall time well over the CPU
time is a step whose thread did not run, another thread or process had the core or the GIL) and the
garbage collector (every collection's pause, generation and thread). SIGUSR1 writes the trace so far
to the file (JSON: ``steps``, ``gc``; times are ``time.perf_counter()``, the same clock as a client's on
this machine). Attribute names only: it runs any checkout's server that has them (``--peer-pythonpath``).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
from typing import Any

PATH = os.environ.get("RATCHET_STEP_TRACE", "")
steps: list[dict[str, float]] = []
pauses: list[tuple[float, float, int, str]] = []  # (start, end, generation, thread)
_gc_start: dict[int, float] = {}


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    tid = threading.get_ident()
    if phase == "start":
        _gc_start[tid] = time.perf_counter()
    elif tid in _gc_start:
        pauses.append((_gc_start.pop(tid), time.perf_counter(), int(info.get("generation", -1)),
                       threading.current_thread().name))


def dump(*_: Any) -> None:
    with open(PATH + ".tmp", "w") as f:
        json.dump({"steps": steps, "gc": pauses}, f)
    os.replace(PATH + ".tmp", PATH)


def install() -> None:
    from ratchetlm.engine import llm_engine, scheduler
    from ratchetlm.engine.step_cost import Rows

    schedule, step = scheduler.Scheduler.schedule, llm_engine.LLMEngine.step
    now: dict[str, float] = {}

    def traced_schedule(self: Any) -> Any:
        out = schedule(self)
        rows = [(Rows.prefill if self.prefilling(s) else Rows.decode)(n, s.num_cached) for s, n in out]
        dec, chunk = [r for r in rows if not r.prompt], [r for r in rows if r.prompt]
        cost = self.cost
        now.update(pred=cost.predict_ms(rows) if cost and rows else 0.0,
                   decode_ms=cost.decode_ms(dec) if cost and dec else 0.0, decode_ctx=sum(r.context for r in dec),
                   chunk=sum(r.n for r in chunk), chunk_ctx=chunk[0].context if chunk else 0)
        return out

    def traced_step(self: Any) -> Any:
        now.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = step(self)
        if now:
            steps.append({**now, "t0": t0, "t1": time.perf_counter(), "cpu": (time.thread_time() - c0) * 1e3})
        return out

    scheduler.Scheduler.schedule = traced_schedule  # type: ignore[method-assign]
    llm_engine.LLMEngine.step = traced_step  # type: ignore[method-assign]
    gc.callbacks.append(_on_gc)
    signal.signal(signal.SIGUSR1, dump)


def _q(v: list[float], f: float) -> float:
    return sorted(v)[int(f * (len(v) - 1))]


def report(trace: dict[str, Any], t_arrival: float, t_first: float, gaps: list[tuple[float, float]],
           itl: float) -> list[str]:
    """Lines on where the largest gaps of one run came from: ``gaps`` (gap s, its end time) after the
    arrival at ``t_arrival`` (its first token at ``t_first``), ``itl`` the streams' median ITL before (s)."""
    during = [s for s in trace["steps"] if t_arrival <= s["t0"] <= t_first]
    if not during:
        return ["    (no traced steps in the window)"]
    out = []
    for gap, end in sorted(gaps, reverse=True)[:2]:
        over = [s for s in trace["steps"] if s["t1"] > end - gap - 0.002 and s["t0"] < end]
        held = [f"{(b - a) * 1e3:.0f} ms gen {g} ({t})" for a, b, g, t in trace["gc"] if b > end - gap and a < end
                and b - a > 0.002]
        spans = "; ".join(f"wall {(s['t1'] - s['t0']) * 1e3:.0f} cpu {s['cpu']:.0f} predicted {s['pred']:.0f} "
                          f"(chunk {s['chunk']:.0f} at {s['chunk_ctx']:.0f}, decode_ms {s['decode_ms']:.0f} = "
                          f"{s['decode_ms'] / (itl * 1e3):.2f}x ITL)" for s in over)
        out.append(f"    gap {gap * 1e3:.0f} ms ({gap / itl:.1f}x) ending +{end - t_arrival:.2f} s: steps {spans}"
                   + (f"; gc {', '.join(held)}" if held else ""))
    chunk = [s for s in during if s["chunk"]]
    if chunk:
        wall = [(s["t1"] - s["t0"]) * 1e3 for s in chunk]
        by_wall = [w / s["pred"] for w, s in zip(wall, chunk, strict=True)]
        by_cpu = [s["cpu"] / s["pred"] for s in chunk]
        off = [w - s["cpu"] for w, s in zip(wall, chunk, strict=True)]
        late = chunk[3 * len(chunk) // 4:]
        ms = itl * 1e3
        out.append(f"    {len(chunk)} chunk steps: wall/predicted median {_q(by_wall, .5):.2f} max {max(by_wall):.2f}; "
                   f"CPU/predicted median {_q(by_cpu, .5):.2f} max {max(by_cpu):.2f}; wall - CPU p50 {_q(off, .5):.1f} "
                   f"p90 {_q(off, .9):.1f} max {max(off):.1f} ms; the last quarter's: predicted "
                   f"{_q([s['pred'] for s in late], .5) / ms:.2f}x ITL, decode_ms "
                   f"{_q([s['decode_ms'] for s in late], .5) / ms:.2f}x ITL, "
                   f"chunk {_q([s['chunk'] for s in late], .5):.0f}")
    long_gc = [(b - a) * 1e3 for a, b, g, t in trace["gc"] if t_arrival <= a <= t_first]
    out.append(f"    GC while the prompt was fed: {len(long_gc)} collections, longest "
               f"{max(long_gc, default=0.0):.1f} ms")
    return out


if __name__ == "__main__":
    assert PATH, "set RATCHET_STEP_TRACE to the trace file's path"
    install()
    from ratchetlm.cli import main

    sys.argv = ["ratchet", *sys.argv[1:]]
    raise SystemExit(main())
