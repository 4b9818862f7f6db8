"""Building the C kernels: sources, flags, the on-disk cache and its key, and a parallel compile. No
torch and nothing else from the package is imported here, so that the install-time build (``setup.py``,
run by pip in an isolated environment without the project's dependencies) can load this file by path.

The library is built for the machine that runs it (``-march=native``; the cache key holds this CPU's
flags, the compiler's version and every source's bytes) into ``~/.cache/ratchetlm/kernels``
(``$XDG_CACHE_HOME``), else a per-user folder in the temp directory. :func:`prebuild` is what ``pip
install`` runs: it builds the library :func:`ratchetlm.kernels.load` will look for, so that the first
``ratchet generate`` compiles nothing. Where the install could not (no compiler, another user's home under
sudo, a wheel built on another machine, sources edited since), the first use builds it and logs one line
before and one after.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("ratchetlm.kernels")

# Each source is one translation unit and one object, compiled in parallel; the slowest first, so that a
# parallel build ends on the quick ones (the int8 panel kernel is one unit per stored-value width, the
# few-token fp32 kernels two units beside the matmul driver).
SOURCES = tuple(Path(__file__).with_name(n) for n in (
    "matmul_int8_vb8.c", "matmul_int8_vb4.c", "matmul_int8_vb5.c", "matmul_int8_vb6.c", "matmul_int8_unpacked.c",
    "matmul_few_k.c",
    "matmul_few_blocks.c", "attention.c", "matmul_int8.c", "matmul.c", "dequant.c", "norm_rope.c", "argmax.c",
    "chain.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in (
    "ggml_types.h", "units_avx512.h", "units_avx2.h", "silu.h", "attention_avx2.h", "matmul_int8_panel.h",
    "matmul_vec.h", "matmul_few.h"))
# -ffp-contract=off: dequantization must round exactly like gguf-py's numpy code (no fused d * q + m).
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fPIC"]
_LDFLAGS = ["-shared", "-fopenmp"]
# CPU seconds of a whole build (every unit, gcc 12 -O3, 2 parallel jobs) on the developers' 2.5 GHz Xeon, by
# the kernel paths the flags select: the estimate the first-use log line gives, divided over the parallel jobs
# (docs/benchmarks.md, "Kernel build time"). 2026-11-29 09:03, idle machine, this package's own path into an
# empty cache: AVX-512 47 s of CPU (25 s wall), AVX2 83 s (44 s wall), portable C ~6 s; before the unpacked
# prefill kinds compiled full tiles only and the AVX-512 rare kinds one body: 69 s (35 s), 100 s (51 s). The
# AVX-512 streamed tiles of 9-15 tokens (matmul_int8_panel.h, panel_stream, each size a function): 1.75x that
# build's CPU (2026-11-29 20:36, this session's VM at load ~1: 37.3 s against 21.2 s, wall 21 s against 12.5 s on
# its 2 cores), so 82 s here.
BUILD_CPU_S = {"avx512": 82.0, "avx2": 83.0, "portable C": 6.0}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ratchetlm" / "kernels"


def _compiler() -> str | None:
    """``$CC`` where it names an executable (a wrong one is reported and skipped), else cc or gcc."""
    cc = os.environ.get("CC")
    if cc and shutil.which(cc) is None:
        log.warning("CC=%r is not an executable; trying cc / gcc for the kernels", cc)
        cc = None
    return cc or shutil.which("cc") or shutil.which("gcc")


def unavailable_reason() -> str:
    """Why :func:`load` returned None, for an error message."""
    if _compiler() is None:
        return "no C compiler was found (install gcc or clang, or set CC)"
    return "the kernel build failed (the warning above gives the compiler's message)"


def _jobs() -> int:
    """Compiler processes to run at once: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def kernel_isa_for(arch_flags: list[str]) -> str:
    """The vector path a build with ``arch_flags`` takes ('avx512', 'avx2', 'portable C'), read from the
    flags (and for -march=native from this CPU's flags), before anything is compiled."""
    if "-march=native" in arch_flags:
        cpu = set(_cpu_flags().split())
        if "avx512f" in cpu:
            return "avx512"
        return "avx2" if {"avx2", "fma", "f16c"} <= cpu else "portable C"
    march = [f for f in arch_flags if f.startswith("-march=")]
    if march:
        return march[-1][len("-march="):]
    if any(f.startswith("-mavx512") for f in arch_flags):
        return "avx512"
    return "avx2" if "-mavx2" in arch_flags else "portable C"


