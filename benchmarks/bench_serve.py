"""Load client for ``ratchet serve``: TTFT, inter-token latency and output tokens/s at several
concurrency levels, measured like ``vllm bench serve`` (streaming completions with
``stream_options.include_usage``; TTFT = first SSE event with non-empty ``choices``; ITL = gap
between successive choice events; output tokens from ``usage.completion_tokens``).

    python benchmarks/bench_serve.py                       # starts its own server on a free port
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model NAME
    python benchmarks/bench_serve.py --server-args "--decoding speculative --decoding-options '{\"method\": \"ngram\"}'"

Prints medians and p90 per concurrency level and the throughput ratio vs concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    ok: bool = False


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    t0 = time.perf_counter()
    last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("choices"):
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
            elif chunk.get("usage"):
                res.output_tokens = chunk["usage"]["completion_tokens"]
    res.e2e = time.perf_counter() - t0
    res.ok = last is not None
    return res


async def level(url: str, model: str, concurrency: int, num: int, max_tokens: int) -> tuple[list[Result], float]:
    prompts = [f"Request {i}: write a short note about the number {i * 37 % 101} and why it matters."
               for i in range(num)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def bounded(p: str) -> Result:
            async with sem:
                return await one(c, url, model, p, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        return list(results), time.perf_counter() - t0


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ratchetlm", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", *extra], env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="existing server (default: start one)")
    ap.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    ap.add_argument("--server-args", default="--torch-threads 1", help="extra `ratchet serve` flags")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-requests", type=int, default=0, help="requests per level (default: 2 x concurrency, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(shlex.split(args.server_args))
    try:
        model = args.model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(level(url, model, 1, 1, 4))  # warm-up
        rows = []
        for c in (int(x) for x in args.concurrency.split(",")):
            n = args.num_requests or max(4, 2 * c)
            results, wall = asyncio.run(level(url, model, c, n, args.max_tokens))
            good = [r for r in results if r.ok]
            ttft = [r.ttft for r in good]
            itl = [x for r in good for x in r.itl]
            out = sum(r.output_tokens for r in good)
            rows.append((c, n, len(good), ttft, itl, out / wall))
        base = rows[0][5]
        print(f"\nmodel={model}  max_tokens={args.max_tokens}  server_args={args.server_args!r}")
        print("| concurrency | requests | ok | TTFT median (ms) | TTFT p90 (ms) | ITL median (ms) | ITL p90 (ms) "
              "| output tok/s | vs c=1 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c, n, ok, ttft, itl, tps in rows:
            print(f"| {c} | {n} | {ok} | {statistics.median(ttft) * 1e3:.0f} | {pct(ttft, 0.9) * 1e3:.0f} | "
                  f"{statistics.median(itl) * 1e3:.0f} | {pct(itl, 0.9) * 1e3:.0f} | {tps:.1f} | {tps / base:.2f}x |")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
