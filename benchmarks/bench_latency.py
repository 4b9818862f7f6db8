"""Latency under mixed load: what one request's size does to everyone else's, before vs after.

Starts ``ratchet serve`` (default model) twice in turn, the peer first, this tree second, and measures
in each (issue 40's scenarios; one run each unless ``--repeats``, medians printed):

* 4 greedy streams in flight, then a 2,000-token prompt arrives: the streams' largest inter-token gap
  from its arrival until it has its first token + 1 s, against their median ITL before it arrived;
  the long prompt's TTFT against its TTFT on the idle server (another prompt: no prefix-cache hit);
* the same with a chat request whose one tool's ``parameters`` nest 50 levels deep;
* two 7.5 MB prompts in flight (each ends in a 400 once counted), then a one-token request: its latency
  against the same request on the idle server;
* (this tree only) a body declaring ``Content-Length: 100`` sent one byte every 7.5 s: seconds to
  the 408 (``--body-timeout``, 30 s by default).

    python benchmarks/bench_latency.py                                   # peer: --max-step-ms inf
    python benchmarks/bench_latency.py --peer-pythonpath /work/main      # peer: another checkout
    python benchmarks/bench_latency.py --peer-pythonpath DIR --only prompt,tool --repeats 3

``--trace`` runs each server through benchmarks/serve_trace.py and says, per run, where the largest
gaps came from: the server steps they spanned (wall and CPU time, the budget's prediction, the prompt
chunk and its context, the decode rows' time against the ITL before), how the chunk steps' times
compare with their predictions, and the garbage collector's pauses.

``--nice N`` runs both servers niced (the client must read each token when it is sent, or its own lag
on a busy machine smooths the gaps it measures; but a niced server on a machine others keep busy gets
less of it than they do). The default peer is this tree with the step-time budget off
(``--max-step-ms inf``: the token budget alone, as before issue 40); ``--peer-pythonpath`` runs
another checkout's server instead (e.g. main before the change) with ``--peer-args``. A ratio (largest
gap / median ITL, TTFT under streams / idle) is the median of each run's own ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import serve_trace  # noqa: E402
from benchmarks.serve_common import start_ratchet, stop  # noqa: E402

WORDS = ("river stone maple quiet engine orbit copper lantern meadow signal harbor violet canyon ember "
         "glacier thunder willow falcon marble prism cedar velvet summit tide").split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def long_prompt_ids(url: str, tokens: int, seed: int) -> list[int]:
    text = f"Session {seed}. " + words(tokens * 2, seed)
    ids = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    return ids[:tokens]


def nested_tool(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"level{depth - i}": schema}, "required": [f"level{depth - i}"]}
    return {"type": "function", "function": {"name": "deep", "description": "a deeply nested tool",
                                             "parameters": schema}}


async def first_token(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> float:
    """Seconds from sending ``body`` (streamed) to its first choice chunk."""
    t0 = time.perf_counter()
    async with client.stream("POST", url + path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - t0
    raise RuntimeError(f"{path}: no token")


async def stream(client: httpx.AsyncClient, url: str, i: int, stop: asyncio.Event, times: list[float]) -> None:
    body = {"prompt": f"Stream {i}: count from {i * 100} upwards, one number a line:", "max_tokens": 3000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
            if stop.is_set():
                return


Arrival = Callable[[httpx.AsyncClient], Awaitable[float]]
# called with (arrival time, its first token's time, [(gap s, its end time)] after it, median ITL before s)
Explain = Callable[[float, float, list[tuple[float, float]], float], None]


async def under_streams(url: str, arrival: Arrival, explain: Explain | None = None) -> tuple[float, float, float]:
    """(median ITL before, largest gap after the arrival, the arrival's TTFT), seconds."""
    async with httpx.AsyncClient(timeout=900) as client:
        stop = asyncio.Event()
        times: list[list[float]] = [[] for _ in range(4)]
        tasks = [asyncio.create_task(stream(client, url, i, stop, times[i])) for i in range(4)]
        while min(len(t) for t in times) < 16:
            await asyncio.sleep(0.05)
        t_arrival = time.perf_counter()
        ttft = await arrival(client)
        await asyncio.sleep(1.0)
        t_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    before = [b - a for t in times for a, b in zip(t, t[1:], strict=False) if b <= t_arrival][8:]
    gaps = [(b - a, b) for t in times for a, b in zip(t, t[1:], strict=False) if t_arrival < b <= t_end]
    # a stream with no token at all since the arrival: its gap is still open at the end
    gaps += [(t_end - max(x for x in t if x <= t_end), t_end) for t in times]
    gap, at = max(gaps)
    ranked = sorted(g for g, _ in gaps)
    print(f"    largest gap {gap * 1e3:.0f} ms, ending {at - t_arrival:.2f} s after the arrival (TTFT {ttft:.2f} s); "
          f"next largest {', '.join(f'{g * 1e3:.0f}' for g in ranked[-4:-1][::-1])} ms; gaps p90 "
          f"{ranked[int(0.9 * (len(ranked) - 1))] * 1e3:.0f} ms of {len(ranked)}", file=sys.stderr)
    if explain is not None:
        explain(t_arrival, t_arrival + ttft, gaps, statistics.median(before))
    return statistics.median(before), gap, ttft


async def huge_then_small(url: str, mb: float) -> tuple[float, float]:
    """Seconds a one-token request takes, sent 2 s after two ``mb`` MB prompts (then being prepared
    on a server that tokenizes them whole), and seconds until both huge ones were answered."""
    text = words(int(mb * 1e6 / 7), 7)[: int(mb * 1e6)]
    async with httpx.AsyncClient(timeout=900) as client:
        t_big = time.perf_counter()
        big = [asyncio.create_task(client.post(url + "/v1/completions",
                                               json={"prompt": text + str(i), "max_tokens": 1})) for i in range(2)]
        await asyncio.sleep(2.0)  # both bodies sent and in preparation
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        codes = [x.status_code for x in await asyncio.gather(*big)]
        big_done = time.perf_counter() - t_big
    print(f"    huge prompts answered {codes} after {big_done:.1f} s", file=sys.stderr)
    return took, big_done


def slow_body(url: str, every: float, give_up: float) -> tuple[float, str]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n")
        s.settimeout(every)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < give_up:
            try:
                s.sendall(b" ")
                data = s.recv(65536)
                return time.perf_counter() - t0, data.split(b"\r\n", 1)[0].decode()
            except TimeoutError:
                continue
            except OSError as e:
                return time.perf_counter() - t0, f"closed ({e})"
    return give_up, "still open"


SCENARIOS = ("prompt", "tool", "huge", "slow-body")


def tracer(proc: subprocess.Popen, path: str) -> Explain:
    """Explain a run's gaps from the server's per-step trace (benchmarks/serve_trace.py)."""

    def explain(t_arrival: float, t_first: float, gaps: list[tuple[float, float]], itl: float) -> None:
        before = os.path.getmtime(path) if os.path.exists(path) else 0.0
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not os.path.exists(path) or os.path.getmtime(path) == before):
            time.sleep(0.1)
        with open(path) as f:
            trace = json.load(f)
        print("\n".join(serve_trace.report(trace, t_arrival, t_first, gaps, itl)), file=sys.stderr)

    return explain


