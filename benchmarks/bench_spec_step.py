"""What a speculative step costs outside the forward, and what the step10 cuts saved, on one core.

Two parts:

* ``--cuts`` (default): each cut against the code it replaced, in one process, interleaved, thread CPU
  time, medians: the successor table's top-k of a verify's rows (kernels/argmax.c's one-pass selection
  against the former two-stage ``top_k_indices`` and ``torch.topk``; the default model's vocabulary,
  real-looking logits: a Gaussian row with a few dozen tokens far above the rest), a table row's read
  (a Python list against indexing a ``[vocab, 8]`` int32 tensor and ``tolist``), staging a step's K/V rows
  (a slice copy against a converted copy and ``index_copy_``), the tree value bound
  (a loop over a list against numpy arrays), a suffix node's kids (grouped in Python against numpy's
  ``unique`` and masks) and the strategy's copy of one proposal's logits (``torch.cat``).
* ``--attention``: the attention kernel alone at 1 row, chains of 4 and 5 rows and an 8-node tree
  (9 rows, masked) over ``--contexts`` cached tokens: what each extra verified row costs there. With
  ``--peer DIR``, this tree's attention.c and DIR's (another checkout, e.g. main) each compiled alone with
  the kernel build's flags into a temporary library, timed interleaved; the table gives this tree's times,
  its ratio to the peer's and whether the outputs' bits are equal.
* ``--phases``: Spec-Bench cases (the arguments after ``--`` go to bench_specbench.py) with every
  phase of a step wrapped: per engine (AR, ``ngram``, ``hybrid``) the thread CPU time per step of
  propose, the proposer's tree build, the forward and its LM head, the table's top-k, the strategy's
  commit and verify, the staging commit, the garbage collector (by generation) and the step; what a
  step costs outside the forward, also by kind of step: prompt rows (prefill), decoding without a
  draft (AR's every decode step) and with one, and by the batch's decoding sequences (``--batch N``
  after ``--``: a batch's sizes shrink as requests end), with tokens per step and decode tok/s per
  batch size.

    python benchmarks/bench_spec_step.py [--cuts] [--rows 1 4 8 12] [--repeats 400]
    python benchmarks/bench_spec_step.py --attention [--contexts 300 1000] [--peer /path/to/other/checkout]
    python benchmarks/bench_spec_step.py --phases -- --configs default hybrid --groups qa translation \\
        math_reasoning mt_bench --per-group 1 --max-tokens 128 --threads 1 --clock cpu --numerics int8
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ratchetlm.decoding.speculative import suffix_index  # noqa: E402
from ratchetlm.decoding.speculative.recycling import top_k_indices, top_k_rows  # noqa: E402

VOCAB = 49152  # the default model's


def timed(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median thread CPU ms of each function, called in turn ``repeats`` times (interleaved)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.thread_time()
            f()
            times[k].append(time.thread_time() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def logits(rows: int, seed: int = 0) -> torch.Tensor:  # [rows, VOCAB]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g) * 2.0
    x[:, torch.randint(0, VOCAB, (40,), generator=g)] += 12.0  # a few dozen plausible next tokens
    return x


def old_may_improve(expected: float, p: float, n: int, max_nodes: int, cost: np.ndarray, base: int, share: float,
                    best: float) -> bool:  # tree_select._may_improve before step10
    k = np.arange(1, max_nodes - n + 1)
    if not len(k):
        return False
    bound = (expected + p * k) / (share + cost[base + n + k + 1])
    return bool(bound.max() > best)


def new_may_improve(expected: float, p: float, n: int, max_nodes: int, cost: list[float], base: int, share: float,
                    best: float) -> bool:
    return any((expected + p * k) / (share + cost[base + n + k + 1]) > best for k in range(1, max_nodes - n + 1))


def cuts(rows_list: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    print(f"thread CPU ms, medians of {repeats} interleaved calls; load average {os.getloadavg()[0]:.1f}")
    print("| cut | new | old | saved |")
    print("|---|---|---|---|")
    for r in rows_list:
        x = logits(r)
        assert torch.equal(top_k_rows(x, 8), torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :8])
        t = timed({"kernel": lambda x=x: top_k_rows(x, 8), "two": lambda x=x: top_k_indices(x, 8),
                   "torch": lambda x=x: torch.topk(x, 8, dim=-1)}, repeats)
        print(f"| top-8 of {r} rows | {t['kernel']:.3f} | two-stage {t['two']:.3f}, torch.topk {t['torch']:.3f} "
              f"| {t['two'] - t['kernel']:.3f} |")
    table = torch.randint(0, VOCAB, (VOCAB, 8), dtype=torch.int32)
    lists = {t: table[t].tolist() for t in range(0, VOCAB, 7)}
    toks = list(lists)[:20]
    t = timed({"list": lambda: [lists.get(k, []) for k in toks],
               "tensor": lambda: [[v for v in table[k].tolist() if v >= 0] for k in toks]}, repeats)
    print(f"| 20 table rows read | {t['list']:.3f} | {t['tensor']:.3f} | {t['tensor'] - t['list']:.3f} |")
    cost_np = np.linspace(1.0, 4.0, 40)
    cost_l = cost_np.tolist()
    e, p, m, base, share, best = 2.1, 0.3, 12, 1, 1.2, 0.9
    assert all(old_may_improve(e, p, n, m, cost_np, base, share, best) == new_may_improve(e, p, n, m, cost_l, base,
                                                                                         share, best)
               for n in range(1, 12))
    t = timed({"list": lambda: [new_may_improve(e, p, n, m, cost_l, base, share, best) for n in range(1, 7)],
               "numpy": lambda: [old_may_improve(e, p, n, m, cost_np, base, share, best) for n in range(1, 7)]},
              repeats)
    print(f"| value bound, 6 nodes | {t['list']:.3f} | {t['numpy']:.3f} | {t['numpy'] - t['list']:.3f} |")
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 400, size=600)
    idx = suffix_index.SequenceIndex(20)
    idx.sync(arr.tolist())
    found = idx.match(12)
    assert found is not None
    node = found[0]

    def kids(few: int) -> None:
        suffix_index.FEW = few
        n = suffix_index.SpanNode(node.arr, node.starts, node.left)
        for _ in range(4):  # a chain of expansions, as a draft walks down a match
            if not n.kids:
                break
            n = next(iter(n.kids.values()))

    few = suffix_index.FEW
    t = timed({"python": lambda: kids(few), "numpy": lambda: kids(-1)}, repeats)
    suffix_index.FEW = few
    print(f"| suffix node kids, a 4-level walk ({node.count} occurrences) | {t['python']:.3f} | {t['numpy']:.3f} | "
          f"{t['numpy'] - t['python']:.3f} |")
    k_all = torch.randn(30, 64, 3, 64)  # the decode chain's K rows of every layer (a view of its first rows)
    buf = torch.zeros(30, 64, 3, 64, dtype=torch.float16)
    for n in (1, 8):
        rows, idx = k_all[:, :n], torch.arange(n)
        t = timed({"slice": lambda rows=rows, n=n: buf[:, 0:n].copy_(rows),
                   "index": lambda rows=rows, idx=idx: buf.index_copy_(1, idx, rows.to(buf.dtype))}, repeats)
        print(f"| staging {n} rows' K of 30 layers (fp32 -> half) | {t['slice']:.3f} | index_copy_ {t['index']:.3f} | "
              f"{t['index'] - t['slice']:.3f} |")
    one = logits(8)
    t = timed({"view": lambda: [one][0], "cat": lambda: torch.cat([one])}, repeats)
    print(f"| one proposal's 8 logit rows to the table | {t['view']:.3f} | cat {t['cat']:.3f} | "
          f"{t['cat'] - t['view']:.3f} |")


def attention_library(root: Path, out_dir: Path) -> Any:
    """``root``'s kernels/attention.c compiled alone (the kernel build's flags, ``-march=native``)."""
    import ctypes
    import subprocess

    from ratchetlm.kernels import build
    cc = build._compiler()
    if cc is None:
        raise SystemExit("no C compiler")
    out = out_dir / f"attention_{len(list(out_dir.iterdir()))}.so"
    subprocess.run([cc, *build._CFLAGS, "-march=native", str(root / "ratchetlm" / "kernels" / "attention.c"), "-o",
                    str(out), *build._LDFLAGS, "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    p, i, fl = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.ratchet_attention.argtypes = [p, p, p, p, p, p, i, p, i, p, i, i, i, i, fl, fl, i, p, i]
    lib.ratchet_attention.restype = None
    return lib


def attention(contexts: list[int], repeats: int, peer: Path | None = None) -> None:
    """The attention kernel alone (kernels/attention.c, the default model's 9 query / 3 KV heads of 64,
    a half cache, one thread, 30 layers' worth): 1 row, a chain of 4 and 5 rows (causal, no mask) and
    a tree of 8 nodes (9 rows with the root, a binary tree's mask) on top of ``contexts`` cached keys."""
    import ctypes
    import tempfile

    from ratchetlm import kernels
    libs: dict[str, Any] = {"this": kernels.load()}
    if libs["this"] is None:
        print("no C kernels")
        return
    if peer is not None:
        tmp = Path(tempfile.mkdtemp(prefix="bench_attention_"))
        libs = {"this": attention_library(Path(__file__).resolve().parents[1], tmp),
                "peer": attention_library(peer, tmp)}
    torch.set_num_threads(1)
    h, hkv, d, slots = 9, 3, 64, 4096
    kc, vc = torch.randn(slots, hkv, d).half(), torch.randn(slots, hkv, d).half()
    tree_parent = [-1, 0, 0, 1, 1, 2, 2, 3, 4]  # row 0 the root; rows 1-8 a tree of 8 nodes
    print(f"attention, 30 layers, thread CPU ms (medians of {repeats}); load average {os.getloadavg()[0]:.1f}")
    if peer is not None:
        print(f"this tree against {peer}: this tree's ms (its time / the peer's; bits equal?)")
    print("| cached tokens | 1 row | chain of 4 | chain of 5 | tree of 8 nodes (9 rows, mask) |")
    print("|---|---|---|---|---|")
    for ctx in contexts:
        cells: list[str] = []
        ms: list[float] = []
        for n, tree in ((1, False), (4, False), (5, False), (9, True)):
            g = torch.Generator().manual_seed(n)
            q, kn, vn = torch.randn(n, h, d, generator=g), torch.randn(n, hkv, d, generator=g), \
                torch.randn(n, hkv, d, generator=g)
            cs = torch.arange(ctx, dtype=torch.long).reshape(1, ctx)  # [1, ctx] slots, in order (as blocks are)
            meta = torch.tensor([ctx, 0, n], dtype=torch.int32)
            outs = {k: torch.empty(n, h, d) for k in libs}
            mask = None
            if tree:  # [1, n, ctx + n]: every context key, then the row's ancestors and itself
                mask = torch.full((1, n, ctx + n), float("-inf"))
                mask[0, :, :ctx] = 0.0
                for i in range(n):
                    j = i
                    while j >= 0:
                        mask[0, i, ctx + j] = 0.0
                        j = tree_parent[j]

            def call(lib: Any, out: torch.Tensor, q=q, kn=kn, vn=vn, cs=cs, meta=meta, mask=mask, ctx=ctx,
                     n=n) -> None:
                lib.ratchet_attention(q.data_ptr(), kn.data_ptr(), vn.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                                      cs.data_ptr(), ctx, meta.data_ptr(), n,
                                      None if mask is None else mask.data_ptr(), 1, h, hkv, d, ctypes.c_float(0.125),
                                      ctypes.c_float(0.0), 1, out.data_ptr(), 1)
            t = timed({k: (lambda lib=lib, out=outs[k], call=call: call(lib, out)) for k, lib in libs.items()}, repeats)
            if peer is None:  # this tree's ms, and its ratio to the 1-row call
                ms.append(t["this"] * 30)
                cells.append(f"{ms[-1]:.2f} ({ms[-1] / ms[0]:.2f}x)")
            else:
                same = torch.equal(outs["this"].view(torch.int32), outs["peer"].view(torch.int32))
                cells.append(f"{t['this'] * 30:.2f} ({t['this'] / t['peer']:.2f}x; "
                             f"{'same bits' if same else 'BITS DIFFER'})")
        print(f"| {ctx} | " + " | ".join(cells) + " |")


def phases(argv: list[str]) -> None:
    """Spec-Bench through bench_specbench.py with each phase of a step wrapped (thread CPU time)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_specbench

    from ratchetlm.decoding import autoregressive
    from ratchetlm.decoding.speculative import recycling, strategy, tree_proposers
    from ratchetlm.engine import llm_engine, model_runner
    from ratchetlm.kv import staging
    from ratchetlm.models import llama

    current = ["?"]
    acc: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    steps: collections.Counter[str] = collections.Counter()

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def w(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                acc[current[0]][label] += time.thread_time() - t0
        setattr(owner, name, w)

    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:  # the cyclic collector's time, by generation
        if phase == "start":
            gc_start[0] = time.thread_time()
        else:
            acc[current[0]][f"  gc gen {info['generation']}"] += time.thread_time() - gc_start[0]
    gc.callbacks.append(on_gc)

    step = llm_engine.LLMEngine.step
    kind = [""]  # the step being run: "prefill" (a prompt row), "drafted" (a staged proposal) or "no draft"

    def classified(propose: Callable[..., Any]) -> Callable[..., Any]:
        def w(self: Any, seqs: list[Any], budgets: list[int]) -> Any:
            out = propose(self, seqs, budgets)
            kind[0] = "prefill" if any(p.direct_write and len(p.token_ids) > 1 for p in out) else \
                "drafted" if any(not p.direct_write for p in out) else "no draft"
            if kind[0] != "prefill":  # decode steps also by batch size (a batch's sizes shrink as requests end)
                kind[0] += f", batch {len(seqs)}"
            return out
        return w

    def engine_step(self: Any) -> Any:
        p = getattr(self.strategy, "proposer", None)
        current[0] = type(p).__name__ if p is not None else "AR"
        t0 = time.thread_time()
        fwd = acc[current[0]][" forward"]
        topk = acc[current[0]][" table top-k"]
        kind[0] = "idle"  # a step that proposes nothing (every request waiting or done)
        out = step(self)
        t = time.thread_time() - t0
        acc[current[0]]["step"] += t
        steps[current[0]] += 1
        # steps by kind: a decode step without a draft against AR's, and one with a draft
        n = split[current[0]][kind[0]]
        n[0], n[1], n[2] = n[0] + 1, n[1] + t, n[2] + t - (acc[current[0]][" forward"] - fwd)
        n[3] += acc[current[0]][" table top-k"] - topk
        n[4] += sum(len(o.new_token_ids) for o in out)
        return out

    split: dict[str, dict[str, list[float]]] = collections.defaultdict(  # engine -> kind ->
        lambda: collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0]))  # [steps, step s, outside s, top-k s,
    # tokens]
    llm_engine.LLMEngine.step = engine_step  # type: ignore[method-assign]
    for owner in (strategy.Speculative, autoregressive.Autoregressive):
        owner.propose = classified(owner.propose)  # type: ignore[method-assign]
    for owner, name, label in [
            (autoregressive.Autoregressive, "propose", "propose"), (autoregressive.Autoregressive, "commit", "commit"),
            (strategy.Speculative, "propose", "propose"), (tree_proposers.TreeProposer, "propose", " proposer.propose"),
            (tree_proposers, "build", "  tree build"), (strategy.Speculative, "commit", "commit"),
            (recycling.SuccessorTable, "observe", " table top-k"), (strategy.Speculative, "_commit_tree", " verify"),
            (model_runner.ModelRunner, "execute", "execute"), (model_runner.ModelRunner, "forward", " forward"),
            (llama.LlamaModel, "logits", "  LM head"), (staging.StagingBuffer, "_stage", "  staging writes"),
            (llm_engine.LLMEngine, "_apply", "apply"), (model_runner.ModelRunner, "commit_staged", " staging commit")]:
        wrap(owner, name, label)
    bench_specbench.main(argv)
    print(f"\nper step, thread CPU ms (load average {os.getloadavg()[0]:.1f}):")
    for eng, d in acc.items():
        if steps[eng]:
            print(f"  {eng} ({steps[eng]} steps): " + ", ".join(f"{k.strip()} {v / steps[eng] * 1e3:.3f}"
                                                             for k, v in d.items())
                  + f", outside the forward {(d['step'] - d[' forward']) / steps[eng] * 1e3:.3f}")
            for k, (n, t, out, topk, toks) in sorted(split[eng].items()):
                print(f"    {k} ({int(n)} steps): step {t / n * 1e3:.3f}, outside the forward {out / n * 1e3:.3f}"
                      + (f" (table top-k {topk / n * 1e3:.3f})" if topk else "") + f", {toks / n:.2f} tokens, "
                      f"{toks / t:.1f} tok/s")
            by_batch: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])  # batch -> [s, tokens]
            for k, (_, t, _, _, toks) in split[eng].items():
                if ", batch " in k:
                    by_batch[k.split(", batch ")[1]][0] += t
                    by_batch[k.split(", batch ")[1]][1] += toks
            if by_batch:  # decode tok/s per batch size, drafting or not (contexts differ between engines)
                print("    decode tok/s by batch size: " + ", ".join(
                    f"{b}: {toks / t:.1f}" for b, (t, toks) in sorted(by_batch.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuts", action="store_true", help="the cuts against the code they replaced (default)")
    ap.add_argument("--phases", action="store_true", help="per-phase time of Spec-Bench steps (args after --)")
    ap.add_argument("--attention", action="store_true", help="the attention kernel by rows and cached tokens")
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--peer", type=Path, default=None, help="--attention: another checkout to time against")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12])
    ap.add_argument("--repeats", type=int, default=400)
    argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        argv, rest = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    args = ap.parse_args(argv)
    if args.phases:
        phases(rest)
    elif args.attention:
        attention(args.contexts, args.repeats, args.peer)
    else:
        cuts(args.rows, args.repeats)


if __name__ == "__main__":
    main()
