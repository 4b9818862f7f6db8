"""Attention over committed paged KV plus this step's tentative tokens.

Every forward sees, per sequence, two key sets:

* the *committed context*: ``context_len`` tokens already in the paged cache (all visible);
* the *new tokens* of this step (prefill chunk, decode token, draft tree, WeDLM window),
  whose K/V come straight from this forward — never re-read from the cache, so a staged or
  not-yet-committed write can never be read stale.

Visibility among new tokens is causal in packed order unless the step supplies its own
``[n_new, n_new]`` boolean mask (``True`` = may attend): a tree mask, a reordered window.
Writing K/V is delegated to the batch's :class:`~ratchetlm.kv.sink.StepSink` — the single
write point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.sink import KVSink


@dataclass
class AttentionBatch:
    """Per-forward metadata shared by all layers. Built by :func:`build_attention_batch`.

    This is the full-attention view: every committed context row is visible. Sliding-window
    layers use :meth:`windowed`, a view of the same forward whose context is cut to the window
    and whose mask also hides keys ``window`` or more positions behind the query.
    """

    positions: torch.Tensor  # [num_tokens] int64 absolute RoPE positions (packed over sequences)
    sink: KVSink  # receives each layer's new K/V
    cache: KVCache | None  # None = no committed context anywhere (pure prefill / reference)
    ctx_slots: torch.Tensor | None  # [G, B, max_ctx] int64 committed context slots per slot group (0: padding)
    pad_index: torch.Tensor  # [B, max_new] int64 index into packed tokens (0 where padded)
    unpad_index: torch.Tensor  # [num_tokens] int64 index into the flattened [B * max_new] grid
    # the additive mask, made on first use (the ``mask`` property) by this function; None: see is_causal
    mask_fn: Callable[[], torch.Tensor] | None
    is_causal: bool  # only meaningful when mask is None: True = causal among new tokens, False = all visible
    num_seqs: int
    max_new: int
    max_ctx: int
    seq_meta: torch.Tensor | None = None  # [B, 3] int32 (context rows, first packed token, new tokens) per seq, CPU
    # every sequence's new tokens causal among themselves and no window: the fixed-order kernel's own
    # rule (context rows of seq_meta, new keys up to the query) is the mask, so it needs none built
    plain_causal: bool = False
    _mask: torch.Tensor | None = None
    _grouped: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _keys: _KeyInputs | None = None  # what the windowed views are cut from
    _windows: dict[int, AttentionBatch] = field(default_factory=dict)
    _slot_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # see slot_rows_ptr
    _fixed_mask: torch.Tensor | None = None  # see fixed_order_mask

    @property
    def mask(self) -> torch.Tensor | None:  # [B, 1, max_new, max_ctx + max_new] additive float (0 / -inf)
        """None where ``is_causal`` says it all; else built once per forward, when a layer first asks."""
        if self._mask is None and self.mask_fn is not None:
            self._mask = self.mask_fn()
        return self._mask

    def grouped_mask(self, g: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` with each query row repeated for the ``g`` heads of a KV group: ``[B, 1, g*n, L]``
        (row ``g_idx * n + i`` = row ``i``). Built once per forward, shared by all layers."""
        if self.mask is None:
            return None
        key = (g, dtype)
        if key not in self._grouped:
            self._grouped[key] = self.mask.repeat(1, 1, g, 1).to(dtype)
        return self._grouped[key]

    def slot_rows_ptr(self, row: int) -> int:
        """Address of ``ctx_slots[row]`` as one contiguous ``[B, max_ctx]`` int64 array (the fixed-order
        kernel's input): made once per forward and slot group, not per layer."""
        assert self.ctx_slots is not None
        if row not in self._slot_rows:
            self._slot_rows[row] = self.ctx_slots[row].contiguous()
        return self._slot_rows[row].data_ptr()

    def fixed_order_mask(self) -> torch.Tensor | None:
        """``mask`` as ``[B, max_new, L]`` contiguous fp32 (the fixed-order kernel's input), once per forward;
        None where the kernel's causal rule is the mask (``plain_causal``)."""
        if self.plain_causal or self.mask is None:
            return None
        if self._fixed_mask is None:
            self._fixed_mask = self.mask.reshape(self.num_seqs, self.max_new, -1).contiguous()
            assert self._fixed_mask.dtype == torch.float32
        return self._fixed_mask

    def windowed(self, window: int | None) -> AttentionBatch:
        """The view a layer with this sliding window attends through (``None``: this full view).
        A query at position ``p`` sees keys at positions ``(p - window, p]`` that the full view
        shows it; context rows older than every query's window are not gathered at all."""
        if window is None:
            return self
        if window not in self._windows:
            assert self._keys is not None
            self._windows[window] = _build(self._keys, window, self.positions, self.sink, self.cache,
                                           self.pad_index, self.unpad_index)
        return self._windows[window]


