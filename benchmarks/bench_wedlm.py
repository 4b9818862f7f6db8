"""WeDLM parallel decoding vs one token per forward, on the tiny model trained here.

On held-out prompts of the generated corpus (never seen in training) it runs the same
weights three ways in one process:

* ``autoregressive`` - the engine's plain decoding (one token per forward);
* ``wedlm one-by-one`` - WeDLM with τ = None (one fill per step, the paper's quality setting);
* ``wedlm τ=…`` - parallel window decoding at several entropy thresholds.

It prints answer accuracy (exact match of the generated answer), tokens per forward (window
forwards; prefill excluded, as in the WeDLM engine), output tokens/s and the median per-batch
wall time ratio vs autoregressive.

    python benchmarks/bench_wedlm.py [--model PATH] [--prompts 64] [--batch 1 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ratchetlm import LLM  # noqa: E402
from ratchetlm.engine.config import EngineConfig  # noqa: E402
from ratchetlm.engine.llm_engine import LLMEngine  # noqa: E402
from ratchetlm.sampling_params import SamplingParams  # noqa: E402
from ratchetlm.training.corpus import held_out  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "ratchetlm" / "assets" / "wedlm-tiny"


def configs(window: int) -> dict[str, tuple[str, dict]]:
    out: dict[str, tuple[str, dict]] = {"autoregressive": ("autoregressive", {})}
    out["wedlm one-by-one"] = ("wedlm", dict(window_size=window, entropy_threshold=None))
    for tau in (0.2, 0.4, 0.8):
        out[f"wedlm tau={tau}"] = ("wedlm", dict(window_size=window, entropy_threshold=tau))
    return out


def run_batches(llm: LLM, decoding: str, opts: dict, prompts: list[list[int]], batch: int, device: str,
                max_tokens: int) -> tuple[list[list[int]], list[float], int, int]:
    cfg = EngineConfig(device=device, dtype="float32", decoding=decoding, decoding_options=opts,
                       kv_cache_blocks=512, max_model_len=512, progress=False)
    eng = LLMEngine(cfg, llm.engine.model, llm.model_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs: list[list[int]] = []
    times: list[float] = []
    for i in range(0, len(prompts), batch):
        t = time.perf_counter()
        ids = [eng.add_request(p, params) for p in prompts[i : i + batch]]
        while eng.has_unfinished():
            eng.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        outs += [eng.seqs[j].output_ids for j in ids]
    m = eng.strategy.metrics()
    forwards = int(m.get("wedlm_forwards", 0))
    committed = int(m.get("wedlm_commits", 0))
    return outs, times, forwards, committed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=1, help="repeat each run; medians over repeats")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, dtype="float32", device=a.device, progress=False)
    examples = held_out(a.prompts)
    prompts = [llm.tokenize(ex.prompt) for ex in examples]
    answers = [ex.answer for ex in examples]
    print(f"model {a.model}: {sum(p.numel() for p in llm.engine.model.parameters()) / 1e6:.2f}M params; "
          f"{len(prompts)} held-out prompts; device {a.device}, {a.threads} thread(s)")
    for batch in a.batch:
        print(f"\nbatch {batch}")
        print(f"{'config':<20} {'accuracy':>8} {'tok/fwd':>8} {'out tok/s':>10} {'median s/batch':>15} {'vs AR':>7}")
        base = None
        for name, (decoding, opts) in configs(a.window).items():
            walls, rates = [], []
            for _ in range(a.repeats):
                outs, times, forwards, committed = run_batches(llm, decoding, opts, prompts, batch, a.device,
                                                               a.max_tokens)
                n_tok = sum(len(o) for o in outs)
                walls.append(statistics.median(times))
                rates.append(n_tok / sum(times))
            texts = [llm.tokenizer.decode(o, skip_special_tokens=True).strip() for o in outs]
            acc = sum(t == ans for t, ans in zip(texts, answers, strict=True)) / len(answers)
            tpf = committed / forwards if forwards else 1.0
            wall = statistics.median(walls)
            base = base or wall
            print(f"{name:<20} {acc:>8.3f} {tpf:>8.2f} {statistics.median(rates):>10.1f} {wall:>15.3f} "
                  f"{base / wall:>6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
