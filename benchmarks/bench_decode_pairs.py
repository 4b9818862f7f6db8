"""Batch-1 decode, ratchetlm vs llama-cpp-python, as interleaved pairs in one process (issues 13/14).

``ratchet bench`` runs each engine in its own process, one after the other; on a shared machine whose
speed drifts over minutes (this session's VM: llama-cpp-python's own decode of the bundled model
measured 120-157 tok/s across runs) a ratio of two such runs moves by +-20%. Here both engines are
loaded in one process (same file, same threads) and alternate: ratchetlm, llama.cpp, ratchetlm, ...
Each pair gives one ratio from two runs seconds apart; the median of the pairs' ratios is printed,
with each engine's median tok/s. Decode time is from every sequence's first token to the last
(the runners of ratchetlm/bench.py: greedy, EOS banned, the same prompt tokens).

    python benchmarks/bench_decode_pairs.py [--model FILE.gguf] [--pairs 9] [--tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from ratchetlm.bench import LlamaCppRunner, RatchetRunner
from ratchetlm.models.loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = args.model or str(default_model_path())
    torch.set_num_threads(args.threads)
    ctx = 64 + args.tokens
    ours, peer = RatchetRunner(path, False, ctx, 1), LlamaCppRunner(path, args.threads, ctx, 1)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]  # token ids both engines accept; the content does not matter for speed
    for r in (ours, peer):
        r.generate(prompt, 4)  # warm-up (kernels packed, caches touched)
    speeds: dict[str, list[float]] = {"ratchetlm": [], "llama.cpp": []}
    ratios = []
    for _ in range(args.pairs):
        pair = []
        for name, r in (("ratchetlm", ours), ("llama.cpp", peer)):
            r.generate(prompt, args.tokens)
            assert r.decode_s is not None
            pair.append((args.tokens - 1) / r.decode_s)
            speeds[name].append(pair[-1])
        ratios.append(pair[0] / pair[1])
    print(f"{os.path.basename(path)}, {args.threads} threads, {args.pairs} interleaved pairs of {args.tokens} "
          f"tokens, load average {os.getloadavg()[0]:.1f}")
    print(f"decode b1 tok/s (median): ratchetlm {statistics.median(speeds['ratchetlm']):.1f}, llama-cpp-python "
          f"{statistics.median(speeds['llama.cpp']):.1f}; ratio per pair: median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
