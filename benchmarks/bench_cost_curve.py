"""Cost curve of a forward over k tentative rows (issue 14): time(k rows) / time(1 row), k = 1..32,
per numerics mode, on one GGUF file (default: the bundled SmolLM2-135M-Instruct).

A forward here is the model and its head over k new tokens with no cached context (what a verify
step costs apart from attending to the context, which is small at these lengths). Medians of
``--repeats`` after a warm-up; the ratios are what a speculative draft of k - 1 tokens must beat.

    python benchmarks/bench_cost_curve.py [--model PATH.gguf] [--modes exact int8 int16] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ratchetlm import LLM
from ratchetlm.kv.sink import NullSink
from ratchetlm.layers.attention import build_attention_batch

ROWS = (1, 2, 4, 8, 16, 32)


def forward_ms(llm: LLM, k: int, repeats: int) -> float:
    model = llm.engine.model
    ids = torch.arange(100, 100 + k)
    batch = build_attention_batch(torch.arange(k), [k], [torch.empty(0, dtype=torch.long)], [None], NullSink(), None)
    times = []
    with torch.inference_mode():
        model.logits(model(ids, batch))
        for _ in range(repeats):
            t = time.perf_counter()
            model.logits(model(ids, batch))
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", nargs="+", default=["exact", "int8", "int16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; ms per forward (median of {args.repeats}) and ratio to 1 row")
    print(f"{'mode':>6} " + " ".join(f"{'k=' + str(k):>14}" for k in ROWS))
    for mode in args.modes:
        llm = LLM(args.model, progress=False, numerics=mode, kv_cache_blocks=16)
        ms = [forward_ms(llm, k, args.repeats) for k in ROWS]
        print(f"{mode:>6} " + " ".join(f"{t:8.1f} {t / ms[0]:4.2f}x" for t in ms), flush=True)
        del llm


if __name__ == "__main__":
    main()
