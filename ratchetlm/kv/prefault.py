"""The CPU KV pools' pages backed ahead of the rows in use, off the step's path.

A CPU pool is a mapping the kernel backs page by page on first write (memory/huge_pages.py), so that an
engine costs no memory for cache it never uses. But the first write into a new 2 MB huge page is a fault
that zeroes it, and may compact memory for it (``defrag=madvise`` asks for that on mappings advised
huge): ~2.5 ms a page with memory fresh from the system, ~0.3 ms once the process has freed some
(docs/benchmarks.md, *KV pages backed ahead of use*). Each layer's K and V cross into a new page every
~5,460 slots on the default model, at different slots per layer, so a fresh server's steps pay a page
every ~90 slots of new blocks, in lumps of up to hundreds of ms when several land in one step (20-420
ms steps were seen), and every stream in the batch waits. llama.cpp and vLLM clear their whole cache at
start-up instead (~1-4 s a GiB on this project's 2-core VMs).

Here a thread backs a huge page of every layer's pool ahead of the highest block ever handed out
(``BlockManager.high_water``: blocks go out in increasing order until every one has been used once;
120 MB of look-ahead on the default model), with ``MADV_POPULATE_WRITE``: the pages are backed without
being written, so the thread may run beside a forward writing the same pools. It starts only once the
blocks in use pass the first huge page of rows (below that the first writes fault what it would, and a
small engine, as in tests, never starts it), when there is work, and ends when it has caught up: no
thread outlives its work or holds a dropped engine's pools.
"""

from __future__ import annotations

import threading

import torch

from ratchetlm.memory.huge_pages import HUGE, populate

AHEAD_BYTES = HUGE  # of each layer's pool past the rows in use


class Prefault:
    """Backs rows ``[0, wanted)`` of ``pools`` (CPU tensors ``[layers, rows, ...]`` addressed by one slot
    mapping) in a thread; :meth:`ahead` raises ``wanted``."""

    def __init__(self, pools: list[torch.Tensor]) -> None:
        assert pools and all(t.device.type == "cpu" and t.shape[1] == pools[0].shape[1] for t in pools)
        self.pools = pools
        self.rows = int(pools[0].shape[1])
        row_bytes = min(t[0, 0].numel() * t.element_size() for t in pools)  # one layer's row
        self.ahead_rows = max(1, AHEAD_BYTES // row_bytes)
        self.wanted = 0  # rows asked for
        self.done = 0  # rows backed: [0, done)
        self.supported = True  # False once the system refused the advice
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def ahead(self, rows_in_use: int) -> None:
        """Rows ``[0, rows_in_use)`` may be written from now on: back them and the look-ahead (returns at
        once; a no-op while nothing new is wanted)."""
        want = min(self.rows, rows_in_use + self.ahead_rows)
        if want <= self.wanted or not self.supported or rows_in_use < self.ahead_rows:
            return  # (below a huge page of rows in use the first writes fault what a look-ahead would: an
            # engine that stays that small, as most in tests do, never starts the thread)
        with self._lock:
            self.wanted = max(self.wanted, want)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="ratchet-kv-prefault", daemon=True)
                self._worker.start()

    def wait(self) -> None:
        """Until the worker has caught up (tests, benchmarks)."""
        w = self._worker
        if w is not None:
            w.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                lo, hi = self.done, self.wanted
                if lo >= hi or not self.supported:
                    self._worker = None
                    return
            # (all() stops at the first range the system refused: then nothing more is asked)
            self.supported = all(populate(t[layer, lo:hi]) for t in self.pools for layer in range(t.shape[0]))
            self.done = hi
