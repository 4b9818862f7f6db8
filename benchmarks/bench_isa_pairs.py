"""ratchetlm vs llama-cpp-python, plain decode at batch 1 and a 512-token prefill, on one instruction set
(this CPU's, or a narrower one such as AVX2: the common laptop / Zen 3 case), both built for it, in one
process as interleaved pairs, over one or more GGUF files.

ratchetlm's kernels are compiled with ``--kernel-flags`` (``native``: the build the engine uses on this
machine; or e.g. ``"-mavx2 -mfma -mf16c"``, the default, AVX2 without AVX-512) and used in place of the
native build. llama-cpp-python must be a build for the same ISA; for AVX2, one installed apart and put
first on the path, e.g.::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \\
      -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX_VNNI=OFF -DLLAVA_BUILD=OFF" \\
      pip install --no-cache-dir --no-deps --target /tmp/llama_avx2 llama-cpp-python==0.3.36
    PYTHONPATH=/tmp/llama_avx2:. python benchmarks/bench_isa_pairs.py --models A.gguf B.gguf default

(``--no-cache-dir``: pip's wheel cache ignores CMAKE_ARGS and would hand back an earlier native build;
the script prints llama.cpp's own system info to show which it got, and refuses an AVX-512 peer when
ratchetlm's kernels are built without AVX-512.) Per file, both engines are loaded (same file, same
threads), warmed up, then alternate ``--pairs`` times: ratchetlm decode 32 tokens (batch 1, greedy, EOS
banned) and prefill a 512-token prompt, then llama-cpp-python the same. Printed per file: median tok/s of
each engine and the median of the per-pair ratios (ours / peer), as a markdown row.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from ratchetlm import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["default"],
                    help="GGUF files; 'default' is the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--kernel-flags", default="-mavx2 -mfma -mf16c", help="'native' or compiler flags")
    ap.add_argument("--numerics", default="auto")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernel_flags != "native":
        lib = kernels.compile_library(args.kernel_flags.split())
        if lib is None:
            raise SystemExit("the kernels did not build with " + args.kernel_flags)
        kernels.load = lambda: lib  # every caller (loader, layers, chain) takes this build
    import llama_cpp

    from ratchetlm.bench import LlamaCppRunner, RatchetRunner
    from ratchetlm.models.loader import default_model_path

    info = llama_cpp.llama_print_system_info().decode().strip()
    print(f"llama-cpp-python {llama_cpp.__version__} from {os.path.dirname(llama_cpp.__file__)}: {info}")
    print(f"ratchetlm kernels: {args.kernel_flags!r}, ISA {kernels.isa()}, integer ISA {kernels.int8_isa()}")
    if kernels.isa() != "avx512" and "AVX512 = 1" in info:
        raise SystemExit("llama-cpp-python is an AVX-512 build but ratchetlm's kernels are not: not a pair")
    print(f"{args.threads} threads, {args.pairs} interleaved pairs per file, decode b1 {args.tokens} tokens, "
          f"prefill {args.prompt_tokens} tokens, numerics {args.numerics}\n")
    print("| file | numerics | decode b1 tok/s ours / llama.cpp | ratio | prefill tok/s ours / llama.cpp | ratio "
          "| load avg |")
    print("|---|---|---|---|---|---|---|")
    short, long = [[1, 2, 3, 4, 5, 6, 7, 8]], [list(range(100, 100 + args.prompt_tokens))]
    ctx = args.prompt_tokens + 88
    for model in args.models:
        path = str(default_model_path()) if model == "default" else model
        ours, peer = RatchetRunner(path, False, ctx, 1, args.numerics), LlamaCppRunner(path, args.threads, ctx, 1)
        for r in (ours, peer):  # warm-up: weights packed and paged in, caches touched
            r.generate(short, 4)
            r.generate(long, 1)
        dec: dict[str, list[float]] = {"ours": [], "peer": []}
        pf: dict[str, list[float]] = {"ours": [], "peer": []}
        for _ in range(args.pairs):
            for name, r in (("ours", ours), ("peer", peer)):
                r.generate(short, args.tokens)
                assert r.decode_s is not None
                dec[name].append((args.tokens - 1) / r.decode_s)
                t = time.perf_counter()
                r.generate(long, 1)
                pf[name].append(args.prompt_tokens / (time.perf_counter() - t))
        m = statistics.median
        dr = m(a / b for a, b in zip(dec["ours"], dec["peer"], strict=True))
        pr = m(a / b for a, b in zip(pf["ours"], pf["peer"], strict=True))
        mode = ours.llm.engine.cfg.numerics
        print(f"| {os.path.basename(path)} | {mode} | {m(dec['ours']):.1f} / {m(dec['peer']):.1f} "
              f"| {dr:.2f}x | {m(pf['ours']):.1f} / {m(pf['peer']):.1f} | {pr:.2f}x | {os.getloadavg()[0]:.1f} |",
              flush=True)
        peer.lc.llama_batch_free(peer.batch)
        peer.lc.llama_free(peer.ctx)
        peer.lc.llama_model_free(peer.model)
        del ours, peer
        gc.collect()


if __name__ == "__main__":
    main()
