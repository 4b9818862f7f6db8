"""ratchetlm vs llama-cpp-python on a narrower instruction set than this CPU's (e.g. an AVX2-only
machine, the common laptop / Zen 3 case), both built for it, in one process as interleaved pairs.

ratchetlm's kernels are compiled with ``--kernel-flags`` (default AVX2 + FMA + F16C, no AVX-512) and
used in place of the native build; llama-cpp-python must be a build for the same ISA, installed
apart and put first on the path, e.g.::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF \\
      -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_FMA=ON -DGGML_F16C=ON" \\
      pip install --no-cache-dir --no-deps --target /tmp/llama_avx2 llama-cpp-python
    PYTHONPATH=/tmp/llama_avx2 python benchmarks/bench_isa_pairs.py [--model FILE] [--pairs 5]

(``--no-cache-dir``: pip's wheel cache ignores CMAKE_ARGS and would hand back an earlier native
build; the script prints llama.cpp's own system info to show which it got.) Prints batch-1 decode
tok/s (32 tokens) and the prefill tok/s of a 512-token prompt, medians of the pairs, with ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ratchetlm import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--kernel-flags", default="-mavx2 -mfma -mf16c")
    ap.add_argument("--numerics", default="auto")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.compile_library(args.kernel_flags.split())
    if lib is None:
        raise SystemExit("the kernels did not build with " + args.kernel_flags)
    kernels.load = lambda: lib  # every caller (loader, layers, chain) takes this build
    import llama_cpp

    from ratchetlm.bench import LlamaCppRunner, RatchetRunner
    from ratchetlm.models.loader import default_model_path

    path = args.model or str(default_model_path())
    print("llama.cpp:", llama_cpp.llama_print_system_info().decode().strip())
    ours, peer = RatchetRunner(path, False, 600, 1, args.numerics), LlamaCppRunner(path, args.threads, 600, 1)
    print(f"ratchetlm: kernels {args.kernel_flags!r} (integer ISA {kernels.int8_isa()}), "
          f"numerics {ours.llm.config.numerics}")
    short, long = [[1, 2, 3, 4, 5, 6, 7, 8]], [list(range(100, 612))]
    for r in (ours, peer):
        r.generate(short, 4)
        r.generate(long, 1)
    dec: dict[str, list[float]] = {"ratchetlm": [], "llama.cpp": []}
    pf: dict[str, list[float]] = {"ratchetlm": [], "llama.cpp": []}
    for _ in range(args.pairs):
        for name, r in (("ratchetlm", ours), ("llama.cpp", peer)):
            r.generate(short, 32)
            assert r.decode_s is not None
            dec[name].append(31 / r.decode_s)
            t = time.perf_counter()
            r.generate(long, 1)
            pf[name].append(512 / (time.perf_counter() - t))
    m = statistics.median
    print(f"{os.path.basename(path)}, {args.threads} threads, {args.pairs} pairs, "
          f"load average {os.getloadavg()[0]:.1f}")
    for what, d in (("decode b1", dec), ("prefill 512", pf)):
        print(f"{what} tok/s: ratchetlm {m(d['ratchetlm']):.1f}, llama-cpp-python {m(d['llama.cpp']):.1f} "
              f"({m(d['ratchetlm']) / m(d['llama.cpp']):.2f}x)")


if __name__ == "__main__":
    main()
