"""Paged attention (packed, padded, GQA-grouped) equals a naive per-token reference."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.sink import DirectSink
from ratchetlm.layers.attention import build_attention_batch, paged_attention


def _naive(q, ks, vs, visible, groups, scale):  # q [H, D], ks/vs [L, Hkv, D], visible [L] bool
    kk, vv = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
    s = torch.einsum("hd,lhd->hl", q, kk) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hl,lhd->hd", s.softmax(-1), vv)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (9, 3)])
def test_paged_attention_matches_naive(heads, kv_heads):
    torch.manual_seed(0)
    d, bs = 8, 4
    cache = KVCache(2, 16, bs, kv_heads, d, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    # three sequences: context in scattered (non-contiguous) slots, different new-token counts and masks
    ctx = [torch.tensor([9, 10, 11, 40, 41]), torch.tensor([], dtype=torch.long), torch.tensor([20, 21])]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    new_lens, masks = [3, 2, 1], [tree, None, None]
    t = sum(new_lens)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    slots = torch.tensor([50, 51, -1, 60, 61, 62])
    batch = build_attention_batch(torch.zeros(t, dtype=torch.long), new_lens, ctx, masks,
                                  DirectSink(cache, slots), cache)
    before = cache.k[1].clone()
    out = paged_attention(1, q, k, v, batch, d**-0.5)
    # the write point wrote exactly the real slots of layer 1
    assert torch.equal(cache.k[1, 50], k[0]) and torch.equal(cache.k[1, 62], k[5])
    changed = (cache.k[1] != before).any(-1).any(-1).nonzero().flatten().tolist()
    assert changed == [50, 51, 60, 61, 62]
    expected, off = [], 0
    for c, n, m in zip(ctx, new_lens, masks, strict=True):
        m = torch.ones(n, n, dtype=torch.bool).tril() if m is None else m
        ks = torch.cat([before[c], k[off : off + n]])
        vs = torch.cat([cache.v[1][c], v[off : off + n]])
        for i in range(n):
            vis = torch.cat([torch.ones(len(c), dtype=torch.bool), m[i]])
            expected.append(_naive(q[off + i], ks, vs, vis, heads // kv_heads, d**-0.5))
        off += n
    assert torch.allclose(out, torch.stack(expected), atol=1e-5)


def test_single_sequence_fast_paths_match_naive():
    """B == 1 prefill (causal kernel) and B == 1 decode (no mask) agree with the reference."""
    torch.manual_seed(1)
    h, hkv, d = 6, 2, 8
    cache = KVCache(1, 8, 4, hkv, d, torch.float32, "cpu")
    q, k, v = torch.randn(5, h, d), torch.randn(5, hkv, d), torch.randn(5, hkv, d)
    b = build_attention_batch(torch.arange(5), [5], [torch.tensor([], dtype=torch.long)], [None],
                              DirectSink(cache, torch.arange(5)), cache)
    assert b.mask is None and b.is_causal
    out = paged_attention(0, q, k, v, b, d**-0.5)
    for i in range(5):
        vis = torch.arange(5) <= i
        assert torch.allclose(out[i], _naive(q[i], k, v, vis, 3, d**-0.5), atol=1e-5)
    q1, k1, v1 = torch.randn(1, h, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    b = build_attention_batch(torch.tensor([5]), [1], [torch.arange(5)], [None],
                              DirectSink(cache, torch.tensor([5])), cache)
    assert b.mask is None and not b.is_causal
    out = paged_attention(0, q1, k1, v1, b, d**-0.5)
    ks, vs = torch.cat([k, k1]), torch.cat([v, v1])
    assert torch.allclose(out[0], _naive(q1[0], ks, vs, torch.ones(6, dtype=torch.bool), 3, d**-0.5), atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_sliding_window_view_and_softcap_match_naive(softcap):
    """A sliding layer sees keys at positions (p - window, p]: committed context (cut to what any
    query can reach, possibly starting past position 0) and new tokens under a tree mask, judged
    by position; soft-capped scores cap * tanh(s / cap) before the mask."""
    torch.manual_seed(2)
    h, hkv, d, bs, window = 4, 2, 8, 4, 5
    cache = KVCache(1, 32, bs, hkv, d, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    # seq 0: context positions 0..9, a 3-token tree at positions 10, 11, 11; seq 1: its blocks below
    # position 8 were released, context rows are positions 8..12, one decode token at 13;
    # seq 2: no context, a 7-token prefill (longer than the window)
    ctx = [torch.arange(40, 50), torch.arange(60, 65), torch.tensor([], dtype=torch.long)]
    starts = [0, 8, 0]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    new_pos = [[10, 11, 11], [13], list(range(7))]
    masks = [tree, None, None]
    t = 11
    q, k, v = torch.randn(t, h, d) * 3, torch.randn(t, hkv, d) * 3, torch.randn(t, hkv, d)
    pos = torch.tensor([p for pp in new_pos for p in pp])
    batch = build_attention_batch(pos, [3, 1, 7], ctx, masks, DirectSink(cache, torch.full((t,), -1)), cache,
                                  ctx_starts=starts)
    out = paged_attention(0, q, k, v, batch, d**-0.5, window=window, softcap=softcap)
    assert batch.windowed(window).max_ctx < 10  # seq 0's rows below position 10 - 5 + 1 are not gathered

    def naive(qi, ks, vs, visible):
        kk, vv = ks.repeat_interleave(h // hkv, 1), vs.repeat_interleave(h // hkv, 1)
        s = torch.einsum("hd,lhd->hl", qi, kk) * d**-0.5
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        return torch.einsum("hl,lhd->hd", s.masked_fill(~visible[None], float("-inf")).softmax(-1), vv)

    off, expected = 0, []
    for c, c0, pp, m in zip(ctx, starts, new_pos, masks, strict=True):
        n = len(pp)
        m = torch.ones(n, n, dtype=torch.bool).tril() if m is None else m
        ks, vs = torch.cat([cache.k[0][c], k[off : off + n]]), torch.cat([cache.v[0][c], v[off : off + n]])
        kpos = torch.tensor(list(range(c0, c0 + len(c))) + pp)
        for i in range(n):
            vis = torch.cat([torch.ones(len(c), dtype=torch.bool), m[i]]) & (kpos > pp[i] - window)
            expected.append(naive(q[off + i], ks, vs, vis))
        off += n
    assert torch.allclose(out, torch.stack(expected), atol=1e-5)
