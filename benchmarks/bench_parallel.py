"""Tensor parallelism (TP=1 vs TP=2, offline engine) and data-parallel replicas (DP=1 vs DP=2,
``ratchet serve``) throughput, each configuration in its own process, in one script.

    python benchmarks/bench_parallel.py --tp-model /work/gguf/random-1b-Q4_K_M.gguf

TP: ``LLM.generate`` of ``--batch`` prompts (each size) x ``--tokens`` greedy tokens (EOS ignored), median of
``--repeats`` runs after a warm-up, on a model that splits over 2 ranks (the default SmolLM2-135M
has 9 heads and does not: use a real-shape random file, benchmarks/make_gguf.py). TP=1 runs with
``--threads`` torch threads, TP=2 with ``--threads // 2`` per rank (the ranks share the cores). Also
load time, memory of every rank (RSS, and PSS: pages of the mmapped file that ranks share counted
once; KV cache 128 MiB per rank), and whether both produced the same tokens.
DP: streaming completions at ``--concurrency`` against ``ratchet serve`` (benchmarks/bench_serve.py's
client) with ``--data-parallel-size`` 1 and 2, each replica ``--threads // replicas`` threads.
Prints ``uptime`` before and after: on a shared machine the load decides more than anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tp_run(model: str, tp: int, threads: int, batches: list[int], tokens: int, repeats: int) -> dict:
    """One TP configuration, in this process (called through a subprocess)."""
    import psutil
    import torch

    from ratchetlm import LLM, SamplingParams

    torch.set_num_threads(threads)
    t = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, progress=False, max_model_len=512, kv_cache_bytes=128 << 20)
    load = time.perf_counter() - t
    prompts = [f"Request {i}: write a short note about the number {i * 37 % 101} and why it matters."
               for i in range(max(batches))]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    rows, outs = {}, {}
    for batch in batches:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            outs[batch] = [o.outputs[0].token_ids for o in llm.generate(prompts[:batch], params)]
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        rows[batch] = {"median_s": med, "tok_s": batch * tokens / med, "runs_s": times}
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    mem = [p.memory_full_info() for p in procs]
    llm.close()
    return {"tp": tp, "threads_per_rank": torch.get_num_threads() if tp == 1 else max(1, threads // tp),
            "load_s": load, "rows": rows, "rss_gb": [m.rss / 2**30 for m in mem],
            "pss_gb": [m.pss / 2**30 for m in mem], "tokens": outs}


def dp_run(replicas: int, threads: int, concurrency: int, tokens: int) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_serve

    per = max(1, threads // replicas)
    proc, url = bench_serve.start_server(["--data-parallel-size", str(replicas), "--torch-threads", str(per),
                                          "--kv-cache-blocks", "512"])
    try:
        import httpx

        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(bench_serve.level(url, model, 1, 1, 4))  # warm-up
        walls = []
        for _ in range(3):
            results, wall = asyncio.run(bench_serve.level(url, model, concurrency, 2 * concurrency, tokens))
            assert all(r.ok for r in results)
            walls.append((sum(r.output_tokens for r in results) / wall, results))
        tps = statistics.median(w for w, _ in walls)
        ttft = statistics.median(r.ttft for _, rs in walls for r in rs)
        return {"dp": replicas, "threads_per_replica": per, "tok_s": tps, "runs_tok_s": [w for w, _ in walls],
                "ttft_median_ms": ttft * 1e3}
    finally:
        proc.terminate()
        proc.wait(30)


def sub(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false"))
    if out.returncode:
        raise SystemExit(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp-model", default="/work/gguf/random-1b-Q4_K_M.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma-separated: tp, dp")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one configuration
    args = ap.parse_args()
    if args.one:
        kind, n = args.one.split("=")
        batches = [int(b) for b in args.batch.split(",")]
        res = (tp_run(args.tp_model, int(n), args.threads, batches, args.tokens, args.repeats) if kind == "tp"
               else dp_run(int(n), args.threads, args.concurrency, args.tokens))
        print(json.dumps(res))
        return
    common = ["--tp-model", args.tp_model, "--threads", str(args.threads), "--batch", str(args.batch), "--tokens",
              str(args.tokens), "--repeats", str(args.repeats), "--concurrency", str(args.concurrency)]
    print("load before:", os.getloadavg())
    if "tp" not in args.skip:
        one, two = (sub([*common, "--one", f"tp={n}"]) for n in (1, 2))
        print(f"\nTP  model={os.path.basename(args.tp_model)} tokens={args.tokens} repeats={args.repeats}")
        print("| TP | threads/rank | load (s) | batch | generate median (s) | output tok/s | vs TP=1 |")
        print("|---|---|---|---|---|---|---|")
        for r in (one, two):
            for b, row in r["rows"].items():
                print(f"| {r['tp']} | {r['threads_per_rank']} | {r['load_s']:.1f} | {b} | {row['median_s']:.2f} | "
                      f"{row['tok_s']:.1f} | {row['tok_s'] / one['rows'][b]['tok_s']:.2f}x |")
        for r in (one, two):
            print(f"TP={r['tp']} memory per rank: RSS {' + '.join(f'{g:.2f}' for g in r['rss_gb'])} GB, "
                  f"PSS {' + '.join(f'{g:.2f}' for g in r['pss_gb'])} GB")
        print("same tokens TP=1 vs TP=2:", one["tokens"] == two["tokens"])
        print("load now:", os.getloadavg())
    if "dp" not in args.skip:
        one, two = (sub([*common, "--one", f"dp={n}"]) for n in (1, 2))
        print(f"\nDP  ratchet serve (SmolLM2-135M) concurrency={args.concurrency} requests={2 * args.concurrency} "
              f"tokens={args.tokens}, median of 3")
        print("| DP | threads/replica | output tok/s | vs DP=1 | TTFT median (ms) |")
        print("|---|---|---|---|---|")
        for r in (one, two):
            print(f"| {r['dp']} | {r['threads_per_replica']} | {r['tok_s']:.1f} | {r['tok_s'] / one['tok_s']:.2f}x "
                  f"| {r['ttft_median_ms']:.0f} |")
    print("load after:", os.getloadavg())


if __name__ == "__main__":
    main()
