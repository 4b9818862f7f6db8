"""The speed sections of benchmarks/gpu_check.py: plain decode against HF transformers' ``generate``
(eager and static cache + ``torch.compile``) and a Spec-Bench sample, speculative vs plain AR."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.bench_specbench import GROUPS, QUESTIONS, draw_sample, load_questions
from benchmarks.gpu_check_common import (
    DEFAULT_SPEC,
    TREE32_SPEC,
    TREE_SPEC,
    Clock,
    Models,
    cell,
    engine_on,
    half,
    hf_decode_tps,
    id_prompts,
    run_ours,
)

VARIANTS = {"hf eager": {}, "hf static+compile": {"cache_implementation": "static"}}
SHARES = (0.6, 0.4)  # of the decode budget: the 1B shape (the targets' model), then the default model


def decode_cells(batches: list[int]) -> list[tuple[str, int]]:
    """(engine, batch) in the order they run: the targets' cells first (batch 1 against HF eager and
    compiled, batch 64 against eager), the rest as long as the model's share of the budget lasts."""
    lo, hi = batches[0], batches[-1]
    first = [("ours", lo), ("hf eager", lo), ("hf static+compile", lo), ("ours", hi), ("hf eager", hi)]
    rest = [(e, b) for b in batches for e in ("ours", *VARIANTS)]
    return first + [c for c in rest if c not in first]


def section_decode(args: argparse.Namespace, clock: Clock, dev: torch.device, models: Models) -> dict[str, Any]:
    batches = [1, 2] if args.dry_run else [1, 8, 64]
    n = 8 if args.dry_run else 128
    res: dict[str, Any] = {"dtype": half(dev), "new_tokens": n, "prompt_tokens": 32, "batches": batches, "rows": []}
    for mi, name in enumerate(models.specs):
        share = SHARES[mi] / sum(SHARES[mi:len(models.specs)])
        model_end = time.perf_counter() + clock.left() * share
        llm = models.ours(name, half(dev))
        eng = engine_on(llm, dev, half(dev))
        prompts = id_prompts(max(batches), 32, llm.model_config.vocab_size, 11)
        run_ours(eng, prompts[:2], 4, dev)  # warm-up (CUDA context, kernels)
        row: dict[str, Any] = {"model": name}
        hf = None
        for engine, b in decode_cells(batches):
            key = f"{name} {engine} b{b}"
            need = 60.0 if engine == "hf static+compile" and dev.type == "cuda" else 0.0  # compiling one shape
            if time.perf_counter() + need > model_end:
                res.setdefault("over_budget", []).append(f"{key}: over the time budget")
                continue
            with cell(res, key, clock) as ok:
                if ok and engine == "ours":
                    outs, _, dd = run_ours(eng, prompts[:b], n, dev)
                    row[f"ours b{b}"] = sum(len(o) - 1 for o in outs) / dd
                elif ok:
                    hf = hf if hf is not None else models.hf(name, getattr(torch, half(dev)))
                    before = _compiled_graphs()
                    row[f"{engine} b{b}"] = hf_decode_tps(hf, prompts[:b], n, dev, **VARIANTS[engine])
                    if VARIANTS[engine]:
                        row[f"{engine} compiled b{b}"] = _compiled_graphs() > before
        for b in batches:
            ours = row.get(f"ours b{b}")
            for label in VARIANTS:
                if ours and row.get(f"{label} b{b}"):
                    row[f"vs {label} b{b}"] = ours / row[f"{label} b{b}"]
        res["rows"].append(row)
        del hf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def _compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["stats"].values()))
    except Exception:  # noqa: BLE001
        return 0


SPEC_BENCH = {  # Spec-Bench's six categories, four prompts each (written for this check)
    "multi-turn conversation": [
        "I am planning a week-long trip to Japan in spring. Which cities should I visit and why?",
        "Can you explain how a refrigerator keeps food cold, step by step?",
        "My tomato plants have yellow leaves. What could be wrong, and what should I do?",
        "What are good habits for writing maintainable Python code?"],
    "translation": [
        "Translate into German: The train to the airport leaves every fifteen minutes from platform two.",
        "Translate into French: Please close the window before you leave the room.",
        "Translate into Spanish: The museum is closed on Mondays but open late on Fridays.",
        "Translate into English: Der Hund schläft unter dem Tisch, weil es draußen regnet."],
    "summarization": [
        "Summarize: The city council met on Tuesday to discuss the new park. Residents asked for more trees "
        "and a playground. The council agreed to plant two hundred trees and to build the playground next year, "
        "paid for by the parks budget. Some residents worried about parking near the park.",
        "Summarize: Solar panels turn sunlight into electricity. Their price has fallen for a decade, so more "
        "homes install them. Batteries store the power for the night. Utilities now pay owners for extra power.",
        "Summarize: The library will extend its opening hours during exams. Students can book study rooms online. "
        "The cafe will stay open until midnight. Quiet zones will be enforced on the upper floors.",
        "Summarize: A new study found that short walks after meals lower blood sugar. Ten minutes were enough. "
        "The effect was largest after dinner. Researchers recommend walking rather than sitting after eating."],
    "question answering": [
        "What is the boiling point of water at sea level in degrees Celsius?",
        "Who wrote the play Romeo and Juliet?",
        "Why is the sky blue during the day?",
        "What is the difference between a virus and a bacterium?"],
    "math reasoning": [
        "A shop sells pens at 3 dollars each. Anna buys 4 pens and pays with a 20 dollar note. How much change "
        "does she get? Think step by step.",
        "If a train travels 120 km in 1.5 hours, what is its average speed in km per hour? Show your work.",
        "Tom has twice as many apples as Sara. Together they have 18 apples. How many does each have?",
        "What is 15 percent of 240? Explain the calculation."],
    "retrieval-augmented generation": [
        "Context: The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 metres tall. "
        "Question: When was the Eiffel Tower completed and why?",
        "Context: Honey bees communicate the location of flowers with a waggle dance. The angle of the dance "
        "shows the direction. Question: How do honey bees tell each other where flowers are?",
        "Context: The Nile is about 6,650 km long and flows north into the Mediterranean Sea. Question: Into "
        "which sea does the Nile flow, and how long is it?",
        "Context: Python was created by Guido van Rossum and first released in 1991. Question: Who created "
        "Python and when was it first released?"],
}


