"""Staging buffer: explicit (out-of-order) token indices, one slot space for all layers,
all-or-nothing commit with rollback, fake-tensor fallback, separate operation/token counts."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.staging import StagingBuffer, StagingCommitError, StepSink

LAYERS, H, D = 4, 2, 3


def make() -> tuple[KVCache, StagingBuffer]:
    cache = KVCache(LAYERS, num_blocks=4, block_size=4, num_kv_heads=H, head_dim=D, dtype=torch.float32,
                    device="cpu")
    cache.k.normal_()  # pre-existing committed content that a failed commit must not disturb
    cache.v.normal_()
    return cache, StagingBuffer(cache, max_tokens=8)


def stage_forward(buf: StagingBuffer, cache: KVCache, stage_index: torch.Tensor, n: int):
    """Run one forward's writes through the StepSink; returns the per-layer K/V that were fed."""
    sink = StepSink(cache, torch.full((n,), -1, dtype=torch.long), buf, stage_index)
    ks = [torch.randn(n, H, D) for _ in range(LAYERS)]
    vs = [torch.randn(n, H, D) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        sink.write(layer, ks[layer], vs[layer])
    return ks, vs


def test_out_of_order_indices_and_any_subset_commit():
    cache, buf = make()
    n = 5
    stage_index = torch.tensor([3, 0, 4, 1, 2])  # packed token i lives in buffer row stage_index[i]
    before_k = cache.k.clone()
    ks, vs = stage_forward(buf, cache, stage_index, n)
    assert torch.equal(cache.k, before_k), "staging must not touch the persistent cache"
    # commit packed tokens 4, 0, 2 (a root-to-node path need not be contiguous or sorted)
    tokens = [4, 0, 2]
    rows = stage_index[tokens]
    slots = torch.tensor([9, 2, 13])
    buf.commit(rows, slots)
    for layer in range(LAYERS):
        for t, s in zip(tokens, slots.tolist(), strict=True):
            assert torch.equal(cache.k[layer, s], ks[layer][t])
            assert torch.equal(cache.v[layer, s], vs[layer][t])
    untouched = torch.ones(cache.num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache.k[:, untouched], before_k[:, untouched])
    assert buf.metrics.tokens_committed == 3
    assert buf.metrics.bytes_committed == 3 * cache.bytes_per_token()


def test_unique_tokens_and_stage_operations_are_counted_separately():
    cache, buf = make()
    stage_forward(buf, cache, torch.tensor([0, 1, 2, -1, 3]), 5)  # one direct (unstaged) row
    stage_forward(buf, cache, torch.tensor([1, 0]), 2)
    assert buf.metrics.unique_tokens == 4 + 2
    assert buf.metrics.stage_operations == LAYERS * (4 + 2)


@pytest.mark.parametrize("fault_layer", [0, 1, LAYERS - 1])
def test_fault_at_commit_layer_k_leaves_cache_untouched(fault_layer):
    cache, buf = make()
    stage_forward(buf, cache, torch.arange(4), 4)
    before_k, before_v, before_bytes = cache.k.clone(), cache.v.clone(), buf.metrics.bytes_committed
    buf.fault_layer = fault_layer
    with pytest.raises(StagingCommitError, match=f"layer {fault_layer}"):
        buf.commit(torch.tensor([0, 2, 3]), torch.tensor([5, 6, 7]))
    assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)
    assert buf.metrics.fallback_commit_fail == 1 and buf.metrics.tokens_committed == 0
    assert buf.metrics.bytes_committed == before_bytes
    buf.fault_layer = None  # the same staged rows commit fine afterwards
    buf.commit(torch.tensor([0, 2, 3]), torch.tensor([5, 6, 7]))
    assert buf.metrics.tokens_committed == 3


def test_rows_not_staged_this_forward_or_out_of_range_are_refused():
    cache, buf = make()
    stage_forward(buf, cache, torch.tensor([0, 1]), 2)
    before = cache.k.clone()
    with pytest.raises(StagingCommitError):
        buf.commit(torch.tensor([0, 5]), torch.tensor([1, 2]))  # row 5 holds nothing from this forward
    with pytest.raises(StagingCommitError):
        buf.commit(torch.tensor([0]), torch.tensor([cache.num_slots]))
    assert torch.equal(cache.k, before)


def test_meta_tensors_are_never_committed():
    cache, buf = make()
    sink = StepSink(cache, torch.full((2,), -1, dtype=torch.long), buf, torch.tensor([0, 1]))
    for layer in range(LAYERS):
        sink.write(layer, torch.empty(2, H, D, device="meta"), torch.empty(2, H, D, device="meta"))
    before = cache.k.clone()
    with pytest.raises(StagingCommitError, match="real storage"):
        buf.commit(torch.tensor([0, 1]), torch.tensor([3, 4]))
    assert torch.equal(cache.k, before)
    assert buf.metrics.fallback_fake_tensor == 1
