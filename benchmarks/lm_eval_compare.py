"""lm-evaluation-harness against ``ratchet serve``: loglikelihoods against lm-eval's ``hf`` backend,
like with like: the server's exact numerics equal HF's (``--tolerance``), its default numerics (the
integer mode on this CPU, float16 KV) stay within that mode's own quality gate (``--gate``: the mean
per-token |log-prob difference| that benchmarks/bench_numerics.py gates at 0.02).

Writes two small local tasks (no downloads): a multiple-choice task scored by loglikelihood and a
``generate_until`` task. Starts ``ratchet serve`` (default model, fp32) on a free loopback port, once
per numerics mode, and runs

* ``local-completions`` (loglikelihood through ``/v1/completions`` with ``echo`` + ``logprobs``;
  the tokenizer is the server's own, through ``/tokenizer_info``, ``/tokenize``, ``/detokenize``),
* ``local-chat-completions`` (the generation task through ``/v1/chat/completions``),
* ``hf`` (HF transformers on the same GGUF weights, dequantized to fp32),

and compares every (question, choice) loglikelihood of each served run with HF's. Not part of the
test suite: lm-eval pulls in datasets, evaluate, scikit-learn, ... (``pip install 'ratchetlm[eval]'``).

    python benchmarks/lm_eval_compare.py [--numerics exact|default|both] [--gguf-kernels true|false]
                                         [--tolerance 1e-3] [--gate 0.02] [--limit N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Which planet is known as the red planet?", ["Venus", "Mars", "Jupiter", "Mercury"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wax paper"], 2),
    ("How many legs does a spider have?", ["six", "ten", "four", "eight"], 3),
    ("What is frozen water called?", ["ice", "steam", "sand", "glass"], 0),
    ("Which animal barks?", ["cat", "dog", "fish", "bird"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "black"], 2),
    ("What do you use to write on paper?", ["a spoon", "a shoe", "a cup", "a pen"], 3),
    ("Which is the largest ocean on Earth?", ["Pacific", "Atlantic", "Indian", "Arctic"], 0),
    ("What is 2 + 2?", ["three", "four", "five", "six"], 1),
    ("Which season comes after winter?", ["autumn", "summer", "spring", "winter"], 2),
    ("What gas do plants take in from the air?", ["oxygen", "helium", "neon", "carbon dioxide"], 3),
]
GEN = [("What is the capital of Italy? Answer with one word.", "Rome"),
       ("What is the opposite of hot? Answer with one word.", "Cold"),
       ("How many days are in a week? Answer with a number.", "7")]


def write_tasks(d: Path) -> None:
    mc = d / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = d / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    (d / "ratchet_mc.yaml").write_text(f"""task: ratchet_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
""")
    (d / "ratchet_gen.yaml").write_text(f"""task: ratchet_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, gguf_kernels: str, threads: int, numerics: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ratchetlm", "serve", "--port", str(port), "--dtype", "float32",
           "--gguf-kernels", gguf_kernels, "--served-model-name", "smollm2", "--log-level", "warning",
           "--torch-threads", str(threads)]
    if numerics == "exact":
        cmd += ["--numerics", "exact"]
    proc = subprocess.Popen(cmd)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy")


def loglikelihoods(results: dict) -> list[float]:
    samples = sorted(results["samples"]["ratchet_mc"], key=lambda s: s["doc_id"])
    return [float(r[0]) for s in samples for r in s["filtered_resps"]]


def continuation_tokens(questions: list) -> list[int]:
    """Tokens of each choice's continuation, split as lm-eval splits it (whole minus context)."""
    from ratchetlm.models.loader import default_model_path, resolve
    from ratchetlm.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(str(default_model_path())))
    out = []
    for q, choices, _ in questions:
        ctx = f"Question: {q}\nAnswer:"
        n = len(tok.encode(ctx))
        out += [len(tok.encode(f"{ctx} {c}")) - n for c in choices]
    return out


