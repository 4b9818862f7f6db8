"""``ratchet bench``: ratchetlm against its peers on one GGUF file (default: the bundled model).

Each engine runs in its own process (so load time and peak RSS are its own) on the same token ids,
the same number of threads and the same KV budget:

* ``ratchetlm``: the engine's defaults (``numerics="auto"``: int8 or int16 on a quantized GGUF, by
  weight format: models/auto_numerics.py);
* ``ratchetlm-exact``: fp32 activations times the exactly dequantized blocks (HF-identical tokens);
* ``ratchetlm-dense``: ``gguf_kernels=False``, a dense fp32 copy multiplied by BLAS (the path
  before the block kernels took every row count: a baseline for prefill);
* ``ratchetlm-int8`` / ``ratchetlm-int16``: the integer numerics modes (``--numerics``: int8 / 16-bit
  activations, VNNI dot products; batch-invariant, not HF-identical);
* ``llama.cpp``: llama-cpp-python's C API (greedy argmax, sequences batched in one ``llama_decode``);
* ``hf``: HF transformers' own GGUF loader, fp32, ``generate`` with left padding.

Measured per engine: load seconds (construct until ready), peak RSS (also less the KV cache, and less
the process's RSS after its imports: the model's own share, over the file), decode tok/s at each batch size
(``(N - 1)`` new tokens per sequence over the time from every sequence's first token to the last
token, so prompt prefill is excluded; EOS banned; HF, which does not stream, over the time between
an ``N``-token and a 1-token generation), prefill tok/s of a ``--prompt-tokens`` prompt (one
sequence, time to first token). Medians of ``--repeats``. Greedy tokens of ratchetlm and HF are
compared (same prompts, up to 32 tokens or EOS).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "def quicksort(arr):",
    "The three most important inventions of the 20th century are",
    "Describe the water cycle in simple terms.",
    "List five fruits and their colors:",
    "Once upon a time, a robot",
    "Summarize the plot of Romeo and Juliet.",
]
ENGINES = ("ratchetlm", "ratchetlm-exact", "ratchetlm-dense", "ratchetlm-int8", "ratchetlm-int16", "llama.cpp", "hf")


def _median(f: Callable[[], float], repeats: int) -> float:
    return statistics.median(f() for _ in range(repeats))


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def _rss_gb() -> float:
    """This process's resident set now (GiB; Linux /proc, else the peak so far)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024**2
    except (OSError, StopIteration):
        return _peak_rss_gb()


# ---------------------------------------------------------------- workers (one engine per process)


class Runner:
    """``generate(prompts, n)`` -> tokens per prompt (greedy, EOS banned unless ``stop_at_eos``);
    ``decode_s``: seconds of the last call from the moment every sequence had its first token to the
    end (None where the engine does not stream)."""

    kv_bytes = 0
    decode_s: float | None = None

    def generate(self, prompts: list[list[int]], n: int, stop_at_eos: bool = False) -> list[list[int]]:
        raise NotImplementedError


class RatchetRunner(Runner):
    def __init__(self, model: str | None, dense: bool, ctx: int, max_batch: int, numerics: str = "auto") -> None:
        from ratchetlm import LLM

        self.llm = LLM(model, progress=False, dtype="float32", gguf_kernels=not dense, max_model_len=ctx,
                       numerics=numerics, enable_prefix_caching=False,  # llama.cpp's runner clears its cache too
                       kv_cache_blocks=ctx // 16 + max_batch, max_num_batched_tokens=max(ctx, 1024))
        self.kv_bytes = sum(t.numel() * t.element_size() for t in _tensors(self.llm.engine.cache))

    def generate(self, prompts: list[list[int]], n: int, stop_at_eos: bool = False) -> list[list[int]]:
        from ratchetlm import SamplingParams

        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=not stop_at_eos)
        out: list[list[int]] = [[] for _ in prompts]
        first = None
        for ev in self.llm.stream(prompts, sp):
            out[ev.index] += ev.token_ids
            if first is None and all(out):
                first = time.perf_counter()
        assert first is not None
        self.decode_s = time.perf_counter() - first
        return out


def _tensors(obj: Any) -> list[Any]:
    import torch

    return [v for v in vars(obj).values() if isinstance(v, torch.Tensor)] + [
        t for v in vars(obj).values() if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]


