"""The fixed-order attention kernel (kernels/attention.c) at decode and verify shapes over a long half
cache: the lean loops a half cache's context rows take (whole blocks of slots for the keys, a literal
query count and masked skips for the values) keep the contract. Every build gives the same bits, a row's
bits do not depend on the other sequences or rows of the call, and the values are a float64 softmax
attention's within a stated tolerance."""

from __future__ import annotations

import pytest
import torch

from ..conftest import KERNEL_VARIANTS

H, HKV, D = 9, 3, 64  # the default model's heads: 3 query heads a KV head
CTX = (1000, 17, 300, 0)  # cached keys per sequence: many whole blocks, one and a tail, some, none
NEW = (1, 5, 1, 3)  # new rows per sequence: decode rows and verify chains


def _call(lib, q, k, v, kc, vc, slots, meta, mask, max_ctx, max_new, threads=1) -> torch.Tensor:
    out = torch.full_like(q, 7.0)
    lib.ratchet_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(),
                          max_ctx, meta.data_ptr(), max_new, 0 if mask is None else mask.data_ptr(), meta.shape[0],
                          H, HKV, D, 0.125, 0.0, 1, out.data_ptr(), threads)
    return out


def _case(seed: int, peaked: bool):
    """A half cache at scattered slots, the sequences' new rows packed; ``peaked``: queries scaled so that
    most of a long context's probabilities underflow to exactly 0 (the skipped keys)."""
    g = torch.Generator().manual_seed(seed)
    nslots = sum(CTX) + 64
    kc = torch.randn(nslots, HKV, D, generator=g).half()
    vc = torch.randn(nslots, HKV, D, generator=g).half()
    perm = torch.randperm(nslots, generator=g)
    max_ctx, t = max(CTX), sum(NEW)
    slots = torch.zeros(len(CTX), max_ctx, dtype=torch.int64)
    o = 0
    for i, c in enumerate(CTX):
        slots[i, :c] = perm[o : o + c]
        o += c
    q = torch.randn(t, H, D, generator=g) * (40.0 if peaked else 1.0)
    k, v = torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    meta = torch.tensor([[c, sum(NEW[:i]), n] for i, (c, n) in enumerate(zip(CTX, NEW, strict=True))],
                        dtype=torch.int32)
    return q, k, v, kc, vc, slots, meta