def run_served(lm_eval, tm, numerics: str, args: argparse.Namespace, chat: bool) -> tuple[dict, dict | None, float]:
    """lm-eval's local-completions (and local-chat-completions) against a server in ``numerics``."""
    port = free_port()
    server = start_server(port, args.gguf_kernels, args.threads, numerics)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        t0 = time.perf_counter()
        served = lm_eval.simple_evaluate(model="local-completions", tasks=["ratchet_mc"], task_manager=tm,
                                         model_args={"base_url": base + "/completions", "model": "smollm2",
                                                     "tokenizer_backend": "remote",  # the server's tokenizer
                                                     "num_concurrent": 1, "max_retries": 1},
                                         log_samples=True, limit=args.limit)
        took = time.perf_counter() - t0
        gen = None
        if chat:
            gen = lm_eval.simple_evaluate(model="local-chat-completions", tasks=["ratchet_gen"], task_manager=tm,
                                          model_args={"base_url": base + "/chat/completions", "model": "smollm2",
                                                      "num_concurrent": 1, "max_retries": 1},
                                          apply_chat_template=True, log_samples=True, limit=args.limit)
    finally:
        server.terminate()
        server.wait(30)
    return served, gen, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf-kernels", default="true")
    ap.add_argument("--numerics", default="both", choices=["exact", "default", "both"],
                    help="server modes to check: exact (against HF, --tolerance) and/or the default (against "
                         "HF within the integer modes' quality gate, --gate)")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="exact mode: max |served - hf| loglikelihood")
    ap.add_argument("--gate", type=float, default=0.02,
                    help="default mode: mean |served - hf| per continuation token (benchmarks/bench_numerics.py)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N documents of each task (a smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the hf backend")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from ratchetlm.models.loader import default_model_path

    d = Path(tempfile.mkdtemp(prefix="ratchet-lmeval-"))
    write_tasks(d)
    tm = TaskManager(include_path=str(d))
    modes = ["exact", "default"] if args.numerics == "both" else [args.numerics]
    runs = {m: run_served(lm_eval, tm, m, args, chat=m == modes[-1]) for m in modes}
    gguf = default_model_path()
    t0 = time.perf_counter()
    hf = lm_eval.simple_evaluate(model="hf", tasks=["ratchet_mc"], task_manager=tm, batch_size=1, device="cpu",
                                 model_args={"pretrained": str(gguf.parent), "gguf_file": gguf.name,
                                             "dtype": "float32"},
                                 log_samples=True, limit=args.limit)
    t_hf = time.perf_counter() - t0
    questions = QUESTIONS[: args.limit] if args.limit else QUESTIONS
    b = loglikelihoods(hf)
    ntok = continuation_tokens(questions)
    assert len(b) == len(ntok) == sum(len(c) for _, c, _ in questions), (len(b), len(ntok))
    failed = []
    for mode, (served, _, took) in runs.items():
        a = loglikelihoods(served)
        assert len(a) == len(b), (mode, len(a), len(b))
        diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
        per_token = sum(abs(x - y) for x, y in zip(a, b, strict=True)) / sum(ntok)
        acc = [r["results"]["ratchet_mc"]["acc,none"] for r in (served, hf)]
        if mode == "exact":  # like with like: HF-identical numerics
            verdict, ok = f"max |served - hf| = {diff:.2e} (tolerance {args.tolerance:g})", diff <= args.tolerance
        else:  # the integer mode against its own quality gate
            verdict, ok = (f"mean |served - hf| per continuation token = {per_token:.2e} (gate {args.gate:g}); "
                           f"max per request {diff:.2e}", per_token <= args.gate)
        print(f"[{mode}] loglikelihood requests: {len(a)}; {verdict}; gguf_kernels={args.gguf_kernels}; "
              f"acc: served {acc[0]:.3f}, hf {acc[1]:.3f}; time: served {took:.1f} s, hf {t_hf:.1f} s")
        if not ok:
            failed.append(f"{mode}: {verdict}")
    chat = runs[modes[-1]][1]
    assert chat is not None
    gen = chat["samples"]["ratchet_gen"]
    print(f"local-chat-completions ({modes[-1]}): {len(gen)} generations, exact_match "
          f"{chat['results']['ratchet_gen']['exact_match,none']:.3f}; answers "
          f"{[s['filtered_resps'][0] for s in gen]}")
    if failed:
        raise SystemExit("FAIL: " + "; ".join(failed))
    print("OK")


if __name__ == "__main__":
    main()
