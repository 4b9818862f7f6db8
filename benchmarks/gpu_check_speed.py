"""The speed sections of benchmarks/gpu_check.py: plain decode against HF transformers' ``generate``
(eager and static cache + ``torch.compile``) and a Spec-Bench sample, speculative vs plain AR."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks.gpu_check_common import (
    DEFAULT_SPEC,
    ROOT,
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


def spec_bench_prompts(limit: int) -> tuple[str, list[str]]:
    """The speculative work's Spec-Bench question file if one is shipped, else the built-in sample."""
    for f in sorted((ROOT / "benchmarks" / "data").glob("*spec*bench*.jsonl")):
        qs = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
        texts = [q["turns"][0] if "turns" in q else q.get("prompt") or q.get("question") for q in qs]
        by_cat: dict[str, list[str]] = {}
        for q, t in zip(qs, texts, strict=True):
            by_cat.setdefault(str(q.get("category", "")), []).append(t)
        per = max(1, limit // max(1, len(by_cat)))  # the same number from every category, in file order
        return f.name, [t for ts in by_cat.values() for t in ts[:per]][:limit]
    return "built-in sample", [t for ts in SPEC_BENCH.values() for t in ts][:limit]


def section_spec_bench(args: argparse.Namespace, clock: Clock, dev: torch.device, models: Models) -> dict[str, Any]:
    name = list(models.specs)[-1]
    n = 8 if args.dry_run else 128
    source, texts = spec_bench_prompts(3 if args.dry_run else 24)
    res: dict[str, Any] = {"model": name, "dtype": "float32", "batch": 1, "new_tokens": n, "prompts": source,
                           "num_prompts": len(texts), "configs": {}}
    if not models.specs[name]["real"]:
        res["note"] = "random weights: acceptance says nothing about a real model; identity and overheads do"
    llm = models.ours(name, "float32")
    chat = getattr(llm.tokenizer, "chat_template", None) is not None
    prompts = [llm.tokenize(llm.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False) if chat
               else llm.tokenize(t) for t in texts]
    configs = {"plain AR": None, "speculative default": DEFAULT_SPEC, "speculative tree 3x4": TREE_SPEC}
    engines = {k: engine_on(llm, dev, "float32", v) for k, v in configs.items()}
    for eng in engines.values():
        run_ours(eng, prompts[:1], 4, dev)  # warm-up; the gain schedule measures its cost curve here
    acc: dict[str, dict[str, Any]] = {k: dict(tokens=0, seconds=0.0, decode_tokens=0, decode_seconds=0.0,
                                             identical=0, prompts=0) for k in configs}
    for i, p in enumerate(prompts):
        if clock.left() <= 0:
            res.setdefault("over_budget", []).append(f"prompts {i + 1}..{len(prompts)}: over the time budget")
            break
        ref = None
        for k, eng in engines.items():  # configs interleaved per prompt: load drift hits them alike
            outs, dt, dd = run_ours(eng, [p], n, dev)
            ref = outs[0] if ref is None else ref
            a = acc[k]
            a["tokens"] += len(outs[0])
            a["seconds"] += dt
            a["decode_tokens"] += len(outs[0]) - 1
            a["decode_seconds"] += dd
            a["identical"] += int(outs[0] == ref)
            a["prompts"] += 1
    base = acc["plain AR"]
    for k, a in acc.items():
        if not a["prompts"]:
            continue
        tps, dps = a["tokens"] / a["seconds"], a["decode_tokens"] / max(a["decode_seconds"], 1e-9)
        m = engines[k].strategy.metrics()
        res["configs"][k] = dict(options=configs[k], tok_s=tps, decode_tok_s=dps,
                                 vs_ar=tps / (base["tokens"] / base["seconds"]),
                                 decode_vs_ar=dps / (base["decode_tokens"] / max(base["decode_seconds"], 1e-9)),
                                 mean_acceptance_length=m.get("spec_decode_mean_acceptance_length"),
                                 identical_to_ar=f"{a['identical']}/{a['prompts']}")
    return res