def _reference(q, k, v, kc, vc, slots, meta) -> torch.Tensor:
    """float64 softmax attention, causal among each sequence's new rows, new K/V rounded to half as the
    cache holds them."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, (c, s, n) in enumerate(meta.tolist()):
        keys = torch.cat([kc[slots[b, :c]].double(), k[s : s + n].half().double()])  # [c + n, HKV, D]
        vals = torch.cat([vc[slots[b, :c]].double(), v[s : s + n].half().double()])
        for i in range(n):
            for h in range(H):
                kv = h // (H // HKV)
                sc = keys[: c + i + 1, kv] @ q[s + i, h].double() * 0.125
                out[s + i, h] = torch.softmax(sc, 0) @ vals[: c + i + 1, kv]
    return out


@pytest.mark.parametrize("peaked", [False, True])
def test_every_build_gives_the_same_bits_at_long_context_and_each_row_is_its_own(peaked, kernel_builds):
    libs = {name: kernel_builds[name] for name in KERNEL_VARIANTS}
    if None in libs.values():
        pytest.skip("no C compiler")
    q, k, v, kc, vc, slots, meta = _case(0, peaked)
    max_ctx, max_new = max(CTX), max(NEW)
    got = {name: _call(lib, q, k, v, kc, vc, slots, meta, None, max_ctx, max_new) for name, lib in libs.items()}
    native = got["native"]
    for name in libs:
        assert torch.equal(got[name], native), name  # (no NaN: every row sees at least its own key)
    assert torch.equal(_call(libs["native"], q, k, v, kc, vc, slots, meta, None, max_ctx, max_new, threads=2), native)
    # each sequence alone: the same bits as in the batch
    for b, (c, s, n) in enumerate(meta.tolist()):
        own = slots[b : b + 1, : max(c, 1)].contiguous()
        alone = _call(libs["native"], q[s : s + n], k[s : s + n], v[s : s + n], kc, vc, own,
                      torch.tensor([[c, 0, n]], dtype=torch.int32), None, max(c, 1), n)
        assert torch.equal(alone, native[s : s + n]), b
    ref = _reference(q, k, v, kc, vc, slots, meta)
    # fp32 sums of up to 1,000 terms: within 2e-5 absolute + 1e-4 relative of float64
    torch.testing.assert_close(native.double(), ref, atol=2e-5, rtol=1e-4)
    if peaked:  # the skipped keys are not vacuous: the long context's row has probabilities of exactly 0
        sc = kc[slots[0, :1000], 0].float() @ q[0, 0] * 0.125
        assert bool(((sc - sc.max()) < -88).sum() > 100)


def test_a_verify_row_equals_the_decode_row_it_becomes():
    """Row i of a verify chain over context c sees c + i + 1 keys, as a decode row at context c + i does
    (its previous rows then cached): the same bits, through the lean blocks of a half cache."""
    from ratchetlm import kernels

    lib = kernels.load()
    if lib is None:
        pytest.skip("no C compiler")
    q, k, v, kc, vc, slots, meta = _case(1, False)
    c, n = CTX[0], 5
    chain = torch.tensor([[c, 0, n]], dtype=torch.int32)
    qs, ks, vs = q[:1].repeat(n, 1, 1) + torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    nslots = kc.shape[0]
    kc2, vc2 = torch.cat([kc, ks.half()]), torch.cat([vc, vs.half()])  # the chain's rows, cached at the end
    row_slots = torch.cat([slots[0, :c], torch.arange(nslots, nslots + n)])
    verify = _call(lib, qs, ks, vs, kc2, vc2, slots[:1, :c].contiguous(), chain, None, c, n)
    for i in range(n):
        one = torch.tensor([[c + i, 0, 1]], dtype=torch.int32)
        dec = _call(lib, qs[i : i + 1], ks[i : i + 1], vs[i : i + 1], kc2, vc2,
                    row_slots[None, : c + i].contiguous(), one, None, c + i, 1)
        assert torch.equal(dec, verify[i : i + 1]), i


@pytest.mark.parametrize("peaked", [False, True])
def test_a_tree_verify_of_many_rows_over_a_long_context_is_every_builds_and_each_rows_own(peaked, kernel_builds):
    """Nine verify rows (a tree draft's mask) over 1,000 cached keys: 27 queries a KV head, so the AVX-512
    build takes its grouped path (a group's tiles share each block of keys and values); its bits are the
    other builds', and each row's are those of the row computed alone (one tile, the ungrouped path)."""
    libs = {name: kernel_builds[name] for name in KERNEL_VARIANTS}
    if None in libs.values():
        pytest.skip("no C compiler")
    q, k, v, kc, vc, slots, _ = _case(2, peaked)
    c, n = CTX[0], 9
    parent = [-1, 0, 0, 1, 1, 2, 2, 3, 4]
    mask = torch.full((1, n, c + n), float("-inf"))
    mask[0, :, :c] = 0.0
    for i in range(n):
        j = i
        while j >= 0:
            mask[0, i, c + j] = 0.0
            j = parent[j]
    g = torch.Generator().manual_seed(3)
    qs = q[:1].repeat(n, 1, 1) + torch.randn(n, H, D, generator=g)
    ks, vs = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    meta = torch.tensor([[c, 0, n]], dtype=torch.int32)
    own = slots[:1, :c].contiguous()
    got = {name: _call(lib, qs, ks, vs, kc, vc, own, meta, mask, c, n) for name, lib in libs.items()}
    for name in libs:
        assert torch.equal(got[name], got["native"]), name
    nslots = kc.shape[0]
    kc2, vc2 = torch.cat([kc, ks.half()]), torch.cat([vc, vs.half()])  # the draft's rows, cached at the end
    row_slots = torch.cat([own[0], torch.arange(nslots, nslots + n)])
    for i in range(n):  # row i as a decode row over the context and rows 0..i-1 cached (its ancestors among them)
        one = _call(libs["native"], qs[i : i + 1], ks[i : i + 1], vs[i : i + 1], kc2, vc2,
                    row_slots[None, : c + i].contiguous(), torch.tensor([[c + i, 0, 1]], dtype=torch.int32),
                    mask[:, i : i + 1, : c + i + 1].contiguous(), c + i, 1)
        assert torch.equal(one, got["native"][i : i + 1]), i
