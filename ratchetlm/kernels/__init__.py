"""CPU kernels written in C, compiled on first use with the system C compiler and bound with ctypes.

Why not a torch C++ extension: that needs ninja and torch's C++ headers; these kernels are plain C over
raw pointers, and the fresh machines this project targets ship gcc. The first use on a machine compiles
them once for its instruction set (each source its own object, compiled in parallel on every core, then
one link: see :data:`BUILD_CPU_S` for what that costs) and logs one line before it starts and one when
it is done; later processes load the cached library from ``~/.cache/ratchetlm/kernels``. Where no
compiler is found or the build fails, :func:`load` returns None and callers keep their dense PyTorch
path (same results).

Why not at install time: the library is built for the machine that runs it (``-march=native``, and the
cache key holds this CPU's flags), while pip builds a project once wherever it installs it and keeps
the wheel in its cache for other machines and containers; a build step would also have to write into
the user's home from pip's isolated build (often another user or HOME: sudo, a Docker layer). It
would move the same compile to ``pip install``, not remove it.

The shared object links ``libgomp.so.1`` by soname; torch is imported first and has already
loaded its own ``libgomp.so.1``, so both use one OpenMP runtime and one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import resource
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch  # noqa: F401  (must be loaded before the kernel library: shared OpenMP runtime)

log = logging.getLogger(__name__)

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
# tried in order: the native ISA (AVX-512 / AVX2 paths), then portable C
_ARCH_FLAGS: tuple[list[str], ...] = (["-march=native"], [])
# CPU seconds of a whole build (every unit, gcc 12 -O3) on the developers' 2.5 GHz Xeon, by the kernel paths
# the flags select: the estimate the first-use log line gives, divided over the parallel jobs. Measured
# 2026-11-28 (docs/benchmarks.md, "Kernel build time"; a shared machine): AVX-512 35 s, AVX2 42 s at load
# 4-7 (-march=znver3 45 s at load 5-16), portable C 6 s; before the AVX2 panel kernel compiled passes
# instead of tile sizes and the few-token kernels got units of their own: AVX-512 37-49 s, AVX2 83-92 s.
# Again 2026-11-29 (idle machine, the sources after the unpacked 5-/6-bit prefill kernels and the Q6_K
# sub-scale work): AVX-512 ~64 s (35 s wall on 2 cores), AVX2 ~95 s (51 s wall; matmul_int8_vb4.c 17 s,
# matmul_int8_unpacked.c 16 s alone): over issue 41's 30 s again
BUILD_CPU_S = {"avx512": 64.0, "avx2": 95.0, "portable C": 6.0}


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


def compile_libraries(variants: list[list[str]]) -> list[ctypes.CDLL | None]:
    """Build (or reuse from the on-disk cache) the kernels once per ``arch_flags`` in ``variants`` (e.g.
    ``["-march=native"]``, ``["-mavx2", "-mfma", "-mf16c"]``, ``[]`` for portable C), every variant's units
    in one parallel pool, and load them; None for a variant without a compiler or whose build failed.
    Tests use it to check every instruction-set variant against the reference."""
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
    libs: list[ctypes.CDLL | None] = []
    for path in paths:
        if not isinstance(path, Path):
            libs.append(None)
            continue
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        libs.append(lib)
    return libs


def compile_library(arch_flags: list[str]) -> ctypes.CDLL | None:
    """:func:`compile_libraries` of one variant."""
    return compile_libraries([arch_flags])[0]


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


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library for this machine's best instruction set (cached per process), or None."""
    for arch in _ARCH_FLAGS:
        lib = compile_library(arch)
        if lib is not None:
            return lib
    return None


class Part(ctypes.Structure):
    """One run of output rows of a block weight (``part_t`` in matmul.c)."""

    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("row_bytes", ctypes.c_int64), ("rowmap", ctypes.c_void_p)]


class Q8Weight(ctypes.Structure):
    """A packed integer-mode weight and its activation bits, one pointer per call (``q8weight_t`` in
    matmul_int8.c): the batch-1 decode of a small model makes ~120 such calls a token."""

    _fields_ = [("K", ctypes.c_int32), ("bits", ctypes.c_int32), ("zw", ctypes.c_int32), ("N", ctypes.c_int32),
                ("panels", ctypes.c_void_p), ("Q", ctypes.c_void_p), ("SM", ctypes.c_void_p)]


_P, _F, _I = ctypes.c_void_p, ctypes.c_float, ctypes.c_int32


