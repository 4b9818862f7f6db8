"""Speculative decoding on the default model (CPU): tokens/s (end to end, and of the decode phase
after each sequence's first token), mean acceptance length, KV bytes
written per committed token, greedy-text identity vs plain AR, and HF transformers' prompt
lookup / early-exit assisted generation on the same prompts. Also measures speculative chunk
verify (SCV) by chunk size at batch 1 and 16. Prints medians and ratios vs a peer from the same run.

    python benchmarks/bench_speculative.py [--max-tokens 128] [--ignore-eos] [--threads 1] [--skip-hf] [--skip-scv]
    python benchmarks/bench_speculative.py --scv-only [--scv-batches 1,16] [--scv-depths 6,12] [--scv-chunks 0,2,4,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ratchetlm import LLM  # noqa: E402
from ratchetlm.engine.config import EngineConfig  # noqa: E402
from ratchetlm.engine.llm_engine import LLMEngine  # noqa: E402
from ratchetlm.sampling_params import SamplingParams  # noqa: E402
from tests.speculative.prompts import CHATS, CODE_EDITS, SUMMARIES  # noqa: E402

CATEGORIES = {"code": CODE_EDITS, "summary": SUMMARIES, "chat": CHATS}


def _chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


_PARAGRAPH = (
    "The Great Barrier Reef, off the coast of Queensland, Australia, is the largest coral reef system in the "
    "world. It stretches for over 2,300 kilometres and is made up of nearly 3,000 individual reefs and 900 "
    "islands. The reef supports a huge diversity of life, including many vulnerable and endangered species. "
    "In recent decades rising sea temperatures have caused repeated mass bleaching events, in which corals "
    "expel the algae living in their tissues and turn white. Scientists warn that without cuts in greenhouse "
    "gas emissions, bleaching will become more frequent and many reefs may not recover.")
# --prompt-set ordinary: the kinds of request Spec-Bench groups (written here, not Spec-Bench's own)
ORDINARY = {
    "qa": [_chat("What are the main differences between a virus and a bacterium?")],
    "summary": [_chat("Summarize the following paragraph in two sentences.\n\n" + _PARAGRAPH)],
    "translation": [_chat("Translate the following German text to English: \"Der Zug nach Berlin hat heute "
                          "zwanzig Minuten Verspätung, weil es auf der Strecke einen technischen Defekt gab. "
                          "Die Reisenden werden gebeten, auf Gleis drei zu warten.\"")],
    "math": [_chat("A bakery sells muffins for $3 each and cookies for $2 each. Anna buys 4 muffins and 5 "
                   "cookies and pays with a $50 bill. How much change does she get? Explain step by step.")],
    "rag": [_chat("Answer the question using only the context.\n\nContext: " + _PARAGRAPH
                  + "\n\nQuestion: What happens to corals during a bleaching event, and what causes it?")],
}
CONFIGS = {
    "plain AR": None,
    "hybrid default (gain)": dict(method="hybrid"),  # (the default was the hybrid when this label was named)
    "hybrid static 16": dict(method="hybrid", depth_schedule="constant"),
    "suffix (gain)": dict(method="suffix"),
    "recycling (gain)": dict(method="recycling"),
    "recycling static 16": dict(method="recycling", depth_schedule="constant"),
    "ngram chain": dict(method="ngram", depth=4, depth_schedule="constant"),
    "ngram tree": dict(method="ngram", num_candidates=3, depth=4, depth_schedule="constant"),
    "ngram chain adaptive": dict(method="ngram", depth=6, depth_schedule="adaptive"),
    "ngram chain gain": dict(method="ngram", depth=6, depth_schedule="gain"),
    "ngram default (gain, depth 8)": dict(method="ngram"),
    "ngram chain gain, depth 4": dict(method="ngram", depth=4),
    "ngram tree gain (3 x 4)": dict(method="ngram", num_candidates=3, depth=4),
    "ngram tree gain (3 x 6)": dict(method="ngram", num_candidates=3, depth=6),
    "eagle chain": dict(method="eagle", depth=4, depth_schedule="constant"),
    "eagle chain gain": dict(method="eagle", depth=6, depth_schedule="gain"),
    "self-draft chain": dict(method="draft", draft_layers=6, depth=3),
    "self-draft beam": dict(method="draft", draft_layers=6, depth=3, num_candidates=2),
    "ngram chain, off at batch >= 4": dict(method="ngram", depth=4, depth_schedule="constant", disable_by_batch_size=4),
}


def engine(llm: LLM, opts: dict | None) -> LLMEngine:
    cfg = EngineConfig(dtype="float32", decoding="speculative" if opts is not None else "autoregressive",
                       decoding_options=opts or {}, kv_cache_blocks=512, progress=False,
                       numerics=llm.config.numerics)
    return LLMEngine(cfg, llm.engine.model, llm.model_config)


# --clock cpu: this process's CPU seconds instead of wall seconds. On a machine shared with busy
# neighbours (load far above the core count) wall time mostly measures the neighbours; with one
# torch thread, CPU time is the work the run did.
CLOCK = time.perf_counter


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float, float]:
    """Outputs, seconds from the requests' arrival to the last token, and seconds of the decode phase:
    from the step at which every sequence holds its first token (the prompts' prefill, which
    speculation does not touch, is behind) to the last token, as ``ratchet bench`` times decode."""
    t = CLOCK()
    ids = [eng.add_request(p, params) for p in prompts]
    t_first = None
    while eng.has_unfinished():
        eng.step()
        if t_first is None and all(eng.seqs[i].output_ids for i in ids):
            t_first = CLOCK()
    end = CLOCK()
    return [eng.seqs[i].output_ids for i in ids], end - t, end - (t_first if t_first is not None else t)


def decode_tps(outs: list[list[int]], seconds: float) -> float:
    """Tokens after each sequence's first over the decode phase's seconds (0 when nothing followed)."""
    n = sum(len(o) - 1 for o in outs)
    return n / seconds if n > 0 and seconds > 0 else 0.0


def mal(eng: LLMEngine) -> float:
    return eng.strategy.metrics().get("spec_decode_mean_acceptance_length", 1.0) or 1.0


def bench_ours(llm: LLM, params: SamplingParams, repeats: int) -> tuple[dict, dict]:
    """Every config on every prompt, ``repeats`` rounds with the configs interleaved inside each
    round, so load drift on a shared machine hits all configs alike; cells are medians."""
    enc = {c: [llm.tokenize(p) for p in ps] for c, ps in CATEGORIES.items()}
    flat = [p for ps in enc.values() for p in ps]
    mixed = (flat * 8)[:8]  # batch 8: every category (cycled to 8)
    tps: dict = {}  # (config, category, batch) -> tok/s of every round
    dps: dict = {}  # (config, category, batch) -> decode-phase tok/s of every round
    same: dict = {}  # (config, category, batch) -> greedy text equal to plain AR in every round
    last: dict = {}  # (config, category, batch) -> the last round's engine (for its counters)
    ref: dict = {}
    for _ in range(repeats):
        for name, opts in CONFIGS.items():
            for cat, prompts in enc.items():  # batch 1: each prompt alone
                k = (name, cat, 1)
                last[k] = eng = engine(llm, opts)
                for p in prompts:
                    out, dt, dd = run(eng, [p], params)
                    tps.setdefault(k, []).append(len(out[0]) / dt)
                    dps.setdefault(k, []).append(decode_tps(out, dd))
                    same[k] = same.get(k, True) and out[0] == ref.setdefault((cat, tuple(p)), out[0])
            k = (name, "mixed", 8)
            last[k] = eng = engine(llm, opts)
            out, dt, dd = run(eng, mixed, params)
            tps.setdefault(k, []).append(sum(map(len, out)) / dt)
            dps.setdefault(k, []).append(decode_tps(out, dd))
            same[k] = same.get(k, True) and out == ref.setdefault(("mixed", tuple(map(tuple, mixed))), out)
            cells = [f"{c}/b{b} {v[-1]:.1f}" for (n, c, b), v in tps.items() if n == name]
            print(f"  {name:20s} " + "  ".join(cells), flush=True)
    rows = {}
    for k, v in tps.items():
        eng = last[k]
        kvw = eng.cache.bytes_written / (sum(s.num_cached for s in eng.seqs.values()) * eng.cache.bytes_per_token())
        rows[k] = dict(tps=statistics.median(v), dps=statistics.median(dps[k]), mal=mal(eng), same=same[k], kv=kvw)
    return rows, ref


def bench_hf(llm: LLM, params: SamplingParams, ref: dict) -> dict:
    import transformers
    from transformers import LlamaForCausalLM

    from ratchetlm.models.loader import default_model_path

    transformers.logging.set_verbosity_error()
    p = default_model_path()
    model = LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    variants = {"HF greedy": {}, "HF prompt lookup": dict(prompt_lookup_num_tokens=4),
                "HF early-exit assisted": dict(assistant_early_exit=6)}
    eos = set(llm.model_config.eos_token_ids)
    rows = {}
    for name, kw in variants.items():
        for cat, prompts in CATEGORIES.items():
            tps: list[float] = []
            same = True
            for text in prompts:
                ids = llm.tokenize(text)
                x = torch.tensor([ids])
                t = time.perf_counter()
                try:
                    with torch.inference_mode():
                        stop = dict(min_new_tokens=params.max_tokens) if params.ignore_eos else {}
                        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=params.max_tokens,
                                           do_sample=False, **stop, **kw)
                except Exception as e:  # an unsupported option is reported, not hidden
                    print(f"  {name}: unsupported ({type(e).__name__}: {e})")
                    tps = []
                    break
                dt = time.perf_counter() - t
                out = y[0, len(ids):].tolist()
                tps.append(len(out) / dt)
                # with --ignore-eos ours emits EOS and goes on while HF's min_new_tokens masks EOS,
                # so the two are compared up to our first EOS (inclusive when HF stops there too)
                ours = ref[(cat, tuple(ids))]
                cut = next((i for i, t in enumerate(ours) if t in eos), len(ours))
                same &= out[:cut] == ours[:cut]
            if tps:
                rows[(name, cat, 1)] = dict(tps=statistics.median(tps), mal=float("nan"), same=same, kv=float("nan"))
                print(f"  {name:17s} {cat:8s} b=1  {rows[(name, cat, 1)]}", flush=True)
    return rows


def bench_scv(llm: LLM, batches: list[int], repeats: int, max_tokens: int, depths: list[int],
              chunks: list[int]) -> None:
    """Speculative chunk verify: an n-gram chain of each depth verified whole (chunk off) or in
    chunks, every chunk of a step's draft inside that step (SCV). Each cell is the median tokens/s
    over ``repeats`` runs (configs interleaved so load drift on a shared machine hits them alike);
    ratios are vs chunk off in the same run; plain AR runs alongside for reference."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [llm.tokenize(p) for ps in CATEGORIES.values() for p in ps]
    print(f"\nSCV (n-gram chain, {max_tokens} new tokens, EOS ignored): median tok/s over {repeats} runs by "
          "chunk_size; fwd/step = target forwards per engine step, tok/chunk = tokens committed per chunk")
    for depth in depths:
        for batch in batches:
            # batch 1: every prompt alone in turn (total tokens / total time); batch b > 1: b prompts at once
            groups = [[p] for p in prompts] if batch == 1 else [(prompts * -(-batch // len(prompts)))[:batch]]
            cfgs = {"AR": None} | {f"chunk={c or 'off'}": dict(method="ngram", depth=depth, chunk_size=c,
                                                                depth_schedule="constant") for c in chunks}
            tps: dict[str, list[float]] = {k: [] for k in cfgs}
            info: dict[str, str] = {}
            outs: dict[str, list[list[int]]] = {}
            for _ in range(repeats):
                for name, opts in cfgs.items():
                    eng = engine(llm, opts)
                    toks, secs, outs[name] = 0, 0.0, []
                    for g in groups:
                        out, dt, _ = run(eng, g, params)
                        toks, secs = toks + sum(map(len, out)), secs + dt
                        outs[name] += out
                    tps[name].append(toks / secs)
                    m = eng.strategy.metrics()
                    per_chunk = m.get("spec_decode_scv_mean_committed_per_chunk")
                    info[name] = (f"mal {mal(eng):.2f}, fwd/step {eng.runner.num_forwards / eng.stats.steps:.2f}"
                                  + (f", tok/chunk {per_chunk:.2f}" if per_chunk else ""))
            base = statistics.median(tps["chunk=off"])
            print(f"  depth {depth}, batch {batch}:", flush=True)
            for name in cfgs:
                med = statistics.median(tps[name])
                same = "" if outs[name] == outs["chunk=off"] else "  TEXT DIFFERS"
                print(f"    {name:10s} {med:7.2f} tok/s ({med / base:.2f}x){'' if name == 'AR' else ', ' + info[name]}"
                      f"{same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="always generate --max-tokens (default: stop at EOS, as a user would)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-scv", action="store_true")
    ap.add_argument("--scv-only", action="store_true", help="only the chunked-verify comparison")
    ap.add_argument("--scv-batches", default="1,16", help="comma-separated batch sizes for the SCV comparison")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per cell, configs interleaved (median reported)")
    ap.add_argument("--scv-depths", default="6,12", help="comma-separated n-gram chain depths for the SCV comparison")
    ap.add_argument("--scv-chunks", default="0,2,4,8", help="comma-separated chunk sizes (0 = off) for SCV")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time runs by wall clock or by this process's CPU time (a busy shared machine)")
    ap.add_argument("--numerics", default=None, help="exact | int8 | int16 (default: the engine's default)")
    ap.add_argument("--prompt-set", choices=("default", "ordinary"), default="default",
                    help="default: code/summary/chat; ordinary: QA, summary, translation, math, RAG chat prompts")
    ap.add_argument("--configs", default=None,
                    help=f"';'-separated subset of our configs (plain AR is always run); known: {'; '.join(CONFIGS)}")
    a = ap.parse_args()
    if a.configs:
        keep = {"plain AR", *(c.strip() for c in a.configs.split(";"))}
        unknown = keep - set(CONFIGS)
        if unknown:
            ap.error(f"unknown config(s) {', '.join(sorted(unknown))}")
        for name in list(CONFIGS):
            if name not in keep:
                del CONFIGS[name]
    torch.set_num_threads(a.threads)
    if a.prompt_set == "ordinary":
        CATEGORIES.clear()
        CATEGORIES.update(ORDINARY)
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    llm = LLM(progress=False, dtype="float32", **({"numerics": a.numerics} if a.numerics else {}))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=a.ignore_eos)
    print(f"default model, numerics {llm.config.numerics}, CPU, {a.threads} thread(s), {a.clock} clock, load "
          f"{os.getloadavg()[0]:.1f}, greedy, up to {a.max_tokens} new tokens"
          f"{' (EOS ignored)' if a.ignore_eos else ', stop at EOS'}")
    scv = ([int(b) for b in a.scv_batches.split(",")], a.repeats, a.max_tokens,
           [int(d) for d in a.scv_depths.split(",")], [int(c) for c in a.scv_chunks.split(",")])
    if a.scv_only:
        bench_scv(llm, *scv)
        return
    rows, ref = bench_ours(llm, params, a.repeats)
    if not a.skip_hf:
        rows.update(bench_hf(llm, params, ref))
    # tok/s: every output token over the time from the requests' arrival (prefill included, as a user
    # waits for a whole answer); decode tok/s: the tokens after the first over the time after it
    # (the phase speculation changes; a long prompt's prefill dilutes the first ratio)
    print("\n| config | prompts | batch | tok/s (median) | vs plain AR | decode tok/s | vs plain AR | mean acc. len "
          "| KV written / committed tok | greedy text == AR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, cat, b), r in rows.items():
        base = rows[("plain AR", cat, b)]
        dvs = f"{r['dps'] / base['dps']:.2f}x" if r.get("dps") and base.get("dps") else "—"
        dcell = f"{r['dps']:.2f}" if r.get("dps") else "—"
        print(f"| {name} | {cat} | {b} | {r['tps']:.2f} | {r['tps'] / base['tps']:.2f}x | {dcell} | {dvs} "
              f"| {r['mal']:.2f} | {r['kv']:.2f} | {'yes' if r['same'] else 'NO'} |")
    if not a.skip_scv:
        bench_scv(llm, *scv)


if __name__ == "__main__":
    main()
