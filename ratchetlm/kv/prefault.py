"""The CPU KV pools' pages backed ahead of the rows in use, off the step's path.

A CPU pool is a mapping the kernel backs page by page on first write (memory/huge_pages.py), so that an
engine costs no memory for cache it never uses. But the first write into a new 2 MB huge page is a fault
that zeroes it, and compacts memory for it when none is free (``defrag=madvise`` asks for that on
mappings advised huge): measured here 20-420 ms for the step that first reaches a new region, one such
step every ~5,000 tokens of new blocks on the default model (30 layers x K and V reach their next region
in the same step), and every stream in the batch waits for it. llama.cpp and vLLM clear their whole
cache at start-up instead (~1-4 s a GiB on this project's 2-core VMs).

Here a worker thread backs the rows just ahead of the highest block ever handed out, once that is past
the first huge page of rows,
(``BlockManager.high_water``; blocks are handed out in increasing order until every one has been used
once), a huge page of each layer's pool ahead (the regions the next blocks reach; 120 MB in all on the
default model: 30 layers x K and V), with ``MADV_POPULATE_WRITE``: the pages get backed
without being written, so the worker may run beside a forward writing the same pools. The thread is
started when there is work and ends when it has caught up (no thread outlives its work, none holds a
dropped engine's pools). The memory backed is what the engine is about to use, plus the look-ahead.
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
            for t in self.pools:
                for layer in range(t.shape[0]):
                    if not populate(t[layer, lo:hi]):
                        self.supported = False
                        break
            self.done = hi
