"""Decode at high absolute positions (up to 16383) through the common engine, against the unpaged reference."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.models.deepseek_v4.attention import select_topk
from ratchetlm.models.deepseek_v4.decode import indexer_topk

from .conftest import forced_run, v4_engine

ATOL = 5e-5
# Position capacity cases, CSA ratio-4 boundaries (3->4, 127->128, 511->512, 4095->4096,
# 8191->8192, 8703, 16383) and HCA ratio-128 boundaries (127->128, 255->256, ...): each
# sequence commits the token at `start`, then the one at `start + 1`.
# 16382 is the last position the engine feeds (a sequence holds max_model_len = 16384 tokens and
# its last one is sampled, never fed); the call at 16383 itself is made on the runner below (its
# logits, and the indexer over all 4096 entries: the seed's kv_seq_len = 16384).
STARTS = [0, 3, 127, 128, 255, 511, 4095, 8191, 8192, 8703, 16382]

# xdist: tests/deepseek_v4/ is one work unit (tests/conftest.py DIR_UNITS): one worker computes the
# 16384-token reference (conftest.long_run) for all its users
pytestmark = pytest.mark.slow


def _run_from(model, ids, traces, starts, steps, decode_seq, shuffle_seed=13):
    """One engine, one sequence per start: the first ``p`` tokens restored from the reference's
    traces, then ``steps`` teacher-forced calls feeding ``ids[p], ids[p+1], ...`` (batched)."""
    engine = v4_engine(model, "teacher_forced", decode_seq=decode_seq, shuffle_seed=shuffle_seed,
                       max_num_seqs=len(starts))
    prompts = [ids[: p + 1].tolist() for p in starts]
    forced = [ids[p + 1 : p + 1 + steps].tolist() + [0] * max(0, p + 1 + steps - len(ids)) for p in starts]
    sids = forced_run(engine, prompts, forced, restored=[(traces, p) for p in starts])
    return engine, sids


@pytest.mark.parametrize("decode_seq", [2, 1])
def test_long_positions_batched_against_reference(model, long_run, decode_seq):
    ids, ref, traces = long_run
    engine, sids = _run_from(model, ids, traces, STARTS, 2, decode_seq)
    for sid, p in zip(sids, STARTS, strict=True):
        got = engine.strategy.logits[sid]
        n = min(2, 16383 - p)  # a sequence reaching max_model_len tokens ends there
        assert len(got) == n
        for k in range(n):
            torch.testing.assert_close(got[k], ref[p + k], atol=ATOL, rtol=1e-4, msg=f"position {p + k}")
    # every decode call of the batch committed exactly one token per sequence
    assert all(set(c.values()) == {1} for c in engine.strategy.commits)


def _call_at_last_position(model, ids, traces, decode_seq):
    """The decode call at position 16383 through the engine's allocator and runner (the engine's
    own steps stop at 16382: a sequence holds 16384 tokens and its last one is sampled, never fed),
    on the reference's state for the first 16383 tokens. Returns (engine, sequence, StepResult)."""
    from ratchetlm.decoding.autoregressive import catch_up_proposal
    from ratchetlm.models.deepseek_v4.reference import prefix_traces
    from ratchetlm.sampling_params import SamplingParams
    from ratchetlm.sequence import Sequence

    p = 16383
    engine = v4_engine(model, decode_seq=decode_seq, shuffle_seed=3)
    seq = Sequence(0, ids[: p + 1].tolist(), p + 1, SamplingParams(temperature=0.0))
    engine.blocks.grow(seq, p)
    engine.runner.layout.restore(0, prefix_traces(traces, p))
    seq.num_cached = p
    assert engine.blocks.can_grow(seq, p + 1)
    engine.blocks.grow(seq, p + 1)
    return engine, seq, engine.runner.execute([seq], [catch_up_proposal(seq, 1)])


@pytest.mark.parametrize("decode_seq", [2, 1])
def test_call_at_the_last_position(model, long_run, decode_seq):
    """A decode call at position 16383 (S = 2: its placeholder at 16384) through the engine's
    allocator and runner: no RoPE, position, cache or state-mapping overflow, reference logits."""
    ids, ref, traces = long_run
    engine, seq, out = _call_at_last_position(model, ids, traces, decode_seq)
    torch.testing.assert_close(out.logits[0][0], ref[16383], atol=ATOL, rtol=1e-4)
    assert not engine.blocks.can_grow(seq, 16383 + 2)  # nothing past the capacity


@pytest.mark.parametrize("kv_seq_len", [8192, 8704, 16384])  # the seed's cases; 16384: the whole capacity
def test_indexer_topk_at_long_context(model, long_run, kv_seq_len):
    ids, _, traces = long_run
    p = kv_seq_len - 1
    if kv_seq_len == 16384:  # the call at 16383 completes the last of the 4096 indexer entries
        engine, _, _ = _call_at_last_position(model, ids, traces, decode_seq=2)
    else:
        engine, _ = _run_from(model, ids, traces, [p], 1, decode_seq=2)
    meta, pools = engine.runner.last_meta, engine.runner.layout.pools
    layer = model.config.layers_of_kind["compressed_sparse_attention"][0]
    attn = model.model.layers[layer].self_attn
    # the call at p wrote the entry it completed (the sequence then finished; its blocks were
    # released but not cleared, and the call's metadata still addresses them)
    g = torch.Generator().manual_seed(kv_seq_len)
    x = torch.randn(1, 2, model.config.hidden_size, generator=g)
    q_res = torch.randn(1, 2, model.config.q_lora_rank, generator=g)
    raw = indexer_topk(attn, x, q_res, meta, pools.get("idx", layer), model.compress_rope, 512, 4096, 128)
    W, S = 128, 2
    visible = kv_seq_len // 4
    assert meta.inner.visible_len[0].tolist() == [visible, visible]
    assert meta.position_ids[0, 0] == p
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
    if kv_seq_len == 16384:
        assert visible == 4096  # SCORE_LEN: every indexer entry of the capacity is a candidate
