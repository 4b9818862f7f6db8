"""What a prompt chunk adds to a step of four decode rows, by chunk size and context, and how much of
that is the attention kernel.

Four greedy streams (default model, engine defaults) hold about S cached tokens each; a prompt is
prefilled to about P cached tokens in 64-token chunks beside them; then each step adds a chunk of k =
0, 1, 3, 6, 12 tokens (forced, in turn, ``--rounds`` rounds). Per k: the step's median CPU time (the
engine thread's: steadier than wall time on a shared machine) and that of its 30 attention calls
alone, replayed right after it on the step's own buffers (as benchmarks/bench_attention_context.py
does). Late in a long prompt a chunk step holds a few tokens; this says what they cost beside the
decode rows and the weights every forward reads.

    PYTHONPATH=$PWD python benchmarks/bench_chunk_cost.py --threads 1 --at 30:200 150:1000 300:1800
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import ratchetlm.models.decode_chain as decode_chain
from ratchetlm import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_replay import AttentionReplay, four_streams  # noqa: E402

KS = (0, 1, 3, 6, 12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--at", nargs="*", default=["30:200", "150:1000", "300:1800"],
                    help="S:P pairs: the streams' and the prompt's cached tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(progress=False)
    ids = llm.tokenize(" ".join(f"word{i} river{i % 7}" for i in range(3000)))
    replay = AttentionReplay()

    print(f"tree {os.path.dirname(os.path.dirname(os.path.abspath(decode_chain.__file__)))}; threads {args.threads}")
    print("| streams' cached tokens (4 x) | prompt's | k | step CPU (ms) | its attention alone (ms) | load |")
    print("|---|---|---|---|---|---|")
    for pair in args.at:
        sc, pc = (int(x) for x in pair.split(":"))
        eng = four_streams(llm, ids, sc)
        k = [64]
        eng.scheduler._chunk = lambda step, seq, want, k=k: min(k[0], want)  # type: ignore[method-assign]
        long = eng.add_request(ids[1000 : 1000 + pc + 200], SamplingParams(max_tokens=1, temperature=0))
        while eng.seqs[long].num_cached < pc:
            eng.step()
        seen: dict[int, list[tuple[float, float]]] = {n: [] for n in KS}
        for _ in range(args.rounds):
            for n in KS:
                k[0] = n
                c0 = time.thread_time()
                eng.step()
                seen[n].append(((time.thread_time() - c0) * 1e3, replay.ms(args.threads, time.thread_time)))
        streams = [s.num_cached for s in eng.seqs.values() if s.seq_id != long]
        for n, v in seen.items():
            print(f"| {min(streams)}-{max(streams)} | {eng.seqs[long].num_cached} | {n} | "
                  f"{statistics.median(x[0] for x in v):.1f} | {statistics.median(x[1] for x in v):.1f} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)
        del eng


if __name__ == "__main__":
    main()
