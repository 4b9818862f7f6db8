"""No-write-on-reject: stage a step's tentative K/V, commit only accepted rows.

One staging buffer ``[num_layers, max_tokens, num_kv_heads, head_dim]`` (K and V) is shared
by all layers and indexed by *explicit token index* (one index per packed token of the step,
the same for every layer — slots are per token, not per layer). Attention in the same forward
reads new tokens' K/V from the forward itself (layers/attention.py), so staging never makes
verification read stale cache rows. After acceptance, :meth:`StagingBuffer.commit` copies the
accepted rows — any subset, in any order — into the persistent cache.

Commit is all-or-nothing across layers: rows and slots are validated before any write, the
previous contents of the target slots are snapshotted, and all layers are written in one copy; if
that fails (``fault_layer`` injects a failure after the layers before it were written, for tests),
the snapshot is restored and :class:`StagingCommitError` is raised with the cache unchanged. The caller then
falls back to the plain path: the tokens stay committed, their KV is recomputed by the next
step's direct-write catch-up (identical output, one extra forward of work).

Metrics follow the NWOR design: ``stage_operations`` counts layer × token row writes,
``unique_tokens`` counts each staged token once per forward (the two differ by the layer
count — conflating them was the design's "4× inflation" bug).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ratchetlm.kv.cache import KVCache


class StagingCommitError(RuntimeError):
    """A staged commit could not be completed; the persistent cache was left untouched."""


@dataclass
class StagingMetrics:
    stage_operations: int = 0  # layer × token rows written into the staging buffer
    unique_tokens: int = 0  # distinct token rows staged (once per forward, not per layer)
    tokens_committed: int = 0
    tokens_rejected: int = 0
    commit_calls: int = 0
    bytes_committed: int = 0  # K+V bytes copied from staging into persistent slots
    fallback_fake_tensor: int = 0  # forwards whose K/V had no real storage (meta/fake)
    fallback_commit_fail: int = 0  # commits that failed and were rolled back

    @property
    def fallback_count(self) -> int:
        return self.fallback_fake_tensor + self.fallback_commit_fail

    @property
    def acceptance_rate(self) -> float:
        total = self.tokens_committed + self.tokens_rejected
        return self.tokens_committed / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f"kv_staging_{k}": v for k, v in asdict(self).items()}
        out["kv_staging_acceptance_rate"] = self.acceptance_rate
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
    def __init__(self, cache: KVCache, max_tokens: int) -> None:
        _, _, h, d = cache.k.shape
        self.cache = cache
        self.max_tokens = max_tokens
        self.k = torch.zeros(cache.num_layers, max_tokens, h, d, dtype=cache.k.dtype, device=cache.k.device)
        self.v = torch.zeros_like(self.k)
        self.metrics = StagingMetrics()
        self.fault_layer: int | None = None  # test hook: make commit fail when writing this layer
        self._staged = torch.zeros(max_tokens, dtype=torch.bool, device=cache.k.device)  # [max_tokens]
        self._poisoned = False  # this forward staged something without real storage
        self._select(torch.empty(0, dtype=torch.long, device=cache.k.device))

    def ensure_capacity(self, n: int) -> None:
        if n > self.max_tokens:
            self.max_tokens = max(n, 2 * self.max_tokens)
            self.k = torch.zeros(self.cache.num_layers, self.max_tokens, *self.k.shape[2:],
                                 dtype=self.k.dtype, device=self.k.device)
            self.v = torch.zeros_like(self.k)
            self._staged = torch.zeros(self.max_tokens, dtype=torch.bool, device=self.k.device)

    def begin(self, stage_index: torch.Tensor) -> None:
        """Start a forward whose tokens stage at ``stage_index`` ([num_tokens], -1 = not staged)."""
        self._staged.zero_()
        self._poisoned = False
        self._select(stage_index)
        self.metrics.unique_tokens += int(self._idx.numel())

    def _select(self, stage_index: torch.Tensor) -> None:
        """Which rows stage where: fixed for a whole forward, so found once, not per layer."""
        self._index = stage_index
        self._keep = stage_index >= 0
        self._keep_all = bool(self._keep.all())
        self._idx = stage_index if self._keep_all else stage_index[self._keep]

    def stage(
        self,
        layer: int,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        stage_index: torch.Tensor,  # [num_tokens] int64 row in the buffer, -1 = not staged
    ) -> None:
        """Store this layer's rows at their explicit indices (any order)."""
        if not (has_real_storage(k) and has_real_storage(v)):
            if not self._poisoned:
                self.metrics.fallback_fake_tensor += 1
            self._poisoned = True
            return
        if stage_index is not self._index:  # a forward that did not call begin() (e.g. a draft model's)
            self._select(stage_index)
        idx = self._idx
        if idx.numel() == 0:
            return
        if not self._keep_all:
            k, v = k[self._keep], v[self._keep]
        self.k[layer].index_copy_(0, idx, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, idx, v.to(self.v.dtype))
        if layer == 0:
            self._staged[idx] = True
        self.metrics.stage_operations += int(idx.numel())

    def commit(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy staged ``rows`` ([n] buffer indices) into persistent ``slots`` ([n]) for every
        layer, all-or-nothing. Raises :class:`StagingCommitError` with the cache unchanged."""
        assert rows.shape == slots.shape and rows.dim() == 1
        if rows.numel() == 0:
            return
        try:
            if self._poisoned:
                raise StagingCommitError("staged K/V had no real storage (meta/fake tensor)")
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
        self.staging = staging
        self.stage_index = stage_index
        # rows written directly and their slots: fixed for the forward, so found once, not per layer
        direct = slot_mapping >= 0
        self.direct_all = bool(direct.all())
        self.direct_rows = None if self.direct_all else direct.nonzero().squeeze(1)  # [n_direct]
        self.direct_slots = slot_mapping if self.direct_all else slot_mapping[direct]
        if staging is not None and stage_index is not None:
            staging.begin(stage_index)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.direct_slots.numel():
            kd, vd = k, v
            if self.direct_rows is not None:
                kd, vd = k.index_select(0, self.direct_rows), v.index_select(0, self.direct_rows)
            self.cache.write_slots(layer, kd, vd, self.direct_slots)
        if self.staging is not None and self.stage_index is not None:
            self.staging.stage(layer, k, v, self.stage_index)
