"""The llama family's paged KV cache: two pools of the one write point (kv/pools.py, kv/sink.py).

Layout: one flat slot space per layer. A slot is ``block_id * block_size + offset``;
block tables (engine/block_manager.py) map a sequence's logical positions onto slots. K and V
are the pools ``k`` and ``v`` (``[num_layers, num_slots, num_kv_heads, head_dim]`` each), both
addressed by the slot group ``kv``: a forward writes them through its
:class:`~ratchetlm.kv.sink.StepSink` (``sink.write(layer, k=k, v=v)``), never by indexing them.
"""

from __future__ import annotations

import torch

from ratchetlm.kv.pools import Pools

GROUP = "kv"  # the slot mapping K and V share


class KVCache(Pools):
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
        super().__init__()
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.k = self.add("k", num_layers, self.num_slots, (num_kv_heads, head_dim), dtype, device, GROUP)
        self.v = self.add("v", num_layers, self.num_slots, (num_kv_heads, head_dim), dtype, device, GROUP)

    def bytes_per_token(self) -> int:
        """K+V bytes of one token across all layers."""
        return self.row_bytes("k") + self.row_bytes("v")
