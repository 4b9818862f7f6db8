"""What n-gram drafting could reach on Spec-Bench at this machine's verify costs: draft policies and cost models
replayed offline on plain decoding's own greedy outputs (issue 37).

Greedy speculative decoding commits exactly plain decoding's tokens, so once AR's outputs are known, any
draft that copies text (the prompt, the output so far, earlier requests) can be judged without a model: a
step drafts ``d`` tokens, accepts their agreed prefix with AR's continuation, commits that plus one. What
it costs comes from a cost model in one-row forwards: the forward cost curve measured as the engine's
start-up probe measures it (cost_curve.py: rows, and per-cached-token terms), but over every layer and
``--repeats`` timed forwards per point, for a forward of ``1 + d`` rows after ``L`` cached tokens, plus
``--overhead`` for a drafted step's work outside the forward, plus the prompt's prefill (fitted to AR's
measured times to first token). So policies and costs that cannot be built in an afternoon (an oracle
that knows which candidate and length will be accepted; rows whose attention is free) are measured
against the one the engine runs, on the same cases, with no timing noise. ``--check`` also runs the
engine's default config on the same cases and prints its measured MAL and decode speed-up beside the
replay's (the replayed ``engine`` policy is the n-gram proposer's own decision: ngram_candidates and
GainSchedule, so the two MALs should agree closely).

Policies: ``engine`` (the default config's: longest suffix match of up to 4 tokens, most recent
occurrence, length by expected gain per match length), ``vote`` (the same, keyed by match length and
by how many of the match's occurrences continue with the drafted token, which picks the most common
continuation), ``history`` (``engine`` plus earlier requests' outputs where the request's own match is
shorter than 3 tokens), ``oracle-length`` (``engine``'s candidate drafted exactly as far as it will be
accepted), ``oracle`` (the best of every occurrence's continuation, exactly as far as it agrees: the
ceiling of any copy-based draft). Cost models: ``measured``, ``no-overhead``, ``no-row-attention`` (an
extra verified row does not read the context again), ``flat-rows`` (``--flat`` forwards of 8 rows cost
that many one-row forwards), ``all`` (the three together), ``free`` (a verify costs a plain step, GPU-like).

    python benchmarks/sim_drafts.py [--per-group 8] [--seed 0] [--overhead 0.04] [--threads 1] [--check]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_specbench as sb  # noqa: E402

from ratchetlm import LLM  # noqa: E402
from ratchetlm.decoding.speculative.cost_curve import CostCurve, context_terms, curve  # noqa: E402
from ratchetlm.decoding.speculative.gain import GainSchedule, PendingContinuation, agreed_prefix  # noqa: E402
from ratchetlm.decoding.speculative.proposers import ngram_candidates  # noqa: E402
from ratchetlm.decoding.speculative.suffix_index import TokenPositions  # noqa: E402
from ratchetlm.sampling_params import SamplingParams  # noqa: E402

DEPTH, MAX_N = 8, 4  # the default config's (SpecConfig: depth 8, max_n 4)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 17, 32)  # the cost curve's points (a verify of depth 8: 9 rows)


@dataclass
class Case:
    group: str
    qid: int
    prompt: list[int]
    out: list[int]  # AR's greedy output
    prefill: float = 0.0  # AR's seconds to the first token


@dataclass(frozen=True)
class Cost:
    """A step's price in one-row forwards (no context)."""

    curve: CostCurve
    overhead: float  # a drafted step's work outside the forward
    flat: float = 0.0  # > 0: forwards of 8 rows cost this (rows 2-8 scaled to it, more rows likewise)

    def step(self, rows: int, cached: int, drafted: bool) -> float:
        c = self.curve(rows)
        if self.flat:
            c = 1.0 + (c - 1.0) * (self.flat - 1.0) / (self.curve(8) - 1.0)
        reads = cached * (self.curve.first_token + self.curve.row_token * (rows - 1))
        return c + reads + (self.overhead if drafted else 0.0)


# a policy: (tokens so far, their positions, the gain schedule, this request's record, cached tokens, state)
# -> draft tokens
Policy = Callable[[list[int], TokenPositions, GainSchedule, Any, int, dict[str, Any]], list[int]]


def _priced(gain: GainSchedule, rec: Any, toks: list[int], key: int, cont: list[int], cached: int) -> list[int]:
    rec.pending.append(PendingContinuation(len(toks), key, cont))
    return cont[: gain.length(rec, key, min(DEPTH, len(cont)), 1, 0, cached)]


def engine_policy(toks, held, gain, rec, cached, st) -> list[int]:
    cands = ngram_candidates(toks, 1, MAX_N, 1, DEPTH, earlier=held.earlier())
    return _priced(gain, rec, toks, *cands[0], cached) if cands else []


