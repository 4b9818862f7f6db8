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
import time
from typing import Any

import torch

import ratchetlm.models.decode_chain as decode_chain
from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.layers.attention import kv_half

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
    last: dict[str, Any] = {}
    run = decode_chain.DecodeChain.run

    def recorded(self: Any, x: Any, cos_sin: Any, batch: Any, num_layers: int) -> Any:
        last.update(chain=self, batch=batch, layers=num_layers)
        return run(self, x, cos_sin, batch, num_layers)

    decode_chain.DecodeChain.run = recorded  # type: ignore[method-assign]

    def attention_alone() -> float:  # CPU ms of the last step's attention calls, every layer
        ch, b = last["chain"], last["batch"]
        slots, half = b.slot_rows_ptr(0), int(kv_half(b.cache))
        t0 = time.thread_time()
        for i in range(last["layers"]):
            kc, vc = b.cache.layer_kv(i)
            ch.lib.ratchet_attention(ch.qb.data_ptr(), ch.k_all[i].data_ptr(), ch.v_all[i].data_ptr(), kc.data_ptr(),
                                     vc.data_ptr(), slots, b.max_ctx, b.seq_meta.data_ptr(), b.max_new, 0, b.num_seqs,
                                     ch.nh, ch.nkv, ch.hd, 0.125, 0.0, half, ch.attn.data_ptr(), args.threads)
        return (time.thread_time() - t0) * 1e3

    print(f"tree {os.path.dirname(os.path.dirname(os.path.abspath(decode_chain.__file__)))}; threads {args.threads}")
    print("| streams' cached tokens (4 x) | prompt's | k | step CPU (ms) | its attention alone (ms) | load |")
    print("|---|---|---|---|---|---|")
    for pair in args.at:
        sc, pc = (int(x) for x in pair.split(":"))
        eng = LLMEngine(EngineConfig(progress=False), llm.engine.model, llm.model_config)
        for i in range(4):
            eng.add_request(ids[i * 7 : i * 7 + sc], SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True))
        while any(not s.output_ids for s in eng.seqs.values()):
            eng.step()
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
                seen[n].append(((time.thread_time() - c0) * 1e3, attention_alone()))
        streams = [s.num_cached for s in eng.seqs.values() if s.seq_id != long]
        for n, v in seen.items():
            print(f"| {min(streams)}-{max(streams)} | {eng.seqs[long].num_cached} | {n} | "
                  f"{statistics.median(x[0] for x in v):.1f} | {statistics.median(x[1] for x in v):.1f} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)
        del eng


if __name__ == "__main__":
    main()
