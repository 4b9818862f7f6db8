"""Attention over committed paged KV plus this step's tentative tokens.

Every forward sees, per sequence, two key sets:

* the *committed context*: ``context_len`` tokens already in the paged cache (all visible);
* the *new tokens* of this step (prefill chunk, decode token, draft tree, WeDLM window),
  whose K/V come straight from this forward — never re-read from the cache, so a staged or
  not-yet-committed write can never be read stale.

Visibility among new tokens is causal in packed order unless the step supplies its own
``[n_new, n_new]`` boolean mask (``True`` = may attend): a tree mask, a reordered window.
Writing K/V is delegated to the batch's :class:`~ratchetlm.kv.cache.KVSink` — the single
write point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ratchetlm.kv.cache import KVCache, KVSink


@dataclass
class AttentionBatch:
    """Per-forward metadata shared by all layers. Built by :func:`build_attention_batch`."""

    positions: torch.Tensor  # [num_tokens] int64 absolute RoPE positions (packed over sequences)
    sink: KVSink  # receives each layer's new K/V
    cache: KVCache | None  # None = no committed context anywhere (pure prefill / reference)
    ctx_slots: torch.Tensor | None  # [B, max_ctx] int64 slots of committed context (0 where padded)
    pad_index: torch.Tensor  # [B, max_new] int64 index into packed tokens (0 where padded)
    unpad_index: torch.Tensor  # [num_tokens] int64 index into the flattened [B * max_new] grid
    mask: torch.Tensor | None  # [B, 1, max_new, max_ctx + max_new] bool; None = plain causal, B == 1
    num_seqs: int
    max_new: int


def build_attention_batch(
    positions: torch.Tensor,  # [num_tokens]
    new_lens: list[int],
    context_slots: list[torch.Tensor],  # per seq [context_len] int64 slots
    new_masks: list[torch.Tensor | None],  # per seq [n_new, n_new] bool or None (causal)
    sink: KVSink,
    cache: KVCache | None,
) -> AttentionBatch:
    device = positions.device
    b = len(new_lens)
    assert b == len(context_slots) == len(new_masks) and sum(new_lens) == positions.shape[0]
    max_new = max(new_lens)
    ctx_lens = [int(s.numel()) for s in context_slots]
    max_ctx = max(ctx_lens)
    starts = [0]
    for n in new_lens[:-1]:
        starts.append(starts[-1] + n)
    pad_index = torch.zeros(b, max_new, dtype=torch.long)
    unpad = []
    for i, (s, n) in enumerate(zip(starts, new_lens, strict=True)):
        pad_index[i, :n] = torch.arange(s, s + n)
        unpad.append(torch.arange(i * max_new, i * max_new + n))
    unpad_index = torch.cat(unpad)

    simple = b == 1 and max_ctx == 0 and new_masks[0] is None
    mask = None
    if not simple:
        mask = torch.zeros(b, 1, max_new, max_ctx + max_new, dtype=torch.bool)
        for i, (c, n, m) in enumerate(zip(ctx_lens, new_lens, new_masks, strict=True)):
            mask[i, 0, :n, :c] = True
            if m is None:
                m = torch.ones(n, n, dtype=torch.bool).tril_()
            assert m.shape == (n, n), f"new-token mask must be [{n}, {n}], got {tuple(m.shape)}"
            mask[i, 0, :n, max_ctx : max_ctx + n] = m.cpu()
            # Padding query rows attend to one real key so softmax stays finite; their output is dropped.
            mask[i, 0, n:, max_ctx] = True
        mask = mask.to(device)
    ctx = None
    if max_ctx > 0:
        ctx = torch.zeros(b, max_ctx, dtype=torch.long)
        for i, s in enumerate(context_slots):
            ctx[i, : s.numel()] = s.cpu()
        ctx = ctx.to(device)
    return AttentionBatch(
        positions=positions,
        sink=sink,
        cache=cache,
        ctx_slots=ctx,
        pad_index=pad_index.to(device),
        unpad_index=unpad_index.to(device),
        mask=mask,
        num_seqs=b,
        max_new=max_new,
    )


def paged_attention(
    layer: int,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write this layer's new K/V through the sink, then attend context + new tokens."""
    batch.sink.write(layer, k, v)
    t, h, d = q.shape
    b, n = batch.num_seqs, batch.max_new
    # [B, H, max_new, D] views of the packed tokens
    qp = q[batch.pad_index].transpose(1, 2)
    kp = k[batch.pad_index].transpose(1, 2)
    vp = v[batch.pad_index].transpose(1, 2)
    if batch.ctx_slots is not None:
        assert batch.cache is not None
        kc = batch.cache.k[layer][batch.ctx_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, max_ctx, D]
        vc = batch.cache.v[layer][batch.ctx_slots].transpose(1, 2).to(q.dtype)
        kp = torch.cat([kc, kp], dim=2)
        vp = torch.cat([vc, vp], dim=2)
    if batch.mask is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(b * n, h, d)  # [B * max_new, H, D]
    return out[batch.unpad_index]
