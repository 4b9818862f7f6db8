"""Giving memory back to the OS: the resident pages of weights that were copied into another layout,
and the free heap after a long forward.

The integer numerics modes repack each quantized weight once (layers/block_quant.py ``pack_q8``) and
never read its GGUF blocks again, but the packing touched every page of them: without this, a
process holds both the packed copy and the file's pages (peak RSS ~2x the file on a 4-bit model).
``madvise(MADV_DONTNEED)`` drops this process's mapping of those pages: they stay in the page cache
(shared, reclaimable) and a later read — an embedding row gathered from the blocks — faults them
back in from the file, with the same bytes.

Only a read-only view into a file mapping is released: on anonymous (or written) memory
``MADV_DONTNEED`` would discard the data itself, so anything else is left alone.

A forward over hundreds of rows (a prefill) allocates and frees tens of megabytes of activations;
glibc keeps much of that in its heap afterwards (each 512-token prefill of a 1B model left RSS
10-20 MB higher), so the next long forward's peak starts higher. :func:`trim_heap` hands the free
heap back (``malloc_trim``), once per long forward, where it costs little next to the forward.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

_MADV_DONTNEED = 4  # Linux
_libc: list[ctypes.CDLL] = []


def is_read_only_file_view(a: np.ndarray) -> bool:
    """Whether ``a`` is a contiguous, read-only view into a file opened by ``np.memmap(mode="r")``."""
    return (isinstance(a, np.memmap) and getattr(a, "mode", None) == "r"
            and isinstance(getattr(a, "_mmap", None), mmap.mmap)
            and not a.flags.writeable and a.flags.c_contiguous)


def _c() -> ctypes.CDLL:
    if not _libc:
        _libc.append(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True))
    return _libc[0]


def trim_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc's ``malloc_trim(0)``); False where there is
    none to call (not glibc) or nothing was released."""
    if not sys.platform.startswith("linux"):
        return False
    trim = getattr(_c(), "malloc_trim", None)
    if trim is None:  # musl
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def release_pages(a: np.ndarray) -> int:
    """Drop the resident pages lying wholly inside ``a``'s bytes; returns how many bytes were advised
    (0: not a read-only file view, not Linux, or smaller than a page)."""
    if not sys.platform.startswith("linux") or not is_read_only_file_view(a):
        return 0
    page = mmap.PAGESIZE
    start = a.ctypes.data
    lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page  # pages wholly inside
    if hi <= lo:
        return 0
    madvise = _c().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return hi - lo if madvise(lo, hi - lo, _MADV_DONTNEED) == 0 else 0
