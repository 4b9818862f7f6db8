"""Fast engine-level checks of the V4 position capacity (issue 40's seed audit: before, only the
slow tests, which need the 16384-token reference, ran the engine at these positions).

The sequences' earlier K/V and compressor state are left as the pools start (zeros) instead of
restored from a reference: what is checked is that every call of the seed's position matrix runs
through the engine's allocator, lowering and runner without a RoPE, position, cache or
state-mapping overflow, and that the answers agree where they must — a sequence's logits are the
same batched with the whole matrix as alone, and with the placeholder row (S = 2) as without it
(S = 1). The call at 16383 with S = 2 ropes its placeholder at 16384: the RoPE tables' spare row."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.decoding.autoregressive import catch_up_proposal
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import Sequence

from .conftest import v4_engine

MATRIX = [0, 127, 128, 8191, 8192, 8703, 16383]  # the seed's basic position-capacity cases


def _call(model, starts: list[int], decode_seq: int) -> tuple[torch.Tensor, object, list[Sequence]]:
    """One decode call per engine: sequence ``i`` has ``starts[i]`` tokens cached (zero state) and
    feeds the token at ``starts[i]``. Returns the last-row logits ``[len(starts), V]``, the engine
    and the sequences."""
    # 64 MiB: room for the matrix's 7 sequences at 16384 tokens (~1 MiB each at these widths) many times over
    engine = v4_engine(model, decode_seq=decode_seq, shuffle_seed=5, max_num_seqs=len(starts),
                       kv_cache_bytes=1 << 26)
    seqs = []
    for i, p in enumerate(starts):  # a sequence's tokens depend on its start only (alone == batched)
        ids = torch.randint(0, model.config.vocab_size, (p + 1,), generator=torch.Generator().manual_seed(p)).tolist()
        seq = Sequence(i, ids, p + 1, SamplingParams(temperature=0.0))
        if p:
            engine.blocks.grow(seq, p)
        seq.num_cached = p
        assert engine.blocks.can_grow(seq, p + 1)
        engine.blocks.grow(seq, p + 1)
        seqs.append(seq)
    out = engine.runner.execute(seqs, [catch_up_proposal(s, 1) for s in seqs])
    return torch.cat([lg[-1:] for lg in out.logits]), engine, seqs


@pytest.fixture(scope="module")
def batched(model):
    return {S: _call(model, MATRIX, S) for S in (1, 2)}


@pytest.mark.parametrize("decode_seq", [1, 2])
def test_the_capacity_matrix_runs_through_the_engine(model, batched, decode_seq):
    logits, engine, seqs = batched[decode_seq]
    assert logits.shape == (len(MATRIX), model.config.vocab_size) and torch.isfinite(logits).all()
    meta = engine.runner.last_meta
    assert meta.position_ids[:, 0].tolist() == MATRIX and meta.kv_seq_lens.tolist() == [p + 1 for p in MATRIX]
    assert (meta.ori_slot_mapping[:, 0] >= 0).all()  # every committed token writes its ring row
    assert not engine.blocks.can_grow(seqs[-1], 16384 + 1)  # nothing past the capacity


@pytest.mark.parametrize("i", [0, 3, 6])
def test_a_sequence_of_the_matrix_gives_the_same_logits_alone(model, batched, i):
    alone, _, _ = _call(model, [MATRIX[i]], 2)
    torch.testing.assert_close(alone[0], batched[2][0][i], atol=1e-5, rtol=1e-5)


def test_the_placeholder_changes_nothing_even_at_the_last_position(model, batched):
    """S = 2 adds a placeholder row after each token (at 16383 it sits at 16384: the spare RoPE
    row); the real tokens' logits equal those of the S = 1 call."""
    torch.testing.assert_close(batched[2][0], batched[1][0], atol=1e-5, rtol=1e-5)
    assert model.main_rope.cos.shape[0] == model.compress_rope.cos.shape[0] == 16384 + 1