@dataclass
class _KeyInputs:
    new_lens: list[int]
    starts: list[int]  # per seq index of its first token in the packed order
    positions: torch.Tensor  # [num_tokens]
    context_slots: list[torch.Tensor]  # per seq [G, context_len] slots of positions ctx_start .. ctx_start + len - 1
    ctx_starts: list[int]
    new_masks: list[torch.Tensor | None]
    dtype: torch.dtype
    _new_positions: list[torch.Tensor] | None = None

    @property
    def new_positions(self) -> list[torch.Tensor]:  # per seq [n_new] int64 on CPU (windowed views only)
        if self._new_positions is None:
            pos = self.positions.cpu()
            self._new_positions = [pos[s : s + n] for s, n in zip(self.starts, self.new_lens, strict=True)]
        return self._new_positions


def build_attention_batch(
    positions: torch.Tensor,  # [num_tokens]
    new_lens: list[int],
    context_slots: list[torch.Tensor],  # per seq [context_len] int64 slots ([G, context_len]: a row per slot group)
    new_masks: list[torch.Tensor | None],  # per seq [n_new, n_new] bool or None (causal)
    sink: KVSink,
    cache: KVCache | None,
    dtype: torch.dtype = torch.float32,
    ctx_starts: list[int] | None = None,  # per seq position of its first context row (0: the whole context)
) -> AttentionBatch:
    device = positions.device
    b = len(new_lens)
    assert b == len(context_slots) == len(new_masks) and sum(new_lens) == positions.shape[0]
    max_new = max(new_lens)
    starts = [0]
    for n in new_lens[:-1]:
        starts.append(starts[-1] + n)
    if b == 1:  # packed == padded: both indices are 0 .. n - 1 (one tensor: a decode step's every op costs)
        pad_index = unpad_index = torch.arange(max_new, device=device)
        pad_index = pad_index.view(1, max_new)
    else:
        pad_index = torch.zeros(b, max_new, dtype=torch.long)
        unpad = []
        for i, (s, n) in enumerate(zip(starts, new_lens, strict=True)):
            pad_index[i, :n] = torch.arange(s, s + n)
            unpad.append(torch.arange(i * max_new, i * max_new + n))
        pad_index, unpad_index = pad_index.to(device), torch.cat(unpad).to(device)
    groups = 1 if cache is None else len(cache.slot_groups)
    context_slots = [cs.reshape(groups, -1) for cs in context_slots]
    keys = _KeyInputs(new_lens, starts, positions, context_slots, ctx_starts or [0] * b, new_masks, dtype)
    batch = _build(keys, None, positions, sink, cache, pad_index, unpad_index)
    batch._keys = keys
    return batch


