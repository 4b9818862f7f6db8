"""No-write-on-reject: stage a step's tentative K/V, commit only accepted rows.

One staging buffer ``[num_layers, rows, num_kv_heads, head_dim]`` (K and V) is shared by all
layers and indexed by *explicit token index* (one index per packed token of the step, the same
for every layer — slots are per token, not per layer). Attention in the same forward reads new
tokens' K/V from the forward itself (layers/attention.py), so staging never makes verification
read stale cache rows. After acceptance, :meth:`StagingBuffer.commit` copies the accepted rows —
any subset, in any order — into the persistent cache.

Fallbacks (the design's "when in doubt, fall back to the plain path"). A forward whose staging is
unusable computes its tentative rows without writing them anywhere; the strategy's commit still
decides the tokens, the engine keeps them but commits no K/V, and the next step's direct-write
catch-up recomputes exactly the committed tokens' K/V (identical output, one extra forward;
nothing rejected ever reaches the cache). Causes, each counted once per forward:

* ``overflow`` — the step's staged rows exceed ``capacity`` (the buffer grows up to it, never
  past it): the proposals that do not fit are not staged (:meth:`ModelRunner.execute`);
* ``stage_fail`` — staging raised (``fault_stage_layer`` injects it, for tests): staging is
  abandoned for the rest of the forward;
* ``fake_tensor`` — K/V without real storage (meta / fake tensors of tracing);
* ``commit_fail`` — the all-or-nothing commit failed (``fault_layer`` injects it after the layers
  before it were written, for tests): the snapshot of the target slots is restored and
  :class:`StagingCommitError` raised with the cache unchanged.

Metrics follow the NWOR design: ``stage_operations`` counts layer × token row writes,
``unique_tokens`` counts each staged token once per forward (the two differ by the layer
count — conflating them was the design's "4× inflation" bug); committed / rejected count staged
rows after a successful commit; ``bytes_avoided`` is the K/V that writing every tentative row
would have written on top (the rejected rows, all layers).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ratchetlm.kv.cache import KVCache

FALLBACK_CAUSES = ("fake_tensor", "overflow", "stage_fail", "commit_fail")


class StagingCommitError(RuntimeError):
    """A staged commit could not be completed; the persistent cache was left untouched."""


@dataclass
class StagingMetrics:
    stage_operations: int = 0  # layer × token rows written into the staging buffer
    unique_tokens: int = 0  # distinct token rows staged (once per forward, not per layer)
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


class StagingBuffer:
    """``capacity``: most token rows one forward may stage; the buffer is allocated on demand
    and grows up to it, never past it (a step needing more falls back for what does not fit)."""

    def __init__(self, cache: KVCache, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1, got {capacity}")
        self.cache = cache
        self.capacity = capacity
        self.max_tokens = 0  # rows allocated so far (<= capacity)
        _, _, h, d = cache.k.shape
        self.k = torch.zeros(cache.num_layers, 0, h, d, dtype=cache.k.dtype, device=cache.k.device)
        self.v = torch.zeros_like(self.k)
        self.metrics = StagingMetrics()
        self.fault_layer: int | None = None  # test hook: make commit fail when writing this layer
        self.fault_stage_layer: int | None = None  # test hook: make staging raise at this layer
        self._staged = torch.zeros(0, dtype=torch.bool, device=cache.k.device)  # [max_tokens]
        self.usable = False  # this forward's staged rows may be committed
        self._select(torch.empty(0, dtype=torch.long, device=cache.k.device))

    def reserve(self, n: int) -> None:
        """Make room for ``n <= capacity`` rows."""
        assert n <= self.capacity, (n, self.capacity)
        if n > self.max_tokens:
            self.max_tokens = min(self.capacity, max(n, 2 * self.max_tokens, 64))
            self.k = torch.zeros(self.cache.num_layers, self.max_tokens, *self.k.shape[2:],
                                 dtype=self.k.dtype, device=self.k.device)
            self.v = torch.zeros_like(self.k)
            self._staged = torch.zeros(self.max_tokens, dtype=torch.bool, device=self.k.device)

    def begin(self, stage_index: torch.Tensor) -> None:
        """Start a forward whose tokens stage at ``stage_index`` ([num_tokens], -1 = not staged)."""
        self._select(stage_index)
        self.reserve(int(self._idx.max()) + 1 if self._idx.numel() else 0)
        self._staged.zero_()
        self.usable = True
        self.metrics.unique_tokens += int(self._idx.numel())

    def _select(self, stage_index: torch.Tensor) -> None:
        """Which rows stage where: fixed for a whole forward, so found once, not per layer."""
        self._index = stage_index
        self._keep = stage_index >= 0
        self._keep_all = bool(self._keep.all())
        self._idx = stage_index if self._keep_all else stage_index[self._keep]

    def _abandon(self, cause: str) -> None:
        """Give up staging for the rest of this forward (counted once per forward)."""
        if self.usable:
            setattr(self.metrics, "fallback_" + cause, getattr(self.metrics, "fallback_" + cause) + 1)
        self.usable = False

    def stage(
        self,
        layer: int,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> None:
        """Store this layer's rows at the forward's explicit indices (any order)."""
        if not self.usable:
            return
        if not (has_real_storage(k) and has_real_storage(v)):
            self._abandon("fake_tensor")
            return
        idx = self._idx
        if idx.numel() == 0:
            return
        try:
            if self.fault_stage_layer == layer:
                raise RuntimeError(f"injected staging fault at layer {layer}")
            if not self._keep_all:
                k, v = k[self._keep], v[self._keep]
            self.k[layer].index_copy_(0, idx, k.to(self.k.dtype))
            self.v[layer].index_copy_(0, idx, v.to(self.v.dtype))
        except Exception:  # any staging failure: the plain path recomputes these tokens
            self._abandon("stage_fail")
            return
        if layer == 0:
            self._staged[idx] = True
        self.metrics.stage_operations += int(idx.numel())

    def commit(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy staged ``rows`` ([n] buffer indices) into persistent ``slots`` ([n]) for every
        layer, all-or-nothing. Raises :class:`StagingCommitError` with the cache unchanged."""
        assert rows.shape == slots.shape and rows.dim() == 1
        if not self.usable:
            raise StagingCommitError("this forward's staging was abandoned (a fallback was counted)")
        if rows.numel() == 0:
            return
        try:
            if int(rows.min()) < 0 or int(rows.max()) >= self.max_tokens or int(slots.min()) < 0 \
                    or int(slots.max()) >= self.cache.num_slots:
                raise StagingCommitError("staging commit with an out-of-range row or slot")
            if not bool(self._staged[rows].all()):
                raise StagingCommitError("staging commit of a row that was not staged this forward")
            self._write_all_layers(rows, slots)
        except StagingCommitError:
            self.metrics.fallback_commit_fail += 1
            raise
        n = int(rows.numel())
        self.metrics.commit_calls += 1
        self.metrics.tokens_committed += n
        self.metrics.bytes_committed += n * self.cache.bytes_per_token()

    def reject(self, n: int) -> None:
        """``n`` staged rows of a successfully committed proposal were discarded."""
        self.metrics.tokens_rejected += n
        self.metrics.bytes_avoided += n * self.cache.bytes_per_token()

    def _write_all_layers(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        old_k = self.cache.k[:, slots].clone()  # [num_layers, n, h, d] snapshot for rollback
        old_v = self.cache.v[:, slots].clone()
        # One copy for all layers; the test hook stops it after layers [0, fault_layer).
        upto = self.cache.num_layers if self.fault_layer is None else self.fault_layer
        try:
            self.cache.copy_rows(self.k[:upto, rows], self.v[:upto, rows], slots)  # slots checked >= 0
            if upto < self.cache.num_layers:
                raise StagingCommitError(f"injected fault while committing layer {upto}")
        except Exception as e:
            # restore, bypassing the write counter: not new data
            self.cache.k.index_copy_(1, slots, old_k)
            self.cache.v.index_copy_(1, slots, old_v)
            raise e if isinstance(e, StagingCommitError) else StagingCommitError(str(e)) from e


class StepSink:
    """The write point of one forward: direct rows go to their slots, staged rows to the buffer."""

    def __init__(
        self,
        cache: KVCache,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = not written directly
        staging: StagingBuffer | None = None,
        stage_index: torch.Tensor | None = None,  # [num_tokens] int64, -1 = not staged
    ) -> None:
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.staging = staging if stage_index is not None else None
        # rows written directly and their slots: fixed for the forward, so found once, not per layer
        direct = slot_mapping >= 0
        self.direct_all = bool(direct.all())
        self.direct_rows = None if self.direct_all else direct.nonzero().squeeze(1)  # [n_direct]
        self.direct_slots = slot_mapping if self.direct_all else slot_mapping[direct]
        if self.staging is not None and stage_index is not None:
            self.staging.begin(stage_index)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.direct_slots.numel():
            kd, vd = k, v
            if self.direct_rows is not None:
                kd, vd = k.index_select(0, self.direct_rows), v.index_select(0, self.direct_rows)
            self.cache.write_slots(layer, kd, vd, self.direct_slots)
        if self.staging is not None:
            self.staging.stage(layer, k, v)
