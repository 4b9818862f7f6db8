"""Soak test for ``ratchet serve`` (not run in CI): minutes of mixed traffic against one server with a
small KV cache (so preemption happens), random disconnects and bad requests, then the verdict.

    python benchmarks/soak_serve.py --minutes 10
    python benchmarks/soak_serve.py --minutes 2 --concurrency 16 --kv-cache-blocks 48

Traffic, drawn at random by each of ``--concurrency`` workers:
  * good requests (completions and chat, streamed or not, greedy or seeded sampling) whose output must
    equal the same request's output run alone at the start ("no mixed output");
  * disconnects: a stream closed after a few chunks, or a non-streaming request given up on;
  * bad requests that must get a 4xx: a lone surrogate, a wrong type, too many stop strings, a non-JSON
    content type, a wrong API key, an oversized body, a malformed body.

Asserted at the end: no lost request (every good request answered 200 with its reference output,
every bad one a 4xx, no 5xx, no transport error except the intended disconnects), every KV block
free, no handler left running (``/health`` ``http_requests_active`` 0), RSS flat (the last fifth's
median within ``--rss-slack-mb`` of the second fifth's). Prints the figures recorded in docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httpx

KEY = "soak-key"
MODEL = "soak"
PROMPTS = [
    "Write a haiku about the sea.",
    "Explain what a hash map is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "def fibonacci(n):\n    ",
    "Translate 'good morning' into French, Spanish and German.",
    "What is the capital of Australia? Answer:",
    "Summarize the plot of a heist movie in one paragraph.",
    "Give me a recipe for pancakes.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass(frozen=True)
class Good:
    """One good request shape; ``key`` identifies its reference output."""

    chat: bool
    prompt: str
    seed: int | None
    max_tokens: int

    def body(self, stream: bool) -> dict:
        b: dict = {"model": MODEL, "max_tokens": self.max_tokens, "stream": stream}
        if self.seed is None:
            b["temperature"] = 0
        else:
            b.update(temperature=0.9, top_p=0.95, seed=self.seed)
        if self.chat:
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        return b

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def shapes(max_tokens: int) -> list[Good]:
    out = []
    for i, p in enumerate(PROMPTS):
        for chat in (False, True):
            out.append(Good(chat, p, None, max_tokens))
            out.append(Good(chat, p, 1000 + i, max_tokens))
    return out


def text_of(obj: dict) -> str:
    ch = obj["choices"][0]
    if "message" in ch:
        return ch["message"]["content"]
    if "delta" in ch:
        return ch["delta"].get("content") or ""
    return ch["text"]


async def run_good(c: httpx.AsyncClient, base: str, g: Good, stream: bool) -> str:
    """The request's text; raises on anything but a clean 200 (and [DONE] when streamed)."""
    if not stream:
        r = await c.post(base + g.path, json=g.body(False))
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        return text_of(r.json())
    parts, done = [], False
    async with c.stream("POST", base + g.path, json=g.body(True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"in-stream error: {obj['error']}")
            parts.append(text_of(obj))
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return "".join(parts)


BAD = [
    ("surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', {}),
    ("wrong_type", "/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', {}),
    ("stop_flood", "/v1/completions", json.dumps({"prompt": "hi", "stop": ["s"] * 500}).encode(), {}),
    ("not_json", "/v1/completions", b'{"prompt": "hi"}', {"content-type": "text/plain"}),
    ("bad_key", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}',
     {"authorization": "Bearer wrong"}),
    ("oversized", "/v1/completions", b'{"prompt": "' + b"x" * (9 << 20) + b'"}', {}),
    ("malformed", "/v1/chat/completions", b'{"messages": [', {}),
    ("infinity", "/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', {}),
]


class Soak:
    def __init__(self, args: argparse.Namespace, base: str, refs: dict[Good, str]) -> None:
        self.args = args
        self.base = base
        self.refs = refs
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self.counts["FAILED"] += 1
        if len(self.failures) < 20:
            self.failures.append(what)

    async def worker(self, rng: random.Random, end: float) -> None:
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(timeout=600, headers=headers) as c:
            while time.monotonic() < end:
                x = rng.random()
                if x < 0.6:
                    await self.good(c, rng)
                elif x < 0.8:
                    await self.disconnect(c, rng)
                else:
                    await self.bad(c, rng)

    async def good(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        g = rng.choice(list(self.refs))
        stream = rng.random() < 0.5
        try:
            text = await run_good(c, self.base, g, stream)
        except Exception as e:  # noqa: BLE001 - any failure of a good request is a lost request
            self.fail(f"good {g.path} stream={stream}: {type(e).__name__}: {e}")
            return
        if text != self.refs[g]:
            self.fail(f"mixed output for {g}: {text!r} != {self.refs[g]!r}")
        else:
            self.counts["good_ok"] += 1

    async def disconnect(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        g = rng.choice(list(self.refs))
        body = {**g.body(rng.random() < 0.7), "max_tokens": 200, "ignore_eos": True}
        if body["stream"]:
            async with c.stream("POST", self.base + g.path, json=body) as r:
                if r.status_code != 200:
                    self.fail(f"disconnect stream got {r.status_code}")
                    return
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= rng.randint(1, 8):
                        break  # leaving the block closes the connection mid-stream
            self.counts["disconnect_stream"] += 1
        else:
            try:
                await c.post(self.base + g.path, json=body, timeout=httpx.Timeout(60, read=rng.uniform(0.2, 2.0)))
                self.counts["disconnect_too_late"] += 1  # finished before we gave up: fine
            except httpx.ReadTimeout:
                self.counts["disconnect_nonstream"] += 1

    async def bad(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        name, path, raw, headers = rng.choice(BAD)
        h = {"content-type": "application/json", **headers}
        try:
            r = await c.post(self.base + path, content=raw, headers=h)
        except httpx.TransportError as e:
            self.fail(f"bad {name}: transport error {e!r}")
            return
        if 400 <= r.status_code < 500 and "error" in r.json():
            self.counts["bad_4xx"] += 1
        else:
            self.fail(f"bad {name}: {r.status_code} {r.text[:200]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kv-cache-blocks", type=int, default=20, help="small, so the scheduler preempts")
    ap.add_argument("--rss-slack-mb", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="--torch-threads 1")
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ratchetlm", "serve", "--port", str(port), "--served-model-name", MODEL,
           "--api-key", KEY, "--kv-cache-blocks", str(args.kv_cache_blocks), "--max-model-len", "512",
           "--max-num-seqs", "16", "--log-level", "warning", *args.server_args.split()]
    proc = subprocess.Popen(cmd, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return asyncio.run(soak(args, base, proc))
    finally:
        proc.terminate()
        proc.wait(60)


async def soak(args: argparse.Namespace, base: str, proc: subprocess.Popen) -> int:
    async with httpx.AsyncClient(timeout=600, headers={"authorization": f"Bearer {KEY}"}) as c:
        refs = {g: await run_good(c, base, g, False) for g in shapes(args.max_tokens)}  # each alone
    s = Soak(args, base, refs)
    rss: list[tuple[float, float]] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60

    async def sample_rss() -> None:
        while time.monotonic() < end:
            rss.append((time.monotonic() - t0, rss_mb(proc.pid)))
            await asyncio.sleep(2.0)

    load0 = os.getloadavg()[0]
    await asyncio.gather(sample_rss(), *(s.worker(random.Random(args.seed * 1000 + i), end)
                                          for i in range(args.concurrency)))
    load1 = os.getloadavg()[0]
    # settle: aborted requests are freed before the next step; give the engine a moment
    deadline = time.monotonic() + 30
    while True:
        h = httpx.get(base + "/health", timeout=10).json()
        idle = h["requests_running"] == 0 and h["requests_waiting"] == 0 and h["http_requests_active"] == 0
        if (idle and h["kv_blocks_free"] == h["kv_blocks_total"]) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    metrics = httpx.get(base + "/metrics", timeout=10).text
    preempt = next((float(x.split()[-1]) for x in metrics.splitlines()
                    if x.startswith("ratchet:num_preemptions{")), float("nan"))
    fifth = max(1, len(rss) // 5)
    early = statistics.median(v for _, v in rss[fifth : 2 * fifth]) if len(rss) >= 5 else float("nan")
    late = statistics.median(v for _, v in rss[-fifth:]) if rss else float("nan")
    total = sum(v for k, v in s.counts.items() if k != "FAILED") + s.counts["FAILED"]
    print(f"soak: {args.minutes:g} min, {args.concurrency} workers, kv blocks {args.kv_cache_blocks}, "
          f"load avg {load0:.1f} -> {load1:.1f}")
    print(f"requests: {total} ({dict(sorted(s.counts.items()))})")
    print(f"preemptions: {preempt:g}")
    print(f"rss MB: start {rss[0][1]:.0f}, 2nd fifth median {early:.0f}, last fifth median {late:.0f}, "
          f"max {max(v for _, v in rss):.0f}")
    print(f"end state: {h}")
    problems = list(s.failures)
    if h["kv_blocks_free"] != h["kv_blocks_total"]:
        problems.append(f"leaked KV blocks: {h['kv_blocks_total'] - h['kv_blocks_free']}")
    if h["http_requests_active"] or h["requests_running"] or h["requests_waiting"]:
        problems.append(f"leaked requests/handlers: {h}")
    if late - early > args.rss_slack_mb:
        problems.append(f"RSS grew {late - early:.0f} MB")
    if s.counts["good_ok"] == 0:
        problems.append("no good request completed")
    for p in problems:
        print("PROBLEM:", p)
    print("verdict:", "FAIL" if problems or s.counts["FAILED"] else "PASS")
    return 1 if problems or s.counts["FAILED"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
