"""The single write point of every forward, and no-write-on-reject staging behind it.

:class:`StepSink` is the one sink every cache layout writes through (kv/pools.py: llama's K/V,
DeepSeek-V4's seven pools). A forward hands it, once per layer, that layer's new rows by pool:
``sink.write(layer, k=k, v=v)`` / ``sink.write(layer, ori=kv, csa_cmp=entries, ...)``. Every token
row of the forward has, per slot group, the slot of its position (``-1`` = compute but do not
write); it is written there now (direct rows: prefill, plain decode) or *staged* (``stage_index
>= 0``: draft trees, verify chains, WeDLM windows) and written there only if a commit names it.

One :class:`StagingBuffer` per layout: per pool ``[num_layers(p), rows, *row_shape]``, indexed by
*explicit token index* (one index per staged token of the step, the same for every layer and
pool — slots are per token, not per layer), with each staged row's destination slot per group.
Attention in the same forward reads new rows from the forward itself, so staging never makes
verification read stale cache rows. :meth:`StagingBuffer.commit` copies the accepted rows — any
subset, in any order — into every pool and layer, all-or-nothing.

Fallbacks (the design's "when in doubt, fall back to the plain path"). A forward whose staging is
unusable computes its tentative rows without writing them anywhere; the strategy's commit still
decides the tokens, the engine keeps them but commits no K/V, and the next step's direct-write
catch-up recomputes exactly the committed tokens' K/V (identical output, one extra forward;
nothing rejected ever reaches the cache). Causes, each counted once per forward:

* ``overflow`` — the step's staged rows exceed ``capacity`` (the buffer grows up to it, never
  past it): the proposals that do not fit are not staged (:meth:`ModelRunner.execute`);
* ``stage_fail`` — staging raised (``fault_stage_layer`` / ``fault_stage_pool`` inject it, for
  tests): staging is abandoned for the rest of the forward;
* ``fake_tensor`` — K/V without real storage (meta / fake tensors of tracing);
* ``commit_fail`` — the all-or-nothing commit failed (``fault_layer`` injects it in pool
  ``fault_pool``, default the first one copied, after its layers before it were written, for
  tests): the snapshot of the target rows is restored and :class:`StagingCommitError` raised
  with the cache unchanged.

Metrics follow the NWOR design: ``stage_operations`` counts layer × token rows staged,
``unique_tokens`` counts each staged token once per forward whose staging succeeded (the two
differ by the layer count — conflating them was the design's "4× inflation" bug), so that every
unique token is eventually committed or rejected unless its commit fails; committed / rejected
count staged rows after a successful commit; ``bytes_avoided`` is the K/V that writing every tentative row
would have written on top (the rejected rows, all layers of every pool that has a slot for them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass

import torch

from ratchetlm.kv.pools import Pools

FALLBACK_CAUSES = ("fake_tensor", "overflow", "stage_fail", "commit_fail")


class StagingCommitError(RuntimeError):
    """A staged commit could not be completed; the persistent cache was left untouched."""


@dataclass
class StagingMetrics:
    stage_operations: int = 0  # layer × token rows written into the staging buffer
    unique_tokens: int = 0  # distinct token rows staged (once per forward, not per layer; not if abandoned)
    tokens_committed: int = 0  # staged rows copied into the cache
    tokens_rejected: int = 0  # staged rows discarded by a successful commit
    commit_calls: int = 0
    bytes_committed: int = 0  # K+V bytes copied from staging into persistent slots
    bytes_avoided: int = 0  # K+V bytes of rejected rows: what writing every tentative row would add
    fallback_fake_tensor: int = 0  # forwards whose K/V had no real storage (meta/fake)
    fallback_overflow: int = 0  # forwards with proposals left unstaged because the buffer was full
    fallback_stage_fail: int = 0  # forwards whose staging raised
    fallback_commit_fail: int = 0  # commits that failed and were rolled back

    @property
    def fallback_count(self) -> int:
        return sum(getattr(self, "fallback_" + c) for c in FALLBACK_CAUSES)

    @property
    def acceptance_rate(self) -> float:
        """Committed / (committed + rejected) staged rows."""
        total = self.tokens_committed + self.tokens_rejected
        return self.tokens_committed / total if total else 0.0

    @property
    def staging_efficiency(self) -> float:
        """Unique tokens per stage operation (the design's definition: 1 / num_layers when every
        layer stages every token once; lower means duplicated staging)."""
        return self.unique_tokens / self.stage_operations if self.stage_operations else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f"kv_staging_{k}": v for k, v in asdict(self).items()}
        out["kv_staging_acceptance_rate"] = self.acceptance_rate
        out["kv_staging_efficiency"] = self.staging_efficiency
        out["kv_staging_fallbacks"] = self.fallback_count
        return out


def has_real_storage(t: torch.Tensor) -> bool:
    """False for meta / fake tensors (tracing, compile warm-up): those must never be committed."""
    if not isinstance(t, torch.Tensor) or t.is_meta or type(t).__name__ == "FakeTensor":
        return False
    try:
        t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def run_start(idx: list[int]) -> int | None:
    """``idx[0]`` where ``idx`` counts up by one from it (the rows are a slice), else None (or empty)."""
    if idx and idx[-1] - idx[0] == len(idx) - 1 and idx == list(range(idx[0], idx[-1] + 1)):
        return idx[0]
    return None


SLICE_RUNS = 2  # a commit's rows copied as at most this many slices (else one gathered index_copy_)


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` of the maximal runs in which both ``src`` and ``dst`` advance
    by one: a chain's accepted rows, staged at consecutive rows for consecutive positions, are one run
    (two where the positions cross into a block that does not follow the last)."""
    out: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst, strict=True):
        if out and a == out[-1][0] + out[-1][2] and b == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((a, b, 1))
    return out


