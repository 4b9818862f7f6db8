"""Embedding throughput of the pooling runner (engine/pooling.py) against HF transformers on the same
GGUF, interleaved in one process, the same prompts and threads: prompts / s of ``LLM.embed`` (each
numerics mode asked for) and of HF's ``model.model(...)`` forward with the same last-token pooling,
one prompt per HF forward (unpadded, so it computes no more than needed) and our packed forwards.

    python benchmarks/bench_embeddings.py [--model PATH.gguf] [--prompts 16] [--repeats 3] [--threads 1]

Prints the median seconds per run and each mode's ratio to HF (> 1: faster), and the worst cosine
between our vectors and HF's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "public_domain.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--words", type=int, default=60, help="words per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["int16", "exact"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers
    from transformers import AutoModelForCausalLM

    from ratchetlm import LLM
    from ratchetlm.models.loader import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    words = TEXT.read_text().split()
    prompts = [" ".join(words[i * args.words:(i + 1) * args.words]) for i in range(args.prompts)]
    llms = {m: LLM(str(path), progress=False, dtype="float32", numerics=m, runner="pooling") for m in args.modes}
    transformers.logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = [o.prompt_token_ids for o in llms[args.modes[0]].embed(prompts)]

    def run_hf() -> list[torch.Tensor]:
        with torch.no_grad():
            return [torch.nn.functional.normalize(hf.model(torch.tensor([i])).last_hidden_state[0, -1], dim=-1)
                    for i in ids]

    times: dict[str, list[float]] = {m: [] for m in ["hf", *args.modes]}
    vecs: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):  # interleaved: the machine's load hits every contender alike
        t = time.perf_counter()
        vecs["hf"] = run_hf()
        times["hf"].append(time.perf_counter() - t)
        for m, llm in llms.items():
            t = time.perf_counter()
            vecs[m] = [torch.tensor(o.outputs.embedding) for o in llm.embed(prompts)]
            times[m].append(time.perf_counter() - t)
    tokens = sum(len(i) for i in ids)
    hf_med = statistics.median(times["hf"])
    print(f"{args.prompts} prompts, {tokens} tokens, {args.threads} thread(s), {args.repeats} interleaved runs")
    print(f"  HF transformers      {hf_med:7.3f} s  ({args.prompts / hf_med:6.1f} prompts/s)  runs "
          f"{' '.join(f'{t:.2f}' for t in times['hf'])}")
    for m in args.modes:
        med = statistics.median(times[m])
        worst = min(float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(vecs[m], vecs["hf"],
                                                                                              strict=True))
        print(f"  ratchetlm {m:<10} {med:7.3f} s  ({args.prompts / med:6.1f} prompts/s)  {hf_med / med:5.2f}x HF  "
              f"worst cosine vs HF {worst:.6f}  runs {' '.join(f'{t:.2f}' for t in times[m])}")


if __name__ == "__main__":
    main()
