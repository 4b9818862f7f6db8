"""CPU kernels written in C, compiled on first use with the system C compiler and bound with ctypes.

Why not a torch C++ extension: that needs ninja and torch's C++ headers (minutes of compile on a
2-core machine); these kernels are plain C over raw pointers, compile in about a second, and the
fresh machines this project targets ship gcc. Where no compiler is found or the build fails,
:func:`load` returns None and callers keep their dense PyTorch path (same results).

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
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (must be loaded before the kernel library: shared OpenMP runtime)

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("dequant.c", "matmul.c", "matmul_int8.c", "attention.c",
                                                           "norm_rope.c", "argmax.c", "chain.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("ggml_types.h", "units_avx512.h", "units_avx2.h", "silu.h",
                                                           "attention_avx2.h"))
# -ffp-contract=off: dequantization must round exactly like gguf-py's numpy code (no fused d * q + m).
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
# tried in order: the native ISA (AVX-512 / AVX2 paths), then portable C
_ARCH_FLAGS: tuple[list[str], ...] = (["-march=native"], [])


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


def _build(cc: str, flags: list[str], out: Path) -> bool:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as e:  # read-only or missing home: the caller tries the next directory
        log.warning("cannot write kernel cache in %s: %s", out.parent, e)
        return False
    os.close(fd)
    proc = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        log.warning("kernel build failed (%s): %s", " ".join(flags), proc.stderr.strip()[-500:])
        return False
    os.replace(tmp, out)  # atomic: concurrent processes never load a half-written library
    return True


def compile_library(arch_flags: list[str]) -> ctypes.CDLL | None:
    """Build (or reuse from the on-disk cache) the kernels with ``arch_flags`` (e.g. ``["-march=native"]``,
    ``["-mavx2", "-mfma"]``, ``[]`` for portable C) and load them; None if there is no compiler or the
    build fails. Tests use it to check every instruction-set variant against the reference."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: GGUF block kernels disabled, using dense matmuls")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError as e:  # found on PATH but cannot run
        log.warning("cannot run the C compiler %s (%s): GGUF block kernels disabled, using dense matmuls", cc, e)
        return None
    flags = _FLAGS + arch_flags
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + " ".join(flags).encode() + version.encode() + platform.machine().encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    fallback = Path(tempfile.gettempdir()) / f"ratchetlm-kernels-{getattr(os, 'getuid', lambda: 0)()}"
    for folder in (cache_dir(), fallback):
        path = folder / f"ratchet_kernels-{key}.so"
        if path.exists() or _build(cc, flags, path):
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            return lib
    return None


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
