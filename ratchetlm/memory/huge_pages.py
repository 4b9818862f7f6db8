"""Packed weights and CPU KV pools in transparent huge pages.

A decode step streams every packed weight once (116 MB a token for the default model in int16),
and with 4 KiB pages that is a TLB miss every 4 KiB and a hardware prefetcher that stops at every
page boundary. Linux backs a mapping with 2 MiB pages when asked (``madvise(MADV_HUGEPAGE)``; the
common ``transparent_hugepage=madvise`` setting gives them to no one else). numpy already asks for
its own arrays of ``NUMPY_HUGE`` (4 MiB) or more, so those stay numpy's; the smaller ones (the
default model's packed weights are 0.1-1 MB; 27 MB of them were in huge pages, 94 MB with this)
are cut from chunks of ``CHUNK`` bytes advised here (a bump allocator: a mapping of its own per
weight would round each up to a huge page). Measured on the integer matmul with cold weights, 2
threads, same process (the same bytes in 4 KiB pages vs here): 1-2 tokens 0.86-0.93x the time on the
default model's shapes, 4-16 tokens 0.92-1.00x (compute bound there).

A chunk is unmapped when the last array cut from it is gone (each array keeps its chunk's ``mmap``
alive as its base); the chunk being filled is held here too, so a dropped model can leave up to one
chunk's touched pages mapped until later arrays fill it. A huge page is resident as a whole once
touched, so each chunk can hold up to one partly used huge page (2 MiB) beyond its arrays. Where
the platform has no ``MADV_HUGEPAGE`` (or the kernel refuses it) the arrays are still valid memory,
in ordinary pages.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import threading
from typing import Any

import numpy as np
import torch

HUGE = 2 << 20  # the x86-64 / arm64 transparent huge page
CHUNK = 8 * HUGE
ALIGN = 64  # the kernels' vector loads
MIN_BYTES = 64 << 10  # smaller arrays: numpy's (not worth a place in a chunk)
NUMPY_HUGE = 4 << 20  # numpy advises huge pages for its own arrays from this size up (numpy >= 1.22 on Linux)

_lock = threading.Lock()
_chunk: tuple[mmap.mmap, int] | None = None  # the chunk being filled, its first huge-page boundary
_used = 0  # bytes of it handed out


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with room for ``nbytes`` from a huge-page boundary (returned as an offset)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(m, np.uint8, count=1).ctypes.data
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:  # e.g. transparent_hugepage=never with a strict kernel: ordinary pages
            pass
    return m, -base % HUGE


def empty(nbytes: int) -> np.ndarray:
    """``np.empty(nbytes, np.uint8)``, in huge pages where the system allows (64-byte aligned when
    cut from a chunk)."""
    global _chunk, _used
    if nbytes < MIN_BYTES or nbytes >= NUMPY_HUGE:
        return np.empty(nbytes, np.uint8)
    size = -(-nbytes // ALIGN) * ALIGN
    with _lock:
        if _chunk is None or _used + size > CHUNK:
            _chunk, _used = _mapping(CHUNK), 0
        m, start = _chunk
        out = np.frombuffer(m, np.uint8, count=nbytes, offset=start + _used)
        _used += size
        return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in huge pages (the CPU KV pools). From ``NUMPY_HUGE`` bytes up: a mapping
    of its own, which the kernel hands out zeroed and backs page by page on first touch, so that a pool
    costs nothing until rows are written (zeroing the default ~1 GiB cache took ~1 s of system CPU per
    engine, touching every page of it); smaller ones are cut from :func:`empty` and zeroed."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    if nbytes >= NUMPY_HUGE:
        m, start = _mapping(nbytes)
        return torch.frombuffer(np.frombuffer(m, np.uint8, count=nbytes, offset=start), dtype=dtype).view(shape)
    return torch.frombuffer(empty(nbytes), dtype=dtype).view(shape).zero_()


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: back a range's pages writable, as a write would, without writing
PAGE = mmap.PAGESIZE
_madvise: Any = None  # libc's madvise (ctypes releases the GIL for the call); False: none here


def populate(t: torch.Tensor) -> bool:
    """Back every page of CPU tensor ``t`` now (``MADV_POPULATE_WRITE``), leaving its contents as they are:
    what the first write into each page would cost (a huge page zeroed, maybe compacted for), paid by the
    calling thread instead. Safe beside threads writing ``t``: nothing is written. False where the system has
    no such advice (not Linux, a kernel before 5.14): nothing was done."""
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _madvise = libc.madvise
            _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _madvise = False
    if _madvise is False or not t.numel():
        return False
    start = t.data_ptr() // PAGE * PAGE  # madvise takes whole pages
    end = t.data_ptr() + t.numel() * t.element_size()
    if _madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() == errno.EINVAL:  # the kernel does not know the advice: do not ask again
            _madvise = False
        return False
    return True
