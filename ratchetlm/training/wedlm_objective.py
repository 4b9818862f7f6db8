"""The WeDLM training objective: a dual-stream batch under one 2-D attention mask.

For a clean sequence ``x0`` of length L the model input is ``[x0 ; xt]`` (2L tokens) where
both streams carry positions 0..L-1:

* ``x0`` is read causally and trained with the ordinary next-token (AR) loss, which keeps the
  model usable as a plain AR model and supplies the "committed prefix" the masks condition on;
* ``xt`` is ``x0`` split into blocks of ``B``; in each block a ratio γ ~ U(0, 1) of tokens is
  replaced by ``[MASK]`` and the block is *reordered* observed-first, masks-last (each keeps
  its true position id). An ``xt`` token sees the clean ``x0`` of earlier blocks plus the
  tokens of its own block that precede it in reordered order — exactly what a window token
  sees at inference (committed prefix + filled slots + earlier masks under causal attention).
  Masked slots are trained to predict the token *at their own position* (no shift), weighted
  by 1/γ (γ = the realised ratio of the block), weights normalised to sum to one.

Total loss = ``(mlm + w·ar) / (1 + w)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class WeDLMBatch:
    input_ids: torch.Tensor  # [B, 2L] int64: clean stream then reordered masked stream
    position_ids: torch.Tensor  # [B, 2L] int64: 0..L-1 for x0, permuted within blocks for xt
    attention_mask: torch.Tensor  # [B, 1, 2L, 2L] bool, True = may attend
    ar_targets: torch.Tensor  # [B, L] int64, next clean token (-100 at the last slot)
    mlm_targets: torch.Tensor  # [B, L] int64 per xt slot: original token if masked else -100
    mlm_weights: torch.Tensor  # [B, L] fp32 per xt slot: 1/γ of its block if masked else 0


def dual_stream_mask(seq_len: int, block_size: int) -> torch.Tensor:  # [2L, 2L] bool
    """The 2-D mask: x0 causal; xt causal within its block (reordered order) + x0 of earlier blocks."""
    L = seq_len
    idx = torch.arange(L)
    blk = idx // block_size
    causal = idx[None, :] <= idx[:, None]
    mask = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    mask[:L, :L] = causal
    mask[L:, :L] = idx[None, :] < (blk[:, None] * block_size)  # clean tokens of earlier blocks
    mask[L:, L:] = causal & (blk[None, :] == blk[:, None])  # own block, reordered-causal
    return mask


def build_wedlm_batch(
    x0: torch.Tensor,  # [B, L] int64 clean tokens
    mask_token_id: int,
    block_size: int,
    generator: torch.Generator,
) -> WeDLMBatch:
    b, L = x0.shape
    if L % block_size:
        raise ValueError(f"seq_len {L} must be a multiple of block_size {block_size}")
    xt = torch.empty_like(x0)
    pos_t = torch.empty_like(x0)
    mlm_t = torch.full_like(x0, -100)
    mlm_w = torch.zeros(b, L)
    for row in range(b):
        for start in range(0, L, block_size):
            n = block_size
            gamma = float(torch.rand((), generator=generator))
            k = round(gamma * n)
            perm = torch.randperm(n, generator=generator)
            masked = torch.zeros(n, dtype=torch.bool)
            masked[perm[:k]] = True
            order = torch.cat([torch.nonzero(~masked).flatten(), torch.nonzero(masked).flatten()])
            src = start + order  # reordered slot j holds the token of position src[j]
            toks = x0[row, src].clone()
            toks[n - k :] = mask_token_id
            xt[row, start : start + n] = toks
            pos_t[row, start : start + n] = src
            if k:
                mlm_t[row, start + n - k : start + n] = x0[row, src[n - k :]]
                mlm_w[row, start + n - k : start + n] = n / k  # 1/γ with γ the realised ratio
    pos0 = torch.arange(L).expand(b, L)
    ar = torch.full_like(x0, -100)
    ar[:, :-1] = x0[:, 1:]
    mask = dual_stream_mask(L, block_size)[None, None].expand(b, 1, 2 * L, 2 * L)
    return WeDLMBatch(torch.cat([x0, xt], 1), torch.cat([pos0, pos_t], 1), mask, ar, mlm_t, mlm_w)


def wedlm_loss(
    logits: torch.Tensor,  # [B, 2L, V]
    batch: WeDLMBatch,
    ar_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (total, mlm, ar). MLM rows predict the token at their own position (no shift)."""
    L = batch.ar_targets.shape[1]
    v = logits.shape[-1]
    ar = F.cross_entropy(logits[:, :L].reshape(-1, v).float(), batch.ar_targets.reshape(-1), ignore_index=-100)
    sel = batch.mlm_targets.reshape(-1) >= 0
    if bool(sel.any()):
        ce = F.cross_entropy(logits[:, L:].reshape(-1, v)[sel].float(), batch.mlm_targets.reshape(-1)[sel],
                             reduction="none")
        w = batch.mlm_weights.reshape(-1)[sel]
        mlm = (ce * w).sum() / w.sum()
    else:
        mlm = logits.sum() * 0.0
    return (mlm + ar_weight * ar) / (1.0 + ar_weight), mlm, ar
