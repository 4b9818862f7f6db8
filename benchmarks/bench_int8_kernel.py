"""Kernel micro-benchmark of the numerics modes (issue 14): one ``x @ w.T`` over k rows per mode, on
random GGUF blocks of a real shape, with the ratio to one row and the integer rate (G MAC/s; one
AMD EPYC Zen 4 core does 236 G int8 MAC/s with 512-bit vpdpbusd, half that for int16's two passes).

Best of many short runs (a shared machine preempts long ones), the compute bound shows at 8+ rows.

    python benchmarks/bench_int8_kernel.py [--shape 2048x2048] [--types Q4_0 Q4_1 Q8_0 Q4_K Q6_K] [--threads 1]

``--against OTHER.so`` (another build of the kernels, e.g. a cached library of an older source tree):
the same calls through both libraries in one process, interleaved, and the time of this build over
the other's per row count (best of each; below 1 = this build is faster), after checking both give the
same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import numpy as np
import torch

from ratchetlm import kernels
from ratchetlm.layers.block_quant import BlockWeight, block_matmul, set_blas_rows

ROWS = (1, 2, 4, 8, 16, 32)
SCALE_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
            "Q6_K": (208,)}
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
         "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def random_weight(type_name: str, n: int, k: int) -> BlockWeight:
    rng = np.random.default_rng(0)
    blck, nbytes = BLOCK[type_name]
    raw = rng.integers(0, 256, (n, k // blck, nbytes), dtype=np.uint8)
    for off in SCALE_AT[type_name]:
        raw[..., off:off + 2] = rng.uniform(1e-4, 1e-3, (n, k // blck, 1)).astype(np.float16).view(np.uint8)
    return BlockWeight.from_gguf(type_name, raw.reshape(n, -1), k)


CLOCK = time.perf_counter  # --cpu-time: time.thread_time (one thread: the calling thread does the work)


def best_ms(f, budget_s: float = 0.3) -> float:
    f()
    best, t0 = float("inf"), time.perf_counter()
    while time.perf_counter() - t0 < budget_s:
        t = CLOCK()
        f()
        best = min(best, CLOCK() - t)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048x2048", help="N x K of the weight")
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
    ap.add_argument("--modes", nargs="+", default=["exact", "int8", "int16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--against", help="another kernel library (.so): A/B ratios in this process")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (with --against)")
    ap.add_argument("--kernel-flags", help="compile this build with these flags instead of -march=native")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts (tokens) per call")
    ap.add_argument("--new-bits", action="store_true",
                    help="with --against: the builds may differ in bits (a numerics change): print the largest "
                         "difference relative to the output's scale instead of asserting the same bits")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the calling thread's CPU time (with --threads 1: the time others' work on a shared "
                         "machine does not stretch)")
    args = ap.parse_args()
    if args.cpu_time:
        assert args.threads == 1, "--cpu-time measures the calling thread only"
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    set_blas_rows(0)  # the block kernels at every row count
    if args.kernel_flags:
        lib = kernels.compile_library(args.kernel_flags.split())
        if lib is None:
            raise SystemExit("the kernels did not build with " + args.kernel_flags)
        kernels.load = lambda: lib  # block_matmul's default library
    n, k = map(int, args.shape.split("x"))
    print(f"load {os.getloadavg()[0]:.1f}; {n}x{k}, {args.threads} thread(s); ms per matmul (best) / ratio to 1 row "
          f"/ G MAC/s")
    if args.against:
        return against(args, n, k)
    with torch.inference_mode():
        for type_name in args.types:
            w = random_weight(type_name, n, k)
            for mode in args.modes:
                xs = [torch.randn(r, k) for r in args.rows]
                ms = [best_ms(lambda x=x, w=w, mode=mode: block_matmul(x, w, numerics=mode)) for x in xs]
                cells = " ".join(f"{m:7.3f} {m / ms[0]:5.2f}x {r * n * k / m / 1e6:5.0f}" for r, m in zip(args.rows, ms,
                                                                                                      strict=True))
                print(f"{type_name:5} {mode:6} {cells}", flush=True)



def against(args: argparse.Namespace, n: int, k: int) -> None:
    """This build (kernels.load()) against the library at ``args.against``: best of ``rounds``
    interleaved short runs each, per type, integer mode and row count."""
    this = kernels.load()
    other = ctypes.CDLL(os.path.abspath(args.against))
    kernels._declare(other)
    assert this is not None
    modes = args.modes
    print(f"time of this build / {os.path.basename(args.against)} (best of {args.rounds} interleaved rounds each)")
    print("type  mode   " + " ".join(f"{r:>6}" for r in args.rows))
    with torch.inference_mode():
        for type_name in args.types:
            w = random_weight(type_name, n, k)
            for mode in modes:
                ratios = []
                diffs = []
                for r in args.rows:
                    x = torch.randn(r, k)
                    a, b = (block_matmul(x, w, lib=lib, path="kernel", numerics=mode) for lib in (this, other))
                    if args.new_bits:
                        diffs.append(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
                    else:
                        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (type_name, mode, r)
                    best = {id(this): float("inf"), id(other): float("inf")}
                    for _ in range(args.rounds):
                        for lib in (this, other):
                            def call(x=x, w=w, lib=lib, mode=mode):
                                return block_matmul(x, w, lib=lib, path="kernel", numerics=mode)

                            ms = best_ms(call, 0.05)
                            best[id(lib)] = min(best[id(lib)], ms)
                    ratios.append(best[id(this)] / best[id(other)])
                note = f"  (max |diff| / max |y|: {max(diffs):.1e})" if diffs else ""
                print(f"{type_name:5} {mode:6} " + " ".join(f"{q:6.3f}" for q in ratios) + note, flush=True)


if __name__ == "__main__":
    main()
