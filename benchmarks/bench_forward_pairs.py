"""One model forward (body and head, no cached context) over R new rows through this tree's kernel build and
another build (``--against OTHER.so``, e.g. the cached library of another checkout), interleaved in one process:
a kernel change's effect at the model level, with the same Python code, weights and machine load on both sides.

Each round times every row count with each build in turn (the order alternating per round), ``--reps`` forwards a
cell; printed: the fastest forward per build and row count (``--clock cpu``: the process's CPU time, one thread)
and the median over rounds of this build's fastest over the other's in the same round (a shared machine's
speed drifts between rounds: a ratio of two overall minima can pair a lucky moment with an unlucky one). Both
builds must give the same logits (asserted): a numerics change cannot pass as a speed change. Swapping a build
resets every ``Linear``'s packed handle and rebuilds the decode chain (models/decode_chain.py binds its library),
so neither build runs a layer through the other.

    PYTHONPATH=. python benchmarks/bench_forward_pairs.py --against ~/.cache/ratchetlm/kernels/OTHER.so \\
        [--model FILE.gguf] [--numerics int8] [--rows 1 8 9 16 17] [--rounds 8] [--reps 4] [--threads 1] \\
        [--decode-batch 9 12 16 --decode-tokens 48]

``--decode-batch B ...``: also plain greedy decoding of B different short prompts at once through the engine
(``LLM.generate``, EOS ignored, ``--decode-tokens`` each: every decode step a forward of B rows, one per
sequence, over its own cached context), the whole call timed per build the same interleaved way (its prefill
is ~10 tokens a prompt), the token ids asserted equal.

The other tree's library: ``PYTHONPATH=OTHER python -c "from ratchetlm import kernels; print(kernels.load()._name)"``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from ratchetlm import LLM, SamplingParams, kernels
from ratchetlm.kv.sink import NullSink
from ratchetlm.layers.attention import build_attention_batch
from ratchetlm.layers.block_quant import Linear
from ratchetlm.models.decode_chain import DecodeChain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the other kernel library (.so)")
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--numerics", default="int8")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 7, 8, 9, 10, 12, 13, 16, 17, 24, 32])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4, help="forwards per build, row count and round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[], help="batch sizes of plain decoding")
    ap.add_argument("--decode-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1 (CPU time adds up every thread's work)")
    if not os.path.isfile(args.against):
        raise SystemExit(f"--against: no such file {args.against!r}")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    other = ctypes.CDLL(os.path.abspath(args.against))
    kernels._declare(other)
    this = kernels.load()
    if this is None:
        raise SystemExit("this tree's kernels did not build")
    decode_rows = max(args.decode_batch, default=0) * (args.decode_tokens + 32)  # cached tokens at most
    llm = LLM(args.model, progress=False, numerics=args.numerics,
              kv_cache_blocks=16 + (max(args.rows) + decode_rows) // 8)  # blocks of >= 8 tokens
    model = llm.engine.model
    builds = {"this": this, "other": other}

    def use(lib: ctypes.CDLL) -> None:
        kernels.load = lambda: lib  # every kernels.load() call site reads the module attribute
        for m in model.modules():
            if isinstance(m, Linear):
                m._q8_call = None  # repacked for (and bound to) lib at its next call
        if model._chain is not None:
            model._chain = DecodeChain.build(model)
            assert model._chain is not None and model._chain.lib is lib

    best = {(b, r): float("inf") for b in builds for r in args.rows}
    ratios: dict[int, list[float]] = {r: [] for r in args.rows}
    first: dict[tuple[str, int], torch.Tensor] = {}
    dec_best = {(b, n): float("inf") for b in builds for n in args.decode_batch}
    dec_ratios: dict[int, list[float]] = {n: [] for n in args.decode_batch}
    dec_ids: dict[tuple[str, int], list[list[int]]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    print(f"{args.model or 'default model'}, {args.numerics}, {args.threads} thread(s), {args.clock} clock; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    with torch.inference_mode():
        for rd in range(args.rounds):
            now: dict[tuple[str, int], float] = {}
            for name in (("this", "other") if rd % 2 == 0 else ("other", "this")):
                use(builds[name])
                for rows in args.rows:
                    ids = (torch.arange(rows) * 7919 + 100) % int(model.config.vocab_size)  # [rows]
                    batch = build_attention_batch(torch.arange(rows), [rows], [torch.arange(0, dtype=torch.long)],
                                                  [None], NullSink(), None)
                    logits = model.logits(model(ids, batch))  # warm-up (and the packed handles, the chain)
                    first.setdefault((name, rows), logits)
                    now[name, rows] = float("inf")
                    for _ in range(args.reps):
                        t = clock()
                        model.logits(model(ids, batch))
                        now[name, rows] = min(now[name, rows], clock() - t)
                    best[name, rows] = min(best[name, rows], now[name, rows])
                for n in args.decode_batch:
                    prompts = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(n)]
                    t = clock()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    now[name, -n] = clock() - t
                    dec_best[name, n] = min(dec_best[name, n], now[name, -n])
                    dec_ids.setdefault((name, n), [o.outputs[0].token_ids for o in outs])
            for r in args.rows:
                ratios[r].append(now["this", r] / now["other", r])
            for n in args.decode_batch:
                dec_ratios[n].append(now["this", -n] / now["other", -n])
    for rows in args.rows:
        assert torch.equal(first["this", rows], first["other", rows]), f"the builds' logits differ at {rows} rows"
    print("rows   " + " ".join(f"{r:>6}" for r in args.rows))
    for name in builds:
        print(f"{name:6} " + " ".join(f"{1e3 * best[name, r]:6.2f}" for r in args.rows) + "  ms")
    print("ratio  " + " ".join(f"{statistics.median(ratios[r]):6.3f}" for r in args.rows) + "  (median of rounds)")
    for n in args.decode_batch:
        assert dec_ids["this", n] == dec_ids["other", n], f"the builds' tokens differ at batch {n}"
        a, b = dec_best["this", n], dec_best["other", n]
        print(f"decode batch {n}, {args.decode_tokens} tokens each: this {1e3 * a:.0f} ms, other {1e3 * b:.0f} ms, "
              f"ratio {statistics.median(dec_ratios[n]):.3f} (median of rounds; fastest: "
              f"{n * args.decode_tokens / a:.0f} / {n * args.decode_tokens / b:.0f} tok/s)")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
