"""The one write point and its staging, for both cache layouts: the llama family's K/V (pools k, v
in one slot group) and a DeepSeek-V4-shaped layout (pools over different layer sets, a string
layer key, fp32 rows, each pool its own group). Explicit (out-of-order) token indices, one slot
per token for all layers, all-or-nothing commit with rollback, fake-tensor and stage-failure
fallbacks, separate operation / token counts."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.pools import Pools
from ratchetlm.kv.sink import StepSink
from ratchetlm.kv.staging import StagingBuffer, StagingCommitError

LAYERS, H, D = 4, 2, 3
ROWS = 16  # slots per pool


class Layout:
    """pools + which pools each layer key writes (in layer order)."""

    def __init__(self, kind: str) -> None:
        if kind == "llama":
            self.pools: Pools = KVCache(LAYERS, num_blocks=4, block_size=4, num_kv_heads=H, head_dim=D,
                                        dtype=torch.float32, device="cpu")
            self.writes: dict[Hashable, list[str]] = {i: ["k", "v"] for i in range(LAYERS)}
        else:
            self.pools = Pools()
            self.pools.add("ori", [0, 1, 2, "mtp0"], ROWS, (D,), torch.float32, "cpu")
            self.pools.add("cmp", [1, 2], ROWS, (D,), torch.float32, "cpu")
            self.pools.add("state", [2], ROWS, (2 * D,), torch.float32, "cpu")
            self.writes = {0: ["ori"], 1: ["ori", "cmp"], 2: ["ori", "cmp", "state"], "mtp0": ["ori"]}
        for t in self.pools.stacked.values():
            t.normal_()  # committed content that a failed commit must not disturb

    def slots(self, per_token: list[int]) -> dict[str, torch.Tensor]:
        """Every group gets the same slots, except V4's ``cmp``: only even slots are pooled."""
        s = torch.tensor(per_token)
        return {g: torch.where(s % 2 == 0, s, -1) if g == "cmp" else s for g in self.pools.groups}

    def forward(self, buf: StagingBuffer, stage_index: torch.Tensor, slots: dict[str, torch.Tensor]):
        """One forward's writes through the sink; returns the rows fed, by (pool, layer)."""
        sink = StepSink(self.pools, slots, buf, stage_index)
        n = stage_index.shape[0]
        fed = {}
        for layer, pools in self.writes.items():
            rows = {p: torch.randn(n, *self.pools.stacked[p].shape[2:]) for p in pools}
            fed.update({(p, layer): v for p, v in rows.items()})
            sink.write(layer, **rows)
        return fed

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {p: t.clone() for p, t in self.pools.stacked.items()}

    def unchanged(self, snap: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(t, snap[p]) for p, t in self.pools.stacked.items())


KINDS = ["llama", "v4"]


def make(kind: str, capacity: int = 8) -> tuple[Layout, StagingBuffer]:
    lay = Layout(kind)
    return lay, StagingBuffer(lay.pools, capacity)