class LlamaCppRunner(Runner):
    def __init__(self, model: str, threads: int, ctx: int, max_batch: int) -> None:
        import llama_cpp as lc
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp logs every tensor at load
        self.lc = lc
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(model.encode(), mp)
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = ctx, ctx, min(ctx, 512), max_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.eos = lc.llama_vocab_eos(vocab)
        self.batch = lc.llama_batch_init(ctx, 0, max_batch)
        n_layer, n_embd = lc.llama_model_n_layer(self.model), lc.llama_model_n_embd(self.model)
        heads, kv_heads = lc.llama_model_n_head(self.model), lc.llama_model_n_head_kv(self.model)
        self.kv_bytes = ctx * n_layer * 2 * (n_embd // heads * kv_heads) * 2  # f16 K and V

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:  # (token, pos, seq, want logits)
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        rc = self.lc.llama_decode(self.ctx, b)
        assert rc == 0, f"llama_decode failed: {rc}"

    def _argmax(self, i: int, ban_eos: bool) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()
        if ban_eos:
            logits[self.eos] = -np.inf
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], n: int, stop_at_eos: bool = False) -> list[list[int]]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        items = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        self._decode(items)
        rows = [i for i, it in enumerate(items) if it[3]]
        out: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        first = time.perf_counter()  # every sequence's first token is one argmax away
        for step in range(n):
            for s, row in zip(live, rows, strict=True):
                out[s].append(self._argmax(row, not stop_at_eos))
            live = [s for s in live if not (stop_at_eos and out[s][-1] == self.eos)]
            if step == n - 1 or not live:
                break
            self._decode([(out[s][-1], len(prompts[s]) + step, s, True) for s in live])
            rows = list(range(len(live)))
        self.decode_s = time.perf_counter() - first
        return out


class HFRunner(Runner):
    def __init__(self, model: str) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        path = os.path.abspath(model)
        self.torch = torch
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
        self.pad = int(self.hf.config.eos_token_id if isinstance(self.hf.config.eos_token_id, int) else 0)

    def generate(self, prompts: list[list[int]], n: int, stop_at_eos: bool = False) -> list[list[int]]:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=self.pad,
                                   **({} if stop_at_eos else {"min_new_tokens": n}))
        rows = out[:, width:].tolist()
        if stop_at_eos:
            eos = self.hf.config.eos_token_id
            rows = [r[:r.index(eos) + 1] if eos in r else r for r in rows]
        return rows


def worker(a: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(a.threads)
    if a.worker.startswith("ratchetlm"):
        import ratchetlm.engine.llm  # noqa: F401  (the interpreter's part of the peak: imports, before any model)
    elif a.worker == "llama.cpp":
        import llama_cpp  # noqa: F401
    base_rss = _rss_gb()
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    ctx = max(a.prompt_tokens + 8, max(map(len, job["prompts"])) + a.max_tokens + 8)
    t = time.perf_counter()
    runner: Runner
    if a.worker.startswith("ratchetlm"):
        numerics = a.worker.split("-")[1] if a.worker in ("ratchetlm-int8", "ratchetlm-int16", "ratchetlm-exact") \
            else "exact" if a.worker == "ratchetlm-dense" else "auto"
        runner = RatchetRunner(job["model"], a.worker == "ratchetlm-dense", ctx, max(sizes), numerics)
    elif a.worker == "llama.cpp":
        runner = LlamaCppRunner(job["model"], a.threads, ctx, max(sizes))
    else:
        runner = HFRunner(job["model"])
    load_s = time.perf_counter() - t
    runner.generate([job["prompts"][0]], 2)  # warm-up
    result: dict[str, Any] = {"engine": a.worker, "load_s": load_s, "kv_bytes": runner.kv_bytes, "decode": {}}
    for b in sizes:
        prompts = [job["prompts"][i % len(job["prompts"])] for i in range(b)]

        def rate(prompts: list[list[int]] = prompts) -> float:
            runner.generate(prompts, a.max_tokens)
            if runner.decode_s is not None:
                return len(prompts) * (a.max_tokens - 1) / runner.decode_s
            t0 = time.perf_counter()
            runner.generate(prompts, 1)
            t1 = time.perf_counter()
            runner.generate(prompts, a.max_tokens)
            t2 = time.perf_counter()
            return len(prompts) * (a.max_tokens - 1) / ((t2 - t1) - (t1 - t0))

        result["decode"][b] = _median(rate, a.repeats)

    def prefill() -> float:
        t0 = time.perf_counter()
        runner.generate([job["long"]], 1)
        return len(job["long"]) / (time.perf_counter() - t0)

    result["prefill"] = _median(prefill, a.repeats)
    result["check"] = [runner.generate([p], 32, stop_at_eos=True)[0] for p in job["prompts"][1:4]]
    result["peak_rss_gb"] = _peak_rss_gb()
    result["base_rss_gb"] = base_rss
    return result


# ---------------------------------------------------------------- parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ratchet bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--engines", default=None,
                    help=f"comma list of {', '.join(ENGINES)} (default: all for the bundled model, "
                         "ratchetlm,llama.cpp for --model)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        with open(a.job) as f:
            job = json.load(f)
        print("RESULT " + json.dumps(worker(a, job)), flush=True)
        return 0

    engines = (a.engines or ("ratchetlm,ratchetlm-dense,llama.cpp,hf" if a.model is None else "ratchetlm,llama.cpp"))
    for engine in engines.split(","):  # before the tokenizer (and transformers) loads: a typo costs no wait
        if engine not in ENGINES:
            raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")

    from ratchetlm.models.loader import ModelLoadError, resolve
    from ratchetlm.models.tokenizer import load_tokenizer

    try:
        source = resolve(a.model)
    except ModelLoadError as e:
        raise SystemExit(str(e)) from None
    if source.kind != "gguf":
        raise SystemExit("ratchet bench compares engines on a GGUF file; --model must be a .gguf")
    tok = load_tokenizer(source)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    text = " ".join(PROMPTS)
    long: list[int] = []
    while len(long) < a.prompt_tokens:
        long += tok.encode(text, add_special_tokens=False)
    job = {"model": str(source.path), "prompts": prompts, "long": long[:a.prompt_tokens]}
    results = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
        json.dump(job, tmp)
    try:
        for engine in engines.split(","):
            cmd = [sys.executable, "-m", "ratchetlm.bench", "--worker", engine, "--job", tmp.name,
                   *[x for x in (argv if argv is not None else sys.argv[1:])]]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                msg = (proc.stderr.strip().splitlines() or ["?"])[-1]
                print(f"({engine}: skipped: {msg})", flush=True)
                continue
            results.append(json.loads(line[0][7:]))
            print(f"({engine} done)", flush=True)
    finally:
        os.unlink(tmp.name)
    _report(a, source.path, results)
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"model": str(source.path), "args": vars(a), "results": results}, out, indent=1)
    return 0


