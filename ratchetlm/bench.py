"""``ratchet bench``: decode throughput of ratchetlm vs HF transformers (and llama-cpp-python).

All peers run in this one process on the same prompts and the same weights (the bundled GGUF;
HF dequantizes it with its own loader). Each configuration is timed ``--repeats`` times; the
table shows medians and the ratio to HF at the same batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

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


def _median_tps(run: Callable[[], int], repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = run()
        rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ratchet bench", description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", type=str, default="1,8")
    ap.add_argument("--dtypes", type=str, default="float32", help="ratchetlm dtypes to time (comma list)")
    ap.add_argument("--gguf-kernels", type=str, default="true,false",
                    help="ratchetlm runs with the GGUF block kernels on and/or off (comma list of true/false)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ratchetlm import LLM, SamplingParams
    from ratchetlm.models.loader import default_model_path

    n_new = args.max_tokens
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows: list[tuple[str, int, float]] = []
    sp = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    # greedy identity vs HF: stop at EOS on both sides (no ignore_eos / min_new_tokens), 3 prompts alone
    check_prompts = PROMPTS[1:4]
    ours_check: dict[str, list[list[int]]] = {}
    configs = [(dt, k.strip().lower() == "true") for dt in args.dtypes.split(",") for k in args.gguf_kernels.split(",")]
    for dt, kernels_on in configs:
        label = f"ratchetlm {dt} {'gguf-kernels' if kernels_on else 'dense'}"
        llm = LLM(progress=False, dtype=dt, gguf_kernels=kernels_on)
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        for b in sizes:
            prompts = PROMPTS[:b]

            def run(prompts=prompts, llm=llm) -> int:
                outs = llm.generate(prompts, sp, use_tqdm=False)
                return sum(len(o.token_ids) for o in outs)

            rows.append((label, b, _median_tps(run, args.repeats)))
        if dt == "float32":
            check = SamplingParams(max_tokens=n_new, temperature=0)
            ours_check[label] = [llm.generate(x, check, use_tqdm=False)[0].token_ids for x in check_prompts]
        tok = llm.tokenizer
        del llm
    if not args.skip_hf:
        import transformers
        from transformers import LlamaForCausalLM

        transformers.logging.set_verbosity_error()
        p = default_model_path()
        hf = LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
        for b in sizes:
            enc = [tok.encode(x, add_special_tokens=False) for x in PROMPTS[:b]]
            width = max(map(len, enc))
            ids = torch.tensor([[2] * (width - len(e)) + e for e in enc])  # left padding
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])

            def run_hf(ids=ids, mask=mask) -> int:
                with torch.no_grad():
                    hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                do_sample=False, pad_token_id=2)
                return n_new * ids.shape[0]

            rows.append(("HF transformers float32", b, _median_tps(run_hf, args.repeats)))
        refs = []
        for x in check_prompts:
            e = torch.tensor([tok.encode(x, add_special_tokens=False)])
            with torch.no_grad():
                refs.append(hf.generate(e, attention_mask=torch.ones_like(e), max_new_tokens=n_new, do_sample=False,
                                        pad_token_id=2)[0, e.shape[1]:].tolist())
        for label, ours in ours_check.items():
            same = sum(r == o for r, o in zip(refs, ours, strict=True))
            print(f"{label}: greedy tokens identical to HF (batch 1, {len(refs)} prompts, up to {n_new} tokens "
                  f"or EOS): {same}/{len(refs)}")
    try:
        from llama_cpp import Llama  # optional extra: pip install 'ratchetlm[llamacpp]'

        lc = Llama(model_path=str(default_model_path()), n_ctx=512, n_threads=torch.get_num_threads(), verbose=False)

        def run_lc() -> int:
            # EOS banned via logit_bias: the same fixed-length decode as ignore_eos on our side
            out: Any = lc(PROMPTS[0], max_tokens=n_new, temperature=0.0, logit_bias={lc.token_eos(): -1e9})
            return int(out["usage"]["completion_tokens"])

        rows.append(("llama-cpp-python Q4_1", 1, _median_tps(run_lc, args.repeats)))
    except ImportError:
        print("(llama-cpp-python not installed: skipping that peer)")
    hf_rate = {b: r for name, b, r in rows if name.startswith("HF")}
    print(f"\ndecode tokens/s, {n_new} new tokens per request, median of {args.repeats} runs, "
          f"{torch.get_num_threads()} torch threads")
    print(f"{'engine':38s} {'batch':>5s} {'tok/s':>8s} {'vs HF':>7s}")
    for name, b, r in rows:
        ratio = f"{r / hf_rate[b]:.2f}x" if b in hf_rate else "-"
        print(f"{name:38s} {b:5d} {r:8.1f} {ratio:>7s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
