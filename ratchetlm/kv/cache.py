"""The llama family's paged KV cache: pools of the one write point (kv/pools.py, kv/sink.py).

Layout: one flat slot space per layer. A slot is ``block_id * block_size + offset``;
block tables (kv/block_manager.py) map a sequence's logical positions onto slots. K and V
are the pools ``k`` and ``v`` (``[num_layers, num_slots, num_kv_heads, head_dim]`` each), both
addressed by the slot group ``kv``: a forward writes them through its
:class:`~ratchetlm.kv.sink.StepSink` (``sink.write(layer, **cache.rows(layer, k, v))``), never by
indexing them.

**Local layers.** A model that mixes sliding-window and global layers (Gemma 2/3) keeps its local
layers' K/V in pools of their own, ``k_local`` / ``v_local``, with fewer rows and their own slot
group ``kv_local`` (engine/layer_groups.py releases their blocks behind the window); ``k`` / ``v``
then hold the global layers only. Slot tensors carry a row per group then (``[G, n]``, in
:attr:`KVCache.slot_groups` order; ``-1`` alike in every row for rows not written), and a layer
reads its own group's row (:meth:`KVCache.slot_row`) and pools (:meth:`KVCache.layer_kv`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ratchetlm.kv.pools import Pools

GROUP = "kv"  # the slot mapping K and V share
LOCAL_GROUP = "kv_local"  # the local layers' own, when they have their own pools


class KVCache(Pools):
    """Holds K and V for all layers: ``[num_layers, num_slots, num_kv_heads, head_dim]`` each, or with
    ``local=(layers, num_blocks)`` the global layers' there and the local layers' in their own pools."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        local: tuple[Sequence[int], int] | None = None,
    ) -> None:
        assert num_layers > 0 and num_blocks > 0 and block_size > 0
        super().__init__()
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.dtype, self.device = dtype, torch.device(device)
        row = (num_kv_heads, head_dim)
        local_layers = set(local[0]) if local is not None else set()
        assert local_layers < set(range(num_layers)), "local layers must be some, not all, of the layers"
        full: Sequence[int] | int = [i for i in range(num_layers) if i not in local_layers] if local else num_layers
        self.k = self.add("k", full, self.num_slots, row, dtype, device, GROUP)
        self.v = self.add("v", full, self.num_slots, row, dtype, device, GROUP)
        self.slot_groups: tuple[str, ...] = (GROUP,)
        self._local = frozenset(local_layers)
        if local is not None:
            layers, blocks = sorted(local[0]), local[1]
            self.add("k_local", layers, blocks * block_size, row, dtype, device, LOCAL_GROUP)
            self.add("v_local", layers, blocks * block_size, row, dtype, device, LOCAL_GROUP)
            self.slot_groups = (GROUP, LOCAL_GROUP)

    def bytes_per_token(self) -> int:
        """K+V bytes of one token across all layers."""
        return sum(self.row_bytes(p) for p in self.stacked)

    def rows(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """A layer's new K and V by pool, for ``sink.write(layer, **rows)``."""
        return {"k_local": k, "v_local": v} if layer in self._local else {"k": k, "v": v}

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # [slots of its pool, heads, dim] each
        pools = ("k_local", "v_local") if layer in self._local else ("k", "v")
        return self.get(pools[0], layer), self.get(pools[1], layer)

    def slot_row(self, layer: int) -> int:
        """The row of a ``[G, ...]`` slot tensor that addresses ``layer``'s pools."""
        return int(layer in self._local)

    def by_group(self, slots: torch.Tensor) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """A slot tensor (``[n]``, or ``[G, n]`` with local pools) as the sink takes it."""
        if len(self.slot_groups) == 1:
            return slots.reshape(-1)
        return dict(zip(self.slot_groups, slots, strict=True))