def _build(
    keys: _KeyInputs,
    window: int | None,
    positions: torch.Tensor,
    sink: KVSink,
    cache: KVCache | None,
    pad_index: torch.Tensor,
    unpad_index: torch.Tensor,
) -> AttentionBatch:
    """One view of the forward's keys: all committed context (``window`` None) or only what a
    sliding window of that size can reach."""
    device = positions.device
    b, new_lens, max_new = len(keys.new_lens), keys.new_lens, max(keys.new_lens)
    ctx_slots, ctx_first = keys.context_slots, keys.ctx_starts
    if window is not None:  # drop context rows below every query's window
        cut = [max(0, int(p.min()) - window + 1 - c0) if p.numel() else 0
               for p, c0 in zip(keys.new_positions, ctx_first, strict=True)]
        ctx_slots = [s[:, k:] for s, k in zip(ctx_slots, cut, strict=True)]
        ctx_first = [c0 + k for c0, k in zip(ctx_first, cut, strict=True)]
    ctx_lens = [int(s.shape[1]) for s in ctx_slots]
    max_ctx = max(ctx_lens)
    # B == 1 needs no mask when nothing is hidden: plain causal prefill (within the window), or one
    # query seeing everything left after the cut.
    causal = b == 1 and max_ctx == 0 and keys.new_masks[0] is None
    if causal and window is not None:  # ... and no key is window or more positions behind its query
        causal = int(keys.new_positions[0].max() - keys.new_positions[0].min()) < window
    see_all = b == 1 and max_new == 1

    def build_mask() -> torch.Tensor:  # [B, 1, max_new, max_ctx + max_new] additive float
        if b == 1 and window is None:  # every context key visible, the new keys by their mask: three ops, not ~20
            nm = keys.new_masks[0]
            nm = torch.ones(max_new, max_new, dtype=torch.bool).tril_() if nm is None else nm.to(device)
            new = torch.where(nm, 0.0, float("-inf")).to(keys.dtype)  # [n, n]
            return F.pad(new, (max_ctx, 0), value=0.0).view(1, 1, max_new, max_ctx + max_new)
        mask = torch.zeros(b, 1, max_new, max_ctx + max_new, dtype=torch.bool)
        for i, (c, n, nm) in enumerate(zip(ctx_lens, new_lens, keys.new_masks, strict=True)):
            mask[i, 0, :n, :c] = True
            nm = torch.ones(n, n, dtype=torch.bool).tril_() if nm is None else nm
            mask[i, 0, :n, max_ctx : max_ctx + n] = nm.cpu()
            if window is not None:  # key position > query position - window
                q_pos = keys.new_positions[i]
                mask[i, 0, :n, :c] &= (ctx_first[i] + torch.arange(c))[None, :] > (q_pos[:, None] - window)
                mask[i, 0, :n, max_ctx : max_ctx + n] &= q_pos[None, :] > (q_pos[:, None] - window)
            # Padding query rows attend to one real key so softmax stays finite; their output is dropped.
            mask[i, 0, n:, max_ctx] = True
        # Additive float mask: SDPA's CPU kernels are markedly faster with it than with a bool mask.
        return torch.zeros(mask.shape, dtype=keys.dtype).masked_fill_(~mask, float("-inf")).to(device)

    for nm, n in zip(keys.new_masks, new_lens, strict=True):  # checked now, whoever builds the mask
        assert nm is None or nm.shape == (n, n), f"new-token mask must be [{n}, {n}], got {tuple(nm.shape)}"
    ctx = None
    if max_ctx > 0 and b == 1 and window is None and ctx_slots[0].device == device and ctx_slots[0].is_contiguous():
        ctx = ctx_slots[0][:, None]  # [G, 1, ctx]: the slots as given (read only), not a padded copy
    elif max_ctx > 0:
        ctx = torch.zeros(ctx_slots[0].shape[0], b, max_ctx, dtype=torch.long)
        for i, cs in enumerate(ctx_slots):
            ctx[:, i, : cs.shape[1]] = cs.cpu()
        # -1: rows the local layers' pool released; only the full view has them, in the local row that
        # global layers never read (a window view cuts them off)
        assert window is None or not bool((ctx < 0).any()), "a sliding window reaches released KV rows"
        ctx = ctx.to(device)
    return AttentionBatch(
        positions=positions,
        sink=sink,
        cache=cache,
        ctx_slots=ctx,
        pad_index=pad_index,
        unpad_index=unpad_index,
        mask_fn=None if causal or see_all else build_mask,
        is_causal=causal and max_new > 1,
        num_seqs=b,
        max_new=max_new,
        max_ctx=max_ctx,
        seq_meta=torch.tensor(list(zip(ctx_lens, keys.starts, new_lens, strict=True)), dtype=torch.int32),
        plain_causal=window is None and all(nm is None for nm in keys.new_masks),
    )


