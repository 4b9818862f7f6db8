"""Sparse-attention raw-index contract and the no-write / invisibility of the placeholder."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.models.deepseek_v4.attention import SCORE_BLOCK, Indexer, select_topk, sink_attention
from ratchetlm.models.deepseek_v4.paging import physical_rows
from ratchetlm.models.deepseek_v4.reference import reference_forward
from ratchetlm.models.deepseek_v4.sparse_attn import gather_keys
from ratchetlm.sampling_params import SamplingParams

from .conftest import forced_run, pool_bytes, v4_engine

W, BS, D, S = 128, 128, 8, 2


def _pools(seed=0):
    g = torch.Generator().manual_seed(seed)
    ring = torch.randn(3, BS, D, generator=g)
    cmp = torch.randn(40, BS, D, generator=g)
    overlay = torch.randn(1, S, D, generator=g)
    ori_table = torch.tensor([[2]])
    cmp_table = torch.randperm(40, generator=g)[:32][None]  # permuted cmp_block_table
    return ring, cmp, overlay, ori_table, cmp_table


def test_raw_indices_resolve_to_ring_overlay_and_compressed_rows():
    ring, cmp, overlay, ori_table, cmp_table = _pools()
    slot = 1500  # compressed slot > 1024
    raw = torch.tensor([[[5, 127, W, W + 1, W + S + 0, W + S + slot, -1]] * S])
    keys, valid = gather_keys(raw, ring, ori_table, overlay, cmp, cmp_table, W, BS)
    k = keys[0, 0]
    assert torch.equal(k[0], ring[2, 5]) and torch.equal(k[1], ring[2, 127])
    assert torch.equal(k[2], overlay[0, 0]) and torch.equal(k[3], overlay[0, 1])
    assert torch.equal(k[4], cmp[cmp_table[0, 0], 0])
    assert torch.equal(k[5], cmp[cmp_table[0, slot // BS], slot % BS])
    assert valid[0, 0].tolist() == [True] * 6 + [False]


def test_unmapped_compressed_block_is_invalid():
    ring, cmp, overlay, ori_table, cmp_table = _pools()
    cmp_table = cmp_table.clone()
    cmp_table[0, 20:] = -1
    raw = torch.tensor([[[W + S + 20 * BS - 1, W + S + 20 * BS]] * S])
    _, valid = gather_keys(raw, ring, ori_table, overlay, cmp, cmp_table, W, BS)
    assert valid[0, 0].tolist() == [True, False]


@pytest.mark.parametrize("width, k", [(4096, 512), (600, 512), (513, 512), (512, 512), (100, 30)])
def test_select_topk_is_a_stable_descending_sort_cut_at_k(width, k):
    """The partial selection picks and orders exactly what a full stable sort would: ties (exact
    zeros, -inf for hidden slots, rounded scores) towards the lower slot, rows with fewer than k
    visible slots filled with the lowest hidden ones."""
    g = torch.Generator().manual_seed(width + k)
    scores = torch.randn(6, width, generator=g)
    r = torch.rand(6, width, generator=g)
    scores[r < 0.3] = 0.0  # every head's ReLU off
    scores[r > 0.8] = float("-inf")  # hidden
    scores[1] = scores[1].round()  # many ties at the cut
    scores[2, k // 2:] = float("-inf")  # fewer than k visible
    scores[3] = float("-inf")
    want = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = select_topk(scores, k)
    assert torch.equal(values, want.values[:, :k]) and torch.equal(indices, want.indices[:, :k])


def test_indexer_scores_equal_the_formula_for_shared_per_query_and_grouped_keys():
    """I[n, s] = sum_h w[n, h] * relu(q[n, h] . k[s]) / sqrt(Di), bit for bit whichever way the keys
    come (one set for all queries, one per query, one per sequence of n queries)."""
    g = torch.Generator().manual_seed(0)
    G, n, H, Di, T = 3, 5, 16, 16, 300

    class Tiny:
        dim = Di
        scores = Indexer.scores

    q, w = torch.randn(G, n, H, Di, generator=g), torch.randn(G, n, H, generator=g)
    keys = torch.randn(G, T, Di, generator=g)
    # the formula, one query at a time
    want = torch.stack([torch.stack([(torch.relu(q[b, i] @ keys[b].T) * Di**-0.5 * w[b, i, :, None]).sum(0)
                                     for i in range(n)]) for b in range(G)])  # [G, n, T]
    torch.testing.assert_close(Tiny().scores(q, w, keys), want, rtol=1e-6, atol=1e-6)
    per_query = Tiny().scores(q.flatten(0, 1), w.flatten(0, 1), keys.repeat_interleave(n, 0)).view(G, n, T)
    assert torch.equal(Tiny().scores(q, w, keys), per_query)
    shared = Tiny().scores(q[0], w[0], keys[:1])  # [n, T]
    assert torch.equal(shared, Tiny().scores(q[0], w[0], keys[:1].expand(n, -1, -1)))
    torch.testing.assert_close(shared, want[0], rtol=1e-6, atol=1e-6)


def test_indexer_scores_of_whole_score_blocks_equal_the_full_width_bit_for_bit():
    """decode.indexer_topk and the reference score only the first whole SCORE_BLOCKs of slots their
    queries can see: a slot's score must be the same bits as when every slot is scored (a decode
    step's batch, a prefill chunk, the reference's shared keys of any entry count)."""
    g = torch.Generator().manual_seed(3)

    class Tiny:
        dim = 16
        scores = Indexer.scores

    cases = [((5, 2), 4096), ((1, 2), 4096), ((64, 3), 4096), ((1, 256), 4096), ((4, 17), 4096),
             ((None, 1), 576), ((None, 256), 4096), ((None, 512), 2175), ((None, 7), 300)]
    for (B, n), width in cases:
        lead = (n,) if B is None else (B, n)
        q, w = torch.randn(*lead, 16, 16, generator=g), torch.randn(*lead, 16, generator=g)
        keys = torch.randn(1 if B is None else B, width, 16, generator=g)
        full = Tiny().scores(q, w, keys)
        blocks = range(SCORE_BLOCK, width, SCORE_BLOCK)
        for t in {blocks[0], blocks[1], blocks[len(blocks) // 2], blocks[-1]}:  # first, middle and last widths
            assert torch.equal(Tiny().scores(q, w, keys[:, :t]), full[..., :t]), (B, n, width, t)


def test_sink_attention_ignores_invalid_keys_and_uses_sink():
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(1, 2, D, generator=g), torch.randn(1, 5, D, generator=g)
    sinks = torch.tensor([0.3, -1.0])
    visible = torch.tensor([[True, False, True, True, False]])
    got = sink_attention(q, kv, visible, sinks, 0.5)
    logits = (q[0] @ kv[0, [0, 2, 3]].T) * 0.5  # [2, 3]
    w = torch.exp(logits) / (torch.exp(logits).sum(-1, keepdim=True) + torch.exp(sinks)[:, None])
    torch.testing.assert_close(got[0], w @ kv[0, [0, 2, 3]])
    # poisoning an invisible key changes nothing
    kv2 = kv.clone()
    kv2[0, 1] = 1e4
    torch.testing.assert_close(sink_attention(q, kv2, visible, sinks, 0.5), got)


def _run(model, decode_seq, shuffle_seed, prompt, fed, placeholder=None):
    """Prefill + one teacher-forced decode call per fed token through the common engine.
    ``placeholder``: the id the S=2 call feeds its placeholder row (default: the token itself)."""
    engine = v4_engine(model, "teacher_forced", decode_seq=decode_seq, shuffle_seed=shuffle_seed)
    if placeholder is not None:
        _poison_placeholder(engine, placeholder)
    (sid,) = forced_run(engine, [prompt.tolist()], [list(fed) + [0]])
    return engine, torch.stack(engine.strategy.logits[sid][1:])


def _poison_placeholder(engine, placeholder):
    """Make the runner feed ``placeholder`` in every placeholder row."""
    runner = engine.runner
    forward = runner._forward

    def patched(seqs, props):
        import ratchetlm.models.deepseek_v4.runner as mod

        real = mod.forward_step

        def with_ids(model, pools, meta, ids, sink, cap):
            ids = ids.clone()
            ids[torch.arange(ids.shape[1])[None, :] >= meta.num_tokens[:, None]] = placeholder
            return real(model, pools, meta, ids, sink, cap)

        mod.forward_step = with_ids
        try:
            return forward(seqs, props)
        finally:
            mod.forward_step = real

    runner._forward = patched


def test_placeholder_mutates_no_cache_and_is_invisible(model):
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 96, (250,), generator=g)
    fed = torch.randint(0, 96, (10,), generator=g).tolist()  # crosses 255 -> 256 (CSA + HCA)
    e1, l1 = _run(model, 1, 3, prompt, fed)
    e2, l2 = _run(model, 2, 3, prompt, fed, placeholder=7)
    e3, l3 = _run(model, 2, 3, prompt, fed, placeholder=91)
    # Different call shapes (and MoE expert groups: the placeholder routes somewhere) round
    # differently (~1e-6); a leak of the placeholder would be O(1).
    torch.testing.assert_close(l1, l2, atol=2e-5, rtol=0)
    torch.testing.assert_close(l2, l3, atol=2e-5, rtol=0)
    p1, p2, p3 = pool_bytes(e1), pool_bytes(e2), pool_bytes(e3)
    for k in p1:  # S=2 with any placeholder leaves the cache S=1 leaves: same rows written, same values
        assert torch.equal(p1[k] != 0, p2[k] != 0) and torch.equal(p2[k] != 0, p3[k] != 0), k
        torch.testing.assert_close(p1[k], p2[k], atol=2e-5, rtol=0, msg=str(k))
        torch.testing.assert_close(p2[k], p3[k], atol=2e-5, rtol=0, msg=str(k))


def test_permuted_tables_give_identical_results(model):
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 96, (600,), generator=g)
    fed = torch.randint(0, 96, (5,), generator=g).tolist()
    _, identity = _run(model, 2, None, prompt, fed)
    engine, permuted = _run(model, 2, 99, prompt, fed)
    maps = [m for name, _, m in engine.blocks.page_history if name == "csa_cmp"]
    assert maps[:2] != [0, 1]  # genuinely non-identity
    torch.testing.assert_close(identity, permuted, atol=2e-5, rtol=0)


@pytest.mark.parametrize("prompt_len", [130, 131])
def test_future_compressed_slot_is_never_read(model, prompt_len):
    # Poison every compressed / indexer row except the slots already completed by the prompt:
    # the incomplete slot `written` (positions [written * ratio, ...)) included. At 130 the decode
    # token does not complete it, so it must stay invisible; at 131 the step completes CSA slot 32
    # itself, so it must read its own entry, never the pool row. Results must not move, and must
    # be the unpaged reference's.
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 96, (prompt_len,), generator=g)
    fed = torch.randint(0, 96, (3,), generator=g).tolist()
    _, clean = _run(model, 2, None, prompt, fed[:1])
    engine = v4_engine(model, "teacher_forced", decode_seq=2, shuffle_seed=5)
    sid = engine.add_request(prompt.tolist(), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.strategy.forced[sid] = [fed[0], 0]
    engine.step()  # the prefill (prompt cached, fed[0] appended)
    assert engine.seqs[sid].num_cached == prompt_len
    tables = engine.runner.layout.tables([sid])
    poisoned = 0
    for name, ratio in (("csa_cmp", 4), ("idx", 4), ("hca_cmp", 128)):
        written = prompt_len // ratio  # complete compressed slots after the prompt
        keep = physical_rows(getattr(tables, name), torch.arange(written)[None], BS)[0]
        assert bool((keep >= 0).all())
        for (pool_name, _), flat in engine.runner.layout.pools.tensors.items():
            if pool_name != name:
                continue
            bad = torch.ones(flat.shape[0], dtype=torch.bool)
            bad[keep] = False
            flat[bad] = float("nan")
            poisoned += int(bad.sum())
    assert poisoned > 0
    engine.step()  # the decode call at position prompt_len
    torch.testing.assert_close(engine.strategy.logits[sid][1], clean[0], atol=2e-5, rtol=0)
    # ... and both are the unpaged reference's: a slot made visible one too early is read from the
    # step itself (the placeholder at 131 completes slot 32), which the poison cannot see
    want, _ = reference_forward(model, torch.tensor(prompt.tolist() + fed[:1]), logits_for=slice(-1, None))
    torch.testing.assert_close(clean[0], want[0], atol=2e-5, rtol=0)
