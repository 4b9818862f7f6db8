"""lm-evaluation-harness against ``ratchet serve``: loglikelihoods equal lm-eval's ``hf`` backend.

Writes two small local tasks (no downloads): a multiple-choice task scored by loglikelihood and a
``generate_until`` task. Starts ``ratchet serve`` (default model, fp32) on a free loopback port and
runs

* ``local-completions`` (loglikelihood through ``/v1/completions`` with ``echo`` + ``logprobs``;
  the tokenizer is the server's own, through ``/tokenizer_info``, ``/tokenize``, ``/detokenize``),
* ``local-chat-completions`` (the generation task through ``/v1/chat/completions``),
* ``hf`` (HF transformers on the same GGUF weights, dequantized to fp32),

and compares every (question, choice) loglikelihood of the two loglikelihood runs. Not part of the
test suite: lm-eval pulls in datasets, evaluate, scikit-learn, ... (``pip install 'ratchetlm[eval]'``).

    python benchmarks/lm_eval_compare.py [--gguf-kernels true|false] [--tolerance 1e-3] [--limit N]
                                         [--threads N]
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


def start_server(port: int, gguf_kernels: str, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ratchetlm", "serve", "--port", str(port), "--dtype", "float32",
           "--gguf-kernels", gguf_kernels, "--served-model-name", "smollm2", "--log-level", "warning",
           "--torch-threads", str(threads)]
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
    return [float(r[0]) for s in results["samples"]["ratchet_mc"] for r in s["filtered_resps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf-kernels", default="true")
    ap.add_argument("--tolerance", type=float, default=1e-3)
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
    port = free_port()
    server = start_server(port, args.gguf_kernels, args.threads)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        t0 = time.perf_counter()
        served = lm_eval.simple_evaluate(model="local-completions", tasks=["ratchet_mc"], task_manager=tm,
                                         model_args={"base_url": base + "/completions", "model": "smollm2",
                                                     "tokenizer_backend": "remote",  # the server's tokenizer
                                                     "num_concurrent": 1, "max_retries": 1},
                                         log_samples=True, limit=args.limit)
        t_served = time.perf_counter() - t0
        chat = lm_eval.simple_evaluate(model="local-chat-completions", tasks=["ratchet_gen"], task_manager=tm,
                                       model_args={"base_url": base + "/chat/completions", "model": "smollm2",
                                                   "num_concurrent": 1, "max_retries": 1},
                                       apply_chat_template=True, log_samples=True, limit=args.limit)
    finally:
        server.terminate()
        server.wait(30)
    gguf = default_model_path()
    t0 = time.perf_counter()
    hf = lm_eval.simple_evaluate(model="hf", tasks=["ratchet_mc"], task_manager=tm, batch_size=1, device="cpu",
                                 model_args={"pretrained": str(gguf.parent), "gguf_file": gguf.name,
                                             "dtype": "float32"},
                                 log_samples=True, limit=args.limit)
    t_hf = time.perf_counter() - t0
    a, b = loglikelihoods(served), loglikelihoods(hf)
    questions = QUESTIONS[: args.limit] if args.limit else QUESTIONS
    assert len(a) == len(b) == sum(len(c) for _, c, _ in questions), (len(a), len(b))
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    gen = chat["samples"]["ratchet_gen"]
    print(f"loglikelihood requests: {len(a)}; max |served - hf| = {diff:.2e} (tolerance {args.tolerance:g}); "
          f"gguf_kernels={args.gguf_kernels}")
    acc = [r["results"]["ratchet_mc"]["acc,none"] for r in (served, hf)]
    print(f"acc: served {acc[0]:.3f}, hf {acc[1]:.3f}; time: served {t_served:.1f} s, hf {t_hf:.1f} s")
    print(f"local-chat-completions: {len(gen)} generations, exact_match "
          f"{chat['results']['ratchet_gen']['exact_match,none']:.3f}; answers "
          f"{[s['filtered_resps'][0] for s in gen]}")
    if diff > args.tolerance:
        raise SystemExit(f"FAIL: loglikelihoods differ by {diff:.2e} > {args.tolerance:g}")
    print("OK")


if __name__ == "__main__":
    main()