def _compile_objects(cc: str, builds: list[tuple[list[str], Path]]) -> list[Path | bool]:
    """Compile every source of each build ``(arch flags, library path)`` to its own object (one pool of
    :func:`_jobs` compiler processes for all of them, slowest units first), then link each library.
    Returns each library's path, False where its build failed (logged), True where its folder is not writable."""
    staged: list[tuple[list[str], Path, Path] | None] = []
    for arch, out in builds:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            staged.append((arch, out, Path(tempfile.mkdtemp(prefix="build-", dir=out.parent))))
        except OSError as e:  # read-only or missing home: the caller tries the next directory
            log.warning("cannot write kernel cache in %s: %s", out.parent, e)
            staged.append(None)
    units = [(cc, [*_CFLAGS, *st[0], "-c", str(src), "-o", str(st[2] / f"{src.stem}.o")])
             for src in SOURCES for st in staged if st is not None]
    with ThreadPoolExecutor(max_workers=_jobs()) as pool:
        procs = list(pool.map(lambda u: subprocess.run([u[0], *u[1]], capture_output=True, text=True), units))
    failed = {cmd[-1]: p.stderr for (_, cmd), p in zip(units, procs, strict=True) if p.returncode != 0}
    done: list[Path | bool] = []
    for st in staged:
        if st is None:
            done.append(True)
            continue
        arch, out, tmp = st
        objs = [str(tmp / f"{src.stem}.o") for src in SOURCES]
        errors = [failed[o] for o in objs if o in failed]
        lib = tmp / out.name
        if not errors:
            link = subprocess.run([cc, *_LDFLAGS, *arch, *objs, "-o", str(lib)], capture_output=True, text=True)
            errors = [link.stderr] if link.returncode != 0 else []
        if errors:
            log.warning("kernel build failed (%s): %s", " ".join(_CFLAGS + arch), errors[0].strip()[-500:])
            done.append(False)
        else:
            os.replace(lib, out)  # atomic: concurrent processes never load a half-written library
            done.append(out)
        shutil.rmtree(tmp, ignore_errors=True)
    return done


def _version(cc: str) -> str | None:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError as e:  # found on PATH but cannot run
        log.warning("cannot run the C compiler %s (%s): GGUF block kernels disabled, using dense matmuls", cc, e)
        return None


def _library_name(cc_version: str, arch_flags: list[str]) -> str:
    flags = _CFLAGS + _LDFLAGS + arch_flags
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + " ".join(flags).encode() + cc_version.encode() + platform.machine().encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    return f"ratchet_kernels-{key}.so"


@functools.cache
def _cpu_flags() -> str:
    """This CPU's feature flags (part of the cache key: -march=native code must not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()



def build_libraries(variants: list[list[str]]) -> list[Path | None]:
    """Build (or find in the on-disk cache) the kernel library once per ``arch_flags`` in ``variants`` (e.g.
    ``["-march=native"]``, ``["-mavx2", "-mfma", "-mf16c"]``, ``[]`` for portable C), every variant's units
    in one parallel pool: each library's path, None for a variant without a compiler or whose build failed."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: GGUF block kernels disabled, using dense matmuls")
        return [None] * len(variants)
    version = _version(cc)
    if version is None:
        return [None] * len(variants)
    fallback = Path(tempfile.gettempdir()) / f"ratchetlm-kernels-{getattr(os, 'getuid', lambda: 0)()}"
    paths: list[Path | bool] = [True] * len(variants)  # True: not built yet; False: the build failed
    for folder in (cache_dir(), fallback):
        todo = [i for i, p in enumerate(paths) if p is True]
        for i in todo:
            cached = folder / _library_name(version, variants[i])
            if cached.exists():
                paths[i] = cached
        todo = [i for i in todo if paths[i] is True]
        if not todo:
            break
        isas = ", ".join(kernel_isa_for(variants[i]) for i in todo)
        estimate = sum(BUILD_CPU_S[kernel_isa_for(variants[i])] if kernel_isa_for(variants[i]) in BUILD_CPU_S
                       else max(BUILD_CPU_S.values()) for i in todo) / min(_jobs(), len(SOURCES) * len(todo))
        log.info("compiling CPU kernels for %s, once, ~%.0f s (%d jobs; cached in %s)", isas, estimate, _jobs(), folder)
        t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        built = _compile_objects(cc, [(variants[i], folder / _library_name(version, variants[i])) for i in todo])
        for i, out in zip(todo, built, strict=True):
            paths[i] = out
        if any(isinstance(b, Path) for b in built):
            log.info("compiled CPU kernels in %.0f s (%.0f s of CPU)", time.perf_counter() - t0,
                     resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu0)
    return [p if isinstance(p, Path) else None for p in paths]


# tried in order by ratchetlm.kernels.load (and prebuild): the native ISA (AVX-512 / AVX2 paths), then portable C
ARCH_FLAGS: tuple[list[str], ...] = (["-march=native"], [])


def prebuild() -> Path | None:
    """Build the library :func:`ratchetlm.kernels.load` will load on this machine (the first of
    :data:`ARCH_FLAGS` that builds), or find it already built; its path, or None. For ``setup.py``
    (``pip install``) and ``python -m ratchetlm.kernels.build``."""
    for arch in ARCH_FLAGS:
        path = build_libraries([arch])[0]
        if path is not None:
            return path
    return None


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    path = prebuild()
    print(path if path is not None else f"no kernel library: {unavailable_reason()}")
    return 0 if path is not None else 1


if __name__ == "__main__":
    sys.exit(main())
