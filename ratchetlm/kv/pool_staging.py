"""The single write point for caches made of named row pools, with no-write-on-reject staging.

A model whose cache is not per-token K/V (DeepSeek-V4: a sliding ring, compressed entries,
indexer keys, compressor state rows) still writes each forward's new rows through one sink,
with the contract of :mod:`ratchetlm.kv.cache`: every row a layer produces has, per pool, one
slot given by the step's lowering (``-1`` = compute but do not write). A row is written at the
end of its layer, after every read of that layer (so an in-step token never overwrites a row
another in-step token still reads; in-step rows are read from the forward itself).

Rows of a verifying step are *staged* instead (``stage_index >= 0``): copied into a buffer
indexed by token row, with the destination slot of every pool remembered, and only the rows the
commit names are copied into the pools — all pools and layers at once, all-or-nothing (targets
snapshotted first, restored on failure, :class:`StagingCommitError`). Rejected rows leave no
trace: the pools hold exactly what plain decoding would have written.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from ratchetlm.kv.staging import StagingCommitError, StagingMetrics, has_real_storage

PoolKey = tuple[str, Hashable]  # (pool name, layer key)


class RowPools:
    """Named pools of flat rows: ``tensors[(pool, layer)]`` is ``[num_rows, width]``."""

    def __init__(self) -> None:
        self.tensors: dict[PoolKey, torch.Tensor] = {}
        self.bytes_written = 0  # bytes scattered into persistent rows (direct writes and commits)

    def add(self, pool: str, layer: Hashable, rows: int, width: int, dtype: torch.dtype,
            device: torch.device | str) -> None:
        self.tensors[(pool, layer)] = torch.zeros(rows, width, dtype=dtype, device=device)

    def get(self, pool: str, layer: Hashable) -> torch.Tensor:
        return self.tensors[(pool, layer)]

    def write(self, key: PoolKey, values: torch.Tensor, slots: torch.Tensor) -> None:
        """values: ``[n, width]``; slots: ``[n]`` all >= 0."""
        if slots.numel():
            t = self.tensors[key]
            t.index_copy_(0, slots, values.to(t.dtype))
            self.bytes_written += values.shape[0] * t.shape[1] * t.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class PoolStaging:
    """Staged rows of one forward, per ``(pool, layer)``, indexed by token row. ``capacity``: most
    token rows one forward may stage (the runner leaves proposals past it unstaged: the overflow
    fallback of kv/staging.py). The other fallbacks mirror it too: a forward whose staging raised
    or saw no real storage is abandoned (``usable`` False) and its commit refused."""

    def __init__(self, pools: RowPools, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1, got {capacity}")
        self.pools = pools
        self.capacity = capacity
        self.max_tokens = 0  # rows of the per-(pool, layer) buffers allocated so far (<= capacity)
        self.buffers: dict[PoolKey, torch.Tensor] = {}
        self.dest: dict[str, torch.Tensor] = {}  # pool -> [max_tokens] destination slot of each stage row
        self.staged: set[PoolKey] = set()  # keys written this forward
        self.metrics = StagingMetrics()
        self.fault_after: int | None = None  # test hook: fail the commit after this many (pool, layer) writes
        self.fault_stage_pool: str | None = None  # test hook: make staging raise for this pool
        self.usable = False

    def begin(self, stage_index: torch.Tensor, slots: Mapping[str, torch.Tensor]) -> None:
        """A forward whose token ``t`` stages at row ``stage_index[t]`` (-1 = not staged); its
        rows of pool ``p``, once committed, go to ``slots[p][t]`` (-1 = nowhere)."""
        keep = stage_index >= 0
        idx = stage_index[keep]
        n = int(idx.max()) + 1 if idx.numel() else 0
        assert n <= self.capacity, (n, self.capacity)
        if n > self.max_tokens:
            self.max_tokens = min(self.capacity, max(n, 2 * self.max_tokens, 64))
            self.buffers.clear()
        self.staged.clear()
        self.usable = True
        for pool, s in slots.items():
            d = torch.full((self.max_tokens,), -1, dtype=torch.long, device=s.device)
            d[idx] = s[keep]
            self.dest[pool] = d
        self.metrics.unique_tokens += int(idx.numel())

    def _abandon(self, cause: str) -> None:
        """Give up staging for the rest of this forward (counted once per forward)."""
        if self.usable:
            setattr(self.metrics, "fallback_" + cause, getattr(self.metrics, "fallback_" + cause) + 1)
        self.usable = False

    def stage(self, key: PoolKey, values: torch.Tensor, stage_index: torch.Tensor) -> None:
        """values: ``[N, width]`` rows of the forward's tokens; stage_index: ``[N]``."""
        if not self.usable:
            return
        if not has_real_storage(values):
            self._abandon("fake_tensor")
            return
        keep = stage_index >= 0
        if not bool(keep.any()):
            return
        try:
            if self.fault_stage_pool == key[0]:
                raise RuntimeError(f"injected staging fault at {key}")
            buf = self.buffers.get(key)
            if buf is None:
                pool = self.pools.tensors[key]
                buf = self.buffers[key] = torch.zeros(self.max_tokens, pool.shape[1], dtype=pool.dtype,
                                                      device=pool.device)
            buf.index_copy_(0, stage_index[keep], values[keep].to(buf.dtype))
        except Exception:  # any staging failure: the plain path recomputes these tokens
            self._abandon("stage_fail")
            return
        self.staged.add(key)
        self.metrics.stage_operations += int(keep.sum())

    def commit(self, rows: torch.Tensor) -> None:
        """Copy stage ``rows`` ([n]) into their destination slots in every pool and layer,
        all-or-nothing. Raises :class:`StagingCommitError` with the pools unchanged."""
        if not self.usable:
            raise StagingCommitError("this forward's staging was abandoned (a fallback was counted)")
        if rows.numel() == 0:
            return
        try:
            if int(rows.min()) < 0 or int(rows.max()) >= self.max_tokens:
                raise StagingCommitError("staging commit with an out-of-range row")
            self._write_all(rows)
        except StagingCommitError:
            self.metrics.fallback_commit_fail += 1
            raise
        self.metrics.commit_calls += 1
        self.metrics.tokens_committed += int(rows.numel())

    def reject(self, rows: torch.Tensor) -> None:
        """Stage ``rows`` of a successfully committed proposal were discarded."""
        self.metrics.tokens_rejected += int(rows.numel())
        self.metrics.bytes_avoided += sum(int((self.dest[key[0]][rows] >= 0).sum()) * buf.shape[1]
                                          * buf.element_size() for key, buf in self.buffers.items()
                                          if key in self.staged)

    def _write_all(self, rows: torch.Tensor) -> None:
        plan = []
        for key in sorted(self.staged, key=str):
            dest = self.dest[key[0]][rows]
            ok = dest >= 0
            if bool(ok.any()):
                plan.append((key, rows[ok], dest[ok]))
        snapshots = [(key, slots, self.pools.tensors[key][slots].clone()) for key, _, slots in plan]
        done = 0
        try:
            for key, src, slots in plan:
                if self.fault_after is not None and done >= self.fault_after:
                    raise StagingCommitError(f"injected fault while committing {key}")
                before = self.pools.bytes_written
                self.pools.write(key, self.buffers[key][src], slots)
                self.metrics.bytes_committed += self.pools.bytes_written - before
                done += 1
        except Exception as e:
            for key, slots, old in snapshots:  # restore, not new data
                self.pools.tensors[key].index_copy_(0, slots, old)
            raise e if isinstance(e, StagingCommitError) else StagingCommitError(str(e)) from e