@pytest.mark.parametrize("kind", KINDS)
def test_direct_rows_are_written_now_staged_rows_only_when_committed(kind):
    lay, buf = make(kind)
    before = lay.snapshot()
    stage_index = torch.tensor([-1, 3, 0, -1, 4, 1, 2])  # tokens 0 and 3 direct; the rest in any order
    slots = lay.slots([10, 11, 12, 9, 13, 14, 15])
    fed = lay.forward(buf, stage_index, slots)
    for (pool, layer), rows in fed.items():
        t, s = lay.pools.get(pool, layer), slots[lay.pools.group[pool]]
        for tok in (0, 3):  # direct rows landed at their slots, in every layer of their pools
            if s[tok] >= 0:
                assert torch.equal(t[s[tok]], rows[tok])
    direct = {p: {int(slots[lay.pools.group[p]][t]) for t in (0, 3)} - {-1} for p in lay.pools.stacked}
    for p, t in lay.pools.stacked.items():  # nothing staged reached the pools
        other = [r for r in range(t.shape[1]) if r not in direct[p]]
        assert torch.equal(t[:, other], before[p][:, other]), p
    # commit tokens 4, 2, 6 (a tree path need not be contiguous or sorted): each to its own slot
    tokens = [4, 2, 6]
    snap = lay.snapshot()
    buf.commit(stage_index[tokens])
    written = 0
    for (pool, layer), rows in fed.items():
        s = slots[lay.pools.group[pool]]
        for tok in tokens:
            if s[tok] >= 0:
                assert torch.equal(lay.pools.get(pool, layer)[s[tok]], rows[tok])
                written += rows[tok].numel() * 4
    for p, t in lay.pools.stacked.items():
        hit = {int(slots[lay.pools.group[p]][tok]) for tok in tokens} - {-1}
        other = [r for r in range(t.shape[1]) if r not in hit]
        assert torch.equal(t[:, other], snap[p][:, other]), p
    assert buf.metrics.tokens_committed == 3 and buf.metrics.bytes_committed == written


@pytest.mark.parametrize("kind", KINDS)
def test_unique_tokens_and_stage_operations_are_counted_separately(kind):
    lay, buf = make(kind)
    lay.forward(buf, torch.tensor([0, 1, 2, -1, 3]), lay.slots([1, 2, 3, 4, 5]))  # one direct row
    lay.forward(buf, torch.tensor([1, 0]), lay.slots([6, 7]))
    assert buf.metrics.unique_tokens == 4 + 2
    assert buf.metrics.stage_operations == len(lay.writes) * (4 + 2)  # layer x token, all pools of a layer at once


@pytest.mark.parametrize("kind,fault_pool,fault_layer", [("llama", None, 0), ("llama", None, 1), ("llama", "v", 3),
                                                         ("v4", None, 0), ("v4", None, 2), ("v4", "state", 0),
                                                         ("v4", "cmp", 1)])
def test_fault_inside_the_commit_leaves_every_pool_untouched(kind, fault_pool, fault_layer):
    lay, buf = make(kind)
    lay.forward(buf, torch.arange(4), lay.slots([5, 6, 7, 8]))
    before, bytes_before = lay.snapshot(), lay.pools.bytes_written
    buf.fault_layer, buf.fault_pool = fault_layer, fault_pool
    with pytest.raises(StagingCommitError, match=f"layer {fault_layer}"):
        buf.commit(torch.tensor([0, 2, 3]))
    assert lay.unchanged(before)
    # rows before the fault were physically written, then restored (unless it hit the first layer of the first pool)
    first = fault_pool is None or fault_pool == buf.staged_pools[0]
    assert (lay.pools.bytes_written > bytes_before) == (not (first and fault_layer == 0))
    assert buf.metrics.fallback_commit_fail == 1 and buf.metrics.tokens_committed == 0
    assert buf.metrics.bytes_committed == 0  # restored rows are not committed bytes
    buf.fault_layer = None  # the same staged rows commit fine afterwards
    buf.commit(torch.tensor([0, 2, 3]))
    assert buf.metrics.tokens_committed == 3 and not lay.unchanged(before)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_not_staged_this_forward_or_out_of_range_are_refused(kind):
    lay, buf = make(kind)
    lay.forward(buf, torch.tensor([0, 1]), lay.slots([1, ROWS + 100]))  # token 1's slot is past every pool
    before = lay.snapshot()
    with pytest.raises(StagingCommitError, match="not staged"):
        buf.commit(torch.tensor([0, 5]))  # row 5 holds nothing from this forward
    with pytest.raises(StagingCommitError, match="out-of-range"):
        buf.commit(torch.tensor([0, 1]))
    assert lay.unchanged(before) and buf.metrics.fallback_commit_fail == 2


