"""One device run that proves and times the CUDA path (issue 39): every number beside the GPU's
name and the torch / CUDA versions, under a total time budget (default 420 s), each section with
its own budget and skipped with a note once over it. Writes ``OUT/gpu_check.json`` and
``OUT/gpu_check.md`` (the JSON after every section, so a killed run still leaves what it measured).

Sections, in order:

* ``cuda_tests``: ``pytest -m cuda tests/cuda`` in a subprocess, pass/fail counts;
* ``parity``: fp32 greedy == HF transformers ``generate`` on the same weights, batched == alone;
* ``decode``: plain decode tokens/s at batch 1, 8, 64 (bf16) of a 1B-shape random Llama (Llama
  3.2 1B's shape, written by this script as an HF folder) and of the default model (the bundled
  SmolLM2-135M GGUF; where it is not installed, a random model of its shape), against HF
  transformers ``generate`` on the same device and weights: eager (dynamic cache) and static cache
  (which transformers compiles with ``torch.compile`` on CUDA);
* ``cost_curve``: time of a verify forward over k = 1..64 new rows (no context) / one row, per model
  (ratchetlm/decoding/speculative/cost_curve.py, as benchmarks/bench_cost_curve.py times it);
* ``spec_bench``: a Spec-Bench sample (``benchmarks/data/spec_bench*.jsonl`` if present, else 24
  built-in prompts in Spec-Bench's six categories), batch 1, fp32: plain AR vs the default
  speculative config vs an n-gram tree, greedy identity checked prompt by prompt.

    python benchmarks/gpu_check.py --out DIR [--device cuda] [--budget 420] [--default-model PATH]
    python benchmarks/gpu_check.py --device cpu --dry-run --out DIR   # tiny sizes, well under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_check_report import SECTIONS, markdown  # noqa: E402
from ratchetlm import LLM, SamplingParams  # noqa: E402
from ratchetlm.engine.config import EngineConfig  # noqa: E402
from ratchetlm.engine.llm_engine import LLMEngine  # noqa: E402

# Llama 3.2 1B's shape; SmolLM2-135M's (the default model's) for its random stand-in
SHAPE_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
SHAPE_135M = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
DEFAULT_SPEC = {"method": "ngram"}  # the speculative strategy's defaults (n-gram, depth 8, gain schedule)
TREE_SPEC = {"method": "ngram", "num_candidates": 3, "depth": 4}
BUDGETS = {"cuda_tests": 120.0, "parity": 40.0, "decode": 170.0, "cost_curve": 30.0, "spec_bench": 80.0}


class Clock:
    """The run's deadline and one section's: ``left()`` is the smaller of what both have left."""

    def __init__(self, total: float) -> None:
        self.end = time.perf_counter() + total
        self.section_end = self.end

    def start(self, seconds: float) -> None:
        self.section_end = min(self.end - 5.0, time.perf_counter() + seconds)

    def left(self) -> float:
        return self.section_end - time.perf_counter()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def environment(dev: torch.device) -> dict[str, Any]:
    import transformers

    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(device=str(dev), gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda,
                transformers=transformers.__version__, python=platform.python_version(), cpu=platform.processor(),
                cpu_count=os.cpu_count(), commit=commit, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                load=os.getloadavg()[0])


# ---------------------------------------------------------------- models


def write_llama(folder: Path, shape: dict[str, Any], dev: torch.device, seed: int = 0) -> Path:
    """A random-weight HF ``LlamaForCausalLM`` of ``shape`` saved in bf16 with the tests' byte tokenizer
    (its 258 ids are the low end of the model's vocabulary; prompts here are token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.tiny import byte_tokenizer

    cfg = LlamaConfig(**shape, max_position_embeddings=4096, bos_token_id=256, eos_token_id=257, pad_token_id=0,
                      head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    torch.manual_seed(seed)
    with torch.device(dev):  # a 1B model's random init is seconds on a GPU, a minute on a CPU
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    del model
    return folder


class Models:
    """The two models of the run, as ``{name: spec}``; a spec says where the weights are for ours and HF."""

    def __init__(self, args: argparse.Namespace, dev: torch.device, tmp: Path) -> None:
        self.dev, self.tmp, self.notes = dev, tmp, []
        big = TINY if args.dry_run else SHAPE_1B
        self.specs: dict[str, dict[str, Any]] = {
            "llama-1b-shape (random)": dict(path=str(write_llama(tmp / "llama1b", big, dev)), gguf=None, real=False)}
        default = None if args.dry_run else _default_gguf(args.default_model, self.notes)
        if default is not None:
            self.specs["SmolLM2-135M-Instruct Q4_1 (default)"] = dict(path=str(default), gguf=default, real=True)
        else:
            small = dict(TINY, num_hidden_layers=3) if args.dry_run else SHAPE_135M
            self.specs["smollm2-135m-shape (random)"] = dict(path=str(write_llama(tmp / "smol", small, dev, 1)),
                                                             gguf=None, real=False)
        self._ours: dict[tuple[str, str], LLM] = {}

    def ours(self, name: str, dtype: str) -> LLM:
        key = (name, dtype)
        if key not in self._ours:
            self._ours[key] = LLM(self.specs[name]["path"], device=str(self.dev), dtype=dtype, progress=False,
                                  max_num_seqs=128, kv_cache_bytes=(4 << 30) if self.dev.type == "cuda" else 1 << 22)
        return self._ours[key]

    def hf(self, name: str, dtype: torch.dtype) -> Any:
        from transformers import AutoModelForCausalLM

        s = self.specs[name]
        if s["gguf"] is not None:
            p = Path(s["gguf"])
            m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
        else:
            m = AutoModelForCausalLM.from_pretrained(s["path"], dtype=dtype)
        return m.to(self.dev).eval()


def _default_gguf(path: str | None, notes: list[str]) -> Path | None:
    """The default model's GGUF (``--default-model`` or the installed wheel), None with a note if absent
    or if HF cannot read it (no ``gguf`` package)."""
    try:
        import gguf  # noqa: F401

        from ratchetlm.models.loader import default_model_path

        p = Path(path) if path else default_model_path()
        if not p.is_file():
            raise FileNotFoundError(p)
        return p
    except Exception as e:  # noqa: BLE001 (reported; a random model of its shape stands in)
        notes.append(f"default model not used ({type(e).__name__}: {e}); a random model of its shape stands in")
        return None


# ---------------------------------------------------------------- measurements


def engine_on(llm: LLM, dev: torch.device, dtype: str, decoding: dict[str, Any] | None = None) -> LLMEngine:
    cfg = EngineConfig(device=str(dev), dtype=dtype, decoding="speculative" if decoding else "autoregressive",
                       decoding_options=decoding or {}, kv_cache_blocks=llm.engine.blocks.num_blocks,
                       max_num_seqs=128, progress=False)
    return LLMEngine(cfg, llm.engine.model, llm.model_config)


def run_ours(eng: LLMEngine, prompts: list[list[int]], n: int, dev: torch.device) -> tuple[list[list[int]], float,
                                                                                           float]:
    """Greedy, EOS ignored: outputs, seconds from arrival to the last token, and decode-phase seconds
    (from the step at which every sequence holds its first token, as ``ratchet bench`` times decode)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sync(dev)
    t0 = time.perf_counter()
    ids = [eng.add_request(p, params) for p in prompts]
    t_first = None
    while eng.has_unfinished():
        eng.step()
        if t_first is None and all(eng.seqs[i].output_ids for i in ids):
            sync(dev)
            t_first = time.perf_counter()
    sync(dev)
    end = time.perf_counter()
    outs = []
    for i in ids:
        seq = eng.release(i)
        assert seq is not None
        outs.append(list(seq.output_ids))
    return outs, end - t0, end - (t_first or t0)


def hf_generate(model: Any, prompts: list[list[int]], n: int, dev: torch.device, **kw: Any) -> tuple[list[list[int]],
                                                                                                      float]:
    """HF greedy ``generate`` of exactly ``n`` tokens per prompt (equal-length prompts, no padding)."""
    x = torch.tensor(prompts, device=dev)
    sync(dev)
    t = time.perf_counter()
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, **kw)
    sync(dev)
    return y[:, x.shape[1]:].tolist(), time.perf_counter() - t


def hf_decode_tps(model: Any, prompts: list[list[int]], n: int, dev: torch.device, **kw: Any) -> float:
    """Decode tokens/s: (n - 1) tokens a prompt over the time of ``n`` tokens less that of the first
    (prefill + one token), each the faster of two after a warm-up (which compiles, where it does)."""
    hf_generate(model, prompts, n, dev, **kw)
    t_n = min(hf_generate(model, prompts, n, dev, **kw)[1] for _ in range(2))
    t_1 = min(hf_generate(model, prompts, 1, dev, **kw)[1] for _ in range(2))
    return len(prompts) * (n - 1) / max(t_n - t_1, 1e-9)


def id_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (count, length), generator=g).tolist()


@contextlib.contextmanager
def cell(out: dict[str, Any], key: str, clock: Clock, need: float = 0.0) -> Iterator[bool]:
    """Run one measurement unless the section is over budget (``need``: seconds it must have left);
    an exception is recorded under ``key`` and the run goes on."""
    if clock.left() <= need:
        out.setdefault("over_budget", []).append(f"{key}: over the section's time budget")
        yield False
        return
    try:
        yield True
    except Exception as e:  # noqa: BLE001 (one failed cell must not cost the rest of the device run)
        out.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
        traceback.print_exc()


def section_cuda_tests(args: argparse.Namespace, clock: Clock, dev: torch.device) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/cuda", "-q", "-p", "no:cacheprovider"]
    res: dict[str, Any] = {"command": "pytest -m cuda tests/cuda"}
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(clock.left(), 1.0),
                           env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        text = p.stdout + p.stderr
        res["returncode"] = p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        res["status_note"] = "timed out: over the section's time budget"
    summary = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|skipped|error|no tests ran)\b", ln)]
    last = summary[-1] if summary else ""
    for what, key in (("passed", "passed"), ("failed", "failed"), ("skipped", "skipped"), ("error", "test_errors"),
                      ("deselected", "deselected")):
        m = re.search(rf"(\d+) {what}", last)
        res[key] = int(m.group(1)) if m else 0
    res["summary"] = last.strip("= ")
    res["failures"] = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))][:20]
    return res


def section_parity(args: argparse.Namespace, clock: Clock, dev: torch.device, models: Models) -> dict[str, Any]:
    """fp32 on the default model (or its random stand-in): ours alone == HF greedy, batched == alone."""
    name = list(models.specs)[-1]
    n = 8 if args.dry_run else 48
    res: dict[str, Any] = {"model": name, "dtype": "float32", "new_tokens": n}
    llm = models.ours(name, "float32")
    prompts = id_prompts(4, 24, llm.model_config.vocab_size, 7)
    if models.specs[name]["real"]:
        texts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time, a fox"]
        prompts = [llm.encode(t) for t in texts]
    eng = engine_on(llm, dev, "float32")
    alone = [run_ours(eng, [p], n, dev)[0][0] for p in prompts]
    batched = run_ours(eng, prompts, n, dev)[0]
    res["batched_equals_alone"] = batched == alone
    with cell(res, "hf", clock) as ok:
        if ok:
            hf = models.hf(name, torch.float32)
            ref = [hf_generate(hf, [p], n, dev)[0][0] for p in prompts]
            res["greedy_equals_hf"] = [a == b for a, b in zip(alone, ref, strict=True)]
            res["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                                       for a, b in zip(alone, ref, strict=True)]
            del hf
    return res


def half(dev: torch.device) -> str:
    """bf16 on a GPU; fp32 in a CPU dry run (bf16 matmuls on a CPU without bf16 units take minutes)."""
    return "bfloat16" if dev.type == "cuda" else "float32"


def section_decode(args: argparse.Namespace, clock: Clock, dev: torch.device, models: Models) -> dict[str, Any]:
    batches = [1, 2] if args.dry_run else [1, 8, 64]
    n = 8 if args.dry_run else 128
    res: dict[str, Any] = {"dtype": half(dev), "new_tokens": n, "prompt_tokens": 32, "batches": batches, "rows": []}
    for mi, name in enumerate(models.specs):
        # each model gets an equal share of what is left; compiling costs tens of seconds a shape
        model_end = time.perf_counter() + clock.left() / (len(models.specs) - mi)
        llm = models.ours(name, half(dev))
        eng = engine_on(llm, dev, half(dev))
        prompts = id_prompts(max(batches), 32, llm.model_config.vocab_size, 11)
        run_ours(eng, prompts[:2], 4, dev)  # warm-up (CUDA context, kernels)
        row: dict[str, Any] = {"model": name}
        for b in batches:
            with cell(res, f"{name} ours b{b}", clock) as ok:
                if ok:
                    outs, _, dd = run_ours(eng, prompts[:b], n, dev)
                    row[f"ours b{b}"] = sum(len(o) - 1 for o in outs) / dd
        hf = None
        with cell(res, f"{name} HF load", clock) as ok:
            if ok:
                hf = models.hf(name, getattr(torch, half(dev)))
        variants = {"hf eager": {}, "hf static+compile": {"cache_implementation": "static"}}
        for label, kw in variants.items():
            for b in batches:
                need = 45.0 if kw and dev.type == "cuda" else 0.0  # a compile of one shape
                if hf is None or time.perf_counter() + need > model_end:
                    res.setdefault("over_budget", []).append(f"{name} {label} b{b}: over the time budget")
                    continue
                with cell(res, f"{name} {label} b{b}", clock) as ok:
                    if ok:
                        before = _compiled_graphs()
                        row[f"{label} b{b}"] = hf_decode_tps(hf, prompts[:b], n, dev, **kw)
                        if kw:
                            row[f"{label} compiled"] = _compiled_graphs() > before
        for b in batches:
            ours = row.get(f"ours b{b}")
            for label in variants:
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


def section_cost_curve(args: argparse.Namespace, clock: Clock, dev: torch.device, models: Models) -> dict[str, Any]:
    from ratchetlm.decoding.speculative import cost_curve

    rows = [1, 2, 4] if args.dry_run else [1, 2, 4, 8, 16, 24, 32, 48, 64]
    res: dict[str, Any] = {"dtype": half(dev), "rows": rows, "curves": []}
    for name in models.specs:
        with cell(res, name, clock) as ok:
            if ok:
                model = models.ours(name, half(dev)).engine.model
                ms = [1e3 * cost_curve.seconds(model, dev, k, 5, agg=statistics.median) for k in rows]
                res["curves"].append({"model": name, "ms": ms, "ratio": [t / ms[0] for t in ms]})
    return res


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
    prompts = [llm.encode(llm.apply_chat_template([{"role": "user", "content": t}]) if chat else t) for t in texts]
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="tiny random models, few tokens: the plumbing on a CPU")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (sections are cut)")
    ap.add_argument("--default-model", default=None, help="the default model's GGUF, if not the installed wheel's")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    args = ap.parse_args(argv)
    clock = Clock(args.budget)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device (use --device cpu --dry-run for the plumbing)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1 if args.dry_run else min(torch.get_num_threads(), 16))
    report: dict[str, Any] = {"env": environment(dev), "dry_run": args.dry_run, "budget_s": args.budget,
                              "section_budgets_s": BUDGETS, "notes": [], "sections": {}}

    def save() -> None:
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "gpu_check.md").write_text(markdown(report))

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        models: Models | None = None
        for name in SECTIONS:
            t0 = time.perf_counter()
            clock.start(BUDGETS[name])
            if name in skip or clock.left() <= 0:
                why = "left out (--skip)" if name in skip else "over the run's time budget"
                report["sections"][name] = {"status": "skipped", "note": why}
                save()
                continue
            print(f"[gpu_check] {name} (budget {clock.left():.0f} s)", flush=True)
            try:
                if name == "cuda_tests":
                    res = section_cuda_tests(args, clock, dev)
                else:
                    if models is None:
                        models = Models(args, dev, Path(tmp))
                        report["notes"] += models.notes
                        report["models"] = {k: {kk: v for kk, v in s.items() if kk != "path"}
                                            for k, s in models.specs.items()}
                    fn: Callable[..., dict[str, Any]] = globals()[f"section_{name}"]
                    res = fn(args, clock, dev, models)
                res["status"] = ("failed" if res.get("failed") or res.get("test_errors") else "over budget"
                                 if res.get("over_budget") or "status_note" in res else "error" if res.get("errors")
                                 else "ok")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            res["seconds"] = time.perf_counter() - t0
            report["sections"][name] = res
            save()
    report["total_s"] = args.budget - (clock.end - time.perf_counter())
    save()
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