class PoolSink:
    """The write point of one forward: per pool, direct rows go to their slots, staged rows to
    the staging buffer, ``-1`` rows nowhere."""

    def __init__(self, pools: RowPools, slots: Mapping[str, torch.Tensor],
                 staging: PoolStaging | None = None, stage_index: torch.Tensor | None = None) -> None:
        self.pools = pools
        self.slots = dict(slots)  # pool -> [N] int64 slot of each token row, -1 = no write
        self.staging = staging if stage_index is not None and bool((stage_index >= 0).any()) else None
        self.stage_index = stage_index
        direct = None if self.staging is None else stage_index < 0  # type: ignore[operator]
        # which rows each pool writes directly: fixed for the forward, found once, not per layer
        self._direct: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for pool, s in self.slots.items():
            ok = s >= 0 if direct is None else (s >= 0) & direct
            self._direct[pool] = (ok.nonzero().squeeze(1), s[ok])
        if self.staging is not None:
            assert stage_index is not None
            self.staging.begin(stage_index, self.slots)

    def write(self, pool: str, layer: Hashable, values: torch.Tensor) -> None:
        """values: ``[N, width]``, one row per token of the forward (flattened ``[B * S]``)."""
        rows, slots = self._direct[pool]
        if slots.numel():
            self.pools.write((pool, layer), values.index_select(0, rows), slots)
        if self.staging is not None:
            assert self.stage_index is not None
            self.staging.stage((pool, layer), values, self.stage_index)
