"""Step times of a fresh engine while its blocks reach new regions of the KV pools, with and without
``kv_prefault`` (kv/prefault.py): each setting in a process of its own (fresh pools, as a server starts),
one after the other, alternating, ``--rounds`` each.

A batch of ``--batch`` requests of ``--prompt`` random prompt tokens decoding ``--tokens`` tokens each moves
the highest block in use through ``batch * (prompt + tokens)`` slots; on the default model a 2 MB region of
a layer's pool holds ~5,460 slots, and all 30 layers' K and V reach their next region in the same step. Per
run: the median decode step, the slowest, and how many steps took over ``--slow`` times the median.

    python benchmarks/bench_prefault.py [--batch 16] [--prompt 600] [--tokens 128] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one(a: argparse.Namespace, prefault: bool) -> dict[str, float]:
    import torch

    from ratchetlm import LLM, SamplingParams

    torch.set_num_threads(a.threads)
    llm = LLM(numerics="int8", progress=False, kv_prefault=prefault)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for _ in range(a.batch):
        ids = torch.randint(100, 40000, (a.prompt,), generator=g).tolist()
        eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        prefill = bool(eng.scheduler.waiting) or any(eng.scheduler.prefilling(s) for s in eng.scheduler.running)
        t = time.perf_counter()
        eng.step()
        if not prefill:
            steps.append(time.perf_counter() - t)
    med = statistics.median(steps)
    return {"median_ms": med * 1e3, "max_ms": max(steps) * 1e3, "slow": sum(s > a.slow * med for s in steps),
            "steps": len(steps), "slots": eng.runner.blocks.high_water * eng.runner.blocks.block_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slow", type=float, default=3.0)
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a, a.child == "on")))
        return
    print(f"batch {a.batch} x ({a.prompt} prompt + {a.tokens} decoded) tokens, {a.threads} thread(s), load "
          f"{os.getloadavg()[0]:.1f}")
    print("| kv_prefault | round | slots reached | decode steps | median step ms | slowest ms | steps > "
          f"{a.slow:g}x median |\n|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", mode], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            d = json.loads(out)
            print(f"| {mode} | {r + 1} | {d['slots']} | {d['steps']} | {d['median_ms']:.1f} | {d['max_ms']:.1f} | "
                  f"{d['slow']} |", flush=True)


if __name__ == "__main__":
    main()