@pytest.mark.parametrize("kind", KINDS)
def test_meta_tensors_are_never_committed(kind):
    lay, buf = make(kind)
    sink = StepSink(lay.pools, lay.slots([3, 4]), buf, torch.tensor([0, 1]))
    for layer, pools in lay.writes.items():
        sink.write(layer, **{p: torch.empty(2, *lay.pools.stacked[p].shape[2:], device="meta") for p in pools})
    before = lay.snapshot()
    with pytest.raises(StagingCommitError, match="abandoned"):
        buf.commit(torch.tensor([0, 1]))
    assert lay.unchanged(before)
    assert buf.metrics.fallback_fake_tensor == 1 and buf.metrics.fallback_commit_fail == 0


@pytest.mark.parametrize("kind,fault", [("llama", ("layer", 0)), ("llama", ("layer", 2)), ("llama", ("pool", "v")),
                                        ("v4", ("layer", "mtp0")), ("v4", ("layer", 1)), ("v4", ("pool", "state"))])
def test_stage_failure_abandons_the_forward_once_and_the_next_forward_stages(kind, fault):
    lay, buf = make(kind)
    setattr(buf, "fault_stage_" + fault[0], fault[1])
    lay.forward(buf, torch.arange(4), lay.slots([3, 4, 5, 6]))
    before = lay.snapshot()
    assert not buf.usable
    assert buf.metrics.fallback_stage_fail == 1  # once per forward, not per layer
    keys = list(lay.writes)
    ok = next(i for i, k in enumerate(keys) if k == fault[1] or fault[1] in lay.writes[k])
    assert buf.metrics.stage_operations == ok * 4  # layers after the fault staged nothing
    assert buf.metrics.unique_tokens == 0  # counted on success only: these rows are never committed or rejected
    with pytest.raises(StagingCommitError, match="abandoned"):
        buf.commit(torch.tensor([0, 1]))
    assert lay.unchanged(before) and buf.metrics.fallback_commit_fail == 0
    setattr(buf, "fault_stage_" + fault[0], None)
    fed = lay.forward(buf, torch.arange(4), lay.slots([3, 4, 5, 6]))
    buf.commit(torch.tensor([0, 1]))
    buf.reject(torch.tensor([2, 3]))
    m = buf.metrics
    assert m.unique_tokens == 4 == m.tokens_committed + m.tokens_rejected
    last = keys[-1]
    pool = lay.writes[last][-1]
    assert torch.equal(lay.pools.get(pool, last)[4], fed[(pool, last)][1])
    assert buf.metrics.fallback_stage_fail == 1


@pytest.mark.parametrize("kind", KINDS)
def test_capacity_bounds_the_buffer(kind):
    lay, buf = make(kind, capacity=5)
    assert buf.max_tokens == 0 and not buf.buffers  # allocated on demand
    lay.forward(buf, torch.arange(3), lay.slots([1, 2, 3]))
    assert buf.max_tokens == 5 and all(b.shape[1] == 5 for b in buf.buffers.values())  # grew, capped
    with pytest.raises(AssertionError):
        lay.forward(buf, torch.arange(6), lay.slots([1, 2, 3, 4, 5, 6]))
    with pytest.raises(ValueError, match="capacity"):
        StagingBuffer(lay.pools, capacity=0)


