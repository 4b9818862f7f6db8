"""DeepSeek-V4 decode: step time and cache bytes per sequence, ours (paged) vs HF.

Builds the tiny random V4 config of tests/deepseek_v4 (real capacity constants, tiny
widths), then for each context length L measures one-token decode calls at position L:

* ours: ``DeepseekV4Runner.decode`` over the paged cache (S=2 with placeholder);
* HF: ``DeepseekV4ForCausalLM`` single-token forward on its DynamicCache after a chunked prefill.

Cache bytes per sequence: ours counts every mapped block/page of the sequence (ring,
compressed KV, indexer keys, rolling compressor state); HF counts its cache tensors; the
"full KV" column is raw K=V for every token at every layer (what a non-compressing MQA
model of the same width keeps).

    python benchmarks/bench_dsv4.py [--contexts 1024 4096 8192 16384] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "deepseek_v4"))

from conftest import build_hf_model  # noqa: E402

from ratchetlm.models.deepseek_v4.loader import load_deepseek_v4  # noqa: E402
from ratchetlm.models.deepseek_v4.reference import prefix_traces, reference_forward  # noqa: E402
from ratchetlm.models.deepseek_v4.runner import DeepseekV4Runner  # noqa: E402


def ours_cache_bytes(runner: DeepseekV4Runner, seq: int) -> int:
    c, t = runner.cache, runner.cache._seqs[seq]
    total = 0
    for name, pools in (("csa_cmp", c.csa_cmp), ("idx", c.idx), ("hca_cmp", c.hca_cmp)):
        for pool in pools.values():
            total += len(getattr(t, name)) * pool[0].numel() * pool.element_size()
    for pool in c.ori.values():
        total += len(t.ori) * pool[0].numel() * pool.element_size()
    for name, pools, page in (("csa_state", c.csa_state, c.cap.csa_state_page),
                              ("inner_state", c.inner_state, c.cap.csa_state_page),
                              ("hca_state", c.hca_state, c.cap.hca_state_page)):
        for pool in pools.values():
            total += len(getattr(t, name)) * page * pool.shape[1] * pool.element_size()
    return total


def hf_cache_bytes(cache) -> int:
    seen, total = set(), 0

    def add(x):
        nonlocal total
        if isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                add(v)

    for layer in cache.layers:
        for attr in ("keys", "buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
            add(getattr(layer, attr, None))
    return total


def time_calls(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf = build_hf_model(seed=0)
    folder = Path("/tmp/ratchet_bench_dsv4")
    hf.save_pretrained(folder)
    model = load_deepseek_v4(folder)
    cfg = model.config
    longest = max(args.contexts)
    ids = torch.randint(0, cfg.vocab_size, (longest + args.steps + 2,), generator=torch.Generator().manual_seed(0))
    _, traces = reference_forward(model, ids[:longest], chunk=512, logits_for=slice(-1, None))

    from transformers import DynamicCache

    rows = []
    for L in args.contexts:
        if L + args.steps > cfg.max_position_embeddings:
            L_eff = cfg.max_position_embeddings - args.steps
        else:
            L_eff = L
        runner = DeepseekV4Runner(model, max_seqs=1)
        runner.restore(0, prefix_traces(traces, L_eff))
        it = iter(ids[L_eff:].tolist())
        ours_ms = time_calls(lambda: runner.decode({0: next(it)}), args.steps)  # noqa: B023
        ours_b = ours_cache_bytes(runner, 0)

        cache = DynamicCache(config=hf.config)
        with torch.no_grad():
            for c0 in range(0, L_eff, 1024):
                hf(ids[None, c0 : min(L_eff, c0 + 1024)], past_key_values=cache, use_cache=True)
            it2 = iter(ids[L_eff:].tolist())

            def hf_step():
                hf(torch.tensor([[next(it2)]]), past_key_values=cache, use_cache=True)  # noqa: B023

            hf_ms = time_calls(hf_step, args.steps)
        hf_b = hf_cache_bytes(cache)
        full_b = (L_eff + args.steps) * cfg.num_layers * cfg.head_dim * 4
        rows.append((L, ours_ms, hf_ms, ours_b, hf_b, full_b))
        print(f"L={L}: ours {ours_ms:.1f} ms, hf {hf_ms:.1f} ms, bytes ours {ours_b} hf {hf_b} full {full_b}",
              flush=True)

    print("\n| context | ours step (ms) | HF step (ms) | HF/ours | ours cache (KiB) | HF cache (KiB) "
          "| full-KV (KiB) | ours/full |")
    print("|---|---|---|---|---|---|---|---|")
    for L, o, h, ob, hb, fb in rows:
        print(f"| {L} | {o:.1f} | {h:.1f} | {h / o:.2f} | {ob / 1024:.0f} | {hb / 1024:.0f} | {fb / 1024:.0f} "
              f"| {ob / fb:.2f} |")


if __name__ == "__main__":
    main()
