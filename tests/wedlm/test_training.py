"""The WeDLM training objective (dual stream, per-block ratio, reorder, 2-D mask, weighted MLM +
AR loss), the corpus/tokenizer, and ``ratchet train-wedlm`` end to end on a toy size."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ratchetlm import LLM, SamplingParams
from ratchetlm.cli import main as ratchet_main
from ratchetlm.training.corpus import documents, held_out, vocabulary_words
from ratchetlm.training.tokenizer_build import build_tokenizer
from ratchetlm.training.wedlm_objective import build_wedlm_batch, dual_stream_mask, wedlm_loss


def test_dual_stream_mask_matches_its_definition():
    L, B = 12, 4
    m = dual_stream_mask(L, B)
    for i, j in itertools.product(range(2 * L), range(2 * L)):
        if i < L:  # clean stream: causal over the clean stream only
            want = j < L and j <= i
        elif j < L:  # masked stream → clean tokens of strictly earlier blocks
            want = j // B < (i - L) // B
        else:  # masked stream → own block, causal in reordered order
            want = (j - L) // B == (i - L) // B and j <= i
        assert bool(m[i, j]) == want, (i, j)


def test_batch_reorders_each_block_observed_first_with_true_positions():
    g = torch.Generator().manual_seed(3)
    x0 = torch.arange(100, 132).reshape(2, 16)
    b = build_wedlm_batch(x0, mask_token_id=3, block_size=8, generator=g)
    L = 16
    xt, pos = b.input_ids[:, L:], b.position_ids[:, L:]
    assert torch.equal(b.input_ids[:, :L], x0) and torch.equal(b.position_ids[:, :L], torch.arange(L).expand(2, L))
    seen_ratios = set()
    for r, blk in itertools.product(range(2), range(2)):
        sl = slice(8 * blk, 8 * blk + 8)
        assert sorted(pos[r, sl].tolist()) == list(range(8 * blk, 8 * blk + 8))  # a permutation of the block
        is_mask = xt[r, sl] == 3
        k = int(is_mask.sum())
        assert is_mask.tolist() == [False] * (8 - k) + [True] * k  # observed first, masks last
        obs = ~is_mask
        assert torch.equal(xt[r, sl][obs], x0[r, pos[r, sl][obs]])  # observed tokens keep their ids
        obs_pos = pos[r, sl][obs].tolist()
        assert obs_pos == sorted(obs_pos)  # each group in original order
        tgt, w = b.mlm_targets[r, sl], b.mlm_weights[r, sl]
        assert torch.equal(tgt[is_mask], x0[r, pos[r, sl][is_mask]])  # no shift: the token at its own position
        assert (tgt[obs] == -100).all() and (w[obs] == 0).all()
        if k:
            assert torch.allclose(w[is_mask], torch.full((k,), 8 / k))  # 1/γ, γ = realised ratio
        seen_ratios.add(k)
    assert len(seen_ratios) > 1  # the ratio is drawn per block
    assert torch.equal(b.ar_targets[:, :-1], x0[:, 1:]) and (b.ar_targets[:, -1] == -100).all()


def test_loss_is_weighted_mlm_plus_ar():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(4, 50, (2, 16), generator=g)
    b = build_wedlm_batch(x0, 3, 8, g)
    logits = torch.randn(2, 32, 50, generator=g)
    total, mlm, ar = wedlm_loss(logits, b, ar_weight=0.5)
    want_ar = F.cross_entropy(logits[:, :15].reshape(-1, 50), x0[:, 1:].reshape(-1))
    sel = b.mlm_targets.reshape(-1) >= 0
    ce = F.cross_entropy(logits[:, 16:].reshape(-1, 50)[sel], b.mlm_targets.reshape(-1)[sel], reduction="none")
    w = b.mlm_weights.reshape(-1)[sel]
    torch.testing.assert_close(ar, want_ar)
    torch.testing.assert_close(mlm, (ce * w).sum() / w.sum())
    torch.testing.assert_close(total, (mlm + 0.5 * ar) / 1.5)


def test_hf_qwen3_honours_the_2d_mask():
    """A masked-stream row's output equals a forward over exactly what it may see."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    x0 = torch.randint(4, 64, (1, 16))
    b = build_wedlm_batch(x0, 3, 8, torch.Generator().manual_seed(1))
    i = 16 + 8 + 2  # third reordered slot of block 1: sees clean block 0 + reordered slots 0..2 of block 1
    with torch.no_grad():
        full = m(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.attention_mask).logits
        ids = torch.cat([x0[:, :8], b.input_ids[:, 24:27]], 1)
        pos = torch.cat([torch.arange(8)[None], b.position_ids[:, 24:27]], 1)
        causal = torch.ones(11, 11, dtype=torch.bool).tril()[None, None]
        alone = m(input_ids=ids, position_ids=pos, attention_mask=causal).logits
    torch.testing.assert_close(full[0, i], alone[0, -1], rtol=1e-4, atol=1e-4)


def test_tokenizer_round_trips_the_corpus_and_held_out_prompts_are_unseen():
    tok = build_tokenizer(vocabulary_words())
    exs = held_out(64)
    assert len({e.prompt for e in exs}) == 64
    for e in exs[:16]:
        ids = tok.encode(e.text, add_special_tokens=False)
        assert tok.unk_token_id not in ids
        assert tok.decode(ids).strip() == e.text
    held = {e.prompt for e in held_out(256)}
    for doc in itertools.islice(documents(0, held), 3000):
        assert not any(doc.startswith(p + " ") for p in held)


def test_train_wedlm_cli_writes_a_model_the_engine_decodes(tmp_path):
    out = tmp_path / "toy"
    rc = ratchet_main(["train-wedlm", "--out", str(out), "--steps", "3", "--hidden-size", "32", "--layers", "1",
                       "--heads", "2", "--kv-heads", "1", "--intermediate-size", "64", "--seq-len", "32",
                       "--block-size", "8", "--batch-size", "2", "--threads", "1", "--log-every", "1"])
    assert rc == 0
    llm = LLM(str(out), dtype="float32", progress=False, numerics="exact", wedlm={"window_size": 4})
    assert llm.model_config.mask_token_id == 3
    res = llm.generate(["count from 3 to 9 :"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(res.token_ids) == 6
