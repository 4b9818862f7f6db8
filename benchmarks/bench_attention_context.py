"""What a decode step costs as the streams' context grows, and how much of it is the attention kernel.

Four greedy streams (default model, engine defaults: the integer numerics, a half KV cache) are prefilled
to about C cached tokens each, then decode; per C: the median step (wall and process CPU time) and the
median time of the step's 30 attention calls alone, replayed right after it on the step's own buffers
(``kernels/attention.c`` as the decode chain calls it: same queries, cache, slots and thread count).
Run it once per checkout to compare trees, alternating (the kernel is compiled from the tree imported):

    PYTHONPATH=/path/to/main python benchmarks/bench_attention_context.py --threads 1 20 250 1000
    PYTHONPATH=$PWD          python benchmarks/bench_attention_context.py --threads 1 20 250 1000

The load average is printed beside every line (on a shared machine CPU time is the steadier number).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import ratchetlm.models.decode_chain as decode_chain
from ratchetlm import LLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_replay import AttentionReplay, four_streams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("contexts", type=int, nargs="*", default=[20, 250, 1000])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15, help="timed decode steps per context")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(progress=False)
    ids = llm.tokenize(" ".join(f"word{i} river{i % 7}" for i in range(3000)))
    replay = AttentionReplay()

    print(f"tree {os.path.dirname(os.path.dirname(os.path.abspath(decode_chain.__file__)))}; threads {args.threads}")
    for c in args.contexts:
        eng = four_streams(llm, ids, c)
        for _ in range(3):
            eng.step()
        wall, cpu, att = [], [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            eng.step()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            att.append(replay.ms(args.threads))
        cached = [s.num_cached for s in eng.seqs.values()]
        print(f"4 streams at {min(cached)}-{max(cached)} cached tokens: step {statistics.median(wall):.1f} ms wall, "
              f"{statistics.median(cpu):.1f} ms CPU; its attention calls alone {statistics.median(att):.1f} ms "
              f"(medians of {args.steps}); load {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        del eng


if __name__ == "__main__":
    main()