def spec_bench_prompts(limit: int) -> tuple[str, list[tuple[str, str]]]:
    """``(source, [(group, first turn)])``: Spec-Bench's question file (benchmarks/data/spec_bench), the sample
    bench_specbench.py draws (seeded, the same number from each of its six groups), else the built-in one. The
    groups take turns, so a run cut by its time budget still has every group."""
    if QUESTIONS.is_file():
        per = max(1, limit // len(GROUPS))
        sample = draw_sample(load_questions(), per, 0, list(GROUPS))
        return "Spec-Bench question.jsonl, first turns", [(g, qs[i]["turns"][0]) for i in range(per)
                                                          for g, qs in sample.items() if i < len(qs)]
    return "built-in sample", [(g, t) for g, ts in SPEC_BENCH.items() for t in ts][:limit]


def section_spec_bench(args: argparse.Namespace, clock: Clock, dev: torch.device, models: Models) -> dict[str, Any]:
    """Plain AR, the default speculative config and the tree proposers on a Spec-Bench sample, per group as
    its leaderboard reports: MAL (tokens per forward after the first token) and Spec-Bench's speed-up (the
    mean of per-question tokens/s over AR's, bench_specbench.py), EOS respected, greedy identity checked."""
    name = list(models.specs)[-1]
    n = 8 if args.dry_run else 128
    source, cases = spec_bench_prompts(6 if args.dry_run else 24)
    res: dict[str, Any] = {"model": name, "dtype": "float32", "batch": 1, "new_tokens": n, "prompts": source,
                           "num_prompts": len(cases), "configs": {}, "groups": {}}
    if not models.specs[name]["real"]:
        res["note"] = "random weights: acceptance says nothing about a real model; identity and overheads do"
    llm = models.ours(name, "float32")
    chat = getattr(llm.tokenizer, "chat_template", None) is not None
    prompts = [llm.tokenize(llm.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False) if chat
               else llm.tokenize(t) for _, t in cases]
    configs = {"plain AR": None, "speculative default": DEFAULT_SPEC, "speculative hybrid": TREE_SPEC,
               "speculative hybrid, 32 nodes": TREE32_SPEC}
    engines = {k: engine_on(llm, dev, "float32", v) for k, v in configs.items()}
    for eng in engines.values():
        run_ours(eng, prompts[:1], 4, dev)  # warm-up; the gain schedule measures its cost curve here
    # per config and group: tokens/s per question, decode tokens and steps, questions identical to AR
    acc: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in configs}
    for i, ((group, _), p) in enumerate(zip(cases, prompts, strict=True)):
        if clock.left() <= 0:
            res.setdefault("over_budget", []).append(f"prompts {i + 1}..{len(prompts)}: over the time budget")
            break
        ref = None
        for k, eng in engines.items():  # configs interleaved per prompt: load drift hits them alike
            st: dict[str, int] = {}
            outs, dt, dd = run_ours(eng, [p], n, dev, ignore_eos=False, stats=st)
            ref = outs[0] if ref is None else ref
            for key in (group, "overall"):
                a = acc[k].setdefault(key, dict(tps=[], tokens=0, seconds=0.0, decode_tokens=0, decode_seconds=0.0,
                                                decode_steps=0, identical=0))
                a["tps"].append(len(outs[0]) / dt)
                a["tokens"] += len(outs[0])
                a["seconds"] += dt
                a["decode_tokens"] += len(outs[0]) - 1
                a["decode_seconds"] += dd
                a["decode_steps"] += st["decode_steps"]
                a["identical"] += int(outs[0] == ref)

    def row(a: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        return dict(specbench_speedup=(sum(a["tps"]) / len(a["tps"])) / (sum(base["tps"]) / len(base["tps"])),
                    mal=a["decode_tokens"] / max(a["decode_steps"], 1),
                    identical_to_ar=f"{a['identical']}/{len(a['tps'])}")

    base = acc["plain AR"].get("overall")
    for k, groups in acc.items():
        if base is None or "overall" not in groups:
            continue
        a = groups["overall"]
        tps, dps = a["tokens"] / a["seconds"], a["decode_tokens"] / max(a["decode_seconds"], 1e-9)
        res["configs"][k] = dict(options=configs[k], tok_s=tps, decode_tok_s=dps,
                                 vs_ar=tps / (base["tokens"] / base["seconds"]),
                                 decode_vs_ar=dps / (base["decode_tokens"] / max(base["decode_seconds"], 1e-9)),
                                 **row(a, base))
        res["groups"][k] = {g: row(ga, acc["plain AR"][g]) for g, ga in groups.items() if g != "overall"}
    return res