def paged_attention(
    layer: int,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    fixed_order: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write this layer's new K/V through the sink, then attend context + new tokens.

    ``window``: a sliding-window layer (keys ``(p - window, p]``); ``softcap``: scores become
    ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2). ``fixed_order`` (the int8
    numerics mode, CPU fp32): each query row is reduced in one fixed order over its visible keys
    (kernels/attention.c), so its result is bit-identical however many rows and keys share the
    forward; SDPA's order depends on the shapes."""
    batch.sink.write(layer, **({"k": k, "v": v} if batch.cache is None else batch.cache.rows(layer, k, v)))
    batch = batch.windowed(window)
    if fixed_order and q.dtype == torch.float32 and q.device.type == "cpu" and kernels.load() is not None and (
            kernel_reads(batch.cache)):
        return _fixed_order_attention(layer, q, k, v, batch, scale, softcap)
    if batch.cache is not None and batch.cache.dtype != q.dtype:
        # a narrower cache (kv_cache_dtype): attend to this forward's K/V as the cache holds them, so a
        # token's K/V are the same numbers in the step that makes them and in every later one
        k, v = k.to(batch.cache.dtype).to(q.dtype), v.to(batch.cache.dtype).to(q.dtype)
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
        slots = batch.ctx_slots[batch.cache.slot_row(layer)].view(-1)
        k_pool, v_pool = batch.cache.layer_kv(layer)
        kc = k_pool.index_select(0, slots).view(b, batch.max_ctx, hkv, d).to(q.dtype)
        vc = v_pool.index_select(0, slots).view(b, batch.max_ctx, hkv, d).to(q.dtype)
        kp = torch.cat([kc, kp], dim=1)
        vp = torch.cat([vc, vp], dim=1)
    kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)  # [B, Hkv, L, D]
    g = h // hkv
    if batch.is_causal:
        # Single-sequence prefill: SDPA's causal kernel needs one query row per head, so expand K/V.
        qp = qp.transpose(1, 2)
        if g > 1:
            kp, vp = kp.repeat_interleave(g, dim=1), vp.repeat_interleave(g, dim=1)
        out = _sdpa(qp, kp, vp, None, True, scale, softcap)
        out = out.transpose(1, 2).reshape(b * n, h, d)
    else:
        # GQA without copying K/V: the G query heads sharing a KV head become G*n query rows of it
        # (head j uses KV head j // G, as in HF's repeat_kv). Row r = g_idx * n + i.
        qg = qp.view(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
        mask = batch.grouped_mask(g, q.dtype)
        out = _sdpa(qg, kp, vp, mask, False, scale, softcap)
        out = out.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, h, d)  # [B * max_new, H, D]
    return out if b == 1 else out.index_select(0, batch.unpad_index)


def kernel_reads(cache: Any) -> bool:
    """kernels/attention.c can read this cache in place: none, fp32 or IEEE half K/V."""
    return cache is None or cache.dtype in (torch.float32, torch.float16)


def kv_half(cache: Any) -> bool:
    """The cache holds IEEE half K/V (kernels/attention.c reads them widened, this forward's rounded)."""
    return cache is not None and cache.dtype == torch.float16


def _fixed_order_attention(
    layer: int,
    q: torch.Tensor,  # [num_tokens, H, D] packed
    k: torch.Tensor,  # [num_tokens, Hkv, D] this forward's keys
    v: torch.Tensor,  # [num_tokens, Hkv, D]
    batch: AttentionBatch,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [num_tokens, H, D]
    """kernels/attention.c on the packed tokens: context keys read in place from the cache layer by
    slot, this forward's keys from ``k``/``v``; nothing is gathered or padded."""
    lib = kernels.load()
    assert lib is not None and batch.seq_meta is not None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    t, h, d = q.shape
    kc = vc = None
    slots = 0
    if batch.ctx_slots is not None and batch.cache is not None:
        kc, vc = batch.cache.layer_kv(layer)
        assert kc.is_contiguous() and vc.is_contiguous()
        slots = batch.slot_rows_ptr(batch.cache.slot_row(layer))
    mask = batch.fixed_order_mask()
    out = torch.empty_like(q)
    lib.ratchet_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if kc is None else kc.data_ptr(),
                          0 if vc is None else vc.data_ptr(), slots, batch.max_ctx,
                          batch.seq_meta.data_ptr(), batch.max_new, 0 if mask is None else mask.data_ptr(),
                          batch.num_seqs, h, k.shape[1], d, scale, softcap or 0.0, int(kv_half(batch.cache)),
                          out.data_ptr(), torch.get_num_threads())
    return out


def _sdpa(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, H, Lk, D]
    v: torch.Tensor,  # [B, H, Lk, D]
    mask: torch.Tensor | None,  # [B, 1, Lq, Lk] additive
    is_causal: bool,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [B, H, Lq, D]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    # SDPA has no soft-cap: the textbook form, in HF's order (cap before the mask, fp32 softmax)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu_(lk - lq + 1), float("-inf"))
    elif mask is not None:
        s = s + mask
    return torch.matmul(s.softmax(-1, dtype=torch.float32).to(q.dtype), v)
