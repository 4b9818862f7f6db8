"""Quality gates of the integer numerics modes against the exact mode (issue 14), teacher-forced.

Feeds a fixed real text (benchmarks/data/public_domain.txt: classic public-domain passages) through
the model in windows of ``--window`` tokens, once per mode, and compares each integer mode's
next-token distributions with the exact mode's at every position: top-1 agreement (gate >= 99%),
mean |log p_mode(t) - log p_exact(t)| of the actual next token t (gate <= 0.02) and perplexity
(gate: within 1%).

    python benchmarks/bench_numerics.py [--model PATH.gguf] [--modes int8 int16] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from ratchetlm import LLM
from ratchetlm.kv.sink import NullSink
from ratchetlm.layers.attention import build_attention_batch

TEXT = Path(__file__).with_name("data") / "public_domain.txt"


def window_logprobs(llm: LLM, ids: list[int], targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced window: (top-1 token [n], log p of the target token [n]) at its first n = len(targets)
    positions (only these are kept: full [n, vocab] log-probs of every window would take gigabytes)."""
    model = llm.engine.model
    batch = build_attention_batch(torch.arange(len(ids)), [len(ids)], [torch.empty(0, dtype=torch.long)], [None],
                                  NullSink(), None)
    with torch.inference_mode():
        lp = torch.log_softmax(model.logits(model(torch.tensor(ids), batch)).double(), dim=-1)[: len(targets)]
    return lp.argmax(-1), lp.gather(1, torch.tensor(targets)[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["int8", "int16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lp: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    ids: list[int] = []
    for mode in ("exact", *args.modes):
        llm = LLM(args.model, progress=False, numerics=mode, kv_cache_blocks=16)
        ids = llm.encode(Path(args.text).read_text())
        t = time.perf_counter()
        lp[mode] = [window_logprobs(llm, ids[s:s + args.window], ids[s + 1:s + 1 + args.window])
                    for s in range(0, len(ids) - 1, args.window)]
        print(f"{mode}: {len(ids)} tokens in {time.perf_counter() - t:.1f} s")
        del llm
    for mode in args.modes:
        agree = n = 0
        dlog = nll_e = nll_i = 0.0
        for (top_e, pe), (top_q, pq) in zip(lp["exact"], lp[mode], strict=True):
            agree += int((top_e == top_q).sum())
            dlog += float((pe - pq).abs().sum())
            nll_e -= float(pe.sum())
            nll_i -= float(pq.sum())
            n += len(pe)
        ppl_e, ppl_i = math.exp(nll_e / n), math.exp(nll_i / n)
        ok = agree / n >= 0.99 and dlog / n <= 0.02 and abs(ppl_i / ppl_e - 1) <= 0.01
        print(f"{mode} vs exact over {n} positions (windows of {args.window}): top-1 agreement "
              f"{100 * agree / n:.2f}% (>= 99%), mean |d log p| {dlog / n:.4f} (<= 0.02), perplexity exact "
              f"{ppl_e:.3f} {mode} {ppl_i:.3f} ratio {ppl_i / ppl_e:.4f} (within 1%): {'PASS' if ok else 'FAIL'}")

if __name__ == "__main__":
    main()
