"""Cost curve of a forward over k tentative rows (issue 14): time(k rows) / time(1 row), k = 1..32,
per numerics mode, on one GGUF file (default: the bundled SmolLM2-135M-Instruct).

A forward here is the model and its head over k new tokens with no cached context (what a verify
step costs apart from attending to the context, which is small at these lengths), timed by
ratchetlm/decoding/speculative/cost_curve.py: wall-clock medians of ``--repeats`` after a warm-up.
The ratios are what a speculative draft of k - 1 tokens must beat. Beside them: the curve the
engine's gain schedule measures for itself at start (four layers scaled plus the head, wall time,
fastest of three) and what that probe cost, so the two can be compared.

    python benchmarks/bench_cost_curve.py [--model PATH.gguf] [--modes exact int8 int16] [--threads 2]
        [--clock wall|cpu] [--agg median|min] [--rows 1 9 17 33 65] [--contexts 0 512 1500]

``--rows``: the row counts to time (default the engine's probe points, 1-32; a verify of an n-node tree
is n + 1 rows). ``--contexts``: also time each row count on top of that many cached tokens (every
verified row reads them; the engine's probe prices them by two per-token terms): one table per context,
each ratio against one row at no context.

``--clock cpu --agg min`` (one thread only) times each forward by the process's CPU seconds and keeps
the fastest: on a machine shared with other jobs wall-clock medians measure the neighbours (the
engine's own probe, decoding/speculative/cost_curve.py, uses CPU time at one thread for that reason).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ratchetlm import LLM
from ratchetlm.decoding.speculative import cost_curve

ROWS = cost_curve.ROWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", nargs="+", default=["exact", "int8", "int16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or the process's CPU time (one thread only)")
    ap.add_argument("--agg", choices=("median", "min"), default="median")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts (1 first)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[0], help="cached tokens under the rows")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1 (CPU time adds up every thread's work)")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    agg = statistics.median if args.agg == "median" else min
    print(f"model {args.model or 'default (bundled SmolLM2-135M-Instruct GGUF)'}; threads {args.threads}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"ms per forward ({args.agg} of {args.repeats}, {args.clock} clock) and ratio to 1 row; "
          "'probe': the engine's own curve")
    rows = sorted(set(args.rows) | {1})
    print(f"{'mode':>6} {'context':>7} " + " ".join(f"{'k=' + str(k):>14}" for k in rows))
    cpu = torch.device("cpu")
    for mode in args.modes:
        blocks = 16 + (max(args.contexts) + max(rows)) // 8  # room for the longest context (blocks of >= 8)
        llm = LLM(args.model, progress=False, numerics=mode, kv_cache_blocks=blocks)
        model, cache = llm.engine.model, llm.engine.runner.cache
        one = None
        for ctx in args.contexts:
            ms = [1e3 * cost_curve.seconds(model, cpu, k, args.repeats, agg=agg, clock=clock,
                                           cache=cache if ctx else None, context=ctx) for k in rows]
            one = one or ms[0]
            print(f"{mode:>6} {ctx:>7} " + " ".join(f"{t:8.1f} {t / one:4.2f}x" for t in ms), flush=True)
        t, c = time.perf_counter(), time.process_time()
        probe = cost_curve.curve(model, cpu)
        print(f"{'probe':>6} " + " ".join(f"{x:13.2f}x" for x in probe.cost)
              + f"   ({time.perf_counter() - t:.2f} s wall, {time.process_time() - c:.2f} s CPU)", flush=True)
        del llm, model
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