def vote_policy(toks, held, gain, rec, cached, st) -> list[int]:
    ends = held.earlier()
    cands = ngram_candidates(toks, 1, MAX_N, 1, DEPTH, earlier=ends)
    if not cands:
        return []
    n, cont = cands[0]
    t = len(toks)
    occ = [e for e in ends if all(e - i >= 0 and toks[e - i] == toks[t - 1 - i] for i in range(1, n))]
    votes = Counter(toks[e + 1] for e in occ)
    if votes:
        first = votes.most_common(1)[0][0]
        if first != cont[0]:
            e = next(e for e in occ if toks[e + 1] == first)
            cont = toks[e + 1 : e + 1 + DEPTH]
    share = votes[cont[0]] / len(occ) if len(occ) > 1 else -1.0
    kind = 0 if share < 0 else 1 if share == 1.0 else 2 if share >= 0.6 else 3
    return _priced(gain, rec, toks, (n - 1) * 4 + kind + 1, cont, cached)


def history_policy(toks, held, gain, rec, cached, st) -> list[int]:
    cands = ngram_candidates(toks, 1, MAX_N, 1, DEPTH, earlier=held.earlier())
    if (not cands or cands[0][0] < 3) and (h := st["history"].get(tuple(toks[-3:]))):
        return _priced(gain, rec, toks, MAX_N + 1, h, cached)
    return _priced(gain, rec, toks, *cands[0], cached) if cands else []


def oracle_length_policy(toks, held, gain, rec, cached, st) -> list[int]:
    cands = ngram_candidates(toks, 1, MAX_N, 1, DEPTH, earlier=held.earlier())
    return cands[0][1][: agreed_prefix(cands[0][1], st["next"])] if cands else []


def oracle_policy(toks, held, gain, rec, cached, st) -> list[int]:
    cands = ngram_candidates(toks, 1, 64, 1 << 20, DEPTH, earlier=held.earlier())
    return st["next"][: max((agreed_prefix(c, st["next"]) for _, c in cands), default=0)]


POLICIES: dict[str, tuple[Policy, int]] = {  # name -> (policy, keys of its gain schedule)
    "engine": (engine_policy, MAX_N), "vote": (vote_policy, 4 * MAX_N), "history": (history_policy, MAX_N + 1),
    "oracle-length": (oracle_length_policy, MAX_N), "oracle": (oracle_policy, MAX_N)}


def replay(cases: list[Case], policy: str, cost: Cost, prefill: Callable[[int], float]) -> dict[str, Any]:
    """Every case through ``policy`` in order (one engine: the gain schedule's counts carry over, as they do
    in a server); per group: tokens, steps, AR's and the drafts' decode cost, and per question Spec-Bench's
    speed (tokens over prefill + decode, both MT-bench turns as one question)."""
    fn, keys = POLICIES[policy]
    gain = GainSchedule(keys, DEPTH, cost.curve)
    st: dict[str, Any] = {"history": {}}
    groups: dict[str, list[float]] = {}
    questions: dict[tuple[str, int], list[float]] = {}
    for c in cases:
        toks, pos, rec, held = c.prompt + c.out[:1], 1, gain.new_record(), TokenPositions()
        ar = sum(cost.step(1, len(c.prompt) + i, False) for i in range(1, len(c.out)))
        spec, steps = 0.0, 0
        while pos < len(c.out):
            held.sync(toks)
            gain.judge(rec, toks)
            st["next"] = c.out[pos:]
            draft = fn(toks, held, gain, rec, len(toks) - 1, st)
            spec += cost.step(1 + len(draft), len(toks) - 1, bool(draft))
            steps += 1
            n = min(agreed_prefix(draft, c.out[pos:]) + 1, len(c.out) - pos)
            toks, pos = toks + c.out[pos : pos + n], pos + n
        for i in range(3, len(c.out) - 1) if policy == "history" else ():  # its source: earlier outputs' 3-grams
            st["history"][tuple(c.out[i - 3 : i])] = c.out[i : i + DEPTH]
        g = groups.setdefault(c.group, [0.0] * 4)
        for i, v in enumerate((len(c.out) - 1, steps, ar, spec)):
            g[i] += v
        q = questions.setdefault((c.group, c.qid), [0.0] * 3)
        first = prefill(len(c.prompt)) + 1.0
        q[0], q[1], q[2] = q[0] + len(c.out), q[1] + first + ar, q[2] + first + spec
    tot = [sum(g[i] for g in groups.values()) for i in range(4)]
    return {"mal": tot[0] / tot[1], "decode": tot[2] / tot[3],
            "specbench": statistics.mean(q[0] / q[2] for q in questions.values())
            / statistics.mean(q[0] / q[1] for q in questions.values()),
            "groups": {g: (v[0] / v[1], v[2] / v[3]) for g, v in groups.items()}}


