"""One device run that proves and times the CUDA path (issue 39): every number beside the GPU's
name and the torch / CUDA versions, under a total time budget (default 400 s), each section with
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
* ``spec_bench``: a Spec-Bench sample (4 first turns from each of its six groups, drawn from
  ``benchmarks/data/spec_bench/question.jsonl`` as bench_specbench.py draws them; 24 built-in prompts
  where the file is missing), batch 1, fp32, EOS respected: plain AR vs the default speculative config
  vs the ``hybrid`` trees at 16 and 32 nodes (sized by the cost curve the engine measures on the device), MAL and
  Spec-Bench's speed-up per group, greedy identity checked prompt by prompt.

    python benchmarks/gpu_check.py --out DIR [--device cuda] [--budget 400] [--default-model PATH]
    python benchmarks/gpu_check.py --device cpu --dry-run --out DIR   # tiny sizes, well under a minute
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_check_common import ROOT, Clock, Models, cell, engine_on, half, hf_generate, id_prompts, run_ours  # noqa: E402,I001
from benchmarks.gpu_check_report import SECTIONS, markdown  # noqa: E402
from benchmarks.gpu_check_speed import section_decode, section_spec_bench  # noqa: E402

# seconds per section; what a section leaves unspent goes to the next ones (Clock), the run's budget caps all
BUDGETS = {"cuda_tests": 100.0, "parity": 30.0, "decode": 170.0, "cost_curve": 20.0, "spec_bench": 80.0}


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


def section_cuda_tests(args: argparse.Namespace, clock: Clock, dev: torch.device) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/cuda", "-q", "-p", "no:cacheprovider", "-n", "0"]
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
        prompts = [llm.tokenize(t) for t in texts]
    eng = engine_on(llm, dev, "float32")
    alone = [run_ours(eng, [p], n, dev)[0][0] for p in prompts]
    batched = run_ours(eng, prompts, n, dev)[0]
    res["batched_equals_alone"] = batched == alone
    with cell(res, "hf", clock) as ok:
        if ok:
            hf = models.hf(name, torch.float32)
            ref = [hf_generate(hf, [p], n, dev)[0][0] for p in prompts]
            # ours goes on after an EOS (ignore_eos) while HF's min_new_tokens masks it: compare up to our first
            eos = set(llm.model_config.eos_token_ids)
            cuts = [next((i for i, t in enumerate(a) if t in eos), len(a)) for a in alone]
            res["compared_tokens"] = cuts
            res["greedy_equals_hf"] = [a[:c] == b[:c] for a, b, c in zip(alone, ref, cuts, strict=True)]
            res["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a[:c], b[:c], strict=True)) if x != y),
                                            None) for a, b, c in zip(alone, ref, cuts, strict=True)]
            del hf
    return res


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="tiny random models, few tokens: the plumbing on a CPU")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds for the whole run (sections are cut)")
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

    # The CPU kernels compile on a fresh machine's first use (minutes: issue 41), CUDA runs too (the argmax of
    # the host-side logits, the CUDA tests' CPU reference): once here, timed, before any section waits on it
    t0 = time.perf_counter()
    from ratchetlm import kernels

    report["kernels"] = {"isa": kernels.isa() if kernels.load() is not None else None,
                         "seconds": time.perf_counter() - t0}
    save()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    sections: dict[str, Callable[..., dict[str, Any]]] = {
        "parity": section_parity, "decode": section_decode, "cost_curve": section_cost_curve,
        "spec_bench": section_spec_bench}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        models: Models | None = None
        for name in SECTIONS:
            if name != "cuda_tests" and models is None and clock.total_left() > 0:
                t0 = time.perf_counter()  # written and loaded once, outside every section's budget
                models = Models(args, dev, Path(tmp))
                report["notes"] += models.notes
                report["models"] = {k: {kk: v for kk, v in s.items() if kk != "path"} for k, s in models.specs.items()}
                report["setup_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            clock.start(BUDGETS[name])
            if name in skip or clock.left() <= 0:
                why = "left out (--skip)" if name in skip else "over the run's time budget"
                report["sections"][name] = {"status": "skipped", "note": why}
                save()
                continue
            print(f"[gpu_check] {name} (budget {clock.left():.0f} s)", flush=True)
            try:
                res = section_cuda_tests(args, clock, dev) if name == "cuda_tests" else sections[name](
                    args, clock, dev, models)
                res["status"] = ("failed" if res.get("failed") or res.get("test_errors") else "over budget"
                                 if res.get("over_budget") or "status_note" in res else "error" if res.get("errors")
                                 else "ok")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            res["seconds"] = time.perf_counter() - t0
            clock.stop()
            report["sections"][name] = res
            save()
    report["total_s"] = args.budget - clock.total_left()
    save()
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
