"""The step-time budget in one process, step by step: how well the cost model predicts a step, and what
the chunks it picks do to the streams' gaps and to the long prompt's time to its first token.

Two parts, on the default model (engine defaults: the measured cost model, ``--max-step-ms`` as given):

* accuracy: four streams decode; each step adds a prompt chunk of k = 0, 1, 2, 4, 8, 16, 32, 64 tokens
  (forced, in turn, ``--repeats`` rounds); per k the median measured step time beside the probe's
  prediction (the prior) and the refit model's (what the scheduler uses);
* the budget at work: four streams decode, then a ``--prompt-tokens`` prompt arrives and the scheduler
  sizes its chunks; per run: the decode-only steps' median before it arrived (the streams' inter-token
  latency), the largest step while it was fed (their largest gap), the prompt's time to its first
  token against the same prompt on an idle engine, and the chunk sizes.

    python benchmarks/bench_step_cost.py [--threads 1] [--prompt-tokens 2000] [--runs 1]
    python benchmarks/bench_step_cost.py --overhead      # the cost model's own time a step (no model)
    python benchmarks/bench_step_cost.py --skip-accuracy --trace   # every step while the prompt is fed

``--trace`` prints, per step while the prompt is fed, the chunk, its context, the step's predicted time
(the fit the scheduler sized it with) beside its measured time, and the decode rows' time the budget
scaled (``decode_ms``) against the streams' median step before the prompt; then the measured/predicted
ratio by context and the decode steps right after the prompt's first token (is ``decode_ms`` the
machine now, or a biased sample?). The trace wraps ``Scheduler.schedule`` in the benchmark only.

Wall-clock times of ``LLMEngine.step``: no server, no client, so no HTTP or event-loop lag.
``--overhead`` times ``MeasuredStepCost`` alone (run it with PYTHONPATH at another checkout to compare):
per decode-only step (``observe``) and per step that sizes a chunk (``observe`` + ``decode_ms`` if the
model has it + the 12 predictions of the chunk's binary search).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.engine.step_cost import Rows

KS = (0, 1, 2, 4, 8, 16, 32, 64)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def timed_step(eng: LLMEngine) -> float:
    t0 = time.perf_counter()
    eng.step()
    return (time.perf_counter() - t0) * 1000.0


def start_streams(llm: LLM, eng: LLMEngine, tokens: int) -> list[int]:
    ids = [eng.add_request(llm.tokenize(f"Stream {i}: count from {i * 100} upwards, one number a line:"),
                           greedy(tokens)) for i in range(4)]
    for _ in range(8):
        eng.step()
    return ids


def accuracy(llm: LLM, cfg: EngineConfig, prompt: list[int], repeats: int) -> None:
    eng = LLMEngine(cfg, llm.engine.model, llm.model_config)
    cost = eng.step_cost
    assert cost is not None
    prior = cost.calibrate()
    start_streams(llm, eng, 4000)
    sched = eng.scheduler
    k_now = [0]
    sched._chunk = lambda step, seq, want: min(k_now[0], want)  # type: ignore[method-assign]
    long = eng.add_request(prompt, greedy(1))
    seen: dict[int, list[tuple[float, float, float]]] = {k: [] for k in KS}
    schedule = sched.schedule
    rows: list[list[Rows]] = []

    def recorded():  # the step's rows as scheduled, for the predictions
        out = schedule()
        rows.append([(Rows.prefill if sched.prefilling(s) else Rows.decode)(n, s.num_cached) for s, n in out])
        return out

    sched.schedule = recorded  # type: ignore[method-assign]
    for _ in range(repeats):
        for k in KS:
            k_now[0] = k  # (k = 0: the prompt gets no tokens, admitted or not)
            ms = timed_step(eng)
            r = rows[-1]
            seen[k].append((ms, prior.fixed + prior.per_row * prior.work(r), cost.predict_ms(r)))
    print(f"\naccuracy: 4 decode rows + a prompt chunk of k rows (medians of {repeats}; the prompt's context "
          f"grows to {eng.seqs[long].num_cached}); load {load()}")
    print(f"refit: {cost.fixed:.1f} ms + {cost.per_row:.2f} ms a decode row + {cost.per_prompt_row:.2f} a prompt row "
          f"+ {cost.per_read * 1e3:.2f} us a cached token read + {cost.per_context * 1e3:.2f} us a cached token held "
          f"+ {cost.per_chunk:.1f} ms a chunk; prior: {prior.fixed:.1f} + {prior.per_row:.2f} a row + "
          f"{prior.per_row * prior.attention * 1e3:.2f} us a read (head {prior.head:.2f} of a row)")
    print("| k | measured (ms) | prior's prediction | refit prediction | refit / measured |")
    print("|---|---|---|---|---|")
    for k in KS:
        m, p, f = (statistics.median(x[i] for x in seen[k]) for i in range(3))
        print(f"| {k} | {m:.1f} | {p:.1f} | {f:.1f} | {f / m:.2f} |")


def trace_schedule(eng: LLMEngine, log: list[dict[str, float]]) -> None:
    """Record, per scheduled step, what the budget saw when it sized the step: the step's predicted time,
    the decode rows' time now (decode_ms) and their predicted time, the chunk and its context (read by
    ``budget_run``'s trace; the predictions are the fit's as the scheduler used it)."""
    sched, cost = eng.scheduler, eng.step_cost
    assert cost is not None
    schedule = sched.schedule

    def traced():  # type: ignore[no-untyped-def]
        out = schedule()
        rows = [(Rows.prefill if sched.prefilling(s) else Rows.decode)(n, s.num_cached) for s, n in out]
        dec = [r for r in rows if not r.prompt]
        chunk = [r for r in rows if r.prompt]
        log.append({"pred": cost.predict_ms(rows), "decode_ms": cost.decode_ms(dec) if dec else 0.0,
                    "decode_pred": cost.predict_ms(dec), "chunk": float(sum(r.n for r in chunk)),
                    "ctx": float(chunk[0].context if chunk else 0)})
        return out

    sched.schedule = traced  # type: ignore[method-assign]


def print_trace(log: list[dict[str, float]], during: list[float], itl: float) -> None:
    print("  | step | chunk | ctx | predicted | measured | meas/pred | decode_ms | decode_ms/ITL | meas/ITL |")
    for i, (t, ms) in enumerate(zip(log, during, strict=True)):
        print(f"  | {i + 1} | {t['chunk']:.0f} | {t['ctx']:.0f} | {t['pred']:.1f} | {ms:.1f} | {ms / t['pred']:.2f} | "
              f"{t['decode_ms']:.1f} | {t['decode_ms'] / itl:.2f} | {ms / itl:.1f} |")
    chunk = [(t, ms) for t, ms in zip(log, during, strict=True) if t["chunk"]]
    dec = [(t, ms) for t, ms in zip(log, during, strict=True) if not t["chunk"]]
    q = lambda xs, f: statistics.quantiles(xs, n=10)[int(f * 10) - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    if chunk:
        r = [ms / t["pred"] for t, ms in chunk]
        d = [t["decode_ms"] / itl for t, _ in chunk]
        print(f"  chunk steps ({len(chunk)}): measured/predicted median {statistics.median(r):.2f}, "
              f"p90 {q(r, 0.9):.2f}; "
              f"decode_ms/ITL before median {statistics.median(d):.2f}, p90 {q(d, 0.9):.2f}; first chunk step "
              f"{chunk[0][1]:.0f} ms vs predicted {chunk[0][0]['pred']:.0f}")
        for lo, hi in ((0, 500), (500, 1000), (1000, 1500), (1500, 10**9)):
            part = [ms / t["pred"] for t, ms in chunk if lo <= t["ctx"] < hi]
            if part:
                print(f"    ctx {lo}-{min(hi, 10**4)}: {len(part)} steps, measured/predicted median "
                      f"{statistics.median(part):.2f}, max {max(part):.2f}")
    if dec:
        m = [ms for _, ms in dec]
        print(f"  decode-only samples mid-prompt ({len(dec)}): measured median {statistics.median(m):.1f} ms = "
              f"{statistics.median(m) / itl:.2f}x ITL before")


def budget_run(llm: LLM, cfg: EngineConfig, prompt: list[int], idle_prompt: list[int],
               trace: bool = False) -> dict[str, float]:
    eng = LLMEngine(cfg, llm.engine.model, llm.model_config)
    if eng.step_cost is not None:  # the probe now, as the server does at start-up, not in a timed step
        eng.step_cost.calibrate()
    t0 = time.perf_counter()
    sid = eng.add_request(idle_prompt, greedy(1))
    while eng.has_unfinished():
        eng.step()
    idle = time.perf_counter() - t0
    eng.release(sid)
    start_streams(llm, eng, 4000)
    before = [timed_step(eng) for _ in range(12)]
    log: list[dict[str, float]] = []
    if trace:
        trace_schedule(eng, log)
    long = eng.add_request(prompt, greedy(1))
    t0 = time.perf_counter()
    during, chunks = [], []
    while not eng.seqs[long].output_ids:
        c0 = eng.seqs[long].num_cached
        during.append(timed_step(eng))
        chunks.append(eng.seqs[long].num_cached - c0)
    ttft = time.perf_counter() - t0
    itl = statistics.median(before)
    if trace:
        print_trace(log, during, itl)
        after = [timed_step(eng) for _ in range(12)]
        print(f"  decode steps before the prompt: median {itl:.1f} ms; right after its first token: median "
              f"{statistics.median(after):.1f} ms ({statistics.median(after) / itl:.2f}x before)")
    big = max(range(len(during)), key=during.__getitem__)
    print(f"  run: ITL {itl:.0f} ms, largest step {max(during):.0f} ms ({max(during) / itl:.1f}x; step {big + 1} of "
          f"{len(during)}, chunk {chunks[big]}), "
          f"p90 {sorted(during)[int(0.9 * (len(during) - 1))]:.0f} ms; TTFT {ttft:.1f} s vs idle {idle:.1f} s "
          f"({ttft / idle:.2f}x); {len(chunks)} steps, chunks {chunks[:6]} ... {chunks[-4:]}; load {load()}",
          flush=True)
    return {"itl": itl, "gap": max(during), "gap_ratio": max(during) / itl, "ttft": ttft, "idle": idle,
            "ttft_ratio": ttft / idle}


def overhead(steps: int, rounds: int) -> None:
    from ratchetlm.engine.step_cost import MeasuredStepCost, Prior

    prior = Prior(fixed=20.0, per_row=0.8, head=0.3, attention=2e-3)

    def one_round(mixed: bool) -> float:
        cost = MeasuredStepCost(lambda _stop: prior)
        cost.calibrate()
        decode_ms = getattr(cost, "decode_ms", cost.predict_ms)
        t0 = time.perf_counter()
        for i in range(steps):
            rows = [Rows.decode(1, 100 + i + 10 * j) for j in range(4)]
            if mixed:
                decode_ms(rows)
                for k in range(12):
                    cost.predict_ms([*rows, Rows.prefill(1 + k * 5, 4 * i)])
                rows = [*rows, Rows.prefill(8 + i % 5, 4 * i)]
            cost.observe(rows, 30.0 + (i % 7) + 60.0 * mixed)
        return (time.perf_counter() - t0) / steps * 1e6

    for mixed in (False, True):
        us = statistics.median(one_round(mixed) for _ in range(rounds))
        print(f"{'a step that sizes a chunk' if mixed else 'a decode-only step'}: {us:.1f} us of cost-model time "
              f"(median of {rounds} rounds of {steps} steps); load {load()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-step-ms", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the accuracy part")
    ap.add_argument("--runs", type=int, default=1, help="runs of the budget part (medians printed)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--trace", action="store_true", help="print every step while the prompt is fed: predicted vs "
                                                          "measured, the decode time the budget scaled vs the ITL")
    ap.add_argument("--overhead", action="store_true", help="only time the cost model itself (no model)")
    args = ap.parse_args()
    if args.overhead:
        overhead(400, 7)
        return
    torch.set_num_threads(args.threads)
    llm = LLM(progress=False)
    cfg = EngineConfig(max_step_ms=args.max_step_ms, progress=False)
    text = " ".join(f"word{i} river{i % 7}" for i in range(args.prompt_tokens))
    ids = llm.tokenize(text)
    print(f"threads {args.threads}; max_step_ms {cfg.step_time_target()}; load {load()}")
    if not args.skip_accuracy:
        accuracy(llm, cfg, ids[: args.prompt_tokens], args.repeats)
    runs = [budget_run(llm, cfg, ids[i + 1 : i + 1 + args.prompt_tokens], ids[i + 3 : i + 3 + args.prompt_tokens],
                       args.trace) for i in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\nthe budget at work ({args.prompt_tokens}-token prompt beside 4 streams; medians of {args.runs}): "
          f"ITL {med['itl']:.0f} ms, largest gap {med['gap']:.0f} ms = {med['gap_ratio']:.1f}x ITL; TTFT "
          f"{med['ttft']:.1f} s vs idle {med['idle']:.1f} s = {med['ttft_ratio']:.2f}x; load {load()}")


if __name__ == "__main__":
    main()
