"""Paged KV cache storage and the single K/V write point.

Layout: one flat slot space per layer. A slot is ``block_id * block_size + offset``;
block tables (engine/block_manager.py) map a sequence's logical positions onto slots.

Every K/V write in the engine goes through a :class:`KVSink`. The model never indexes the
cache tensors for writing itself; it calls ``sink.write(layer, k, v)`` once per layer per
forward. The default sink (:class:`DirectSink`) scatters into the cache by slot mapping
(slot ``-1`` = compute but do not write). A verifying step swaps in a staging sink
(kv/staging.py) so that nothing rejected ever lands in the persistent cache.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache:
    """Holds K and V for all layers: ``[num_layers, num_slots, num_kv_heads, head_dim]`` each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        assert num_layers > 0 and num_blocks > 0 and block_size > 0
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_written = 0  # K+V bytes scattered into persistent slots, all layers

    def bytes_per_token(self) -> int:
        """K+V bytes of one token across all layers."""
        return 2 * self.num_layers * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    def write(
        self,
        layer: int,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not write
    ) -> None:
        """Scatter K/V rows into their slots; rows whose slot is -1 are dropped."""
        assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0], (k.shape, slot_mapping.shape)
        keep = slot_mapping >= 0
        if not bool(keep.all()):  # [real rows only]
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        if slot_mapping.numel() == 0:
            return
        self.write_slots(layer, k, v, slot_mapping)

    def write_slots(
        self,
        layer: int,
        k: torch.Tensor,  # [n, num_kv_heads, head_dim]
        v: torch.Tensor,  # [n, num_kv_heads, head_dim]
        slots: torch.Tensor,  # [n] int64, all >= 0 (the caller filtered -1 once per forward)
    ) -> None:
        """Scatter rows into real slots: :meth:`write` without the per-call filtering."""
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))
        self.bytes_written += 2 * k.numel() * self.k.element_size()

    def copy_rows(
        self,
        k_rows: torch.Tensor,  # [num_layers', n, num_kv_heads, head_dim], layers 0..num_layers'-1
        v_rows: torch.Tensor,  # [num_layers', n, num_kv_heads, head_dim]
        slots: torch.Tensor,  # [n] int64, all >= 0 (the caller checked)
    ) -> None:
        """Write ``n`` token rows into the first ``k_rows.shape[0]`` layers in one copy (staging commit)."""
        upto = k_rows.shape[0]
        assert k_rows.shape == v_rows.shape and upto <= self.num_layers
        self.k[:upto].index_copy_(1, slots, k_rows.to(self.k.dtype))
        self.v[:upto].index_copy_(1, slots, v_rows.to(self.v.dtype))
        self.bytes_written += 2 * k_rows.numel() * self.k.element_size()


class KVSink(Protocol):
    """Where a forward's new K/V go. Called once per layer per forward, in layer order."""

    def write(
        self,
        layer: int,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> None: ...


class DirectSink:
    """Writes straight into the persistent cache by slot mapping (prefill / plain decode)."""

    def __init__(self, cache: KVCache, slot_mapping: torch.Tensor) -> None:
        self.cache = cache
        self.slot_mapping = slot_mapping  # [num_tokens] int64, -1 = do not write

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, k, v, self.slot_mapping)


class NullSink:
    """Computes without writing anything (pure scoring / reference runs)."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        return None
