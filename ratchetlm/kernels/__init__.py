"""CPU kernels written in C, compiled with the system C compiler and bound with ctypes.

Why not a torch C++ extension: that needs ninja and torch's C++ headers; these kernels are plain C over
raw pointers, and the fresh machines this project targets ship gcc. The library is compiled for the
machine that runs it (each source its own object, compiled in parallel on every core, then one link:
:mod:`ratchetlm.kernels.build`, which says what it costs): ``pip install`` builds it into the user's
cache (``setup.py``), and where that did not happen the first use does, logging one line before it
starts and one when it is done; later processes load the cached library from
``~/.cache/ratchetlm/kernels``. Where no compiler is found or the build fails, :func:`load` returns None
and callers keep their dense PyTorch path (same results).

The shared object links ``libgomp.so.1`` by soname; torch is imported first and has already
loaded its own ``libgomp.so.1``, so both use one OpenMP runtime and one thread pool.
"""

from __future__ import annotations

import ctypes
import functools

import torch  # noqa: F401  (must be loaded before the kernel library: shared OpenMP runtime)

from ratchetlm.kernels import build
from ratchetlm.kernels.build import HEADERS, SOURCES, cache_dir, kernel_isa_for, unavailable_reason

__all__ = ["HEADERS", "SOURCES", "build", "cache_dir", "compile_libraries", "compile_library", "int8_isa", "isa",
           "kernel_isa_for", "load", "unavailable_reason"]

def compile_libraries(variants: list[list[str]]) -> list[ctypes.CDLL | None]:
    """Build (or find in the on-disk cache: :func:`build.build_libraries`) the kernels once per ``arch_flags``
    in ``variants`` (e.g. ``["-march=native"]``, ``["-mavx2", "-mfma", "-mf16c"]``, ``[]`` for portable C),
    every variant's units in one parallel pool, and load them; None for a variant without a compiler or whose
    build failed. Tests use it to check every instruction-set variant against the reference."""
    libs: list[ctypes.CDLL | None] = []
    for path in build.build_libraries(variants):
        lib = None if path is None else ctypes.CDLL(str(path))
        if lib is not None:
            _declare(lib)
        libs.append(lib)
    return libs


def compile_library(arch_flags: list[str]) -> ctypes.CDLL | None:
    """:func:`compile_libraries` of one variant."""
    return compile_libraries([arch_flags])[0]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library for this machine's best instruction set (cached per process), or None."""
    for arch in build.ARCH_FLAGS:
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
    lib.ratchet_topk_rows.argtypes = [p, p, i64, i64, i64, i, p]
    lib.ratchet_topk_rows.restype = i
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
