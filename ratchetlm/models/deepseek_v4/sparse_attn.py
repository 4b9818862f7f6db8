"""Gather of sparse-attention keys by raw index (ring / overlay / compressed) and the
sink softmax over them.

Raw index contract (``W`` = window, ``S`` = tokens in the step):
``-1`` invalid; ``[0, W)`` ring slot through ``ori_block_table``; ``[W, W+S)`` the step's
own token ``raw - W`` (its KV is not yet in the ring); ``[W+S, ...)`` compressed slot
``raw - W - S`` through ``cmp_block_table``.
"""

from __future__ import annotations

import torch

from ratchetlm.models.deepseek_v4.attention import sink_attention
from ratchetlm.models.deepseek_v4.paging import physical_rows


def gather_keys(raw: torch.Tensor, ring_pool: torch.Tensor, ori_block_table: torch.Tensor,
                overlay: torch.Tensor, cmp_pool: torch.Tensor | None, cmp_block_table: torch.Tensor | None,
                window: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """raw: ``[B, S, K]``; ring_pool / cmp_pool: ``[num_blocks, block, D]``;
    overlay: ``[B, S, D]`` this step's KV -> (keys ``[B, S, K, D]``, valid ``[B, S, K]``)."""
    B, S, K = raw.shape
    D = overlay.shape[-1]
    in_ring = (raw >= 0) & (raw < window)
    in_overlay = (raw >= window) & (raw < window + S)
    in_cmp = raw >= window + S

    ring_rows = physical_rows(ori_block_table, torch.where(in_ring, raw, -1), block)
    keys = ring_pool.view(-1, D)[ring_rows.clamp(min=0)]
    valid = in_ring & (ring_rows >= 0)

    ov_idx = (raw - window).clamp(0, S - 1).view(B, S * K, 1).expand(-1, -1, D)
    keys = torch.where(in_overlay[..., None], overlay.gather(1, ov_idx).view(B, S, K, D), keys)
    valid |= in_overlay

    if cmp_pool is not None and cmp_block_table is not None:
        cmp_rows = physical_rows(cmp_block_table, torch.where(in_cmp, raw - window - S, -1), block)
        keys = torch.where(in_cmp[..., None], cmp_pool.view(-1, D)[cmp_rows.clamp(min=0)], keys)
        valid |= in_cmp & (cmp_rows >= 0)
    return keys, valid


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: ``[B, S, H, D]``, keys: ``[B, S, K, D]``, valid: ``[B, S, K]`` -> ``[B, S, H, D]``."""
    B, S = q.shape[:2]
    out = sink_attention(q.flatten(0, 1), keys.flatten(0, 1), valid.flatten(0, 1), sinks, scale)
    return out.view(q.shape)
