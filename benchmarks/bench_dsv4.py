"""DeepSeek-V4 on the one engine: plain vs MTP speculative decoding, and our cache vs HF's.

Builds the tiny random V4 config of tests/deepseek_v4 (real capacity constants, tiny widths)
with random MTP weights, runs one reference forward over the longest context, and for each
context length L starts one sequence at position L (its cache restored from the reference's
traces, as a prefix-cache hit would) and decodes ``--steps`` greedy tokens through
``LLMEngine``:

* ``plain``: one committed token per call (the seed's S = 2 shape, placeholder second row);
* ``mtp``: the checkpoint's MTP module drafts, ``[root, draft]`` verified in the same S = 2
  shape (random weights: its drafts are nearly always wrong — this row is the mechanism's cost
  at zero acceptance);
* ``mtp, all accepted``: the same module runs and its chain is replaced by the known greedy
  continuation, every draft accepted (depth 1 and 3): the mechanism's ceiling in tokens per call.

Per row: tokens per engine step (call), median step time over ``--repeats`` interleaved runs,
time per generated token (median step x calls / tokens).
Also: HF's single-token step on its DynamicCache, and cache bytes per sequence (ours: every
mapped block/page; HF: its cache tensors; "full KV": raw K = V for every token at every layer).

    python benchmarks/bench_dsv4.py [--contexts 1024 8192 16384] [--steps 16] [--threads 1] [--repeats 3]

The setup (random checkpoint, reference forward over the longest context: minutes at 16k) is not
timed; ``--cache DIR`` keeps it between runs and ``--prepare`` only builds it, so it can run niced
outside the shared benchmark lock and each context's timed run can take the lock on its own:

    nice -n 19 python benchmarks/bench_dsv4.py --cache /tmp/dsv4 --contexts 16384 --prepare
    flock /tmp/bench.lock python benchmarks/bench_dsv4.py --cache /tmp/dsv4 --contexts 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ratchetlm.decoding.speculative.proposers import DraftBeam  # noqa: E402
from ratchetlm.models.deepseek_v4.loader import load_deepseek_v4  # noqa: E402
from ratchetlm.models.deepseek_v4.reference import prefix_traces, reference_forward  # noqa: E402
from ratchetlm.sampling_params import SamplingParams  # noqa: E402
from tests.deepseek_v4.conftest import add_restored, build_hf_model, v4_engine, write_mtp_weights  # noqa: E402


def hf_cache_bytes(cache: Any) -> int:
    seen, total = set(), 0

    def add(x: Any) -> None:
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


def steer_all_accepted(engine: Any, truth: list[int]) -> None:
    """After the module drafts, replace its chain by the known greedy continuation."""
    prop = engine.strategy.proposer
    real = prop.propose

    def propose(seqs: list[Any], depths: list[int]) -> list[DraftBeam | None]:
        out: list[DraftBeam | None] = []
        for s, b in zip(seqs, real(seqs, depths), strict=True):
            if b is not None:
                k = b.tokens.shape[1]
                chain = (truth[s.num_output_tokens : s.num_output_tokens + k] + [0] * k)[:k]
                b = DraftBeam(torch.tensor([chain]), b.scores)
            out.append(b)
        return out

    prop.propose = propose


def run(engine: Any, ids: torch.Tensor, traces: Any, L: int, steps: int) -> tuple[list[int], list[float], int]:
    """Greedy ``steps`` tokens after position L -> (tokens, per-step seconds, cache bytes held)."""
    sid = add_restored(engine, ids[: L + 1].tolist(), SamplingParams(temperature=0.0, max_tokens=steps,
                                                                       ignore_eos=True), traces, L)
    times, held = [], 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        held = max(held, engine.blocks.seq_bytes(sid))
    return engine.seqs[sid].output_ids, times[1:], held  # step 0 feeds the restored root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 16384])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (interleaved); medians over all")
    ap.add_argument("--cache", type=Path, help="keep the checkpoint and reference traces here between runs")
    ap.add_argument("--prepare", action="store_true", help="only build the --cache (untimed setup) and exit")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf = build_hf_model(seed=0)
    folder = args.cache / "model" if args.cache else Path(tempfile.mkdtemp(prefix="ratchet_bench_dsv4_"))
    if not (folder / "config.json").exists():
        hf.save_pretrained(folder)
        write_mtp_weights(folder)
    model = load_deepseek_v4(folder)
    cfg = model.config
    cap = cfg.max_position_embeddings
    lengths = [min(L, cap - args.steps - 1) for L in args.contexts]  # room for the generated tokens
    ids = torch.randint(0, cfg.vocab_size, (cap,), generator=torch.Generator().manual_seed(0))
    saved = args.cache / f"traces_{max(lengths)}.pt" if args.cache else None
    found = sorted(args.cache.glob("traces_*.pt"), key=lambda f: int(f.stem.split("_")[1])) if args.cache else []
    found = [f for f in found if int(f.stem.split("_")[1]) >= max(lengths)]
    if found:  # the forward is causal: a longer run's traces hold a shorter one's as a prefix
        traces = prefix_traces(torch.load(found[0], weights_only=False), max(lengths))
    else:
        _, traces = reference_forward(model, ids[: max(lengths)], chunk=512, logits_for=slice(-1, None))
        if saved is not None:
            torch.save(traces, saved)
    if args.prepare:
        return
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cpus), threads {args.threads}",
          flush=True)

    from transformers import DynamicCache

    configs = [("plain", 0, False), ("mtp (module's own drafts)", 1, False), ("mtp, all accepted, depth 1", 1, True),
               ("mtp, all accepted, depth 3", 3, True)]
    table = []
    for L in lengths:
        plain_tokens, _, held = run(v4_engine(model), ids, traces, L, args.steps)  # warm-up + the reference output
        timed: dict[str, list[float]] = {label: [] for label, _, _ in configs}
        calls: dict[str, tuple[int, int]] = {}
        for _ in range(args.repeats):  # configurations interleaved, so load changes hit them alike
            for label, depth, steer in configs:
                if depth == 0:
                    eng = v4_engine(model)
                else:
                    eng = v4_engine(model, "speculative",
                                    decoding_options={"method": "mtp", "depth": depth, "depth_schedule": "constant"})
                if steer:
                    steer_all_accepted(eng, plain_tokens)
                toks, t, _ = run(eng, ids, traces, L, args.steps)
                assert toks == plain_tokens, f"{label}: output differs from plain greedy at L={L}"
                timed[label] += t
                calls[label] = (len(t), len(toks))
        rows = [(label, calls[label][0], timed[label], calls[label][1]) for label, _, _ in configs]
        cache = DynamicCache(config=hf.config)
        with torch.no_grad():
            for c0 in range(0, L, 1024):
                hf(ids[None, c0 : min(L, c0 + 1024)], past_key_values=cache, use_cache=True)
            hf_t = []
            for t in [int(ids[L])] + plain_tokens[:-1]:
                t0 = time.perf_counter()
                hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
                hf_t.append(time.perf_counter() - t0)
        full = (L + args.steps) * cfg.num_layers * cfg.head_dim * 4
        table.append((L, rows, statistics.median(hf_t), held, hf_cache_bytes(cache), full))
        print(f"L={L} done (load {os.getloadavg()[0]:.2f})", flush=True)

    print("\n| context | decoding | tokens / call | step (ms, median) | ms / token | vs plain (ms / token) |")
    print("|---|---|---|---|---|---|")
    for L, rows, _, _, _, _ in table:
        # generated tokens after the restored root's step, over the calls that produced them
        base = statistics.median(rows[0][2]) * 1e3 * rows[0][1] / (rows[0][3] - 1)
        for label, calls, t, ntok in rows:
            step = statistics.median(t) * 1e3
            per_tok = step * calls / (ntok - 1)
            print(f"| {L} | {label} | {(ntok - 1) / calls:.2f} | {step:.1f} | {per_tok:.1f} | {base / per_tok:.2f}x |")
    print("\n| context | ours plain step (ms) | HF step (ms) | ours cache (KiB) | HF cache (KiB) | full-KV (KiB) |")
    print("|---|---|---|---|---|---|")
    for L, rows, hf_ms, ob, hb, fb in table:
        print(f"| {L} | {statistics.median(rows[0][2]) * 1e3:.1f} | {hf_ms * 1e3:.1f} | {ob / 1024:.0f} "
              f"| {hb / 1024:.0f} | {fb / 1024:.0f} |")
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {rss:.0f} MiB (reference traces and HF included)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
