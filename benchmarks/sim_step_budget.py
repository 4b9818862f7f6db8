"""Issue 40's scenario on a simulated CPU: the step-time budget's largest step and the long prompt's TTFT,
without a model (seconds, deterministic; for trying STRETCH_* settings before a machine run).

The real scheduler and cost model (``MeasuredStepCost``, probed from a prior) drive a machine whose step
time is the parts measured on this project's CPU (benchmarks/bench_chunk_cost.py, 2026-11-29; docs/
benchmarks.md, "lat2"): 14.5 ms a forward, 0.4 ms a decode row, 1.6 ms a prompt row, 2.8 us a cached
token read, 3.5 us a cached token held, times a uniform noise of +-``--noise``. As in
benchmarks/bench_latency.py, an idle 2,000-token prompt runs first (the fit sees a prompt step), then
four streams decode, then the prompt arrives. Per seed: the largest and p90 step over the streams'
median step before it, and the prompt's TTFT over its idle time; medians over the seeds.

    python benchmarks/sim_step_budget.py [--seeds 15] [--stretch-min 3.5 --stretch-max 4 --floor 2.75]
    PYTHONPATH=<an older checkout> python benchmarks/sim_step_budget.py --sample-every 8   # its scheduler
"""

from __future__ import annotations

import argparse
import random
import statistics

import ratchetlm.engine.scheduler as scheduler
from ratchetlm import SamplingParams
from ratchetlm.engine.step_cost import DEFAULT_MAX_STEP_MS, SAMPLE_EVERY, MeasuredStepCost, Prior, Rows, reads
from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.sequence import SeqStatus, Sequence


def this_cpu(rows: list[Rows]) -> float:
    prompt = [r for r in rows if r.prompt]
    return (14.5 + 0.4 * sum(r.n for r in rows if not r.prompt) + 1.6 * sum(r.n for r in prompt)
            + 0.0028 * reads(rows) + 0.0035 * sum(r.context for r in rows))


def run(seed: int, noise: float, tokens: int, sample_every: int) -> tuple[float, float, float]:
    rng = random.Random(seed)
    cost = MeasuredStepCost(lambda _stop: Prior(fixed=14.5, per_row=1.6, head=0.0, attention=0.0015),
                            sample_every=sample_every)
    cost.calibrate()
    sched = scheduler.Scheduler(BlockManager(1024, 16, enable_caching=True),
                                tokens_wanted=lambda s: len(s.token_ids) - s.num_cached, on_preempt=lambda s: None,
                                max_num_seqs=8, max_num_batched_tokens=2048, cost=cost,
                                max_step_ms=DEFAULT_MAX_STEP_MS["cpu"])
    idle = [Rows.prefill(tokens, 0)]
    cost.observe(idle, this_cpu(idle) * rng.uniform(1 - noise, 1 + noise))
    for i in range(4):  # the streams: 14 cached tokens each, decoding
        seq = Sequence(i, list(range(1, 16)), 14, SamplingParams(max_tokens=4000, temperature=0), num_cached=14,
                       status=SeqStatus.RUNNING)
        sched.blocks.grow(seq, 14)
        sched.running.append(seq)

    def step() -> float:
        out = sched.schedule()
        rows = [(Rows.prefill if s.num_cached < s.num_prompt_tokens else Rows.decode)(n, s.num_cached) for s, n in out]
        ms = this_cpu(rows) * rng.uniform(1 - noise, 1 + noise)
        cost.observe(rows, ms)
        for s, n in out:  # the engine's commit: K/V kept, a token appended once past the prompt
            before = s.num_cached
            s.num_cached += n
            if s.num_cached == len(s.token_ids):
                s.token_ids.append(7)
            sched.blocks.cache_full_blocks(s, before)
        return ms

    itl = statistics.median(step() for _ in range(16))
    long = Sequence(99, [1000 + i for i in range(tokens)], tokens, SamplingParams(max_tokens=1))
    sched.add(long)
    during = []
    while long.num_cached < tokens:
        during.append(step())
    return max(during) / itl, sorted(during)[int(0.9 * (len(during) - 1))] / itl, sum(during) / this_cpu(idle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=15)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--stretch-min", type=float, default=scheduler.STRETCH_MIN)
    ap.add_argument("--stretch-max", type=float, default=scheduler.STRETCH_MAX)
    ap.add_argument("--floor", type=float, default=getattr(scheduler, "STRETCH_FLOOR", 0.0))
    ap.add_argument("--sample-every", type=int, default=SAMPLE_EVERY)
    args = ap.parse_args()
    scheduler.STRETCH_MIN, scheduler.STRETCH_MAX = args.stretch_min, args.stretch_max  # type: ignore[misc]
    if hasattr(scheduler, "STRETCH_FLOOR"):  # (a tree before it: PYTHONPATH=<main before 2026-11-29>)
        scheduler.STRETCH_FLOOR = args.floor  # type: ignore[misc]
    runs = [run(s, args.noise, args.prompt_tokens, args.sample_every) for s in range(args.seeds)]
    big, p90, ttft = (statistics.median(r[i] for r in runs) for i in range(3))
    print(f"stretch {args.stretch_min}-{args.stretch_max}, floor {args.floor}, a decode sample every "
          f"{args.sample_every} chunk steps: largest step {big:.2f}x the ITL before, p90 {p90:.2f}x, TTFT "
          f"{ttft:.2f}x idle (medians of {args.seeds} seeds)")


if __name__ == "__main__":
    main()