class StagingBuffer:
    """``capacity``: most token rows one forward may stage; the buffer is allocated on demand
    and grows up to it, never past it (a step needing more falls back for what does not fit).

    What a forward stages where (its rows, their destination slots, which rows are staged) is kept
    in Python lists, read once from the forward's tensors: a commit's checks and lookups are then
    list reads, not a dozen small tensor operations (~5-20 us each on a CPU), and a commit whose rows
    run consecutively in both the buffer and the pool (a chain's, mostly) copies slices."""

    def __init__(self, pools: Pools, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1, got {capacity}")
        self.pools = pools
        self.capacity = capacity
        self.max_tokens = 0  # rows allocated so far (<= capacity)
        self.buffers: dict[str, torch.Tensor] = {}  # pool -> [num_layers(p), max_tokens, *row_shape]
        self.dest: dict[str, list[int]] = {}  # group -> [max_tokens] slot of each stage row, -1 = none
        self.staged_pools: list[str] = []  # pools written this forward, in first-write order
        self.metrics = StagingMetrics()
        self.fault_layer: int | None = None  # test hook: the commit fails in pool fault_pool at this layer
        self.fault_pool: str | None = None  # (None: the first pool it copies)
        self.fault_stage_layer: Hashable | None = None  # test hook: staging raises at this layer ...
        self.fault_stage_pool: str | None = None  # ... or for this pool
        self.device = next(iter(pools.stacked.values())).device
        self._staged: range | set[int] = range(0)  # rows staged this forward (once marked)
        self._marked = False  # this forward's rows are in _staged
        self.usable = False  # this forward's staged rows may be committed
        self._select(torch.empty(0, dtype=torch.long, device=self.device))

    def reserve(self, n: int) -> None:
        """Make room for ``n <= capacity`` rows (pool buffers are allocated at their first stage)."""
        assert n <= self.capacity, (n, self.capacity)
        if n > self.max_tokens:
            self.max_tokens = min(self.capacity, max(n, 2 * self.max_tokens, 64))
            self.buffers.clear()

    def begin(self, stage_index: torch.Tensor, slots: Mapping[str, torch.Tensor]) -> None:
        """Start a forward whose token ``t`` stages at row ``stage_index[t]`` (-1 = not staged) and,
        once committed, goes to slot ``slots[group][t]`` of the group's pools (-1 = nowhere)."""
        self._select(stage_index)
        self.reserve(max(self._rows) + 1 if self._rows else 0)
        self._staged = range(0)
        self._marked = False
        self.staged_pools = []
        self.usable = True
        for group, s in slots.items():
            d = [-1] * self.max_tokens
            kept = s.tolist() if self._keep_all else [x for x, k in zip(s.tolist(), self._kept, strict=True) if k]
            for row, slot in zip(self._rows, kept, strict=True):
                d[row] = slot
            self.dest[group] = d

    def _select(self, stage_index: torch.Tensor) -> None:
        """Which rows stage where: fixed for a whole forward, so found once, not per layer."""
        si = stage_index.tolist()
        self._kept = [x >= 0 for x in si]
        self._keep_all = all(self._kept)
        self._rows: list[int] = si if self._keep_all else [x for x in si if x >= 0]  # stage row of each staged token
        # staged at consecutive rows (a step's proposals are): a slice copy, converting as it goes, in
        # place of a converted copy and an index_copy_ (~0.05 ms a forward of the default model)
        self._span = run_start(self._rows)
        # the tensors the general case indexes with, made only for it
        self._keep = None if self._keep_all else torch.tensor(self._kept, dtype=torch.bool, device=stage_index.device)
        self._idx = None if self._span is not None else torch.tensor(self._rows, dtype=torch.long, device=self.device)

    def _abandon(self, cause: str) -> None:
        """Give up staging for the rest of this forward (counted once per forward). Rows already
        staged in earlier layers leave ``unique_tokens``: they will never be committed or rejected."""
        if self.usable:
            setattr(self.metrics, "fallback_" + cause, getattr(self.metrics, "fallback_" + cause) + 1)
            if self._marked:
                self.metrics.unique_tokens -= len(self._rows)
        self.usable = False

    def _buffer(self, pool: str) -> torch.Tensor:
        buf = self.buffers.get(pool)
        if buf is None:
            t = self.pools.stacked[pool]
            buf = self.buffers[pool] = torch.zeros((t.shape[0], self.max_tokens, *t.shape[2:]), dtype=t.dtype,
                                                   device=t.device)
        return buf

    def stage(self, layer: Hashable, rows: Mapping[str, torch.Tensor]) -> None:
        """Store this layer's rows (``rows[pool]``: ``[num_tokens, *row_shape]``) at the forward's
        explicit indices (any order)."""
        self._stage({pool: v.unsqueeze(0) for pool, v in rows.items()},
                    lambda pool: self.pools.layer_index(pool, layer), self.fault_stage_layer == layer)

    def stage_layers(self, rows: Mapping[str, torch.Tensor]) -> None:
        """:meth:`stage` for layers ``0 .. n - 1`` at once (``rows[pool]``: ``[n, num_tokens, *row_shape]``)."""
        n, f = max((v.shape[0] for v in rows.values()), default=0), self.fault_stage_layer
        self._stage(rows, lambda pool: 0, isinstance(f, int) and 0 <= f < n)

    def _stage(self, rows: Mapping[str, torch.Tensor], first: Callable[[str], int], fault: bool) -> None:
        """``rows[pool]``: ``[n, num_tokens, *row_shape]`` for the pool's layers ``first(pool) ..``
        ``+ n - 1``; ``fault``: the test hook names one of them."""
        if not self.usable:
            return
        if not all(has_real_storage(v) for v in rows.values()):
            self._abandon("fake_tensor")
            return
        count = len(self._rows)
        if count == 0:
            return
        n = 0
        try:
            if fault or self.fault_stage_pool in rows:
                raise RuntimeError("injected staging fault")
            for pool, values in rows.items():
                n, i = values.shape[0], first(pool)
                buf = self._buffer(pool)
                if not self._keep_all:
                    values = values[:, self._keep]
                if self._span is not None:
                    buf[i : i + n, self._span : self._span + count].copy_(values)
                else:
                    assert self._idx is not None
                    buf[i : i + n].index_copy_(1, self._idx, values.to(buf.dtype))
                if pool not in self.staged_pools:
                    self.staged_pools.append(pool)
        except Exception:  # any staging failure: the plain path recomputes these tokens
            self._abandon("stage_fail")
            return
        self._mark(n)

    def _mark(self, layers: int) -> None:
        """This forward's rows are staged (``layers`` more layers of them)."""
        count = len(self._rows)
        if not self._marked:  # counted when staged (not at begin), withdrawn if staging is then abandoned
            self._staged = range(self._span, self._span + count) if self._span is not None else set(self._rows)
            self._marked = True
            self.metrics.unique_tokens += count
        self.metrics.stage_operations += layers * count

    def commit(self, rows: torch.Tensor | list[int]) -> None:
        """Copy staged ``rows`` ([n] buffer indices) to their destination slots in every pool and
        layer, all-or-nothing. Raises :class:`StagingCommitError` with the pools unchanged."""
        if isinstance(rows, torch.Tensor):
            assert rows.dim() == 1
            rows = rows.tolist()
        if not self.usable:
            raise StagingCommitError("this forward's staging was abandoned (a fallback was counted)")
        if not rows:
            return
        try:
            if min(rows) < 0 or max(rows) >= self.max_tokens:
                raise StagingCommitError("staging commit with an out-of-range row")
            staged = self._staged
            if not all(r in staged for r in rows):
                raise StagingCommitError("staging commit of a row that was not staged this forward")
            plan = []
            found: dict[str, tuple[list[int], list[int]] | None] = {}  # group -> rows, their slots
            for pool in self.staged_pools:  # (pools of one group share their rows' slots: looked up once)
                group = self.pools.group[pool]
                if group not in found:
                    dest = self.dest[group]
                    kept = [r for r in rows if dest[r] >= 0]
                    found[group] = (kept, [dest[r] for r in kept]) if kept else None
                got = found[group]
                if got is not None:
                    if max(got[1]) >= self.pools.stacked[pool].shape[1]:
                        raise StagingCommitError(f"staging commit to an out-of-range slot of {pool}")
                    plan.append((pool, got[0], got[1]))
            written = self._write_all(plan)
        except StagingCommitError:
            self.metrics.fallback_commit_fail += 1
            raise
        self.metrics.bytes_committed += written
        self.metrics.commit_calls += 1
        self.metrics.tokens_committed += len(rows)

    def try_commit(self, rows: torch.Tensor | list[int]) -> bool:
        """:meth:`commit`; False instead of :class:`StagingCommitError`."""
        try:
            self.commit(rows)
        except StagingCommitError:
            return False
        return True

    def reject(self, rows: torch.Tensor | list[int]) -> None:
        """Stage ``rows`` ([n]) of a successfully committed proposal were discarded."""
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        self.metrics.tokens_rejected += len(rows)
        if rows:
            written: dict[str, int] = {}  # group -> rows with a slot (looked up once per group)
            for p in self.staged_pools:
                g = self.pools.group[p]
                if g not in written:
                    dest = self.dest[g]
                    written[g] = sum(dest[r] >= 0 for r in rows)
                self.metrics.bytes_avoided += written[g] * self.pools.row_bytes(p)

    def _write_all(self, plan: list[tuple[str, list[int], list[int]]]) -> int:
        """Copy every pool's rows (all its layers at once); returns the bytes written. Rows that run
        consecutively in the buffer and the pool go as slices (:func:`runs`), others gathered."""
        stacked = self.pools.stacked
        moves: list[tuple[str, list[tuple[slice | torch.Tensor, slice | torch.Tensor]]]] = []  # pool, (src, dst)
        # the pools of a group get the same two lists (commit's plan): their selections are made once
        made: dict[tuple[int, int], list[tuple[slice | torch.Tensor, slice | torch.Tensor]]] = {}
        for pool, src, slots in plan:
            key = (id(src), id(slots))
            parts = made.get(key)
            if parts is None:
                rs = runs(src, slots)
                parts = made[key] = [(slice(a, a + n), slice(b, b + n)) for a, b, n in rs] \
                    if len(rs) <= SLICE_RUNS else [(torch.tensor(src, dtype=torch.long, device=self.device),
                                                    torch.tensor(slots, dtype=torch.long, device=self.device))]
            moves.append((pool, parts))
        fault = None if self.fault_layer is None else (self.fault_pool or (plan[0][0] if plan else None))
        # for rollback: the target rows as they were, of every pool but the last one copied: a later pool's
        # failure must undo the earlier ones, while the last one's own copies, checked above (slots in range,
        # the same shapes), either raise before writing or complete. The test hook writes part of a pool and
        # then raises: the pool it hits is kept too. (A snapshot costs a clone per pool, and the first read
        # of rows never written yet, ~0.1 ms a commit on one core.)
        last = moves[-1][0] if moves else None
        snapshots = [(pool, dst, stacked[pool][:, dst].clone() if isinstance(dst, slice) else stacked[pool][:, dst])
                     for pool, parts in moves if pool != last or pool == fault for _, dst in parts]
        before = self.pools.bytes_written
        try:
            for pool, parts in moves:
                buf = self.buffers[pool]
                upto = self.fault_layer if pool == fault else buf.shape[0]  # the hook stops after [0, fault_layer)
                assert upto is not None
                for src_sel, dst_sel in parts:
                    self.pools.copy_rows(pool, buf[:upto, src_sel], dst_sel)
                if upto < buf.shape[0]:
                    raise StagingCommitError(f"injected fault while committing {pool} layer {upto}")
        except Exception as e:
            for pool, dst, old in snapshots:  # restore, bypassing the write counter: not new data
                if isinstance(dst, slice):
                    stacked[pool][:, dst].copy_(old)
                else:
                    stacked[pool].index_copy_(1, dst, old)
            raise e if isinstance(e, StagingCommitError) else StagingCommitError(str(e)) from e
        return self.pools.bytes_written - before


def commit_proposal(staging: StagingBuffer, stage_base: int, kv_rows: list[int], num_rows: int,
                    commit: Callable[[list[int]], bool] | None = None) -> bool:
    """The engine's commit of one staged proposal of ``num_rows`` rows (row ``r`` staged at
    ``stage_base + r``): its accepted ``kv_rows`` go to their slots, the rest are rejected. False
    when the proposal was not staged (overflow, abandoned staging) or the all-or-nothing commit
    failed (the pools are then untouched): the caller commits no K/V, the next step recomputes it.
    ``commit``: how the rows are committed (default :meth:`StagingBuffer.try_commit`; tensor
    parallelism mirrors it on every rank)."""
    if stage_base < 0 or not staging.usable:
        return False
    rows = [stage_base + r for r in kv_rows]
    if not (staging.try_commit(rows) if commit is None else commit(rows)):
        return False
    kept = set(kv_rows)
    staging.reject([stage_base + r for r in range(num_rows) if r not in kept])
    return True