def scenario(url: str, repeats: int, seed0: int, tokens: int, only: set[str],
             explain: Explain | None = None) -> dict[str, float]:
    out: dict[str, list[float]] = {}

    def add(k: str, v: float) -> None:
        out.setdefault(k, []).append(v)

    async def small(client: httpx.AsyncClient) -> float:
        t0 = time.perf_counter()
        await client.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        return time.perf_counter() - t0

    def ttft_of(path: str, body: dict[str, Any]) -> Arrival:
        return lambda c: first_token(c, url, path, body)

    async def alone(arrival: Arrival) -> float:
        async with httpx.AsyncClient(timeout=900) as c:
            return await arrival(c)

    for k in range(repeats):
        seed = seed0 + 10 * k
        if "prompt" in only:
            idle_ids, mixed_ids = long_prompt_ids(url, tokens, seed), long_prompt_ids(url, tokens, seed + 1)
            add("idle_ttft", asyncio.run(alone(ttft_of("/v1/completions", {"prompt": idle_ids, "max_tokens": 1}))))
            itl, gap, ttft = asyncio.run(under_streams(url, ttft_of("/v1/completions",
                                                                    {"prompt": mixed_ids, "max_tokens": 1}), explain))
            add("itl", itl)
            add("gap", gap)
            add("mixed_ttft", ttft)
            add("gap_ratio", gap / itl)
            add("ttft_ratio", ttft / out["idle_ttft"][-1])
        if "tool" in only:
            chat = {"messages": [{"role": "user", "content": f"Call the tool ({seed})."}],
                    "tools": [nested_tool(50)], "max_tokens": 1}
            itl, gap, ttft = asyncio.run(under_streams(url, ttft_of("/v1/chat/completions", chat), explain))
            add("tool_itl", itl)
            add("tool_gap", gap)
            add("tool_ratio", gap / itl)
        if "huge" in only:
            add("small_idle", asyncio.run(alone(small)))
            small_huge, big_done = asyncio.run(huge_then_small(url, 7.5))
            add("small_huge", small_huge)
            add("huge_done", big_done)
        print(f"    run {k + 1}: " + ", ".join(f"{key} {v[-1]:.3f}" for key, v in out.items()) + f"  load {uptime()}",
              file=sys.stderr)
    return {k: statistics.median(v) for k, v in out.items()}


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-pythonpath", default=None, help="run the peer server from this checkout (default: this "
                                                             "tree with --max-step-ms inf)")
    ap.add_argument("--peer-args", default=None, help="the peer's extra flags (default: --max-step-ms inf, or none "
                                                      "with --peer-pythonpath)")
    ap.add_argument("--server-args", default="", help="extra flags for both servers")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--slow-body-every", type=float, default=7.5)
    ap.add_argument("--nice", type=int, default=0, help="niceness of both servers (default 0)")
    ap.add_argument("--trace", action="store_true", help="trace each server's steps (benchmarks/serve_trace.py) "
                                                          "and say where each run's largest gaps came from")
    ap.add_argument("--only", default=",".join(SCENARIOS),
                    help=f"comma-separated scenarios to run, of {', '.join(SCENARIOS)} (default: all)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if not only <= set(SCENARIOS):
        ap.error(f"--only: unknown scenario(s) {', '.join(sorted(only - set(SCENARIOS)))}")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    peer_path = args.peer_pythonpath or here
    peer_args = args.peer_args if args.peer_args is not None else ("" if args.peer_pythonpath else "--max-step-ms inf")
    common = shlex.split(args.server_args)
    results = {}
    for name, path, extra in (("peer", peer_path, shlex.split(peer_args)), ("this", here, [])):
        print(f"== {name}: PYTHONPATH={path} {' '.join(common + extra)}  load {uptime()}", file=sys.stderr)
        trace = os.path.join(tempfile.mkdtemp(prefix="bench_latency_"), "trace.json") if args.trace else None
        proc, url = start_ratchet(common + extra, path, nice=args.nice, trace=trace)
        try:
            asyncio.run(huge_then_small(url, 0.001))  # warm-up
            results[name] = scenario(url, args.repeats, 1000 if name == "peer" else 2000, args.prompt_tokens, only,
                                     tracer(proc, trace) if trace else None)
            if name == "this" and "slow-body" in only:
                results[name]["slow_body"], results[name]["slow_body_status"] = slow_body(  # type: ignore[assignment]
                    url, args.slow_body_every, 60)
        finally:
            stop(proc)
        print(f"   {name}: {results[name]}  load {uptime()}", file=sys.stderr)
    p, t = results["peer"], results["this"]
    ms = lambda s: f"{s * 1e3:,.0f}"  # noqa: E731
    print(f"\npeer: {peer_path} {peer_args!r}; this: {here}; medians of {args.repeats}; load at end {uptime()}")
    print("| scenario | peer | this | target |")
    print("|---|---|---|---|")
    n = args.prompt_tokens
    if "prompt" in only:
        print(f"| streams' median ITL before the {n}-token prompt (ms) | {ms(p['itl'])} | {ms(t['itl'])} | |")
        print(f"| streams' largest gap after it arrived (ms) | {ms(p['gap'])} | {ms(t['gap'])} | "
              f"<= 6x ITL and <= 250 |")
        print(f"| largest gap / median ITL | {p['gap_ratio']:.1f}x | {t['gap_ratio']:.1f}x | <= 6x |")
        print(f"| {n}-token prompt TTFT, idle server (ms) | {ms(p['idle_ttft'])} | {ms(t['idle_ttft'])} | |")
        print(f"| the same under 4 streams (ms) | {ms(p['mixed_ttft'])} | {ms(t['mixed_ttft'])} | <= 1.5x idle |")
        print(f"| TTFT under streams / idle | {p['ttft_ratio']:.2f}x | {t['ttft_ratio']:.2f}x | <= 1.5x |")
    if "tool" in only:
        print(f"| 50-level tool schema: streams' largest gap / median ITL (ms) | {ms(p['tool_gap'])} / "
              f"{ms(p['tool_itl'])} | {ms(t['tool_gap'])} / {ms(t['tool_itl'])} | <= 250 |")
        print(f"| the same, as a ratio | {p['tool_ratio']:.1f}x | {t['tool_ratio']:.1f}x | <= 6x |")
    if "huge" in only:
        print(f"| one-token request, idle (ms) | {ms(p['small_idle'])} | {ms(t['small_idle'])} | |")
        print(f"| one-token request, two 7.5 MB prompts in flight (ms) | {ms(p['small_huge'])} | "
              f"{ms(t['small_huge'])} | <= 500 |")
        print(f"| both 7.5 MB prompts answered (400) after (s) | {p['huge_done']:.1f} | {t['huge_done']:.1f} | |")
    if "slow-body" in only:
        print(f"| one byte every {args.slow_body_every:g} s: answer | (not run) | {t['slow_body_status']} after "
              f"{t['slow_body']:.1f} s | 408 at the deadline |")


if __name__ == "__main__":
    main()
