"""Load client for ``ratchet serve``: TTFT, inter-token latency and output tokens/s at several
concurrency levels, measured like ``vllm bench serve`` (streaming completions with
``stream_options.include_usage``; TTFT = first SSE event with non-empty ``choices``; ITL = gap
between successive choice events; output tokens from ``usage.completion_tokens``).

    python benchmarks/bench_serve.py                       # starts its own server on a free port
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model NAME
    python benchmarks/bench_serve.py --server-args "--decoding speculative --decoding-options '{\"method\": \"ngram\"}'"
    python benchmarks/bench_serve.py --peer llama-cpp --prompts spec-bench --concurrency 1,4,16 \
        --num-requests 16 --max-tokens 64 --threads 1

Prints medians and p90 per concurrency level and the throughput ratio vs concurrency 1. With
``--peer llama-cpp`` it also starts llama-cpp-python's OpenAI server (``python -m llama_cpp.server``)
on the same GGUF file (``--gguf``, default: the bundled model) with the same threads, runs every level
against both in turn (ours first, then the peer, level by level, so both see the same machine), and
prints output tokens/s, TTFT and ITL p50/p99 side by side. Each request asks for exactly
``--max-tokens`` tokens: ``ignore_eos`` here, ``min_tokens`` there (its server has no ``ignore_eos``),
greedy, no repetition penalty (llama-cpp-python's default is 1.1). llama-cpp-python's server runs one
request at a time (one ``Llama`` under a lock): its concurrency is a queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.serve_common import Timings, start_llama_cpp, start_ratchet, stop, stream_completion  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def synthetic_prompts(num: int) -> list[str]:
    return [f"Request {i}: write a short note about the number {i * 37 % 101} and why it matters." for i in range(num)]


def spec_bench_prompts(num: int) -> list[str]:
    """The first turns of Spec-Bench's questions, ``num`` of them spread over its categories in turn."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "spec_bench", "question.jsonl")
    by_cat: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            by_cat.setdefault(q["category"], []).append(q["turns"][0])
    cats = list(by_cat.values())
    return [cats[i % len(cats)][i // len(cats)] for i in range(num)]


async def level(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[Timings], float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def bounded(body: dict[str, Any]) -> Timings:
            async with sem:
                try:
                    return await stream_completion(c, url, body)
                except (RuntimeError, httpx.HTTPError) as e:
                    print(f"    request failed: {e}", file=sys.stderr)
                    return Timings()

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        return list(results), time.perf_counter() - t0


@dataclass
class Row:
    concurrency: int
    requests: int
    ok: int
    ttft: list[float]
    itl: list[float]
    tokens: int
    tps: float


def run_level(url: str, bodies: list[dict[str, Any]], concurrency: int) -> Row:
    results, wall = asyncio.run(level(url, bodies, concurrency))
    good = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in good)
    return Row(concurrency, len(bodies), len(good), [r.ttft for r in good], [x for r in good for x in r.itl], out,
               out / wall)


def ours_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def llama_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
            "repeat_penalty": 1.0}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="existing server (default: start one)")
    ap.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    ap.add_argument("--server-args", default="", help="extra `ratchet serve` flags")
    ap.add_argument("--threads", type=int, default=1, help="--torch-threads of our server; --n_threads of the peer")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-requests", type=int, default=0, help="requests per level (default: 2 x concurrency, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", choices=["synthetic", "spec-bench"], default="synthetic",
                    help="synthetic one-line notes, or Spec-Bench's first turns (benchmarks/data/spec_bench)")
    ap.add_argument("--peer", choices=["none", "llama-cpp"], default="none",
                    help="also run llama-cpp-python's OpenAI server on the same GGUF file and threads")
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: the bundled model); our server loads it too")
    args = ap.parse_args()
    from ratchetlm.models.loader import default_model_path

    gguf = args.gguf or str(default_model_path())
    procs = []
    servers: list[tuple[str, str, Any]] = []  # (name, url, body factory)
    try:
        if args.url is None:
            extra = ["--model", gguf, "--torch-threads", str(args.threads), *shlex.split(args.server_args)]
            proc, url = start_ratchet(extra)
            procs.append(proc)
        else:
            url = args.url
        servers.append(("ratchet", url, ours_body))
        if args.peer == "llama-cpp":
            proc, peer_url = start_llama_cpp(gguf, args.threads)
            procs.append(proc)
            servers.append(("llama-cpp-python", peer_url, llama_body))
        models = {name: args.model or httpx.get(u + "/v1/models").json()["data"][0]["id"] for name, u, _ in servers}
        for name, u, body in servers:  # warm-up
            run_level(u, [body(models[name], "Hello", 4)], 1)
        rows: dict[str, list[Row]] = {name: [] for name, _, _ in servers}
        for c in (int(x) for x in args.concurrency.split(",")):
            n = args.num_requests or max(4, 2 * c)
            prompts = (spec_bench_prompts if args.prompts == "spec-bench" else synthetic_prompts)(n)
            for name, u, body in servers:
                rows[name].append(run_level(u, [body(models[name], p, args.max_tokens) for p in prompts], c))
                print(f"  {name} c={c}: {rows[name][-1].tps:.1f} tok/s  load {load()}", file=sys.stderr)
        print(f"\ngguf={gguf}  prompts={args.prompts}  max_tokens={args.max_tokens}  threads={args.threads}  "
              f"server_args={args.server_args!r}  load at end {load()}")
        if len(servers) == 1:
            base = rows["ratchet"][0].tps
            print("| concurrency | requests | ok | TTFT median (ms) | TTFT p90 (ms) | ITL median (ms) | ITL p90 (ms) "
                  "| output tok/s | vs c=1 |")
            print("|---|---|---|---|---|---|---|---|---|")
            for r in rows["ratchet"]:
                print(f"| {r.concurrency} | {r.requests} | {r.ok} | {statistics.median(r.ttft) * 1e3:.0f} | "
                      f"{pct(r.ttft, 0.9) * 1e3:.0f} | {statistics.median(r.itl) * 1e3:.0f} | "
                      f"{pct(r.itl, 0.9) * 1e3:.0f} | {r.tps:.1f} | {r.tps / base:.2f}x |")
            return
        ms = lambda x: f"{x * 1e3:,.0f}"  # noqa: E731
        print("| concurrency | server | ok | output tokens | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
        print("|---|---|---|---|---|---|---|")
        for i, _ in enumerate(rows["ratchet"]):
            for name in rows:
                r = rows[name][i]
                print(f"| {r.concurrency} | {name} | {r.ok}/{r.requests} | {r.tokens} | {r.tps:.1f} | "
                      f"{ms(pct(r.ttft, 0.5))} / {ms(pct(r.ttft, 0.99))} | "
                      f"{ms(pct(r.itl, 0.5))} / {ms(pct(r.itl, 0.99))} |")
        print("\n| concurrency | output tok/s ratchet / llama-cpp-python |")
        print("|---|---|")
        for a, b in zip(rows["ratchet"], rows["llama-cpp-python"], strict=True):
            print(f"| {a.concurrency} | {a.tps / b.tps:.2f}x |")
    finally:
        for proc in procs:
            stop(proc)


if __name__ == "__main__":
    main()
