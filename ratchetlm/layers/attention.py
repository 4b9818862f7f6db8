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

from dataclasses import dataclass, field

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
    mask: torch.Tensor | None  # [B, 1, max_new, max_ctx + max_new] additive float (0 / -inf); None: see is_causal
    is_causal: bool  # only meaningful when mask is None: True = causal among new tokens, False = all visible
    num_seqs: int
    max_new: int
    max_ctx: int
    _grouped: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def grouped_mask(self, g: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` with each query row repeated for the ``g`` heads of a KV group: ``[B, 1, g*n, L]``
        (row ``g_idx * n + i`` = row ``i``). Built once per forward, shared by all layers."""
        if self.mask is None:
            return None
        key = (g, dtype)
        if key not in self._grouped:
            self._grouped[key] = self.mask.repeat(1, 1, g, 1).to(dtype)
        return self._grouped[key]


def build_attention_batch(
    positions: torch.Tensor,  # [num_tokens]
    new_lens: list[int],
    context_slots: list[torch.Tensor],  # per seq [context_len] int64 slots
    new_masks: list[torch.Tensor | None],  # per seq [n_new, n_new] bool or None (causal)
    sink: KVSink,
    cache: KVCache | None,
    dtype: torch.dtype = torch.float32,
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

    # B == 1 needs no mask when nothing is hidden: plain causal prefill, or one query seeing everything.
    causal = b == 1 and max_ctx == 0 and new_masks[0] is None
    see_all = b == 1 and max_new == 1
    mask = None
    if not (causal or see_all):
        mask = torch.zeros(b, 1, max_new, max_ctx + max_new, dtype=torch.bool)
        for i, (c, n, nm) in enumerate(zip(ctx_lens, new_lens, new_masks, strict=True)):
            mask[i, 0, :n, :c] = True
            nm = torch.ones(n, n, dtype=torch.bool).tril_() if nm is None else nm
            assert nm.shape == (n, n), f"new-token mask must be [{n}, {n}], got {tuple(nm.shape)}"
            mask[i, 0, :n, max_ctx : max_ctx + n] = nm.cpu()
            # Padding query rows attend to one real key so softmax stays finite; their output is dropped.
            mask[i, 0, n:, max_ctx] = True
        # Additive float mask: SDPA's CPU kernels are markedly faster with it than with a bool mask.
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")).to(device)
    ctx = None
    if max_ctx > 0:
        ctx = torch.zeros(b, max_ctx, dtype=torch.long)
        for i, cs in enumerate(context_slots):
            ctx[i, : cs.numel()] = cs.cpu()
        ctx = ctx.to(device)
    return AttentionBatch(
        positions=positions,
        sink=sink,
        cache=cache,
        ctx_slots=ctx,
        pad_index=pad_index.to(device),
        unpad_index=unpad_index.to(device),
        mask=mask,
        is_causal=causal and max_new > 1,
        num_seqs=b,
        max_new=max_new,
        max_ctx=max_ctx,
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
    hkv = k.shape[1]
    b, n = batch.num_seqs, batch.max_new
    if b == 1:  # packed == padded: skip the gathers
        qp, kp, vp = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    else:  # [B, max_new, H, D]; index_select, not advanced indexing (much faster on CPU)
        flat = batch.pad_index.view(-1)
        qp = q.index_select(0, flat).view(b, n, h, d)
        kp = k.index_select(0, flat).view(b, n, hkv, d)
        vp = v.index_select(0, flat).view(b, n, hkv, d)
    if batch.ctx_slots is not None:
        assert batch.cache is not None
        slots = batch.ctx_slots.view(-1)
        kc = batch.cache.k[layer].index_select(0, slots).view(b, batch.max_ctx, hkv, d).to(q.dtype)
        vc = batch.cache.v[layer].index_select(0, slots).view(b, batch.max_ctx, hkv, d).to(q.dtype)
        kp = torch.cat([kc, kp], dim=1)
        vp = torch.cat([vc, vp], dim=1)
    kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)  # [B, Hkv, L, D]
    g = h // hkv
    if batch.is_causal:
        # Single-sequence prefill: SDPA's causal kernel needs one query row per head, so expand K/V.
        qp = qp.transpose(1, 2)
        if g > 1:
            kp, vp = kp.repeat_interleave(g, dim=1), vp.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        out = out.transpose(1, 2).reshape(b * n, h, d)
    else:
        # GQA without copying K/V: the G query heads sharing a KV head become G*n query rows of it
        # (head j uses KV head j // G, as in HF's repeat_kv). Row r = g_idx * n + i.
        qg = qp.view(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
        mask = batch.grouped_mask(g, q.dtype)
        out = F.scaled_dot_product_attention(qg, kp, vp, attn_mask=mask, scale=scale)
        out = out.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, h, d)  # [B * max_new, H, D]
    return out if b == 1 else out.index_select(0, batch.unpad_index)