@pytest.mark.parametrize("kind", KINDS)
def test_metrics_have_the_designs_meaning(kind):
    lay, buf = make(kind)
    slots = lay.slots([2, 3, 4, 5, 6])
    lay.forward(buf, torch.arange(5), slots)
    buf.commit(torch.tensor([0, 1]))
    buf.reject(torch.tensor([2, 3, 4]))
    d = buf.metrics.as_dict()
    assert d["kv_staging_unique_tokens"] == 5 and d["kv_staging_stage_operations"] == 5 * len(lay.writes)
    assert d["kv_staging_efficiency"] == pytest.approx(1 / len(lay.writes))
    assert d["kv_staging_tokens_committed"] == 2 and d["kv_staging_tokens_rejected"] == 3
    assert d["kv_staging_acceptance_rate"] == pytest.approx(2 / 5)
    # bytes avoided: the rejected rows, all layers of every pool that had a slot for them
    want = sum(int((slots[lay.pools.group[p]][2:] >= 0).sum()) * lay.pools.row_bytes(p) for p in lay.pools.stacked)
    assert d["kv_staging_bytes_avoided"] == want
    if kind == "llama":
        assert want == 3 * lay.pools.bytes_per_token() == 3 * 2 * LAYERS * H * D * 4  # type: ignore[attr-defined]
    assert d["kv_staging_fallbacks"] == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("slot_of,tokens,sliced", [
    ([4, 5, 6, 7, 8], [0, 1, 2], True),  # a chain's accepted rows: one run in the buffer and the pool
    ([6, 7, 12, 13, 14], [0, 1, 2, 3], True),  # positions crossing into a block that does not follow: two runs
    ([4, 5, 6, 7, 8], [0, 2, 4], False),  # a tree's path: three runs, gathered
    ([4, 5, 6, 7, 8], [3, 1], True),  # out of order: two runs of one row
    ([4, 5, 6, 7, 8], [4, 2, 0], False),  # out of order, three runs
])
def test_commit_copies_runs_as_slices_and_the_rest_gathered(kind, slot_of, tokens, sliced, monkeypatch):
    """Every committed row lands at its slot in every layer and nothing else moves, whether the rows
    went as slices (at most SLICE_RUNS runs) or gathered; a fault restores either way."""
    lay, buf = make(kind)
    slots = lay.slots(slot_of)
    fed = lay.forward(buf, torch.arange(5), slots)
    kinds = []
    copy_rows = lay.pools.copy_rows
    monkeypatch.setattr(lay.pools, "copy_rows",
                        lambda p, v, s: kinds.append(isinstance(s, slice)) or copy_rows(p, v, s))
    buf.fault_layer = 1
    before = lay.snapshot()
    with pytest.raises(StagingCommitError):
        buf.commit(torch.tensor(tokens))
    assert lay.unchanged(before)
    buf.fault_layer = None
    kinds.clear()
    buf.commit(torch.tensor(tokens))
    # V4's cmp pool keeps even slots only: its run count may differ from the other pools'
    if kind == "llama":
        assert kinds and all(k == sliced for k in kinds)
    for p, t in lay.pools.stacked.items():
        s = slots[lay.pools.group[p]]
        hit = {int(s[tok]): tok for tok in tokens if s[tok] >= 0}
        for layer in lay.pools.layers(p):
            now, was = lay.pools.get(p, layer), before[p][lay.pools.layer_index(p, layer)]
            for r in range(t.shape[1]):
                want = fed[(p, layer)][hit[r]] if r in hit else was[r]
                assert torch.equal(now[r], want), (p, layer, r)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage_index,slot_of", [
    ([-1, -1, -1], [3, 4, 5]),  # a decode step's or a prompt chunk's rows: one slice
    ([-1, -1, -1], [5, 3, 4]),  # not consecutive: an index_copy_
    ([-1, 0, -1, -1], [3, 9, 4, 5]),  # direct rows around a staged one: rows gathered, slots a slice
])
def test_direct_rows_land_at_their_slots_as_slices_or_gathered(kind, stage_index, slot_of):
    lay, buf = make(kind)
    before = lay.snapshot()
    slots = lay.slots(slot_of)
    si = torch.tensor(stage_index)
    fed = lay.forward(buf, si, slots)
    for p, t in lay.pools.stacked.items():
        s = slots[lay.pools.group[p]]
        hit = {int(s[i]): i for i in range(len(stage_index)) if stage_index[i] < 0 and s[i] >= 0}
        for layer in lay.pools.layers(p):
            now, was = lay.pools.get(p, layer), before[p][lay.pools.layer_index(p, layer)]
            for r in range(t.shape[1]):
                assert torch.equal(now[r], fed[(p, layer)][hit[r]] if r in hit else was[r]), (p, layer, r)
