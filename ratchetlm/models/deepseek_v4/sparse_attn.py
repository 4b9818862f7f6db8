"""Gather of sparse-attention keys by raw index (ring / overlay / compressed) and the
sink softmax over them.

Raw index contract (``W`` = window, ``S`` = tokens in the step):
``-1`` invalid; ``[0, W)`` ring slot through ``ori_block_table``; ``[W, W+S)`` the step's
own token ``raw - W`` (its KV is not yet in the ring); ``[W+S, ...)`` compressed slot
``raw - W - S``: through ``cmp_block_table`` if it was completed before the step, else the
entry the step itself pooled (not yet in the pool either).
"""

from __future__ import annotations

import torch

from ratchetlm.models.deepseek_v4.attention import sink_attention
from ratchetlm.models.deepseek_v4.paging import physical_rows


def gather_keys(raw: torch.Tensor, ring_pool: torch.Tensor, ori_block_table: torch.Tensor,
                overlay: torch.Tensor, cmp_pool: torch.Tensor | None, cmp_block_table: torch.Tensor | None,
                window: int, block: int, cmp_overlay: torch.Tensor | None = None,
                cmp_history: torch.Tensor | None = None, ratio: int = 0,
                step_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """raw: ``[B, Q, K]`` (``Q`` queries, a chunk of the step's ``S`` tokens); ring_pool / cmp_pool:
    rows of ``D`` (``[num_blocks, block, D]`` or flat); overlay: ``[B, S, D]`` this step's KV
    -> (keys ``[B, Q, K, D]``, valid ``[B, Q, K]``).

    With ``cmp_overlay`` ``[B, S, D]`` (this step's compressed entries), compressed slots
    ``>= cmp_history[b]`` were completed in the step and are read from it: slot ``w`` from
    the token at position ``(w + 1) * ratio - 1``."""
    B, Q, K = raw.shape
    S, D = overlay.shape[1], overlay.shape[-1]
    in_ring = (raw >= 0) & (raw < window)
    in_overlay = (raw >= window) & (raw < window + S)
    in_cmp = raw >= window + S

    ring_rows = physical_rows(ori_block_table, torch.where(in_ring, raw, -1), block)
    keys = ring_pool.reshape(-1, D)[ring_rows.clamp(min=0)]
    valid = in_ring & (ring_rows >= 0)

    ov_idx = (raw - window).clamp(0, S - 1).view(B, Q * K, 1).expand(-1, -1, D)
    keys = torch.where(in_overlay[..., None], overlay.gather(1, ov_idx).view(B, Q, K, D), keys)
    valid |= in_overlay

    if cmp_pool is not None and cmp_block_table is not None:
        slot = torch.where(in_cmp, raw - window - S, -1)
        from_step = torch.zeros_like(in_cmp)
        if cmp_overlay is not None:
            assert cmp_history is not None and step_start is not None and ratio > 0
            from_step = in_cmp & (slot >= cmp_history.view(B, 1, 1))
        if bool(from_step.any()):
            assert cmp_overlay is not None and step_start is not None
            row = ((slot + 1) * ratio - 1 - step_start.view(B, 1, 1))
            ok = from_step & (row >= 0) & (row < S)
            idx = row.clamp(0, S - 1).view(B, Q * K, 1).expand(-1, -1, D)
            step_keys = cmp_overlay.gather(1, idx).view(B, Q, K, D).to(keys.dtype)
            keys = torch.where(from_step[..., None], step_keys, keys)
            valid |= ok
        cmp_rows = physical_rows(cmp_block_table, torch.where(from_step, -1, slot), block)
        keys = torch.where((in_cmp & ~from_step)[..., None], cmp_pool.reshape(-1, D)[cmp_rows.clamp(min=0)], keys)
        valid |= in_cmp & ~from_step & (cmp_rows >= 0)
    return keys, valid


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: ``[B, S, H, D]``, keys: ``[B, S, K, D]``, valid: ``[B, S, K]`` -> ``[B, S, H, D]``."""
    B, S = q.shape[:2]
    out = sink_attention(q.flatten(0, 1), keys.flatten(0, 1), valid.flatten(0, 1), sinks, scale)
    return out.view(q.shape)
