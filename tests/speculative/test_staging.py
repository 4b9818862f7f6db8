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
    return cache, StagingBuffer(cache, capacity=8)


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
    with pytest.raises(StagingCommitError, match="abandoned"):
        buf.commit(torch.tensor([0, 1]), torch.tensor([3, 4]))
    assert torch.equal(cache.k, before)
    assert buf.metrics.fallback_fake_tensor == 1 and buf.metrics.fallback_commit_fail == 0


@pytest.mark.parametrize("fault_layer", [0, 2])
def test_stage_failure_abandons_the_forward_once_and_the_next_forward_stages(fault_layer):
    cache, buf = make()
    buf.fault_stage_layer = fault_layer
    stage_forward(buf, cache, torch.arange(4), 4)
    before = cache.k.clone()
    assert not buf.usable
    assert buf.metrics.fallback_stage_fail == 1  # once per forward, not per layer
    assert buf.metrics.stage_operations == fault_layer * 4  # layers after the fault staged nothing
    with pytest.raises(StagingCommitError, match="abandoned"):
        buf.commit(torch.tensor([0, 1]), torch.tensor([3, 4]))
    assert torch.equal(cache.k, before) and buf.metrics.fallback_commit_fail == 0
    buf.fault_stage_layer = None
    ks, _ = stage_forward(buf, cache, torch.arange(4), 4)
    buf.commit(torch.tensor([0, 1]), torch.tensor([3, 4]))
    assert torch.equal(cache.k[LAYERS - 1, 4], ks[LAYERS - 1][1])
    assert buf.metrics.fallback_stage_fail == 1


def test_capacity_bounds_the_buffer():
    cache = KVCache(LAYERS, num_blocks=4, block_size=4, num_kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu")
    buf = StagingBuffer(cache, capacity=5)
    assert buf.k.shape[1] == 0  # allocated on demand
    stage_forward(buf, cache, torch.arange(3), 3)
    assert buf.k.shape[1] == 5  # grew to what was needed, capped by the capacity
    with pytest.raises(AssertionError):
        stage_forward(buf, cache, torch.arange(6), 6)
    with pytest.raises(ValueError, match="capacity"):
        StagingBuffer(cache, capacity=0)


def test_metrics_have_the_designs_meaning():
    cache, buf = make()
    stage_forward(buf, cache, torch.arange(5), 5)
    buf.commit(torch.tensor([0, 1]), torch.tensor([3, 4]))
    buf.reject(3)
    d = buf.metrics.as_dict()
    assert d["kv_staging_unique_tokens"] == 5 and d["kv_staging_stage_operations"] == 5 * LAYERS
    assert d["kv_staging_efficiency"] == pytest.approx(1 / LAYERS)
    assert d["kv_staging_tokens_committed"] == 2 and d["kv_staging_tokens_rejected"] == 3
    assert d["kv_staging_acceptance_rate"] == pytest.approx(2 / 5)
    assert d["kv_staging_bytes_avoided"] == 3 * cache.bytes_per_token() == 3 * 2 * LAYERS * H * D * 4
    assert d["kv_staging_fallbacks"] == 0