def fit_prefill(cases: list[Case], one_row: float) -> Callable[[int], float]:
    """AR's seconds to the first token as ``a P + b P^2`` one-row forwards (least squares, P prompt tokens)."""
    s11 = sum(len(c.prompt) ** 2 for c in cases)
    s12 = sum(len(c.prompt) ** 3 for c in cases)
    s22 = sum(len(c.prompt) ** 4 for c in cases)
    t1 = sum(c.prefill / one_row * len(c.prompt) for c in cases)
    t2 = sum(c.prefill / one_row * len(c.prompt) ** 2 for c in cases)
    det = s11 * s22 - s12 * s12
    a, b = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
    return lambda p: a * p + b * p * p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--overhead", type=float, default=0.04,
                    help="a drafted step's time outside the forward beyond a plain step's, in one-row forwards "
                         "(bench_spec_step.py --phases, 2026-11-29: 0.82 - 0.46 ms of a 9.6 ms step)")
    ap.add_argument("--flat", type=float, default=1.2, help="the flat-rows model's 8-row forward")
    ap.add_argument("--repeats", type=int, default=15,
                    help="timed forwards per point of the cost curve (every layer, the fastest kept; the engine's "
                         "own probe takes 3 over 4 layers, and moved by up to ~0.2 at 8 rows between runs here)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 times by CPU clock (the Spec-Bench runs' setting), more by wall clock")
    ap.add_argument("--check", action="store_true", help="also run the engine's default config on the cases")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)  # one thread, CPU clock: the Spec-Bench runs' setting on this 2-core machine
    sb.CLOCK = time.process_time if a.threads == 1 else time.perf_counter
    llm = LLM(None, progress=False, dtype="float32", numerics="int8")
    prompts = sb.Prompts(llm, True, None)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)

    ar = sb.make_engine(llm, None)
    spec = sb.make_engine(llm, {}) if a.check else None
    sample = sb.draw_sample(sb.load_questions(), a.per_group, a.seed, list(sb.GROUPS))
    cases: list[Case] = []
    checked: dict[str, list[float]] = {}
    for g, qs in sample.items():
        for q in qs:
            answers: list[str] = []
            for turn in range(len(q["turns"])):
                ids = prompts.ids(q["turns"][: turn + 1], answers)
                r = sb.run_case(ar, ids, params)
                cases.append(Case(g, q["question_id"], ids, r.tokens, r.seconds - r.decode_seconds))
                if spec is not None:
                    s = sb.run_case(spec, ids, params)
                    assert s.tokens == r.tokens, f"{g} q{q['question_id']}: speculative output differs from AR's"
                    acc = checked.setdefault(g, [0.0] * 4)
                    for i, v in enumerate((s.decode_tokens, s.decode_forwards, r.decode_seconds, s.decode_seconds)):
                        acc[i] += v
                answers.append(llm.tokenizer.decode(r.tokens, skip_special_tokens=True))
    clock = time.process_time if a.threads == 1 else time.perf_counter
    model, cpu = ar.runner.model, torch.device("cpu")
    bare = curve(model, cpu, ROWS, a.repeats, None, clock=clock)
    c = context_terms(model, cpu, ar.runner.cache, bare, repeats=a.repeats, probe_layers=None, clock=clock)
    one = sb.run_case(ar, cases[0].prompt[:8], SamplingParams(temperature=0.0, max_tokens=33))
    one_row = one.decode_seconds / max(one.decode_forwards, 1)  # a one-row forward after 8 tokens
    prefill = fit_prefill(cases, one_row)
    costs = {"measured": Cost(c, a.overhead), "no-overhead": Cost(c, 0.0),
             "no-row-attention": Cost(replace(c, row_token=0.0), a.overhead),
             "flat-rows": Cost(c, a.overhead, a.flat),
             "all": Cost(replace(c, row_token=0.0), 0.0, a.flat),
             "free": Cost(CostCurve((1, 2), (1.0, 1.0), c.first_token, 0.0), 0.0)}
    print(f"{len(cases)} Spec-Bench cases ({a.per_group} per group, seed {a.seed}), default model, int8, "
          f"{a.threads} thread(s); cost curve {c}; one-row forward {one_row * 1e3:.2f} ms; drafted-step overhead "
          f"{a.overhead}")
    print("\n| policy | cost model | MAL | decode speed-up | Spec-Bench speed-up | per group (MAL / decode) |")
    print("|---|---|---|---|---|---|")
    for p in a.policies:
        for name, cost in costs.items():
            res = replay(cases, p, cost, prefill)
            per = ", ".join(f"{g} {m:.2f} / {d:.2f}x" for g, (m, d) in res["groups"].items())
            print(f"| {p} | {name} | {res['mal']:.2f} | {res['decode']:.3f}x | {res['specbench']:.3f}x | {per} |",
                  flush=True)
    if checked:
        tot = [sum(v[i] for v in checked.values()) for i in range(4)]
        per = ", ".join(f"{g} {v[0] / v[1]:.2f} / {v[2] / v[3]:.2f}x" for g, v in checked.items())
        print(f"\nthe engine's default config on the same cases (measured, CPU clock): MAL {tot[0] / tot[1]:.2f}, "
              f"decode speed-up {tot[2] / tot[3]:.3f}x; {per}")


if __name__ == "__main__":
    main()
