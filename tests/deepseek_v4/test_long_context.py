"""Decode at high absolute positions (up to 16383) against the unpaged reference."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.models.deepseek_v4.attention import select_topk
from ratchetlm.models.deepseek_v4.decode import indexer_topk
from ratchetlm.models.deepseek_v4.paging import DecodeCapacity
from ratchetlm.models.deepseek_v4.reference import prefix_traces
from ratchetlm.models.deepseek_v4.runner import DeepseekV4Runner

ATOL = 5e-5
# Position capacity cases, CSA ratio-4 boundaries (3->4, 127->128, 511->512, 4095->4096,
# 8191->8192, 8703, 16383) and HCA ratio-128 boundaries (127->128, 255->256, ...): each
# sequence commits the token at `start`, then the one at `start + 1`.
STARTS = [0, 3, 127, 128, 255, 511, 4095, 8191, 8192, 8703, 16383]

pytestmark = pytest.mark.slow


def _restore(model, traces, starts, decode_seq, shuffle_seed=13):
    runner = DeepseekV4Runner(model, max_seqs=len(starts), shuffle_seed=shuffle_seed,
                              cap=DecodeCapacity.for_model(model.config, decode_seq=decode_seq))
    for s, p in enumerate(starts):
        runner.restore(s, prefix_traces(traces, p))
    return runner


@pytest.mark.parametrize("decode_seq", [2, 1])
def test_long_positions_batched_against_reference(model, long_run, decode_seq):
    ids, ref, traces = long_run
    runner = _restore(model, traces, STARTS, decode_seq)
    out = runner.decode({s: int(ids[p]) for s, p in enumerate(STARTS)})
    for s, p in enumerate(STARTS):
        torch.testing.assert_close(out[s], ref[p], atol=ATOL, rtol=1e-4, msg=f"start {p}")
    second = {s: int(ids[p + 1]) for s, p in enumerate(STARTS) if p + 1 < len(ids)}
    out = runner.decode(second)
    for s in second:
        p = STARTS[s] + 1
        torch.testing.assert_close(out[s], ref[p], atol=ATOL, rtol=1e-4, msg=f"position {p}")
    assert runner.lengths == {s: p + 1 + (s in second) for s, p in enumerate(STARTS)}


@pytest.mark.parametrize("kv_seq_len", [8192, 8704, 16384])
def test_indexer_topk_at_long_context(model, long_run, kv_seq_len):
    ids, _, traces = long_run
    p = kv_seq_len - 1
    runner = _restore(model, traces, [p], decode_seq=2)
    runner.decode({0: int(ids[p])})  # writes the entry completed at p, commits kv_seq_len tokens
    meta, cache = runner.last_meta, runner.cache
    layer = model.config.layers_of_kind["compressed_sparse_attention"][0]
    attn = model.model.layers[layer].self_attn
    g = torch.Generator().manual_seed(kv_seq_len)
    x = torch.randn(1, 2, model.config.hidden_size, generator=g)
    q_res = torch.randn(1, 2, model.config.q_lora_rank, generator=g)
    raw = indexer_topk(attn, x, q_res, meta, cache.idx[layer], model.compress_rope, 512, 4096, 128)
    W, S = 128, 2
    visible = kv_seq_len // 4
    assert meta.inner.visible_len[0].tolist() == [visible, visible]
    for s in range(S):
        picked = raw[0, s]
        assert int((picked >= 0).sum()) == 512  # exactly top-512 valid slots
        slots = picked - W - S
        assert int(slots.max()) < visible and len(set(slots.tolist())) == 512
        # same selection as brute force over the unpaged indexer keys
        iq, iw = attn.compressor.indexer.queries(x[0, s], q_res[0, s], meta.position_ids[0, s], model.compress_rope)
        scores = attn.compressor.indexer.scores(iq[None], iw[None], traces[layer].indexer.entries[None, :visible])
        want = set(select_topk(scores[0], 512)[1].tolist())
        assert set(slots.tolist()) == want
        if kv_seq_len > 8192:
            assert int(slots.max()) >= 2048  # slots past the old 2048-wide score range are reachable