def _report(a: argparse.Namespace, path: Any, results: list[dict[str, Any]]) -> None:
    size = os.path.getsize(path) / 1e9
    sizes = [str(b) for b in a.batch_sizes.split(",")]
    peer = next((r for r in results if r["engine"] == "llama.cpp"), None)
    print(f"\n{os.path.basename(path)} ({size:.2f} GB), {a.threads} threads, medians of {a.repeats}; decode: "
          f"{a.max_tokens - 1} tokens per sequence after the first, EOS banned; prefill: {a.prompt_tokens}-token "
          f"prompt; load avg {os.getloadavg()[0]:.1f}")
    head = ["engine", "load s", "peak RSS GiB", "(RSS-KV)/file", "(RSS-base-KV)/file"] + [
        f"decode b{b} tok/s" for b in sizes] + ["prefill tok/s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in results:
        peak, kv, file = r["peak_rss_gb"], r["kv_bytes"] / 1024**3, size / 1.073741824  # GiB
        cells = [r["engine"], f"{r['load_s']:.2f}", f"{peak:.2f}", f"{(peak - kv) / file:.2f}x",
                 f"{(peak - r['base_rss_gb'] - kv) / file:.2f}x"]
        for b in sizes:
            v = r["decode"][b]
            ratio = f" ({v / peer['decode'][b]:.2f}x)" if peer and r is not peer else ""
            cells.append(f"{v:.1f}{ratio}")
        ratio = f" ({r['prefill'] / peer['prefill']:.2f}x)" if peer and r is not peer else ""
        cells.append(f"{r['prefill']:.1f}{ratio}")
        print("| " + " | ".join(cells) + " |")
    hf = next((r for r in results if r["engine"] == "hf"), None)
    for r in results:
        if hf and r["engine"].startswith("ratchetlm"):
            same = sum(x == y for x, y in zip(r["check"], hf["check"], strict=True))
            print(f"{r['engine']}: greedy tokens identical to HF on {same}/{len(hf['check'])} prompts")
    print("(ratios vs llama.cpp in parentheses; peak RSS (GiB) counts the whole process; base: its RSS after the "
          "engine's imports, before any model (python + torch ~0.22 GiB))")


if __name__ == "__main__":
    raise SystemExit(main())
