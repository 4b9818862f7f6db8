"""No-write-on-reject: stage a step's tentative K/V, commit only accepted rows.

One staging buffer ``[num_layers, max_tokens, num_kv_heads, head_dim]`` (K and V) is shared
by all layers and indexed by *explicit token index* (one index per packed token of the step,
the same for every layer — slots are per token, not per layer). Attention in the same forward
reads new tokens' K/V from the forward itself (layers/attention.py), so staging never makes
verification read stale cache rows. After acceptance, :meth:`StagingBuffer.commit` copies the
accepted rows — any subset, in any order — into the persistent cache for all layers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ratchetlm.kv.cache import KVCache


@dataclass
class StagingMetrics:
    stage_operations: int = 0  # (layer, forward) write calls that staged at least one row
    unique_tokens: int = 0  # distinct token rows staged (counted once per forward, not per layer)
    tokens_committed: int = 0
    tokens_rejected: int = 0
    commit_calls: int = 0
    fallback_count: int = 0

    @property
    def acceptance_rate(self) -> float:
        total = self.tokens_committed + self.tokens_rejected
        return self.tokens_committed / total if total else 0.0


class StagingBuffer:
    def __init__(self, cache: KVCache, max_tokens: int) -> None:
        _, _, h, d = cache.k.shape
        self.cache = cache
        self.max_tokens = max_tokens
        self.k = torch.zeros(cache.num_layers, max_tokens, h, d, dtype=cache.k.dtype, device=cache.k.device)
        self.v = torch.zeros_like(self.k)
        self.metrics = StagingMetrics()
        self._staged_this_forward = 0

    def ensure_capacity(self, n: int) -> None:
        if n > self.max_tokens:
            self.max_tokens = max(n, 2 * self.max_tokens)
            self.k = torch.zeros(self.cache.num_layers, self.max_tokens, *self.k.shape[2:],
                                 dtype=self.k.dtype, device=self.k.device)
            self.v = torch.zeros_like(self.k)

    def begin(self, stage_index: torch.Tensor) -> None:
        """Start a forward whose tokens stage at ``stage_index`` ([num_tokens], -1 = not staged)."""
        n = int((stage_index >= 0).sum())
        self._staged_this_forward = n
        self.metrics.unique_tokens += n

    def stage(
        self,
        layer: int,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        stage_index: torch.Tensor,  # [num_tokens] int64 row in the buffer, -1 = not staged
    ) -> None:
        keep = stage_index >= 0
        idx = stage_index[keep]
        if idx.numel() == 0:
            return
        self.k[layer].index_copy_(0, idx, k[keep].to(self.k.dtype))
        self.v[layer].index_copy_(0, idx, v[keep].to(self.v.dtype))
        self.metrics.stage_operations += 1

    def commit(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy staged ``rows`` ([n] buffer indices) into persistent ``slots`` ([n]) for every layer.

        All-or-nothing: indices are validated before any write, and the copy is a single
        all-layer ``index_copy_`` per tensor."""
        assert rows.shape == slots.shape and rows.dim() == 1
        if rows.numel() == 0:
            return
        if int(rows.min()) < 0 or int(rows.max()) >= self.max_tokens or int(slots.min()) < 0:
            raise ValueError("staging commit with an out-of-range row or slot")
        self.cache.copy_rows(self.k[:, rows], self.v[:, rows], slots)
        self.metrics.commit_calls += 1
        self.metrics.tokens_committed += int(rows.numel())


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
        self.direct_any = bool((slot_mapping >= 0).any())
        if staging is not None and stage_index is not None:
            staging.begin(stage_index)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.direct_any:
            self.cache.write(layer, k, v, self.slot_mapping)
        if self.staging is not None and self.stage_index is not None:
            self.staging.stage(layer, k, v, self.stage_index)
