"""Prefix caching through ``ratchet serve``: the same workloads against a server with
``--enable-prefix-caching true`` and one with ``false`` (same flags, both up; each workload runs on
one, then on the other).

* **chat**: ``concurrency`` conversations of 8 turns each; every conversation starts with the same
  ~300-token system prompt (one app, many users); turn *k* sends the whole history (earlier answers
  included) as a streaming chat completion, greedy, up to ``--max-tokens``.
* **few-shot**: ``4 x concurrency`` streaming completions that share a long few-shot prefix and end
  in different questions.

For each workload and concurrency (1 and 8) it prints TTFT medians (chat: turn 1 and turns >= 2
apart, and per turn), total wall time, throughput (generated tokens / s, requests / s, prompt tokens
/ s), the hit rate from ``usage.prompt_tokens_details.cached_tokens`` and ``/metrics``, the on/off
ratios, whether the two servers answered identically, and the machine's load average.

    python benchmarks/bench_prefix_cache.py [--server-args "--torch-threads 2"] [--max-tokens 32]
        [--concurrency 1,8] [--workloads chat,few-shot]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_common import sse_chunks, start_ratchet  # noqa: E402

SYSTEM = (
    "You are the support assistant of Northwind Outdoor, a shop for hiking and camping gear. Answer customers "
    "politely and briefly, in plain English, without making up facts. Store policies: orders over 80 euros ship "
    "for free within the EU; other orders pay a flat 6 euros. Delivery takes two to four working days. Returns "
    "are accepted within 30 days if the item is unused and in its original packaging; the customer pays return "
    "shipping unless the item is faulty. Faulty items are replaced or refunded within 2 years. Gift cards never "
    "expire and cannot be exchanged for cash. Sizes: boots run half a size small, jackets run true to size. "
    "Tents come with a 5-year warranty on poles and seams. Sleeping bags are rated by comfort temperature, not "
    "extreme temperature. We do not sell fuel canisters online because of shipping rules; they are sold in our "
    "two stores, in Lyon and in Turin. Store hours: Monday to Saturday 9 to 19, closed on Sunday and public "
    "holidays. Customer service can be reached by email at any time and answers within one working day. If a "
    "question is not about the shop, politely say that you can only help with Northwind orders and products. "
    "Never share personal data of other customers. Never promise discounts that are not listed here: the only "
    "current offer is 10 percent off all rain jackets until the end of the month."
)
QUESTIONS = [
    "Hi! Do you ship to Norway?", "How long does delivery take?", "Can I return boots I wore once outside?",
    "My tent pole broke after a year. What now?", "Which size of boots should I order if I wear 42?",
    "Do gift cards expire?", "Can I buy gas canisters on your website?", "Are you open on Sunday?",
    "Is there any discount right now?", "What does the comfort temperature of a sleeping bag mean?",
    "Where are your stores?", "How fast does customer service answer emails?",
]
FEW_SHOT = "".join(
    f"Review: {r}\nSentiment: {s}\n\n" for r, s in [
        ("The boots were comfortable from the first day and kept my feet dry in the rain.", "positive"),
        ("The zipper of the jacket broke after two weeks and customer service never answered.", "negative"),
        ("Delivery was fast, but the tent was missing two pegs.", "mixed"),
        ("Great sleeping bag, warm enough for a night at minus five degrees.", "positive"),
        ("The backpack is fine. Nothing special, nothing wrong.", "neutral"),
        ("I returned the stove because it leaked gas; the refund took a month.", "negative"),
        ("The staff in the Lyon store helped me pick the right size. Very happy with my boots.", "positive"),
        ("The headlamp is bright but the battery lasts only two hours.", "mixed"),
        ("The rain jacket is lighter than expected and packs into its own pocket.", "positive"),
        ("Ordered a blue tent, received a green one. They sent the right one the next day.", "mixed"),
        ("The socks lost their shape after three washes.", "negative"),
        ("Average quality for the price.", "neutral"),
    ] * 2
)
FEW_SHOT_QUERIES = [
    "The trekking poles are sturdy and the locks never slipped.", "My order arrived broken and late.",
    "The gloves are warm but the fingers are too short.", "It is a mug. It holds coffee.",
    "Best purchase of the year, the tent survived a storm.", "The shop sent the wrong size twice.",
    "Good fleece, but it pills quickly.", "Quick delivery and a nice handwritten note.",
]


@dataclass
class Run:
    ttft_first: list[float] = field(default_factory=list)  # chat turn 1 / few-shot: all requests
    ttft_later: list[float] = field(default_factory=list)  # chat turns >= 2
    ttft_by_turn: dict[int, list[float]] = field(default_factory=dict)  # chat: turn -> TTFTs
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    cached_tokens: int = 0
    wall: float = 0.0
    answers: list[str] = field(default_factory=list)

    def count(self, usage: dict) -> None:
        self.requests += 1
        self.prompt_tokens += usage["prompt_tokens"]
        self.completion_tokens += usage["completion_tokens"]
        self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, str, dict]:
    """One streaming request: (TTFT, text, usage)."""
    t0 = time.perf_counter()
    ttft, parts, usage = float("nan"), [], {}
    async for chunk in sse_chunks(client, url, {**body, "stream_options": {"include_usage": True}}):
        if chunk.get("choices"):
            c = chunk["choices"][0]
            text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            if text and ttft != ttft:  # first chunk with text
                ttft = time.perf_counter() - t0
            parts.append(text or "")
        elif chunk.get("usage"):
            usage = chunk["usage"]
    return ttft, "".join(parts), usage


async def chat_workload(url: str, model: str, concurrency: int, turns: int, max_tokens: int, system: str) -> Run:
    run = Run()

    async def conversation(client: httpx.AsyncClient, c: int) -> list[str]:
        messages = [{"role": "system", "content": system}]
        answers = []
        for k in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[(c * 3 + k) % len(QUESTIONS)]})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            ttft, text, usage = await stream(client, url + "/v1/chat/completions", body)
            (run.ttft_first if k == 0 else run.ttft_later).append(ttft)
            run.ttft_by_turn.setdefault(k + 1, []).append(ttft)
            run.count(usage)
            messages.append({"role": "assistant", "content": text})
            answers.append(text)
        return answers

    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, c) for c in range(concurrency)))
        run.wall = time.perf_counter() - t0
    run.answers = [a for conv in convs for a in conv]
    return run


async def few_shot_workload(url: str, model: str, concurrency: int, num: int, max_tokens: int, prefix: str) -> Run:
    run = Run()
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        prompt = prefix + f"Review: {FEW_SHOT_QUERIES[i % len(FEW_SHOT_QUERIES)]} (#{i})\nSentiment:"
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        async with sem:
            ttft, text, usage = await stream(client, url + "/v1/completions", body)
        run.ttft_first.append(ttft)
        run.count(usage)
        return text

    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        run.answers = list(await asyncio.gather(*(one(client, i) for i in range(num))))
        run.wall = time.perf_counter() - t0
    return run


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def workload(url: str, model: str, name: str, c: int, turns: int, max_tokens: int) -> tuple[Run, float]:
    """One workload on one server; returns the run and the hit rate /metrics saw during it."""
    tag = f"[{name} c={c}] "  # a fresh prefix per level: one level's cache does not serve the next
    h0 = metric(url, "ratchet:prefix_cache_hits_total")
    q0 = metric(url, "ratchet:prefix_cache_queries_total")
    if name == "chat":
        r = asyncio.run(chat_workload(url, model, c, turns, max_tokens, tag + SYSTEM))
    else:
        r = asyncio.run(few_shot_workload(url, model, c, 4 * c, max_tokens, tag + FEW_SHOT))
    hits = metric(url, "ratchet:prefix_cache_hits_total") - h0
    queries = metric(url, "ratchet:prefix_cache_queries_total") - q0
    return r, (hits / queries if queries else 0.0)


def measure(server_args: list[str], levels: list[int], turns: int, max_tokens: int, names: list[str]) -> dict:
    """Both servers stay up (an idle one costs no CPU); each workload runs on the caching server,
    then on the other, so a change in machine load between workloads hits both sides alike."""
    servers = {on: start_ratchet([*server_args, "--enable-prefix-caching", str(on).lower()]) for on in (True, False)}
    out: dict = {}
    try:
        models = {on: httpx.get(url + "/v1/models").json()["data"][0]["id"] for on, (_, url) in servers.items()}
        for on, (_, url) in servers.items():
            asyncio.run(few_shot_workload(url, models[on], 1, 1, 2, "Warm-up.\n"))
        for c in levels:
            for name in names:
                out[(name, c)] = {on: workload(url, models[on], name, c, turns, max_tokens)
                                  for on, (_, url) in servers.items()}
                print("\n".join(rows((name, c), out[(name, c)])), f"(load {os.getloadavg()[0]:.1f})",
                      flush=True)  # as it comes: a run cut short keeps what it measured
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
    return out


HEADER = ("| workload | concurrency | caching | TTFT turn 1 / all (ms) | TTFT turns >= 2 (ms) | total (s) "
          "| gen tok/s | req/s | prompt tok/s | cached / prompt tokens | hit rate (/metrics) | same answers |\n"
          + "|---" * 12 + "|")


def rows(key: tuple[str, int], both: dict) -> list[str]:
    """Table rows of one workload: on, off, and the off/on ratios."""
    (r_on, hr_on), (r_off, hr_off) = both[True], both[False]
    same = r_on.answers == r_off.answers
    out = [f"| {key[0]} | {key[1]} | {label} | {ms(r.ttft_first)} | {ms(r.ttft_later)} | {r.wall:.1f} | "
           f"{r.completion_tokens / r.wall:.1f} | {r.requests / r.wall:.2f} | {r.prompt_tokens / r.wall:.0f} | "
           f"{r.cached_tokens}/{r.prompt_tokens} | {hr:.2f} | {same} |"
           for label, r, hr in (("on", r_on, hr_on), ("off", r_off, hr_off))]
    later = (f"{statistics.median(r_off.ttft_later) / statistics.median(r_on.ttft_later):.2f}x"
             if r_on.ttft_later else "-")
    first = statistics.median(r_off.ttft_first) / statistics.median(r_on.ttft_first)
    speed = r_off.wall / r_on.wall
    out.append(f"| {key[0]} | {key[1]} | off/on | {first:.2f}x | {later} | {speed:.2f}x | {speed:.2f}x | {speed:.2f}x "
               f"| {speed:.2f}x | | | |")
    if r_on.ttft_by_turn:
        turns = {on: {t: ms(v) for t, v in both[on][0].ttft_by_turn.items()} for on in (True, False)}
        out.append(f"{key[0]} c={key[1]} TTFT median per turn (ms), on / off: "
                   + ", ".join(f"{t}: {turns[True][t]} / {turns[False][t]}" for t in turns[True]))
    return out


def report(results: dict) -> None:
    print(HEADER)
    for key, both in results.items():
        print("\n".join(r for r in rows(key, both) if r.startswith("|")))
    for key, both in results.items():
        print("\n".join(r for r in rows(key, both) if not r.startswith("|")))


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f}" if xs else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-args", default="--torch-threads 2", help="extra `ratchet serve` flags (both servers)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--workloads", default="chat,few-shot", help="comma-separated: chat, few-shot")
    args = ap.parse_args()
    names = args.workloads.split(",")
    if not set(names) <= {"chat", "few-shot"}:
        ap.error(f"unknown workload in {args.workloads!r}")
    levels = [int(x) for x in args.concurrency.split(",")]
    server_args = shlex.split(args.server_args)
    load0 = os.getloadavg()[0]
    results = measure(server_args, levels, args.turns, args.max_tokens, names)
    load1 = os.getloadavg()[0]
    print(f"\nserver_args={args.server_args!r} max_tokens={args.max_tokens} turns={args.turns} "
          f"load average (1 min) before/after: {load0:.1f}/{load1:.1f} on {os.cpu_count()} CPUs")
    report(results)

if __name__ == "__main__":
    main()
