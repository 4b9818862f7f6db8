"""The single write point: every forward of every cache layout writes through one :class:`StepSink`.

A forward hands the sink, once per layer and after that layer's reads, its new rows by pool
(kv/pools.py): ``sink.write(layer, k=k, v=v)`` for the llama family's paged K/V,
``sink.write(layer, ori=kv, csa_state=..., csa_cmp=..., ...)`` for DeepSeek-V4's pools. Every token
row of the forward has, per slot group, the slot of its position; ``-1`` = compute but do not
write. Rows are written now (direct: prefill, plain decode, draft-cache catch-up) or staged
(kv/staging.py: draft trees, verify chains, WeDLM windows) and written only if a commit names them,
so nothing rejected ever lands in the persistent cache. The model never indexes a pool to write.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Protocol

import torch

from ratchetlm.kv.pools import Pools
from ratchetlm.kv.staging import StagingBuffer, run_start


class KVSink(Protocol):
    """Where a forward's new rows go. Called once per layer per forward, in layer order — or, by a
    forward that reads its own new rows from itself (the decode chain), once for all layers after
    them (``write_layers``)."""

    def write(self, layer: Hashable, **rows: torch.Tensor) -> None: ...

    def write_layers(self, **rows: torch.Tensor) -> None: ...


class StepSink:
    """The write point of one forward, for every cache layout: per slot group, direct rows go to
    their slots now, staged rows to the staging buffer, ``-1`` rows nowhere."""

    def __init__(
        self,
        pools: Pools,
        slots: torch.Tensor | Mapping[str, torch.Tensor],  # [num_tokens] int64 (every group), or per group
        staging: StagingBuffer | None = None,
        stage_index: torch.Tensor | None = None,  # [num_tokens] int64, -1 = written directly
    ) -> None:
        self.pools = pools
        by_group = {g: slots for g in pools.groups} if isinstance(slots, torch.Tensor) else dict(slots)
        stage = None if stage_index is None or staging is None else stage_index.tolist()
        staged = stage is not None and any(x >= 0 for x in stage)
        self.staging = staging if staged else None
        # rows written directly and their slots, per group (None: no row): fixed for the forward, found once,
        # not per layer, from lists (a decode step's few rows: list reads, not a handful of small tensor ops);
        # rows (a source's, a pool's) that run consecutively are a slice: a strided copy, no index_copy_
        self._direct: dict[str, tuple[slice | torch.Tensor | None, slice | torch.Tensor] | None] = {}
        for group, s in by_group.items():
            sl = s.tolist()
            rows = [i for i, x in enumerate(sl) if x >= 0 and not (staged and stage[i] >= 0)]  # type: ignore[index]
            src = None if len(rows) == len(sl) else _selection(rows, s.device) if rows else None
            self._direct[group] = (src, _selection([sl[i] for i in rows], s.device)) if rows else None
        if self.staging is not None:
            assert stage_index is not None
            self.staging.begin(stage_index, by_group)

    def write(self, layer: Hashable, **rows: torch.Tensor) -> None:
        """This layer's new rows by pool, ``[num_tokens, *row_shape]`` each (``k=..., v=...``)."""
        group = self.pools.group
        for pool, values in rows.items():
            direct = self._direct[group[pool]]
            if direct is not None:
                src, slots = direct
                picked = values if src is None else values[src] if isinstance(src, slice) else \
                    values.index_select(0, src)
                self.pools.write(pool, layer, picked, slots)
        if self.staging is not None:
            self.staging.stage(layer, rows)

    def write_layers(self, **rows: torch.Tensor) -> None:
        """Layers ``0 .. n - 1`` at once: ``rows[pool]`` is ``[n, num_tokens, *row_shape]`` (pools whose
        layers are numbered from 0). One copy per pool instead of one per pool and layer: at one new
        token the per-layer calls cost more than the copies."""
        group = self.pools.group
        for pool, values in rows.items():
            assert self.pools.layer_index(pool, values.shape[0] - 1) == values.shape[0] - 1, pool
            direct = self._direct[group[pool]]
            if direct is not None:
                src, slots = direct
                picked = values if src is None else values[:, src] if isinstance(src, slice) else \
                    values.index_select(1, src)
                self.pools.copy_rows(pool, picked, slots)
        if self.staging is not None:
            self.staging.stage_layers(rows)


def _selection(idx: list[int], device: torch.device) -> slice | torch.Tensor:
    """Indices ``idx`` (non-empty) as a slice where they run consecutively, else ``[n]`` int64."""
    start = run_start(idx)
    return slice(start, start + len(idx)) if start is not None else torch.tensor(idx, dtype=torch.long, device=device)


class DirectSink(StepSink):
    """Writes straight into the persistent pools by slot mapping (prefill, draft caches)."""

    def __init__(self, pools: Pools, slots: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        super().__init__(pools, slots)


class NullSink:
    """Computes without writing anything (pure scoring / reference runs: no cache at all)."""

    def write(self, layer: Hashable, **rows: torch.Tensor) -> None:
        return None

    def write_layers(self, **rows: torch.Tensor) -> None:
        return None
