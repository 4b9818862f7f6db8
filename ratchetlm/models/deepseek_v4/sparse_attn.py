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
    b_of = torch.arange(B, device=raw.device).view(B, 1, 1).expand(B, Q, K)  # [B, Q, K] the row's sequence
    # The sources are disjoint: each writes only its own entries into the ring gather (which also fills
    # the invalid ones, with a real row: never garbage under the attention's mask). One [B, Q, K, D]
    # tensor, not one per source: long prefill chunks made these copies most of a step.
    # (dtypes as torch.where's promotion of the sources would give)
    ring_dtype = torch.promote_types(ring_pool.dtype, overlay.dtype)
    dtype = ring_dtype if cmp_pool is None or cmp_block_table is None else torch.promote_types(ring_dtype,
                                                                                             cmp_pool.dtype)

    ring_rows = physical_rows(ori_block_table, torch.where(in_ring, raw, -1), block)
    keys = ring_pool.reshape(-1, D)[ring_rows.clamp(min=0)].to(dtype)  # [B, Q, K, D]
    valid = in_ring & (ring_rows >= 0)

    keys[in_overlay] = overlay[b_of[in_overlay], raw[in_overlay] - window].to(dtype)
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
            keys[from_step] = cmp_overlay[b_of[from_step], row[from_step].clamp(0, S - 1)].to(ring_dtype).to(dtype)
            valid |= ok
        cmp_rows = physical_rows(cmp_block_table, torch.where(from_step, -1, slot), block)
        pooled = in_cmp & ~from_step
        keys[pooled] = cmp_pool.reshape(-1, D)[cmp_rows[pooled].clamp(min=0)].to(dtype)
        valid |= pooled & (cmp_rows >= 0)
    return keys, valid


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: ``[B, S, H, D]``, keys: ``[B, S, K, D]``, valid: ``[B, S, K]`` -> ``[B, S, H, D]``."""
    B, S = q.shape[:2]
    out = sink_attention(q.flatten(0, 1), keys.flatten(0, 1), valid.flatten(0, 1), sinks, scale)
    return out.view(q.shape)