class ChainLayer(ctypes.Structure):
    """One decoder layer's constants for ``ratchet_chain`` (``chain_layer_t`` in chain.c)."""

    _fields_ = [("w_in", _P), ("w_post", _P), ("qkv", _P), ("o", _P), ("gu", _P), ("down", _P), ("qkv_bias", _P),
                ("q_norm", _P), ("k_norm", _P), ("q_eps", _F), ("k_eps", _F), ("scale", _F), ("softcap", _F),
                ("kc", _P), ("vc", _P)]


class ChainBuffers(ctypes.Structure):
    """The model's shape and the chain's preallocated buffers (``chain_bufs_t`` in chain.c)."""

    _fields_ = [("nh", _I), ("nkv", _I), ("hd", _I), ("dim", _I), ("ni", _I), ("lanes", _I), ("max_rows", _I),
                ("qk_norm", _I), ("eps", _F), ("xs", _P * 2), ("hn", _P), ("qkv", _P), ("qb", _P), ("k_all", _P),
                ("v_all", _P), ("attn", _P), ("o", _P), ("down", _P), ("qsrc", _P), ("ksrc", _P), ("qn", _P),
                ("kn", _P), ("gu", _P)]


class ChainStep(ctypes.Structure):
    """One forward's arguments to ``ratchet_chain`` (``chain_step_t`` in chain.c)."""

    _fields_ = [("x", _P), ("cos", _P), ("sin", _P), ("slots", _P), ("meta", _P), ("mask", _P), ("t", _I),
                ("rd", _I), ("max_ctx", _I), ("max_new", _I), ("B", _I), ("kv_half", _I), ("num_layers", _I),
                ("threads", _I)]


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.ratchet_kernel_isa.restype = ctypes.c_char_p
    lib.ratchet_num_types.restype = i
    lib.ratchet_type_name.restype = ctypes.c_char_p
    lib.ratchet_type_name.argtypes = [i]
    for f in (lib.ratchet_type_ggml_id, lib.ratchet_type_blck, lib.ratchet_type_bytes):
        f.argtypes, f.restype = [i], i
    lib.ratchet_to_float.argtypes = [i, p, p, i64]
    lib.ratchet_to_float.restype = None
    lib.ratchet_mm.argtypes = [p, i, i, p, i, p, i, i]
    lib.ratchet_mm.restype = None
    lib.ratchet_get_rows.argtypes = [p, i, p, i, p, i]
    lib.ratchet_get_rows.restype = None
    lib.ratchet_dequant_rows.argtypes = [p, i, i, i, i, p, i]
    lib.ratchet_dequant_rows.restype = None
    lib.ratchet_int8_isa.restype = ctypes.c_char_p
    lib.ratchet_type_has_q8.argtypes, lib.ratchet_type_has_q8.restype = [i], i
    lib.ratchet_to_q8w.argtypes = [i, p, p, p, p, p, p, i64]
    lib.ratchet_to_q8w.restype = None
    lib.ratchet_quantize_q8.argtypes = [p, i, i, i, p, p, p, p]
    lib.ratchet_quantize_q8.restype = None
    lib.ratchet_q8_plan.argtypes = [p, i, i, p, p, i]
    lib.ratchet_q8_plan.restype = None
    lib.ratchet_pack_q8.argtypes = [p, i, i, p, p, p, i]
    lib.ratchet_pack_q8.restype = None
    lib.ratchet_mm_q8w.argtypes = [p, i, p, p, i]
    lib.ratchet_mm_q8w.restype = None
    fl = ctypes.c_float
    lib.ratchet_attention.argtypes = [p, p, p, p, p, p, i, p, i, p, i, i, i, i, fl, fl, i, p, i]
    lib.ratchet_attention.restype = None
    lib.ratchet_rms_norm.argtypes = [p, p, p, p, i64, i64, fl, i, p, i]
    lib.ratchet_rms_norm.restype = None
    lib.ratchet_rope.argtypes = [p, i64, i64, i64, i64, p, p, i64, p]
    lib.ratchet_rope.restype = None
    lib.ratchet_argmax_rows.argtypes = [p, i64, i64, i64, p]
    lib.ratchet_argmax_rows.restype = None
    lib.ratchet_silu_mul.argtypes = [p, i64, i64, p, i]
    lib.ratchet_silu_mul.restype = None
    lib.ratchet_chain.argtypes = [p, p, p]
    lib.ratchet_chain.restype = i


def isa() -> str | None:
    """Instruction set the kernels were compiled for ('avx512', 'avx2', 'scalar'), None if unavailable."""
    lib = load()
    return None if lib is None else lib.ratchet_kernel_isa().decode()


def int8_isa() -> str | None:
    """Integer dot product the int8 mode uses ('avx512vnni', 'avx2', 'scalar'), None if unavailable."""
    lib = load()
    return None if lib is None else lib.ratchet_int8_isa().decode()
